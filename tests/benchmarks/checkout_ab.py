"""Before/after of a runtime change: `launch --json` from two checkouts, alternating, side by side.

The ratio benchmarks (core_speed.py and the rest) compare configurations of one checkout. A change
to the runtime itself (the data plane, the coordinator's turn) needs the same run from the code
before and after it: each repeat runs `launch` once from checkout A and once from checkout B (the
order alternating per repeat, so drift hits both alike), with the same prompt, stages and flags,
and reads its `stats`: decode tokens/s, the handoff latencies of the timeline (stage to stage, and
the ring return last stage → coordinator → stage 0; pipeline/measure/handoffs.py) and ITL p50/p99.
Reports the medians over repeats and the paired B/A ratio of tokens/s.

    git worktree add /tmp/before <commit>
    python tests/benchmarks/checkout_ab.py --a /tmp/before --b . [--stages 1,2] [--repeats 5]
        [--max-new-tokens 200] [--quantization auto] [--out FILE]

Each checkout runs with its own sources (PYTHONPATH) and this interpreter; the model and packages
are shared. Ratios only, from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Once upon a time"


def run_launch(checkout: Path, stages: int, args: argparse.Namespace) -> dict:
    """`launch --json` from `checkout`; returns its stats. Raises RuntimeError if it fails."""
    cmd = [sys.executable, "-m", "launcher.cli.main", "launch", "--stages", str(stages), "--quantization",
           args.quantization, "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", "--prompt", PROMPT, "--json",
           "--speculate", "none"]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"launch in {checkout} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["stats"]


def summary(stats: dict) -> dict:
    """The numbers compared: tokens/s, handoff medians (ms) and ITL p50/p99 (ms)."""
    handoffs = stats.get("handoffs") or {}
    ring = (handoffs.get("ring_return") or {}).get("p50_ms")
    links = [h["p50_ms"] for h in handoffs.get("stage_handoff") or []]
    return {"tokens_per_s": stats["tokens_per_s"], "ring_return_ms": ring,
            "stage_handoff_ms": statistics.mean(links) if links else None,
            "itl_ms_p50": stats.get("itl_ms_p50"), "itl_ms_p99": stats.get("itl_ms_p99")}


def _describe(checkout: Path) -> str:
    """The checkout's path, commit and whether it has uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                           capture_output=True, text=True)
    return f"{checkout} @ {head.stdout.strip() or '?'}{' + uncommitted changes' if dirty.stdout.strip() else ''}"


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="checkout before the change (a git worktree)")
    p.add_argument("--b", required=True, help="checkout after the change")
    p.add_argument("--stages", default="1,2", help="comma-separated stage counts (default 1,2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--out", default=None, help="JSON report (default: print only)")
    args = p.parse_args(argv)
    checkouts = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    for name, path in checkouts.items():
        if not (path / "launcher" / "cli" / "main.py").is_file():
            print(f"error: --{name} {path}: not a speedpipe checkout", file=sys.stderr)
            return 2
    stage_counts = [int(s) for s in args.stages.split(",")]
    if args.repeats < 1 or any(s < 1 for s in stage_counts):
        print("error: --repeats and every --stages count must be >= 1", file=sys.stderr)
        return 2
    report = {"benchmark": "checkout_ab", "command": " ".join(["python", "tests/benchmarks/checkout_ab.py",
                                                              *(sys.argv[1:] if argv is None else argv)]),
              "a": _describe(checkouts["a"]), "b": _describe(checkouts["b"]), "quantization": args.quantization,
              "max_new_tokens": args.max_new_tokens, "stages": {}}
    for stages in stage_counts:
        rows: dict[str, list[dict]] = {"a": [], "b": []}
        for r in range(args.repeats):
            for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                rows[name].append(summary(run_launch(checkouts[name], stages, args)))
                print(f"stages {stages} repeat {r + 1} {name}: {rows[name][-1]}", flush=True)
        paired = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(rows["a"], rows["b"], strict=True)]
        medians = {name: {k: _median(v, k) for k in v[0]} for name, v in rows.items()}
        report["stages"][str(stages)] = {"runs": rows, "medians": medians,
                                         "tokens_per_s_b_over_a": round(statistics.median(paired), 3),
                                         "paired": [round(x, 3) for x in paired]}
        print(f"stages {stages}: medians a {medians['a']}\n          b {medians['b']}\n"
              f"          tokens/s b/a {statistics.median(paired):.3f} (paired, per repeat {[round(x, 3) for x in paired]})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
