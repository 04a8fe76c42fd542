"""Cost of a forward pass by rows: how much more a pass with n real rows (+ FIRP pseudo rows) costs
than a pass with one row, on the whole model, one torch thread, in one process.

Speculative decoding pays off only when verifying several tokens in one pass costs little more
than decoding one (the memory-bound regime of a GPU). This measures that premise on the machine
at hand: the median time of a decode-style pass (n new rows over a cached context) divided by the
one-row pass, interleaved repeat by repeat so drift hits every shape alike. A FIRP verify pass with
k drafts has 1 + k real rows and (1 + k) x k pseudo rows from the FIRP layer on
([Note: pseudo rows] in pipeline/model/stage_model.py); its break-even is accepted tokens per pass >= ratio - 1.

Numeric modes (`--modes fp32,fp32-fast,bf16,int8,int4,auto`): fp32 / bf16 are `--quantization none`
with that dtype (fp32-fast: float32 with `--dense-layout fast`), the others
`--quantization int8|int4|auto` ([Note: numeric modes] in pipeline/weights/quant.py).
The JSON report holds one `RowCostTable` per mode (pipeline/measure/row_cost.py), which the scheduler and
predictors can load to choose how many draft / tree / FIRP rows to send ([Note: rows worth sending]).

    python tests/benchmarks/row_cost.py [--model smollm2-135m] [--context 200] [--repeats 15]
        [--modes fp32,fp32-fast,bf16,int8,int4,auto] [--firp-layer 16]
        [--out tests/benchmarks/results/row_cost.json] [--quick]

Ratios only, from a quiet machine; --quick is a smoke run (fp32 only, few repeats, nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pipeline.measure.row_cost import RowCostTable, decode_pass, measure_row_costs
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel
from pipeline.speculation.firp import FirpMaps
from pipeline.weights.quant_load import load_stage_model
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

# (real rows, FIRP chain length k): plain decode, SPEED/verify/tree passes of n rows, FIRP verify
# passes (a FIRP k verify pass has 1 + k real rows, each anchoring k pseudo rows: (4, 3) for k = 3)
SHAPES = [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (8, 0), (16, 0), (1, 2), (3, 2), (4, 3), (1, 4), (5, 4)]
MODES = {"fp32": ("none", torch.float32), "fp32-fast": ("none", torch.float32), "bf16": ("none", torch.bfloat16),
         "int8": ("int8", torch.float32), "int4": ("int4", torch.float32), "auto": ("auto", torch.float32)}


def load_mode(model_dir: Path, mode: str) -> StageModel:
    """The whole model as one stage in numeric `mode` (a key of MODES)."""
    quantization, dtype = MODES[mode]
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return load_stage_model(str(model_dir), LayerRange(0, n), is_first=True, is_last=True,
                            quantization=quantization, dtype=dtype,
                            dense_layout="fast" if mode.endswith("-fast") else "reference")


def measure(model: StageModel, *, context: int, repeats: int, firp_layer: int, clock=None) -> list[dict]:
    """Median seconds per shape and the ratio to the one-row pass, shapes interleaved per repeat."""
    c = model.config
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=context + 96)
    model.forward_rows(torch.arange(context) % c.vocab_size, [Span(0, 0, context)], kv)  # the cached context
    dtype = next(model.parameters()).dtype
    maps = FirpMaps(c.hidden_size, max(k for _, k in SHAPES)).to(dtype)
    run = decode_pass(model, kv, context=context, firp_layer=firp_layer,
                      make_pseudo=lambda h, k: maps.chains(h, [k] * len(h)))
    medians = measure_row_costs(run, SHAPES, repeats=repeats, clock=clock or time.perf_counter)
    base = medians[(1, 0)]
    return [{"real_rows": n, "firp_k": k, "pseudo_rows": n * k if k else 0, "median_ms": round(med * 1e3, 2),
             "ratio_to_one_row": round(med / base, 3)} for (n, k), med in medians.items()]


def table_of(mode: str, rows: list[dict]) -> RowCostTable:
    """The RowCostTable (real rows only) of one mode's measured shapes."""
    plain = sorted((r["real_rows"], r["median_ms"] / 1e3) for r in rows if r["firp_k"] == 0)
    return RowCostTable(mode=mode, num_rows=tuple(n for n, _ in plain), pass_s=tuple(s for _, s in plain))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--context", type=int, default=200, help="cached positions before the pass (default 200)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(MODES)} (default all; --quick fp32)")
    p.add_argument("--firp-layer", type=int, default=16, help="layer whose output anchors FIRP chains (default 16)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "row_cost.json"))
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, short context, no JSON")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (quiet machine), or this thread's CPU time (a machine shared with other jobs)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.repeats, args.context = 2, 16
    modes = [m.strip() for m in (args.modes or ("fp32" if args.quick else ",".join(MODES))).split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"error: --modes {','.join(unknown)}: not one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model, progress=False)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    if not 0 <= args.firp_layer < num_layers - 1:
        print(f"error: --firp-layer {args.firp_layer} must be in [0, {num_layers - 1})", file=sys.stderr)
        return 2
    report = {"model": args.model, "context": args.context, "repeats": args.repeats, "threads": 1, "clock": args.clock,
              "firp_layer": args.firp_layer, "modes": {}, "tables": []}
    for mode in modes:
        rows = measure(load_mode(model_dir, mode), context=args.context, repeats=args.repeats,
                       firp_layer=args.firp_layer, clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
        report["modes"][mode] = rows
        report["tables"].append(table_of(mode, rows).to_json())
        for r in rows:
            print(f"real rows {r['real_rows']:2d}  firp k {r['firp_k']}  pseudo {r['pseudo_rows']:2d}: "
                  f"{r['median_ms']:7.2f} ms  {r['ratio_to_one_row']:.2f}x one row  [{mode}]")
    if not args.quick:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
