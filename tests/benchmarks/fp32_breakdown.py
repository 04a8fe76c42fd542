"""Where a float32 one-row decode pass goes, and how fast its GEMVs stream the weights.

Issue 13 asks `--stages 1` float32 to run ≥ 1.25× transformers' greedy `generate`. This splits the
default model's one-row pass (the whole model as one stage, `--dense-layout fast` by default,
`context` cached positions, one thread) into:
  1. its wall time (median of `--repeats` passes);
  2. per op, the CPU time the torch profiler attributes (the top ops and the GEMM share);
  3. each GEMV shape of the model alone, cycling through ~400 MB of copies so that the weights come
     from memory as in a decode step: µs per call and the GB/s it streams;
and prints the sum of 3 over the model's GEMVs next to 1: what is left for everything else.
Ratios and shares only; a quiet machine gives the meaningful numbers.

    python tests/benchmarks/fp32_breakdown.py [--mode fp32-fast|fp32] [--repeats 21]
        [--out tests/benchmarks/results/fp32_breakdown.json]
"""

from __future__ import annotations

import argparse
import json
import math
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
from tests.benchmarks.row_cost import load_mode  # noqa: E402

OUT_OF_CACHE_BYTES = 400e6


def pass_wall_ms(run, repeats: int) -> float:
    """Median wall ms of a one-row pass after a warm-up."""
    for _ in range(3):
        run(1, 0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(1, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def profile_ops(run, passes: int = 10, top: int = 8) -> dict:
    """Self CPU ms per pass of the top ops, and the GEMM (aten::mm) share of all op time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            run(1, 0)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm")
    return {"op_ms_per_pass": round(total / passes / 1e3, 2), "mm_ms_per_pass": round(mm / passes / 1e3, 2),
            "mm_share_of_op_time": round(mm / total, 3),
            "top": [{"op": e.key, "self_ms_per_pass": round(e.self_cpu_time_total / passes / 1e3, 3),
                     "calls_per_pass": e.count // passes} for e in events[:top]]}


def gemv_us(k: int, n: int, *, transposed: bool) -> float:
    """Best-of-3 µs of [1, k] @ weight [k → n], cycling through copies that do not fit in cache.
    transposed: the weight stored [k, n] (`fast` layout's Wᵀ), else [n, k] as nn.Linear keeps it."""
    copies = max(2, math.ceil(OUT_OF_CACHE_BYTES / (k * n * 4)))  # together at least OUT_OF_CACHE_BYTES
    weights = [torch.randn(k, n) if transposed else torch.randn(n, k) for _ in range(copies)]
    x = torch.randn(1, k)

    def product(w: torch.Tensor) -> torch.Tensor:
        return x @ w if transposed else x @ w.t()

    for w in weights:
        product(w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for w in weights:
            product(w)
        best = min(best, (time.perf_counter() - start) / copies)
    return best * 1e6


def linear_shapes(model) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, stored transposed) of every linear the one-row pass multiplies by, LM head included."""
    shapes = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            shapes.append((name, mod.in_features, mod.out_features, False))
        elif hasattr(mod, "weight_t"):
            shapes.append((name, mod.in_features, mod.out_features, True))
    return shapes


def gemv_counts(model) -> dict[tuple[int, int, bool], int]:
    """(in, out, stored transposed) -> GEMVs of that shape in one one-row pass of `model` (every
    linear once, the LM head included: a tied head is a module of its own on the last stage)."""
    counts: dict[tuple[int, int, bool], int] = {}
    for _, k, n, t in linear_shapes(model):
        counts[(k, n, t)] = counts.get((k, n, t), 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="fp32-fast", choices=("fp32-fast", "fp32"))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=str(REPO / "tests/benchmarks/results/fp32_breakdown.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_mode(resolve_model(DEFAULT_MODEL, progress=False), args.mode)
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=args.context + 8)
    model.forward_rows(torch.arange(args.context) % model.config.vocab_size, [Span(0, 0, args.context)], kv)
    run = decode_pass(model, kv, context=args.context)
    with torch.inference_mode():
        wall = pass_wall_ms(run, args.repeats)
        ops = profile_ops(run)
    gemvs = []
    for (k, n, t), count in sorted(gemv_counts(model).items()):
        us = gemv_us(k, n, transposed=t)
        gemvs.append({"in": k, "out": n, "transposed": t, "per_pass": count, "us": round(us, 1),
                      "gb_per_s": round(k * n * 4 / us / 1e3, 1)})
    gemv_ms = sum(g["us"] * g["per_pass"] for g in gemvs) / 1e3
    report = {"mode": args.mode, "context": args.context, "threads": 1, "pass_wall_ms": round(wall, 2),
              "profile": ops, "gemvs": gemvs, "gemv_ms_alone": round(gemv_ms, 2),
              "rest_ms": round(wall - gemv_ms, 2)}
    print(f"{args.mode}: one-row pass {wall:.1f} ms; GEMVs alone {gemv_ms:.1f} ms; the rest {wall - gemv_ms:.1f} ms; "
          f"aten::mm {ops['mm_ms_per_pass']:.1f} ms of {ops['op_ms_per_pass']:.1f} ms op time under the profiler")
    for g in gemvs:
        print(f"  [{g['in']} -> {g['out']}]{' (Wt)' if g['transposed'] else ''} x{g['per_pass']}: {g['us']:.0f} us, "
              f"{g['gb_per_s']:.1f} GB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
