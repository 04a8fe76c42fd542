"""Does `torch.compile` pay on the per-token path? A probe on two pieces of a decoder layer.

Compiles (inductor, `dynamic=True`) the RMSNorm and the SwiGLU MLP of the default model's shapes
(hidden 576, intermediate 1536), checks that the compiled result is bitwise equal to eager for 1, 3
and 8 rows (exactness within a numeric mode needs that), and times one-row calls of both, side by
side in one process, one thread. Ratios only; a quiet machine gives the meaningful numbers.

    python tests/benchmarks/torch_compile_probe.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """[rows, hidden] -> [rows, hidden], the Llama RMSNorm."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] -> [rows, hidden], the Llama MLP."""
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def per_call_us(fn, args: tuple, repeats: int) -> float:
    """Mean microseconds of one call after 20 warm-up calls."""
    for _ in range(20):
        fn(*args)
    t = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    mats = (torch.randn(1536, 576, generator=g), torch.randn(1536, 576, generator=g), torch.randn(576, 1536, generator=g))
    pieces = {"rms_norm": (rms_norm, (w,)), "swiglu_mlp": (swiglu, mats)}
    ok = True
    for name, (fn, weights) in pieces.items():
        t0 = time.perf_counter()
        compiled = torch.compile(fn, dynamic=True)
        for rows in (1, 3, 8):
            x = torch.randn(rows, 576, generator=g)
            same = torch.equal(fn(x, *weights), compiled(x, *weights))
            ok &= same
            print(f"{name}: {rows} rows bitwise equal to eager: {same}")
        compile_s = time.perf_counter() - t0
        x = torch.randn(1, 576, generator=g)
        eager, comp = per_call_us(fn, (x, *weights), args.repeats), per_call_us(compiled, (x, *weights), args.repeats)
        print(f"{name}: one row eager {eager:.1f} us, compiled {comp:.1f} us ({eager / comp:.2f}x); "
              f"compile + checks {compile_s:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
