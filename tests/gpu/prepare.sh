#!/usr/bin/env bash
# Packs what tests/gpu/run.sh needs on a lent GPU machine that cannot reach the internet, into two
# carry folders that each fit one device call (at most 64 MiB with the working tree).
#
#   tests/gpu/prepare.sh            (here, on the CPU machine, after the README's setup command)
#
# The lent machine (/work/.library/device/KINDS.md) has a CUDA PyTorch in its `python3` (3.12) and
# most of the project's dependencies, but not gguf, nor the grpcio/protobuf versions that
# proto/*_pb2*.py were generated for (nor grpcio's health and reflection packages), nor the default model: its GGUF (98 MB) is larger than one
# call may carry. So this writes, under .gpu/ (git-ignored):
#   .gpu/call1/model.part0          the GGUF's first bytes
#   .gpu/call2/model.part1          the rest, plus model.name and model.sha256 (to check the join)
#   .gpu/call2/wheels/*.whl         gguf, protobuf, grpcio, grpcio-health-checking and grpcio-reflection
#                                   for CPython 3.12, manylinux x86_64
# and prints the two `run` calls to make, back to back (the machine is given back after about 30 s
# idle, and the first call's folder must still be there for the second): the first carries
# .gpu/call1 and only checks the GPU; the second carries .gpu/call2 and runs tests/gpu/run.sh,
# which joins the parts, checks the sha256, installs the wheels into /tmp/site and runs the checks.
# Exit 2 with one line if the model or a wheel is missing, or a call would be over its size limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
LIMIT=$((60 * 1024 * 1024))  # under the 64 MiB a call may carry, with a margin
fail() { echo "prepare.sh: error: $*" >&2; exit 2; }

gguf=$("$PY" -c "from pipeline.weights.registry import DEFAULT_MODEL, registered_gguf_path as p; print(p(DEFAULT_MODEL))" 2>/dev/null) \
  || fail "the default model's GGUF was not found with $PY: run the README's setup command first"
versions=$("$PY" -c "import grpc, google.protobuf as pb; from importlib.metadata import version as v; print(grpc.__version__, pb.__version__, v('gguf'), v('grpcio-health-checking'), v('grpcio-reflection'))" 2>/dev/null) \
  || fail "$PY lacks grpcio, protobuf, gguf, grpcio-health-checking or grpcio-reflection: run the README's setup command first"
read -r grpcio protobuf gguf_pkg health reflection <<< "$versions"
rm -rf .gpu.new && mkdir -p .gpu.new/call1 .gpu.new/call2/wheels  # replaces .gpu/ only when complete
trap 'rm -rf .gpu.new' EXIT
if ! log=$("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu.new/call2/wheels "gguf==$gguf_pkg" "protobuf==$protobuf" "grpcio==$grpcio" \
    "grpcio-health-checking==$health" "grpcio-reflection==$reflection" 2>&1); then
  fail "pip could not download gguf==$gguf_pkg, protobuf==$protobuf, grpcio==$grpcio, grpcio-health-checking==$health, grpcio-reflection==$reflection for CPython 3.12: $(grep -v '^WARNING' <<< "$log" | tail -n 1)"
fi

# what travels besides the carried folder: tracked and untracked-not-ignored files that exist
tree=$(git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [ -f "$f" ]; then stat -c %s "$f"; fi; done | awk '{s += $1} END {print s + 0}')
size=$(stat -c %s "$gguf")
wheels=$(du -cbl .gpu.new/call2/wheels | tail -n 1 | cut -f1)
first=$((LIMIT - tree))
[ "$first" -gt 0 ] || fail "the working tree alone ($tree bytes) is over $LIMIT bytes"
[ $((size - first + wheels + tree)) -le "$LIMIT" ] || fail "the GGUF ($size bytes) does not fit in two calls"
head -c "$first" "$gguf" > .gpu.new/call1/model.part0
tail -c +$((first + 1)) "$gguf" > .gpu.new/call2/model.part1
basename "$gguf" > .gpu.new/call2/model.name
sha256sum "$gguf" | cut -d' ' -f1 > .gpu.new/call2/model.sha256
cat .gpu.new/call1/model.part0 .gpu.new/call2/model.part1 | sha256sum | cut -d' ' -f1 | cmp -s - .gpu.new/call2/model.sha256 \
  || fail "the two parts do not join back into $gguf"
rm -rf .gpu && mv .gpu.new .gpu
echo "prepared .gpu/: call 1 carries $(du -sh .gpu/call1 | cut -f1), call 2 $(du -sh .gpu/call2 | cut -f1) (working tree $((tree / 1024 / 1024)) MiB)"
echo "now, back to back (within ~30 s: the machine is given back when idle, and call 1's folder with it):"
echo "  run  carry=[\".gpu/call1\"]  command='nvidia-smi -L && ls -l .gpu/call1'  timeout_s=120"
echo "  run  carry=[\".gpu/call2\"]  command='bash tests/gpu/run.sh'  timeout_s=450"
