"""The example throughput study of the README, end to end, and the live check of the simulator.

Runs a measured sweep and the simulator calibrated on it:

    speedpipe bench --stages 1,2 --speculate none,speed,firp --predictor hybrid,ngram --concurrency 1,2 \
        --prompts sotu --max-new-tokens K --repeats R --out WORK/bench
    speedpipe simulate --calibrate WORK/bench/results.json --row-cost file:tests/benchmarks/results/row_cost.json \
        --stages 1,2,4,8,16,32,64 --alpha none,0.25,0.5,0.75,0.9,1 --link-latency-s 0,0.001,0.005,0.02 \
        --max-new-tokens 128 --out WORK/simulate

then copies the plots, results.json/.csv, timelines.json (every run's timeline, compact: what
re-calibration needs) and simulate.json/.csv (not the per-run traces) to --out
(tests/benchmarks/results/throughput/, committed), and prints each measured configuration's
tokens/s next to the calibrated simulator's prediction with PASS/FAIL against --tolerance
(issue 14: within +-10 % for every configuration of a sweep at --stages 1,2, speculating ones
included), both at the fitted costs and at each run's own load ([Note: table calibration] in
pipeline/measure/calibrate_tables.py).

    python tests/benchmarks/throughput_study.py [--model smollm2-135m] [--max-new-tokens 32] [--repeats 3]
        [--work /tmp/speedpipe-throughput] [--out tests/benchmarks/results/throughput] [--tolerance 0.10]

Needs a quiet machine: the simulator models stage compute, hops, the coordinator's one thread
and contention between stages computing at once, not other jobs taking the CPUs (on a loaded
2-core machine the tiny model's multi-sequence runs are starved and miss by far more than 15 %).
The calibration maths are tested on recorded data in tests/unit/test_calibrate.py.

Re-calibration without the model: the sweep's timelines.json (every run's timeline, compact;
[Note: timeline record] in launcher/bench/run_records.py) is kept with results.json, so

    python tests/benchmarks/throughput_study.py --recalibrate-from tests/benchmarks/results/throughput_16x2/bench/results.json

fits the costs again from the committed files alone, prints the +-10 % table, and says whether the
fit and the table equal those of the simulate.json committed beside it (../simulate/simulate.json);
no sweep is simulated and nothing is written. `--skip-bench` writes WORK/bench/timelines.json from
runs/ for a sweep made before the records existed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from launcher.bench.run_records import RECORDS_FILE, load_bench_runs, write_records
from launcher.bench.simulate import check_calibration, row_shape_arg
from launcher.cli.output_paths import dumps_strict
from pipeline.measure.calibrate import calibrate
from pipeline.weights.registry import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", default="sotu")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--predictor", default="hybrid,ngram")
    p.add_argument("--work", default="/tmp/speedpipe-throughput", help="where bench/simulate write everything")
    p.add_argument("--out", default="tests/benchmarks/results/throughput", help="where the kept files go")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--speculate", default="none,speed,firp")
    p.add_argument("--row-cost", default="file:tests/benchmarks/results/row_cost.json",
                   help="simulate --row-cost: the measured row-cost table for row counts the runs lack")
    p.add_argument("--skip-bench", action="store_true", help="reuse WORK/bench (simulate and copy again)")
    p.add_argument("--sim-tokens", type=int, default=128, help="tokens per sequence in the simulated sweep")
    p.add_argument("--recalibrate-from", metavar="RESULTS_JSON", help="fit and check a measured sweep again from "
                   "its results.json and timelines.json, without running the model or the simulated sweep")
    args = p.parse_args(argv)
    if args.recalibrate_from:
        try:
            return recalibrate_committed(Path(args.recalibrate_from), row_cost=args.row_cost,
                                         tolerance=args.tolerance)
        except ValueError as exc:
            print(f"throughput_study: error: {exc}", file=sys.stderr)
            return 2
    work, out = Path(args.work), Path(args.out)
    cli = [sys.executable, "-m", "launcher.cli.main"]
    if not args.skip_bench:
        subprocess.run([*cli, "bench", "--model", args.model, "--stages", "1,2", "--speculate", args.speculate,
                        "--predictor", args.predictor, "--concurrency", "1,2", "--prompts", args.prompts,
                        "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
                        "--out", str(work / "bench")], check=True)
    elif not (work / "bench" / RECORDS_FILE).is_file():  # a sweep made before records existed
        results = json.loads((work / "bench" / "results.json").read_text())
        write_records([run for c in results["configs"] for run in c["runs"]], work / "bench")
    subprocess.run([*cli, "simulate", "--calibrate", str(work / "bench" / "results.json"), "--row-cost", args.row_cost,
                    "--stages",
                    "1,2,4,8,16,32,64", "--alpha", "none,0.25,0.5,0.75,0.9,1", "--link-latency-s", "0,0.001,0.005,0.02",
                    "--max-new-tokens", str(args.sim_tokens), "--out", str(work / "simulate")], check=True)
    for part, files in (("bench", ("results.json", "results.csv", RECORDS_FILE)),
                        ("simulate", ("simulate.json", "simulate.csv"))):
        (out / part / "plots").mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy(work / part / name, out / part / name)
        for png in (work / part / "plots").glob("*.png"):
            shutil.copy(png, out / part / "plots" / png.name)
    checks = json.loads((work / "simulate" / "simulate.json").read_text())["calibration_check"]
    return 0 if print_checks(checks, args.tolerance) else 1


def print_checks(checks: list[dict], tolerance: float) -> bool:
    """The +-tolerance table, one line per configuration, and the count line; whether all pass."""
    ok = True
    for c in checks:
        good = abs(c["error"]) <= tolerance
        ok &= good
        print(f"{c['config']:<24} measured {c['measured_tokens_per_s']:8.2f}  predicted "
              f"{c['predicted_tokens_per_s']:8.2f}  {c['error']:+7.1%}  {'PASS' if good else 'FAIL'}   at run load "
              f"({c['run_load']:.2f}x) {c['at_run_load_error']:+7.1%}")
    print(f"simulator within +-{tolerance:.0%} of every measured configuration: {'PASS' if ok else 'FAIL'} "
          f"({sum(abs(c['error']) <= tolerance for c in checks)} of {len(checks)}); at each run's load: "
          f"{sum(abs(c['at_run_load_error']) <= tolerance for c in checks)} of {len(checks)}")
    return ok


def recalibrate(results_json: Path, *, row_cost: str) -> tuple[dict, list[dict]]:
    """(the fitted costs as simulate.json's "calibration", its "calibration_check" rows) of a measured
    sweep, fitted again from its runs' timelines (timelines.json beside results.json, else runs/):
    what `simulate --calibrate` computes before its sweep. row_cost: as simulate's --row-cost, priced
    in the sweep's dtype. Raises ValueError (one line) for a sweep with neither, or a bad table."""
    runs = load_bench_runs(results_json, flag="--recalibrate-from")
    dtype = json.loads(results_json.read_text()).get("settings", {}).get("dtype", "float32")
    cal = calibrate(runs, row_shape=row_shape_arg(argparse.Namespace(row_cost=row_cost, dtype=dtype)))
    return json.loads(dumps_strict(cal.to_json(), default=str)), check_calibration(cal, runs)


def recalibrate_committed(results_json: Path, *, row_cost: str, tolerance: float) -> int:
    """`--recalibrate-from`: print the table of `recalibrate` and whether the fit and the table equal
    the simulate.json committed beside the sweep (../simulate/simulate.json, if there is one).
    Returns 0 when every configuration is within `tolerance` and nothing differs from the committed
    files, else 1. Raises ValueError as `recalibrate`."""
    fitted, checks = recalibrate(results_json, row_cost=row_cost)
    ok = print_checks(checks, tolerance)
    committed = results_json.resolve().parent.parent / "simulate" / "simulate.json"
    if committed.is_file():
        before = json.loads(committed.read_text())
        same = {"fitted costs": before.get("calibration") == fitted, "table": before.get("calibration_check") == checks}
        print(f"recalibrated from {results_json}: " + ", ".join(f"{k} {'as' if v else 'NOT as'} committed"
                                                               for k, v in same.items()) + f" in {committed}")
        ok &= all(same.values())
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
