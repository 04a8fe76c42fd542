"""Benchmark: what exit-head skipping saves, at 1 and several concurrent prompts.

The exit stage runs the exit head (final norm + LM head, with a trained map for `early-exit` /
`hybrid`) only on items whose guess could become a sent draft ([Note: exit-head skipping] in
pipeline/engine/scheduler.py). This compares, side by side in one run, aggregate decode tokens/s of
  none         `--speculate none`
  skip         `--speculate speed --predictor P`, exit-head skipping on (the default)
  noskip       the same session with the skip rule replaced by "always" (head on every decode item;
               the benchmark swaps the scheduler's `_wants_exit` on its instance, while idle)
per concurrency C (C prompts submitted together). The three alternate per repeat (drift hits all
alike); each is summarised by the median over repeats of its ratio over `none`. Also reported:
exit rows computed / skipped, drafts, acceptance, and whether greedy output equals `none`'s.
Decode tokens/s = sum(tokens_i - 1) / (last finish - first first-token), prefill excluded.

Usage: python tests/benchmarks/exit_skipping.py [--stages 2] [--predictor hybrid] [--concurrency 1,2,4]
       [--repeats 3] [--max-new-tokens 48] [--out tests/benchmarks/results/exit_skipping.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import held_out_prompts

MODES = ("none", "skip", "noskip")


def measure(session: PipelineSession, prompts: list[str], max_new_tokens: int, *, exit_skipping: bool) -> dict:
    """Aggregate decode tokens/s of `prompts` submitted together, plus the speculation counters."""
    coord = session.coordinator
    sched = coord.engine.scheduler  # the session is idle: nothing else touches it now
    if exit_skipping:
        sched.__dict__.pop("_wants_exit", None)  # the scheduler's own rule
    else:
        sched._wants_exit = lambda seq, item, *, pipeline_full: True  # noqa: SLF001 - the old behaviour
    coord.reset_stats()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    submitted, handles = [], []
    for p in prompts:
        submitted.append(time.perf_counter())
        handles.append(coord.submit(p, params))
    outs = [h.result(600) for h in handles]
    first = min(t0 + o.ttft_s for t0, o in zip(submitted, outs, strict=True))
    last = max(t0 + o.e2e_s for t0, o in zip(submitted, outs, strict=True))
    spec = coord.spec
    return {"decode_tokens_per_s": sum(len(o.token_ids) - 1 for o in outs) / max(last - first, 1e-9),
            "token_ids": [o.token_ids for o in outs], "exit_rows": spec.exit_rows,
            "exit_rows_skipped": spec.exit_rows_skipped, "drafted": spec.drafted_tokens,
            "verified": spec.verified_drafts, "accepted": spec.accepted_tokens}


def summarise(rows: dict[str, list[dict]]) -> dict:
    """Median ratios over `none` and summed counters, per mode, for one concurrency."""
    base = rows["none"]
    out = {"none_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in base)}
    for mode in MODES[1:]:
        rs = rows[mode]
        verified = sum(r["verified"] for r in rs)
        out[mode] = {
            "ratio_median": statistics.median(r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                                              for r, b in zip(rs, base, strict=True)),
            "exit_rows": sum(r["exit_rows"] for r in rs), "exit_rows_skipped": sum(r["exit_rows_skipped"] for r in rs),
            "drafted": sum(r["drafted"] for r in rs),
            "acceptance_rate": sum(r["accepted"] for r in rs) / verified if verified else 0.0,
            "token_identical": all(r["token_ids"] == b["token_ids"] for r, b in zip(rs, base, strict=True)),
        }
    out["skip_over_noskip"] = statistics.median(
        s["decode_tokens_per_s"] / n["decode_tokens_per_s"] for s, n in zip(rows["skip"], rows["noskip"], strict=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--predictor", default="hybrid")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="tests/benchmarks/results/exit_skipping.json")
    args = ap.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if min(levels) < 1 or args.repeats < 1 or args.max_new_tokens < 2:
        ap.error("--concurrency values and --repeats must be >= 1, --max-new-tokens >= 2")
    prompts = held_out_prompts("sotu", max(levels) * args.repeats)
    sessions = {}
    try:
        for mode in ("none", "speed"):
            opts = PipelineOptions(num_stages=args.stages, speculate=mode, threads_per_stage=1, progress=False,
                                   predictor=args.predictor, max_num_seqs=max(8, max(levels)))
            sessions[mode] = PipelineSession(opts, resolve(opts)).__enter__()
        report = {"stages": args.stages, "predictor": args.predictor, "max_new_tokens": args.max_new_tokens,
                  "repeats": args.repeats, "concurrency": {}}
        print(f"{'C':>3} {'skip/none':>9} {'noskip/none':>11} {'skip/noskip':>11} {'exit rows skip|noskip':>22} "
              f"{'skipped':>8} {'exact':>6}")
        for c in levels:
            rows = {m: [] for m in MODES}
            for r in range(args.repeats):
                group = prompts[r * c:(r + 1) * c]
                for mode in MODES:
                    session = sessions["none" if mode == "none" else "speed"]
                    rows[mode].append(measure(session, group, args.max_new_tokens, exit_skipping=mode != "noskip"))
                    print(f"C={c} repeat {r} {mode}: {rows[mode][-1]['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr)
            s = report["concurrency"][str(c)] = summarise(rows)
            exact = s["skip"]["token_identical"] and s["noskip"]["token_identical"]
            print(f"{c:>3} {s['skip']['ratio_median']:>8.2f}x {s['noskip']['ratio_median']:>10.2f}x "
                  f"{s['skip_over_noskip']:>10.2f}x {s['skip']['exit_rows']:>10} | {s['noskip']['exit_rows']:<9} "
                  f"{s['skip']['exit_rows_skipped']:>8} {exact!s:>6}")
    finally:
        for session in sessions.values():
            session.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
