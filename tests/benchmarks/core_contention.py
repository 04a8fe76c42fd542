"""Is the second core free? A decode pass with the other core idle, and with it running the same pass.

`--stages 2` with 2 prompts keeps both stage processes busy at once, so its best case is 2x one
prompt only if a pass on one core costs the same whether or not the other core is busy. Where two
cores share a physical core (SMT siblings of a virtual machine's host), memory bandwidth or a
cache, it does not, and the 2-prompt speed-up is capped below 2 by the machine, whatever the
runtime does. This measures that cap without the runtime: two bare processes, one pinned to each
CPU, each holding the whole model in one numeric mode with `--context` cached positions, time
1-row decode passes (row_cost.py's `decode_pass`), per repeat in three settings side by side:

- solo 0: process 0 runs `--passes` passes while process 1 waits in a pipe receive (sleeping);
- solo 1: the same with the roles swapped;
- together: both run their passes at the same time.

slowdown = median pass time together / median pass time solo (mean of the two processes); the
2-prompt ceiling is 2 / slowdown (two streams at the together speed against one at the solo speed).

    python tests/benchmarks/core_contention.py [--modes fp32,auto] [--context 200] [--passes 60]
        [--repeats 5] [--out tests/benchmarks/results/core_contention.json]

Ratios only, one torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.measure.row_cost import decode_pass  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.row_cost import MODES, load_mode  # noqa: E402

WARMUP_PASSES = 5


def _pin(cpu: int) -> int | None:
    """Pin this process to `cpu` where the OS allows it; the CPU pinned to, or None."""
    if not hasattr(os, "sched_setaffinity") or cpu not in os.sched_getaffinity(0):
        return None
    os.sched_setaffinity(0, {cpu})
    return cpu


def _worker(model_dir: Path, mode: str, context: int, cpu: int, control) -> None:
    """Loads the model, warms up, then per message n: times n one-row passes and sends their median (s)."""
    pinned = _pin(cpu)
    torch.set_num_threads(1)
    model = load_mode(model_dir, mode)
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=context + 8)
    with torch.inference_mode():
        model.forward_rows(torch.arange(context) % model.config.vocab_size, [Span(0, 0, context)], kv)
        one = decode_pass(model, kv, context=context)
        for _ in range(WARMUP_PASSES):
            one(1, 0)
        control.send(pinned)
        while (n := control.recv()) is not None:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                one(1, 0)
                times.append(time.perf_counter() - start)
            control.send(statistics.median(times))


def run_mode(model_dir: Path, mode: str, *, context: int, passes: int, repeats: int) -> dict:
    """Per repeat: solo 0, solo 1, together; medians in ms and the slowdown together / solo."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(model_dir, mode, context, cpu, pipes[cpu][1]), daemon=True)
             for cpu in range(2)]
    for p in procs:
        p.start()
    pinned = [c.recv() for c, _ in pipes]
    out = []
    try:
        for _ in range(repeats):
            solo = []
            for c, _ in pipes:
                c.send(passes)
                solo.append(c.recv())
            for c, _ in pipes:
                c.send(passes)
            together = [c.recv() for c, _ in pipes]
            slowdown = statistics.mean(t / s for t, s in zip(together, solo, strict=True))
            out.append({"solo_ms": [round(s * 1e3, 2) for s in solo],
                        "together_ms": [round(t * 1e3, 2) for t in together], "slowdown": round(slowdown, 3)})
    finally:
        for c, _ in pipes:
            c.send(None)
        for p in procs:
            p.join(timeout=30)
    slow = statistics.median(r["slowdown"] for r in out)
    return {"pinned_cpus": pinned, "repeats": out, "median_slowdown": slow,
            "two_prompt_ceiling": round(2 / slow, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default="fp32,auto", help=f"comma-separated, of {', '.join(MODES)} (default fp32,auto)")
    p.add_argument("--context", type=int, default=200, help="cached positions before each pass (default 200)")
    p.add_argument("--passes", type=int, default=60, help="timed passes per process per setting (default 60)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "core_contention.json"))
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        print(f"error: --modes {args.modes}: each one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.passes < 1 or args.repeats < 1 or args.context < 1:
        print("error: --passes, --repeats and --context must be >= 1", file=sys.stderr)
        return 2
    if mp.cpu_count() < 2:
        print("error: core_contention needs 2 CPUs", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model, progress=False)
    results = {}
    for mode in modes:
        r = results[mode] = run_mode(model_dir, mode, context=args.context, passes=args.passes, repeats=args.repeats)
        for i, rep in enumerate(r["repeats"]):
            print(f"{mode} repeat {i + 1}: solo {rep['solo_ms']} ms, together {rep['together_ms']} ms, "
                  f"slowdown {rep['slowdown']:.3f}x", flush=True)
        print(f"{mode}: median slowdown {r['median_slowdown']:.3f}x -> 2-prompt ceiling {r['two_prompt_ceiling']:.2f}x"
              f" (CPUs pinned: {r['pinned_cpus']})", flush=True)
    report = {"benchmark": "core_contention",
              "command": " ".join(["python", "tests/benchmarks/core_contention.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "model": args.model, "context": args.context, "passes": args.passes, "threads_per_process": 1,
              "cpu_count": mp.cpu_count(), "order": "per repeat: solo 0, solo 1, together", "modes": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
