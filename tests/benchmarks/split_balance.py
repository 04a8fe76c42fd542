"""Does the default split pay? `launch` with the split it picks against `--layer-split` alternatives,
side by side: the same prompts, each configuration run in turn per repeat (a b a b ...), the ratio of
generated tokens/s taken within each repeat and summarised by its median.

With more prompts than stages every stage is busy, and the pipeline runs at the pace of its most
expensive stage, which is what the split's cost model ([Note: partition cost] in
pipeline/model/partition.py) balances; this checks that model against the pipeline itself.

    python tests/benchmarks/split_balance.py --stages 4 --quantization auto --alternatives 9,8,8,5
        [--prompts 8] [--max-new-tokens 96] [--repeats 3] [--out tests/benchmarks/results/split_balance.json]

Ratios only; one torch thread per stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = ("river", "castle", "robot", "garden", "winter", "music", "ocean", "market", "forest", "city",
         "mountain", "island", "library", "desert", "harbor", "comet")


def run_launch(*, stages: int, quantization: str, split: str | None, prompts: int, max_new_tokens: int) -> dict:
    """One `launch --json` run; its report (the last stdout line). Raises RuntimeError if it fails."""
    cmd = [sys.executable, "-m", "launcher.cli.main", "launch", "--stages", str(stages), "--quantization", quantization,
           "--max-new-tokens", str(max_new_tokens), "--ignore-eos", "--json", "--speculate", "none"]
    for word in (WORDS * (prompts // len(WORDS) + 1))[:prompts]:
        cmd += ["--prompt", f"A short story about a {word}:"]
    if split:
        cmd += ["--layer-split", split]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--alternatives", required=True, help="';'-separated --layer-split values to compare with the default")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "split_balance.json"))
    args = p.parse_args(argv)
    if min(args.stages, args.prompts, args.max_new_tokens, args.repeats) < 1:
        print("error: --stages, --prompts, --max-new-tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    configs = [None] + [s.strip() for s in args.alternatives.split(";") if s.strip()]
    runs: dict[str, list[dict]] = {c or "default": [] for c in configs}
    for i in range(args.repeats):
        for split in configs:
            report = run_launch(stages=args.stages, quantization=args.quantization, split=split, prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens)
            stats = report["stats"]
            row = {"tokens_per_s": stats["tokens_per_s"],
                   "split": [st["layers"][1] - st["layers"][0] for st in stats["stages"]],
                   "stage_busy": [st["busy_fraction"] for st in stats["stages"]]}
            runs[split or "default"].append(row)
            print(f"repeat {i + 1} {split or 'default'} {row['split']}: {row['tokens_per_s']:.1f} tokens/s, "
                  f"stage busy {row['stage_busy']}", flush=True)
    base = runs["default"]
    ratios = {name: round(statistics.median(b["tokens_per_s"] / r["tokens_per_s"] for b, r in zip(base, rs, strict=True)), 3)
              for name, rs in runs.items() if name != "default"}
    for name, ratio in ratios.items():
        print(f"default / {name}: {ratio:.3f}x (median of {args.repeats} paired repeats)")
    report = {"benchmark": "split_balance",
              "command": " ".join(["python", "tests/benchmarks/split_balance.py", *(sys.argv[1:] if argv is None else argv)]),
              "stages": args.stages, "quantization": args.quantization, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "runs": runs, "default_over": ratios}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
