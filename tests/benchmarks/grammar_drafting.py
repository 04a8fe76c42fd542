"""Benchmark: grammar-aware drafting on structured outputs ([Note: grammar-aware drafting] in
pipeline/engine/grammar_drafts.py).

Runs `none`, SPEED with grammar-aware drafting off (`speed/P:off`: the predictor's drafts as they
are; the verifier's mask rejects the forbidden ones), on without jump-forward (`speed/P:nojump`: forced
tokens one draft item each), on with the exit head run before forced drafts too (`speed/P:noskip`), and
on (`speed/P`: a forced run as one item, no exit head before it), side by side in one process
tree as tests/benchmarks/speculation.py does (one pipeline session per configuration; every prompt
measured in alternation over the configurations, `--repeats` rounds, so machine drift hits all
alike). `:stage` configurations run `--draft-at stage` (the exit stage drafts itself; with
grammar-aware drafting on, the coordinator drafts constrained sequences instead).
Prompts: chat-templated requests for JSON with a schema of 3-5 fields, a regex and a choice, greedy,
until EOS (the grammar ends the document) or `--max-new-tokens`.
Reports per configuration: the median ratio of decode tokens/s over `none` (same prompt and round),
acceptance alpha, tokens per pass, the grammar draft counters (forced / replaced / dropped / jump rows),
exit-head rows run and skipped, and whether every output was token-identical to `none`'s.

Usage: python -m tests.benchmarks.grammar_drafting [--stages 2] [--max-new-tokens 80] [--repeats 2]
       [--configs none,speed/hybrid:off,speed/hybrid:nojump:noskip,speed/hybrid:nojump,speed/hybrid]
       [--out tests/benchmarks/results/grammar_drafting.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.openai_protocol import render_chat
from pipeline.speculation.grammar import GrammarSpec
from pipeline.speculation.sampling import SamplingParams
from tests.benchmarks.speculation import options as speculation_options


def _schema(props: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps({
        "type": "object", "properties": props, "required": list(props), "additionalProperties": False}))


STR, INT = {"type": "string", "maxLength": 24}, {"type": "integer"}
CASES = {  # name: (user message, spec)
    "person": ("Give me a person as JSON: name, age, city and job.",
               _schema({"name": STR, "age": INT, "city": STR, "job": STR})),
    "book": ("Give me a book as JSON with its title, author and year.",
             _schema({"title": STR, "author": STR, "year": INT})),
    "product": ("Give me a product as JSON: name, price, currency, in_stock and category.",
                _schema({"name": STR, "price": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "GBP"]},
                         "in_stock": {"type": "boolean"}, "category": STR})),
    "date": ("The date of the first moon landing, as YYYY-MM-DD:",
             GrammarSpec(kind="regex", text=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
    "choice": ("Which is a fruit: apple, car or chair? Answer with one word.",
               GrammarSpec.choice(["apple", "car", "chair"])),
}


def options(config: str, stages: int) -> PipelineOptions:
    """PipelineOptions of one configuration: speculation.py's MODE[/PREDICTOR][:stage], then any of `:off`
    (grammar-aware drafting off), `:nojump` (on, without jump-forward), `:noskip` (see `main`)."""
    flags = _flags(config)
    stage = [f":{f}" for f in flags if f.startswith("stage")]  # :stage[!DEEP], speculation.py's
    base = speculation_options(config.split(":", 1)[0] + "".join(stage), stages, None)
    return dataclasses.replace(base, grammar_drafts="off" not in flags, grammar_jump="nojump" not in flags)


def _flags(config: str) -> set[str]:
    return set(config.split(":")[1:])


def measure(session: PipelineSession, prompt: list[int], spec: GrammarSpec, max_new_tokens: int) -> dict:
    """Decode tokens/s of one greedy constrained request (prefill excluded) and its counters."""
    coord = session.coordinator
    coord.reset_stats()
    out = coord.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, grammar=spec)).result(600)
    s = coord.spec
    return {"decode_tokens_per_s": (len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s), "token_ids": list(out.token_ids),
            "verified": s.verified_drafts, "accepted": s.accepted_tokens, "passes": s.passes,
            "committed": s.committed_tokens, "forced": s.grammar_forced, "replaced": s.grammar_replaced,
            "dropped": s.grammar_dropped, "jump": s.grammar_jump_tokens, "drafted": s.drafted_tokens,
            "stage_drafted": s.stage_drafted, "exit_rows": s.exit_rows, "exit_rows_skipped": s.exit_rows_skipped}


def summarise(rows: list[dict], base: list[dict]) -> dict:
    ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rows, base, strict=True)]
    verified = sum(r["verified"] for r in rows)
    total = {k: sum(r[k] for r in rows) for k in ("drafted", "verified", "accepted", "forced", "replaced", "dropped",
                                                  "jump", "stage_drafted", "exit_rows", "exit_rows_skipped")}
    return {"ratio_median": statistics.median(ratios), "ratios": ratios,
            "acceptance_rate": sum(r["accepted"] for r in rows) / verified if verified else 0.0,
            "tokens_per_pass": sum(r["committed"] for r in rows) / max(1, sum(r["passes"] for r in rows)),
            **total, "token_identical": all(r["token_ids"] == b["token_ids"] for r, b in zip(rows, base, strict=True))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over every prompt")
    ap.add_argument("--configs", default="none,speed/hybrid:off,speed/hybrid:nojump:noskip,speed/hybrid:nojump,"
                                         "speed/hybrid")
    ap.add_argument("--out", default="tests/benchmarks/results/grammar_drafting.json")
    args = ap.parse_args(argv)
    configs = {c: options(c, args.stages) for c in ["none"] + [c for c in args.configs.split(",") if c != "none"]}
    sessions: dict[str, PipelineSession] = {}
    rows: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        for c, opts in configs.items():
            sessions[c] = PipelineSession(opts, resolve(opts)).__enter__()
            if "noskip" in _flags(c):  # the exit head runs before a forced draft too (no RunConfig field: a measurement)
                sessions[c].coordinator.engine.scheduler.grammar_drafts.skip_exit = False
        tokenizer = sessions["none"].coordinator.tokenizer
        for rnd in range(args.repeats):
            for name, (message, spec) in CASES.items():
                prompt = tokenizer.encode(render_chat([{"role": "user", "content": message}], tokenizer=tokenizer))
                for c in configs:
                    r = measure(sessions[c], prompt, spec, args.max_new_tokens)
                    rows[c].append({**r, "case": name, "round": rnd})
                    print(f"{rnd} {name} {c}: {r['decode_tokens_per_s']:.2f} tok/s, {len(r['token_ids'])} tokens, "
                          f"forced {r['forced']}, jump {r['jump']}", file=sys.stderr, flush=True)
    finally:
        for s in sessions.values():
            s.close()
    base = rows["none"]
    report = {"stages": args.stages, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "none_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in base),
              "outputs": {r["case"]: tokenizer.decode(r["token_ids"]) for r in base[:len(CASES)]},
              "configs": {c: summarise(rows[c], base) for c in list(configs)[1:]}}
    print(f"{'config':<24} {'ratio':>6} {'alpha':>6} {'tok/pass':>8} {'drafts':>6} {'forced':>6} {'jump':>5} "
          f"{'replaced':>8} {'dropped':>7} {'exit run/skip':>13} exact")
    for c, e in report["configs"].items():
        print(f"{c:<24} {e['ratio_median']:>5.2f}x {e['acceptance_rate']:>6.2f} {e['tokens_per_pass']:>8.2f} "
              f"{e['drafted']:>6} {e['forced']:>6} {e['jump']:>5} {e['replaced']:>8} {e['dropped']:>7} "
              f"{e['exit_rows']:>6}/{e['exit_rows_skipped']:<6} {e['token_identical']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
