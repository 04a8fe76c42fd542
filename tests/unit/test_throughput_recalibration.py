"""Re-calibrating a committed throughput study without running the model
(`tests/benchmarks/throughput_study.py --recalibrate-from`, launcher/bench/run_records.py).

What breaks when these fail: a committed study's fitted costs and +-10 % table can no longer be
reproduced from the committed files (its runs/ folder is not committed), so a change to the
calibration code cannot be checked against the study without a quiet machine and a new sweep; or a
study made before the records existed fails with a traceback instead of saying what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks import throughput_study

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "benchmarks" / "results" / "throughput_16x2"


def test_the_committed_study_recalibrates_to_its_committed_fit_and_table(monkeypatch, capsys):
    """The reference is the simulate.json that `throughput_study.py --skip-bench` wrote from the
    sweep's full runs/ timelines; the recalibration reads only results.json and timelines.json."""
    monkeypatch.chdir(ROOT)  # --row-cost file:tests/benchmarks/results/row_cost.json is relative to it
    results = SAMPLE / "bench" / "results.json"
    assert not (SAMPLE / "bench" / "runs").exists()  # only the records are committed
    committed = json.loads((SAMPLE / "simulate" / "simulate.json").read_text())
    fitted, checks = throughput_study.recalibrate(results, row_cost=committed["settings"]["row_cost"])
    assert fitted == committed["calibration"]
    assert checks == committed["calibration_check"]
    code = throughput_study.main(["--recalibrate-from", str(results)])
    out = capsys.readouterr().out
    assert "fitted costs as committed, table as committed" in out
    for c in checks:
        assert f"{c['config']:<24} measured {c['measured_tokens_per_s']:8.2f}" in out
    assert code == (0 if all(abs(c["error"]) <= 0.10 for c in checks) else 1)


def test_a_committed_study_without_records_says_what_is_missing(monkeypatch, capsys):
    """The 24 x 3 study of the README was committed before the records existed, without runs/."""
    monkeypatch.chdir(ROOT)
    results = ROOT / "tests" / "benchmarks" / "results" / "throughput" / "bench" / "results.json"
    assert throughput_study.main(["--recalibrate-from", str(results)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"throughput_study: error: --recalibrate-from {results}: no timelines.json beside it")
    assert len(err.splitlines()) == 1
