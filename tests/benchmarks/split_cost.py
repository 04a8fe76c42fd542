"""What the last stage's LM head costs in decoder layers, per numeric mode: the number the layer split
balances with ([Note: partition cost] in pipeline/model/partition.py).

For each mode the same last `--layers` decoder layers are built twice in one process, once as a
middle stage and once as the last stage (the same layers plus the final norm and LM head), the
first `--layers` likewise as a middle and as the first stage (plus the embedding), and
1-row decode passes over `--context` cached positions (row_cost.py's `decode_pass`) are timed on
this thread's CPU clock, the two stages alternating pass by pass. Then, from the medians:

- layer_ms = middle stage / layers;
- head_ms = last stage - middle stage (final norm + LM head + the last stage's sampling rows);
- head_layers = head_ms / layer_ms, the head's cost in layer units;
- bytes_ratio: the bytes the head streams over a layer's linears in the mode (run_plan.py
  `head_costs`: in auto the Q8_0 head over Q4_1 layers, 12.8 on the default model);
- estimate_layers = HEAD_EFFICIENCY x bytes_ratio, the price the split uses;
- efficiency = head_layers / bytes_ratio: what `partition.py`'s HEAD_EFFICIENCY would be for this
  mode alone ([Note: partition cost] lists the measurements);
- embed_layers: the same for the first stage's extra work (token ids in, the embedding gather),
  from the first `--layers` layers built as the first stage and as a middle one.

    python tests/benchmarks/split_cost.py [--modes fp32,bf16,int8,int4,auto] [--layers 10] [--context 200]
        [--passes 40] [--repeats 3] [--out tests/benchmarks/results/split_cost.json]

Ratios only, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launcher.coordinator.pipeline_options import PipelineOptions  # noqa: E402
from launcher.coordinator.run_plan import head_costs, layer_param_count  # noqa: E402
from pipeline.measure.row_cost import decode_pass  # noqa: E402
from pipeline.model.config import ModelConfig  # noqa: E402
from pipeline.model.partition import HEAD_EFFICIENCY, LayerRange  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.weights.quant_load import load_stage_model  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.row_cost import MODES  # noqa: E402


def _pass_of(model, context: int):
    """A 1-row decode pass of `model` after `context` cached positions (the context is cached here)."""
    weight = next(model.parameters())
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=context + 8)
    if model.is_first:
        x = torch.arange(context) % model.config.vocab_size
    else:
        x = torch.randn(context, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    model.forward_rows(x, [Span(0, 0, context)], kv)
    run = decode_pass(model, kv, context=context)
    return lambda: run(1, 0)


def _interleaved_medians(runs: dict[str, object], *, passes: int, repeats: int) -> list[dict[str, float]]:
    """Per repeat, each run's median ms over `passes` passes, the runs alternating pass by pass."""
    for run in runs.values():  # warm-up
        for _ in range(3):
            run()
    per_repeat = []
    for _ in range(repeats):
        times = {k: [] for k in runs}
        for _ in range(passes):
            for k, run in runs.items():
                start = time.thread_time()
                run()
                times[k].append(time.thread_time() - start)
        per_repeat.append({f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()})
    return per_repeat


def measure_mode(model_dir: Path, mode: str, *, layers: int, context: int, passes: int, repeats: int) -> dict:
    """One mode's per-repeat medians (ms) of each stage shape, and the derived costs: the first
    `layers` layers as a first stage (with the embedding) and as a middle one, the last `layers` as
    a middle and as the last stage (with the final norm and LM head)."""
    quantization, dtype = MODES[mode]
    config = ModelConfig.from_model_dir(model_dir)
    n = config.num_hidden_layers

    def stage(span: LayerRange, *, first: bool = False, last: bool = False):
        return load_stage_model(str(model_dir), span, is_first=first, is_last=last, quantization=quantization,
                                dtype=dtype)
    models = {"first": stage(LayerRange(0, layers), first=True), "early": stage(LayerRange(0, layers)),
              "late": stage(LayerRange(n - layers, n)), "last": stage(LayerRange(n - layers, n), last=True)}
    per_repeat = _interleaved_medians({k: _pass_of(m, context) for k, m in models.items()}, passes=passes,
                                      repeats=repeats)
    med = {k: statistics.median(r[f"{k}_ms"] for r in per_repeat) for k in models}
    layer_ms = med["late"] / layers
    head_layers = (med["last"] - med["late"]) / layer_ms
    embed_layers = (med["first"] - med["early"]) / (med["early"] / layers)
    weight_ratio = config.vocab_size * config.hidden_size / layer_param_count(config)
    options = PipelineOptions(num_stages=2, model=str(model_dir), quantization=quantization, progress=False,
                              dtype=str(dtype).removeprefix("torch."))
    estimate = head_costs(options, config, model_dir).head
    bytes_ratio = estimate / HEAD_EFFICIENCY
    return {"repeats": per_repeat, "layer_ms": round(layer_ms, 3), "head_ms": round(med["last"] - med["late"], 3),
            "head_layers": round(head_layers, 2), "weight_ratio": round(weight_ratio, 2),
            "bytes_ratio": round(bytes_ratio, 2), "estimate_layers": round(estimate, 2),
            "efficiency": round(head_layers / bytes_ratio, 3), "embed_ms": round(med["first"] - med["early"], 3),
            "embed_layers": round(embed_layers, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--layers", type=int, default=10, help="decoder layers of both stages (default 10)")
    p.add_argument("--context", type=int, default=200, help="cached positions before each pass (default 200)")
    p.add_argument("--passes", type=int, default=40, help="timed passes per stage per repeat (default 40)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "split_cost.json"))
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        print(f"error: --modes {args.modes}: each one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if min(args.layers, args.context, args.passes, args.repeats) < 1:
        print("error: --layers, --context, --passes and --repeats must be >= 1", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model, progress=False)
    num_layers = ModelConfig.from_model_dir(model_dir).num_hidden_layers
    if args.layers > num_layers:
        print(f"error: --layers {args.layers}: the model has {num_layers} decoder layers", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    results = {}
    for mode in modes:
        r = results[mode] = measure_mode(model_dir, mode, layers=args.layers, context=args.context,
                                         passes=args.passes, repeats=args.repeats)
        print(f"{mode}: layer {r['layer_ms']:.3f} ms, head {r['head_ms']:.3f} ms = {r['head_layers']:.2f} layers "
              f"(bytes {r['bytes_ratio']:.2f} layers: efficiency {r['efficiency']:.3f}; the split prices "
              f"{r['estimate_layers']:.2f}), first stage's embedding "
              f"{r['embed_ms']:.3f} ms = {r['embed_layers']:.2f} layers", flush=True)
    report = {"benchmark": "split_cost",
              "command": " ".join(["python", "tests/benchmarks/split_cost.py", *(sys.argv[1:] if argv is None else argv)]),
              "model": args.model, "layers": args.layers, "context": args.context, "passes": args.passes,
              "threads": 1, "clock": "thread CPU time", "modes": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
