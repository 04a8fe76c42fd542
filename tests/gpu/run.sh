#!/usr/bin/env bash
# GPU readiness checks of issue 13, for a machine with one CUDA GPU; at most 7 minutes (timeouts
# 200 + 2 x 100 s plus set-up), so a 450 s call holds it.
#
#   tests/gpu/run.sh [OUT_DIR]        (default: $OUT if set, else tests/gpu/results)
#
# 1. tests/gpu/gpu_checks.py: the stage model on CUDA against transformers on CUDA (last-row logits
#    per dtype with a tolerance, greedy agreement over 32 tokens), decode tokens/s against
#    transformers `generate` on the same GPU, and what the quantised modes do on CUDA.
# 2. `launch --device cuda --stages 1` and `--stages 2`: on one GPU both stages share the device.
#    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so --stages 2 is expected to fail
#    at the data plane's NCCL set-up until it falls back to gloo for same-device neighbours; the
#    script records what happens rather than assuming it.
# Everything goes to OUT_DIR (JSON + logs).
#
# Python: $PYTHON, else the project's venv (.venv, with a CUDA torch: README "GPU machines"), else
# `python3` (a lent machine's, which holds a CUDA PyTorch). The project runs from this checkout
# (PYTHONPATH), so it needs no install. On a lent machine without internet, carry what
# tests/gpu/prepare.sh packed: with .gpu/call2 here (and .gpu/call1 from the call just before) and
# no gguf in that Python, this joins the default model's GGUF, checks its sha256, and installs the
# carried wheels into /tmp/site first. Exit 2 with one line if that preparation is incomplete.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-tests/gpu/results}}
mkdir -p "$OUT_DIR" && : > "$OUT_DIR/summary.txt"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
MODEL=smollm2-135m
if [ -d .gpu/call2 ] && ! "$PY" -c "import gguf" 2>/dev/null; then  # a lent machine: gguf is not there
  [ -f .gpu/call1/model.part0 ] || { echo "run.sh: error: .gpu/call1 is missing: carry it in a call just before this one (tests/gpu/prepare.sh)" >&2; exit 2; }
  MODEL=/tmp/speedpipe-gpu/$(cat .gpu/call2/model.name)
  mkdir -p /tmp/speedpipe-gpu
  cat .gpu/call1/model.part0 .gpu/call2/model.part1 > "$MODEL"
  [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat .gpu/call2/model.sha256)" ] \
    || { echo "run.sh: error: the joined $MODEL does not match .gpu/call2/model.sha256" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/call2/wheels/*.whl >> "$OUT_DIR/summary.txt" 2>&1 \
    || { cat "$OUT_DIR/summary.txt" >&2; echo "run.sh: error: the carried wheels did not install" >&2; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} SPEEDPIPE_CACHE_DIR=/tmp/speedpipe-gpu/cache
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
echo "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1)); model: $MODEL" | tee -a "$OUT_DIR/summary.txt"
"$PY" -c 'import grpc, google.protobuf as pb, gguf, grpc_health.v1.health, grpc_reflection.v1alpha.reflection; print("grpc", grpc.__version__, grpc.__file__); print("protobuf", pb.__version__, pb.__file__); print("gguf", gguf.__file__)' 2>&1 | tee -a "$OUT_DIR/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/gpu.txt" 2>&1 || true
timeout -k 10 200 "$PY" tests/gpu/gpu_checks.py --model "$MODEL" --out "$OUT_DIR/gpu_checks.json" > "$OUT_DIR/gpu_checks.log" 2>&1
echo "gpu_checks rc=$?" | tee -a "$OUT_DIR/summary.txt"
for stages in 1 2; do
  timeout -k 10 100 "$PY" -m launcher.cli.main launch --model "$MODEL" --device cuda --stages "$stages" --no-progress \
    --max-new-tokens 32 --ignore-eos --prompt "Once upon a time" --json \
    > "$OUT_DIR/launch_stages$stages.json" 2> "$OUT_DIR/launch_stages$stages.log"
  echo "launch --device cuda --stages $stages rc=$?" | tee -a "$OUT_DIR/summary.txt"
done
tail -n 30 "$OUT_DIR/gpu_checks.log"
tail -n 5 "$OUT_DIR"/launch_stages*.log
