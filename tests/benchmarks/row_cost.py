"""Cost of a forward pass by rows: how much more a pass with n real rows (+ FIRP pseudo rows) costs
than a pass with one row, on the whole model, one torch thread, in one process.

Speculative decoding pays off only when verifying several tokens in one pass costs little more
than decoding one (the memory-bound regime of a GPU). This measures that premise on the machine
at hand: the median time of a decode-style pass (n new rows over a cached context) divided by the
one-row pass, interleaved repeat by repeat so drift hits every shape alike. A FIRP verify pass with
k drafts has 1 + k real rows and (1 + k) x k pseudo rows from the FIRP layer on
([Note: pseudo rows] in pipeline/model.py); its break-even is accepted tokens per pass >= ratio - 1.

    python tests/benchmarks/row_cost.py [--model smollm2-135m] [--context 200] [--repeats 15]
        [--firp-layer 16] [--out tests/benchmarks/results/row_cost.json] [--quick]

Ratios only, from a quiet machine; --quick is a smoke run (few repeats, nothing written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.firp import FirpMaps
from pipeline.kv_cache import KVCache
from pipeline.model import StageModel
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.predictor_data import load_full_model
from pipeline.spans import Span

# (real rows, FIRP chain length k): plain decode, a SPEED/verify pass of n rows, FIRP verify passes
SHAPES = [(1, 0), (2, 0), (3, 0), (5, 0), (8, 0), (1, 2), (3, 2), (1, 4), (5, 4)]


def pass_seconds(model: StageModel, kv: KVCache, maps: FirpMaps, *, context: int, num_rows: int, k: int,
                 firp_layer: int) -> float:
    """Seconds of one forward of `num_rows` rows after `context` cached positions (slot 0); with
    k > 0 every row anchors a FIRP chain of k pseudo rows made at `firp_layer`."""
    kv.set_length(0, context)
    ids = torch.arange(num_rows) + 100
    extra = {}
    if k:
        extra = {"firp_layer": firp_layer, "make_pseudo": lambda h: maps.chains(h, [k] * len(h))}
    span = Span(0, context, num_rows, num_anchors=num_rows if k else 0, chain_len=k)
    start = time.perf_counter()
    model.forward_rows(ids, [span], kv, **extra)
    return time.perf_counter() - start


def measure(model: StageModel, *, context: int, repeats: int, firp_layer: int) -> list[dict]:
    """Median seconds per shape and the ratio to the one-row pass, shapes interleaved per repeat."""
    c = model.config
    kv = KVCache(num_layers=c.num_hidden_layers, max_num_seqs=1, max_model_len=context + 64,
                 num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.float32)
    model.forward_rows(torch.arange(context) % c.vocab_size, [Span(0, 0, context)], kv)  # the cached context
    maps = FirpMaps(c.hidden_size, max(k for _, k in SHAPES))
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for n, k in SHAPES:
            times[(n, k)].append(pass_seconds(model, kv, maps, context=context, num_rows=n, k=k, firp_layer=firp_layer))
    base = statistics.median(times[(1, 0)][1:])
    rows = []
    for (n, k), ts in times.items():
        med = statistics.median(ts[1:])
        rows.append({"real_rows": n, "firp_k": k, "pseudo_rows": n * k if k else 0, "median_ms": round(med * 1e3, 2),
                     "ratio_to_one_row": round(med / base, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--context", type=int, default=200, help="cached positions before the pass (default 200)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--firp-layer", type=int, default=16, help="layer whose output anchors FIRP chains (default 16)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "row_cost.json"))
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, short context, no JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.repeats, args.context = 2, 16
    model = load_full_model(resolve_model(args.model, progress=False))
    if not 0 <= args.firp_layer < model.config.num_hidden_layers - 1:
        print(f"error: --firp-layer {args.firp_layer} must be in [0, {model.config.num_hidden_layers - 1})",
              file=sys.stderr)
        return 2
    rows = measure(model, context=args.context, repeats=args.repeats, firp_layer=args.firp_layer)
    for r in rows:
        print(f"real rows {r['real_rows']}  firp k {r['firp_k']}  pseudo {r['pseudo_rows']:2d}: "
              f"{r['median_ms']:7.2f} ms  {r['ratio_to_one_row']:.2f}x one row")
    if not args.quick:
        report = {"model": args.model, "context": args.context, "repeats": args.repeats, "threads": 1,
                  "firp_layer": args.firp_layer, "shapes": rows}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
