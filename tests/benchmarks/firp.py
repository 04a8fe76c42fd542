"""Benchmark: single-prompt tokens/s of `--speculate firp` and `speed+firp` over `--speculate none` (issue 4).

Same method as tests/benchmarks/speculation.py: one pipeline session per configuration stays up,
prompts (opening words of held-out State of the Union speeches) are measured in alternation, so
machine drift hits all alike; one thread per stage. Configurations: none, firp with each --firp-k
asked for (shipped maps, pipeline/assets/predictors/), and speed+firp (hybrid predictor + FIRP
with the shortest k, for each --firp-min-prob asked for). Reports per configuration: the median ratio of decode tokens/s over `none`, committed
tokens per pass, accepted FIRP drafts per pass, SPEED acceptance (run-ahead drafts only), whether
the output is token-identical to `none`, and the ideal expectation: FIRP commits `tokens per pass`
tokens per pipeline pass, so with free pseudo rows its speed-up is tokens-per-pass; speed+firp
multiplies that by SPEED's S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5, e = 1), a rough
upper bound since both compete for the same stage slots.

Usage: python tests/benchmarks/firp.py [--stages 2] [--prompts 6] [--max-new-tokens 64] [--firp-k 2,3,4]
       [--combined-min-prob 0,0.4] [--quick] [--out tests/benchmarks/results/firp.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.engine.simulator import closed_form_speedup
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import held_out_prompts


def measure(session: PipelineSession, prompt: str, max_new_tokens: int) -> dict:
    """Decode tokens/s of one request (prefill excluded) plus FIRP / SPEED counters."""
    coord = session.coordinator
    coord.reset_stats()
    out = coord.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)).result(600)
    spec = coord.spec
    return {"decode_tokens_per_s": (len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s), "token_ids": out.token_ids,
            "passes": spec.passes, "committed": spec.committed_tokens, "firp_verified": spec.firp_verified,
            "firp_accepted": spec.firp_accepted, "speed_verified": spec.verified_drafts - spec.firp_verified,
            "speed_accepted": spec.accepted_tokens - spec.firp_accepted}


def summarise(rows: list[dict], base: list[dict], stages: int, speed: bool) -> dict:
    """Ratios and counters of one configuration over all prompts."""
    ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rows, base, strict=True)]
    passes = sum(r["passes"] for r in rows) or 1
    tokens_per_pass = sum(r["committed"] for r in rows) / passes
    speed_verified = sum(r["speed_verified"] for r in rows)
    alpha = sum(r["speed_accepted"] for r in rows) / speed_verified if speed_verified else 0.0
    ideal = tokens_per_pass * (closed_form_speedup(num_stages=stages, alpha=alpha) if speed else 1.0)
    return {"ratio_median": statistics.median(ratios), "ratios": ratios, "tokens_per_pass": tokens_per_pass,
            "firp_accepted_per_pass": sum(r["firp_accepted"] for r in rows) / passes,
            "firp_acceptance": (sum(r["firp_accepted"] for r in rows) / max(1, sum(r["firp_verified"] for r in rows))),
            "speed_acceptance": alpha, "ideal_speedup": ideal,
            "token_identical": all(r["token_ids"] == b["token_ids"] for r, b in zip(rows, base, strict=True))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--firp-k", default="2,3,4", help="FIRP chain lengths to measure (comma-separated)")
    ap.add_argument("--combined-min-prob", default="0,0.4",
                    help="--firp-min-prob values measured for speed+firp (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 prompt, 12 tokens, k=2 only")
    ap.add_argument("--out", default="tests/benchmarks/results/firp.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.firp_k, args.combined_min_prob = 1, 12, "2", "0"
    ks = [int(k) for k in args.firp_k.split(",")]
    prompts = held_out_prompts("sotu", args.prompts)
    configs = {"none": dict(speculate="none")}
    configs |= {f"firp-k{k}": dict(speculate="firp", firp_k=k) for k in ks}
    for p in (float(x) for x in args.combined_min_prob.split(",")):
        configs[f"speed+firp-k{min(ks)}-p{p:g}"] = dict(speculate="speed+firp", firp_k=min(ks), predictor="hybrid",
                                                       firp_min_prob=p)
    sessions = {}
    try:
        for name, kw in configs.items():
            opts = PipelineOptions(num_stages=args.stages, threads_per_stage=1, progress=False, **kw)
            sessions[name] = PipelineSession(opts, resolve(opts)).__enter__()
        rows = {name: [] for name in configs}
        for i, prompt in enumerate(prompts):
            for name in configs:
                rows[name].append(measure(sessions[name], prompt, args.max_new_tokens))
                print(f"prompt {i} {name}: {rows[name][-1]['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr)
    finally:
        for s in sessions.values():
            s.close()
    base = rows["none"]
    report = {"stages": args.stages, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
              "none_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in base), "configs": {}}
    print(f"{'config':<16} {'ratio':>7} {'tok/pass':>9} {'firp acc/pass':>13} {'speed alpha':>11} {'ideal':>7} {'exact':>6}")
    for name in list(configs)[1:]:
        entry = summarise(rows[name], base, args.stages, speed=name.startswith("speed"))
        report["configs"][name] = entry
        print(f"{name:<16} {entry['ratio_median']:>6.2f}x {entry['tokens_per_pass']:>9.2f} "
              f"{entry['firp_accepted_per_pass']:>13.2f} {entry['speed_acceptance']:>11.2f} "
              f"{entry['ideal_speedup']:>6.2f}x {entry['token_identical']!s:>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
