"""Bubble and useful fractions of a 2-stage pipeline, plain and with SPEED, against theory.

Must-show of issue 5: plain `--speculate none`, `--stages 2`, one prompt: each stage's bubble
(idle) fraction is within 0.1 of the expected (S - 1) / S = 0.5; with speculation the useful
fraction rises by the factor the acceptance predicts, S / (alpha * e + (1 - alpha) * S) with
e = 1 (exit at the end of stage 0), ARCHITECTURE.md §5. Runs `speedpipe launch --json` twice
(plain, then speculating) on the same prompt and prints both, with PASS/FAIL lines.

    python tests/benchmarks/bubble_fraction.py [--model smollm2-135m] [--max-new-tokens 64]
        [--predictor hybrid] [--out tests/benchmarks/results/bubble_fraction.json]

The useful-fraction comparison is a reading, not a gate: on a loaded machine the forwards of the
two runs differ in speed. The plain bubble fraction is a timing, so it is checked here, not in the
suite; tests/integration/test_throughput.py checks the ordering behind it (the two stages of plain
decode never compute at once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pipeline.engine.simulator import closed_form_speedup
from pipeline.weights.registry import DEFAULT_MODEL

PROMPT = "The history of the printing press begins in"
STAGES = 2


def launch_json(model: str, max_new_tokens: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "launcher.cli.main", "launch", "--model", model, "--stages", str(STAGES), "--prompt",
           PROMPT, "--max-new-tokens", str(max_new_tokens), "--ignore-eos", "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--predictor", default="hybrid")
    p.add_argument("--out", default="tests/benchmarks/results/bubble_fraction.json")
    args = p.parse_args(argv)
    plain = launch_json(args.model, args.max_new_tokens, "--speculate", "none")["stats"]
    spec = launch_json(args.model, args.max_new_tokens, "--speculate", "speed", "--predictor", args.predictor)["stats"]
    idle = [s["idle_fraction"] for s in plain["stages"]]
    bubble_ok = all(abs(x - 0.5) <= 0.1 for x in idle)
    alpha = spec["acceptance_rate"]  # null when the run verified no draft: nothing to predict from
    predicted = closed_form_speedup(num_stages=STAGES, alpha=alpha) if alpha is not None else None
    useful_ratio = [b["useful_fraction"] / a["useful_fraction"] for a, b in zip(plain["stages"], spec["stages"],
                                                                                  strict=True)]
    report = {"settings": vars(args), "plain": plain, "speculating": spec, "plain_idle_fractions": idle,
              "bubble_pass": bubble_ok, "acceptance": alpha, "predicted_useful_ratio": predicted,
              "measured_useful_ratio": useful_ratio,
              "measured_tokens_per_s_ratio": spec["tokens_per_s"] / plain["tokens_per_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"plain, 2 stages, 1 prompt: idle fraction per stage {idle} (expected 0.5 +- 0.1): "
          f"{'PASS' if bubble_ok else 'FAIL'}")
    closed = "no draft was verified" if predicted is None else f"closed form predicts x{predicted:.3f}"
    print(f"SPEED ({args.predictor}): acceptance {'-' if alpha is None else f'{alpha:.3f}'}; useful fraction "
          f"x{[round(r, 3) for r in useful_ratio]} per stage, tokens/s x{report['measured_tokens_per_s_ratio']:.3f}; "
          f"{closed}")
    return 0 if bubble_ok else 1


if __name__ == "__main__":
    sys.exit(main())
