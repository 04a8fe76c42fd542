"""Throughput studies as a user runs them: `speedpipe bench` and `speedpipe simulate` subprocesses.

On the tiny model (fast): bench writes results.json / results.csv (one row per configuration,
ratios paired per repeat), a valid Chrome trace and timeline per run, timelines.json (every run's
timeline, compact, enough to calibrate without runs/), and PNG plots of the
documented size; simulate runs calibrated on that bench output; bad input exits 2 with a one-line
error before anything starts. On the real default model: plain decode of one prompt on 2 stages
never runs both stages at once (why its bubble is 1/2; the fraction itself is a timing, measured by
tests/benchmarks/bubble_fraction.py).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from launcher.bench.plots import FIG_PX, png_size
from launcher.cli.main import main as cli_main
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
CONFIGS = ["s1-none-c1", "s2-none-c1", "s2-speed-ngram-c1"]
REPEATS = 2
MAX_NEW_TOKENS = 8


def speedpipe(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli.main", *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("throughput") / "tiny")


@pytest.fixture(scope="module")
def prompts_file(tiny: Path) -> Path:
    path = tiny.parent / "prompts.txt"
    path.write_text("Hello there\nThe answer is\nOnce upon a time\n")
    return path


@pytest.fixture(scope="module")
def bench_out(tiny: Path, prompts_file: Path) -> Path:
    out = tiny.parent / "bench"
    proc = speedpipe("bench", "--model", str(tiny), "--stages", "1,2", "--speculate", "none,speed", "--predictor",
                     "ngram", "--concurrency", "1", "--prompts", str(prompts_file), "--max-new-tokens",
                     str(MAX_NEW_TOKENS), "--repeats", str(REPEATS), "--out", str(out), "--no-progress")
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert "skipped --stages 1 with --speculate speed" in proc.stderr
    return out


def test_bench_writes_results_json_and_one_csv_row_per_configuration(bench_out: Path):
    results = json.loads((bench_out / "results.json").read_text())
    assert [c["name"] for c in results["configs"]] == CONFIGS
    for c in results["configs"]:
        assert len(c["runs"]) == REPEATS and [r["repeat"] for r in c["runs"]] == list(range(REPEATS))
        tps = c["summary"]["tokens_per_s"]
        assert 0 < tps["min"] <= tps["median"] <= tps["max"]
        assert all(r["num_tokens"] == [MAX_NEW_TOKENS] for r in c["runs"])
        assert len(c["stages_fractions"]) == c["stages"]
    rows = list(csv.DictReader((bench_out / "results.csv").open()))
    assert [r["name"] for r in rows] == CONFIGS
    assert all(float(r["tokens_per_s_median"]) > 0 and 0 <= float(r["bubble_fraction_median"]) <= 1 for r in rows)


def test_bench_ratios_are_paired_within_each_repeat(bench_out: Path):
    configs = {c["name"]: c for c in json.loads((bench_out / "results.json").read_text())["configs"]}
    spec, plain = configs["s2-speed-ngram-c1"], configs["s2-none-c1"]
    want = [a["stats"]["tokens_per_s"] / b["stats"]["tokens_per_s"] for a, b in zip(spec["runs"], plain["runs"], strict=True)]
    assert spec["ratio_vs_plain"]["of"] == "s2-none-c1"
    assert spec["ratio_vs_plain"]["samples"] == pytest.approx(want)
    assert configs["s1-none-c1"]["ratio_vs_first"]["samples"] == pytest.approx([1.0] * REPEATS)


def test_bench_trace_of_every_run_has_stage_tracks_ordered_slices_and_commits(bench_out: Path):
    results = json.loads((bench_out / "results.json").read_text())
    for c in results["configs"]:
        for run in c["runs"]:
            events = json.loads((bench_out / run["trace"]).read_text())["traceEvents"]
            tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
            assert [tracks[i] for i in range(c["stages"])] == [f"stage {i}" for i in range(c["stages"])]
            for stage in range(c["stages"]):
                xs = [e for e in events if e["ph"] == "X" and e["tid"] == stage]
                assert xs, f"{run['trace']}: no slice on stage {stage}"
                for a, b in zip(xs, xs[1:], strict=False):  # one stage computes one micro-batch at a time
                    assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{run['trace']}: overlapping slices"
                assert all(item["outcome"] in ("committed", "squashed") for e in xs for item in e["args"]["items"])
            assert sum(1 for e in events if e["ph"] == "i") == MAX_NEW_TOKENS
            timeline = json.loads((bench_out / run["timeline"]).read_text())
            assert timeline["num_stages"] == c["stages"] and timeline["slices"]


def test_bench_keeps_every_run_timeline_as_a_record_that_calibrates_without_runs(bench_out: Path, tmp_path: Path):
    """timelines.json ([Note: timeline record] in launcher/bench/run_records.py): a study commits
    results.json and timelines.json, not runs/, and is re-calibrated from them alone."""
    import shutil

    from launcher.bench.run_records import expand_timeline, load_bench_runs, read_records

    results = json.loads((bench_out / "results.json").read_text())
    records = read_records(bench_out)
    runs = [run for c in results["configs"] for run in c["runs"]]
    assert set(records) == {run["timeline"] for run in runs}
    for run in runs:
        assert expand_timeline(records[run["timeline"]]) == json.loads((bench_out / run["timeline"]).read_text())
    for name in ("results.json", "timelines.json"):
        shutil.copy(bench_out / name, tmp_path / name)
    assert load_bench_runs(tmp_path / "results.json") == load_bench_runs(bench_out / "results.json")


def test_bench_plots_are_pngs_of_the_documented_size(bench_out: Path):
    results = json.loads((bench_out / "results.json").read_text())
    want = {f"plots/gantt_{n}.png" for n in CONFIGS} | {"plots/summary.png", "plots/acceptance.png"}
    assert set(results["plots"]) == want
    for rel in want:
        assert png_size(bench_out / rel) == FIG_PX, rel
        assert (bench_out / rel).stat().st_size > 5_000, f"{rel} looks empty"


def test_simulate_runs_calibrated_on_the_bench_output(bench_out: Path):
    out = bench_out.parent / "simulate"
    proc = speedpipe("simulate", "--calibrate", str(bench_out / "results.json"), "--stages", "1,2,4", "--alpha",
                     "none,0.9", "--link-latency-s", "0,0.001", "--max-new-tokens", "16", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "simulate.json").read_text())
    assert [c["config"] for c in report["calibration_check"]] == CONFIGS
    assert all(c["predicted_tokens_per_s"] > 0 for c in report["calibration_check"])
    sweep = report["sweep"]
    assert len(sweep) == (1 + 2 + 2) * 2  # stages 1: plain only; 2 and 4: plain and alpha 0.9; two latencies
    assert all(0 <= r["bubble_fraction"] <= 1 and r["tokens_per_s"] > 0 for r in sweep)
    assert len(list(csv.DictReader((out / "simulate.csv").open()))) == len(sweep)
    for rel in report["plots"]:
        assert png_size(out / rel) == FIG_PX, rel
    assert {"plots/sim_utilisation.png", "plots/sim_tokens_per_s.png", "plots/sim_latency.png",
            "plots/sim_calibration.png"} <= set(report["plots"])


@pytest.mark.parametrize("args,needle", [
    (["bench", "--speculate", "none,medusa"], "medusa not supported by this pipeline"),
    (["bench", "--stages", "0,2"], "--stages"),
    (["bench", "--concurrency", "two"], "--concurrency"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--prompts", "/nonexistent/prompts.txt"], "--prompts"),
    (["bench", "--predictor", "oracle"], "--predictor"),
    (["bench", "--dense-layout", "fast", "--quantization", "int8"], "--dense-layout"),
    (["simulate", "--alpha", "1.5"], "--alpha"),
    (["simulate", "--stages", "0"], "--stages"),
    (["simulate", "--calibrate", "/nonexistent/results.json"], "--calibrate"),
    (["simulate", "--replay"], "--replay"),
    (["simulate", "--link-bandwidth-bytes-per-s", "0"], "--link-bandwidth"),
    (["launch", "--prompt", "Hi", "--trace", "t.json", "--no-timeline"], "--no-timeline"),
])
def test_bad_input_exits_2_with_one_line_error(args: list[str], needle: str, tiny: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture):
    # in-process (nothing is spawned before the input is checked), so the 10 cases stay fast
    extra = ["--model", str(tiny)] if args[0] in ("bench", "launch") else []
    out = ["--out", str(tmp_path / "out")] if args[0] != "launch" else []
    assert cli_main([*args, *extra, *out]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith(f"speedpipe {args[0]}: error:"), lines
    assert not any("stage_worker" in " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True))
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(600)
def test_plain_two_stage_decode_of_one_prompt_never_runs_both_stages_at_once(smollm2_dir: Path, tmp_path: Path):
    """Why the bubble of plain decode is (S - 1) / S: one sequence has one item in flight, so its
    stages take turns. Checked as an ordering property of the recorded slices (the idle fraction
    itself is timing: tests/benchmarks/bubble_fraction.py measures it against 0.5)."""
    trace = tmp_path / "plain.trace.json"
    proc = speedpipe("launch", "--model", str(smollm2_dir), "--stages", "2", "--speculate", "none", "--prompt",
                     "The history of the printing press begins in", "--max-new-tokens", "16", "--ignore-eos",
                     "--json", "--trace", str(trace), timeout_s=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    assert all(s["wasted_fraction"] == 0 for s in stats["stages"])
    assert stats["tpot_ms_p50"] > 0 and stats["ttft_ms_p50"] > 0
    (link,), ring = stats["handoffs"]["stage_handoff"], stats["handoffs"]["ring_return"]
    assert link["count"] == 16 and ring["count"] == 15, stats["handoffs"]  # every pass; every decode's input found
    assert 0 <= ring["p50_ms"] < stats["tpot_ms_p50"] and 0 <= link["p50_ms"] < stats["tpot_ms_p50"]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    slices = sorted((e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events)
    assert {tid for _, _, tid in slices} == {0, 1}
    for (_, end_a, tid_a), (start_b, _, tid_b) in zip(slices, slices[1:], strict=False):
        assert tid_a != tid_b, "a stage ran twice in a row: items were not passed on"
        assert start_b >= end_a - 1.0, f"stages {tid_a} and {tid_b} overlap by {end_a - start_b:.1f} us"


def test_launch_without_timeline_reports_busy_and_idle_from_stage_counters(tiny: Path):
    proc = speedpipe("launch", "--model", str(tiny), "--stages", "2", "--prompt", "Hello", "--max-new-tokens", "6",
                     "--ignore-eos", "--json", "--no-timeline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    assert stats["timeline_recorded"] is False and stats["generated_tokens"] == 6
    for s in stats["stages"]:
        assert 0 < s["busy_fraction"] <= 1 and s["idle_fraction"] == pytest.approx(1 - s["busy_fraction"], abs=1e-3)
        assert "useful_fraction" not in s
    assert "handoffs" not in stats
