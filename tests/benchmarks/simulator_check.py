"""Live check of the calibrated simulator: bench a sweep, calibrate on it, predict it back.

Must-show of issue 5: calibrated on a measured sweep at --stages 1,2, the simulator predicts the
tokens/s of every measured configuration within +-15 %. Runs

    speedpipe bench --stages 1,2 --speculate none,speed --concurrency 1,2 ... --out OUT/bench
    speedpipe simulate --calibrate OUT/bench/results.json --stages 1,2,4,8 --out OUT/simulate

and prints each configuration's measured and predicted tokens/s with PASS/FAIL.

    python tests/benchmarks/simulator_check.py [--model smollm2-135m] [--max-new-tokens 32] [--repeats 3]
        [--out tests/benchmarks/results/simulator_check] [--tolerance 0.15]

Needs a quiet machine: the simulator models stage compute, hops, the coordinator's one thread
and contention between stages computing at once, not other jobs taking the CPUs (on a loaded
2-core machine the tiny model's multi-sequence runs are starved and miss by far more than 15 %).
The calibration maths are tested on recorded data in tests/unit/test_calibrate.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pipeline.models import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", default="sotu")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--predictor", default="hybrid")
    p.add_argument("--out", default="tests/benchmarks/results/simulator_check")
    p.add_argument("--tolerance", type=float, default=0.15)
    args = p.parse_args(argv)
    out = Path(args.out)
    cli = [sys.executable, "-m", "launcher.cli"]
    subprocess.run([*cli, "bench", "--model", args.model, "--stages", "1,2", "--speculate", "none,speed",
                    "--predictor", args.predictor, "--concurrency", "1,2", "--prompts", args.prompts,
                    "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
                    "--out", str(out / "bench")], check=True)
    subprocess.run([*cli, "simulate", "--calibrate", str(out / "bench" / "results.json"), "--stages", "1,2,4,8",
                    "--out", str(out / "simulate")], check=True)
    checks = json.loads((out / "simulate" / "simulate.json").read_text())["calibration_check"]
    ok = True
    for c in checks:
        good = abs(c["error"]) <= args.tolerance
        ok &= good
        print(f"{c['config']:<24} measured {c['measured_tokens_per_s']:8.2f}  predicted "
              f"{c['predicted_tokens_per_s']:8.2f}  {c['error']:+7.1%}  {'PASS' if good else 'FAIL'}")
    print(f"simulator within +-{args.tolerance:.0%} of every measured configuration: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
