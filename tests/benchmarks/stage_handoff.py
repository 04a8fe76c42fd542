"""What does handing each token from one process to another cost, with no runtime in between?

`--stages 2` decodes one prompt slower than `--stages 1` (core_speed.py: the two stages' forward
times per token add up to more than the whole model's). This separates the machine's share from
the runtime's. The model is cut in two stage models (the default 2-stage split's cut, or --cut),
and each 1-row decode pass over `--context` cached positions is timed in two settings, side by side:

- one process: stage 0's pass, then stage 1's, in turn, in one thread (the halves as one model);
- two processes: stage 0 in one process and stage 1 in another, each waiting on a pipe for the
  other's pass to end, the pattern of a one-prompt pipeline, without gloo, messages, the
  coordinator or any stage-worker code (each side sends one byte), once with the waiting side
  sleeping in the kernel (`sleep`, as a gloo receive does) and once polling its pipe (`spin`).

If the two-process passes are slower, that share of the pipeline's cost belongs to the machine
(where two processes alternate on two CPUs), not to the runtime's message path.

    python tests/benchmarks/stage_handoff.py [--mode auto] [--cut 17] [--passes 80] [--repeats 5]
        [--waits sleep,spin] [--out tests/benchmarks/results/stage_handoff.json]

Ratios only, from a quiet machine, one torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.measure.row_cost import decode_pass  # noqa: E402
from pipeline.model.partition import LayerRange  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.weights.quant_load import activation_dtype, load_stage_model  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.row_cost import MODES  # noqa: E402  (numeric mode -> (--quantization, dtype))


def stage_pass(model_dir: Path, mode: str, layers: LayerRange, num_layers: int, context: int):
    """A one-row decode pass of the stage model holding `layers`, its context already cached."""
    quantization, dtype = MODES[mode]
    model = load_stage_model(str(model_dir), layers, is_first=layers.start == 0, is_last=layers.stop == num_layers,
                             quantization=quantization, dtype=dtype)
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=context + 8)
    hidden = activation_dtype(quantization, str(model_dir), dtype)
    x = (torch.arange(context) % model.config.vocab_size if model.is_first
         else torch.randn(context, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(hidden))
    with torch.inference_mode():
        model.forward_rows(x, [Span(0, 0, context)], kv)
    one = decode_pass(model, kv, context=context)
    return lambda: one(1, 0)


def _timed(run, times: list[float]) -> None:
    start = time.perf_counter()
    with torch.inference_mode():
        run()
    times.append(time.perf_counter() - start)


def _one_process(args: tuple, out) -> None:
    """Both halves in this process, in turn; sends (stage 0 median s, stage 1 median s)."""
    model_dir, mode, ranges, n, context, passes = args
    torch.set_num_threads(1)
    runs = [stage_pass(model_dir, mode, r, n, context) for r in ranges]
    times: list[list[float]] = [[], []]
    for i in range(passes + 5):
        for s, run in enumerate(runs):
            _timed(run, times[s] if i >= 5 else [])
    out.send([statistics.median(t) for t in times])


def _one_side(args: tuple, stage: int, peer, out, spin: bool) -> None:
    """One half in this process; waits for the other side's byte before each pass (stage 0 goes first)."""
    model_dir, mode, ranges, n, context, passes = args
    torch.set_num_threads(1)
    run = stage_pass(model_dir, mode, ranges[stage], n, context)
    for _ in range(5):
        _timed(run, [])
    out.send("ready")
    out.recv()
    times: list[float] = []
    for i in range(passes):
        if stage == 1 or i > 0:
            while spin and not peer.poll(0):
                pass
            peer.recv_bytes()
        _timed(run, times)
        peer.send_bytes(b"x")
    out.send(statistics.median(times))


def _two_processes(ctx, work: tuple, spin: bool) -> list[float]:
    """Medians (s) of both halves, each in its own process, alternating through a pipe."""
    a, b = ctx.Pipe()
    controls = [ctx.Pipe() for _ in range(2)]
    sides = [ctx.Process(target=_one_side, args=(work, s, end, controls[s][1], spin)) for s, end in enumerate((a, b))]
    for proc in sides:
        proc.start()
    for c, _ in controls:
        c.recv()
    for c, _ in controls:
        c.send("go")
    two = [c.recv() for c, _ in controls]
    for proc in sides:
        proc.join()
    return two


def run_repeat(work: tuple, waits: list[str]) -> dict:
    """One repeat: the one-process setting, then the two-process one per wait; medians in ms as
    [stage 0's half, stage 1's half], and each two-process sum over the one-process sum."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_one_process, args=(work, theirs))
    p.start()
    one = mine.recv()
    p.join()
    out = {"one_process_ms": [round(t * 1e3, 2) for t in one]}
    for wait in waits:
        two = _two_processes(ctx, work, wait == "spin")
        out[f"two_processes_{wait}_ms"] = [round(t * 1e3, 2) for t in two]
        out[f"ratio_{wait}"] = round(sum(two) / sum(one), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--mode", default="auto", help=f"numeric mode, one of {', '.join(MODES)} (default auto)")
    p.add_argument("--cut", type=int, default=17, help="stage 0's layer count (default 17: the 2-stage default split)")
    p.add_argument("--context", type=int, default=200, help="cached positions before each pass (default 200)")
    p.add_argument("--passes", type=int, default=80, help="timed passes per stage per setting (default 80)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--waits", default="sleep,spin", help="how the waiting side waits: sleep, spin or both (default)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "stage_handoff.json"))
    args = p.parse_args(argv)
    waits = [w.strip() for w in args.waits.split(",") if w.strip()]
    if not waits or any(w not in ("sleep", "spin") for w in waits):
        print(f"error: --waits {args.waits}: a comma-separated list of sleep, spin", file=sys.stderr)
        return 2
    if args.mode not in MODES:
        print(f"error: --mode {args.mode}: not one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model, progress=False)
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    if not 0 < args.cut < n:
        print(f"error: --cut {args.cut} must be in [1, {n})", file=sys.stderr)
        return 2
    ranges = [LayerRange(0, args.cut), LayerRange(args.cut, n)]
    work = (model_dir, args.mode, ranges, n, args.context, args.passes)
    repeats = []
    for i in range(args.repeats):
        r = run_repeat(work, waits)
        repeats.append(r)
        print(f"repeat {i + 1}: one process {r['one_process_ms']} ms; two processes "
              + "; ".join(f"{w} {r[f'two_processes_{w}_ms']} ms = {r[f'ratio_{w}']:.3f}x" for w in waits), flush=True)
    medians = {w: statistics.median(r[f"ratio_{w}"] for r in repeats) for w in waits}
    print(f"two processes / one process, median of {args.repeats} [{args.mode}, cut {args.cut}]: "
          + ", ".join(f"{w} {m:.3f}x" for w, m in medians.items()))
    report = {"benchmark": "stage_handoff",
              "command": " ".join(["python", "tests/benchmarks/stage_handoff.py", *(sys.argv[1:] if argv is None else argv)]),
              "model": args.model, "mode": args.mode, "cut": args.cut, "context": args.context, "passes": args.passes,
              "threads_per_process": 1, "cpu_count": mp.cpu_count(), "order": "per repeat: one process, then " +
              ", ".join(f"two processes ({w})" for w in waits), "repeats": repeats, "median_ratio": medians}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
