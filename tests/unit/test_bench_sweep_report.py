"""`bench sweep`'s summary and flags, in process (no driver is started): acceptance aggregated only
over runs that verified drafts, strict results.json, partial results after Ctrl-C, trained predictor
files as sweep configurations, --out checked before anything runs.

What breaks when these fail: the table and results.csv average a run that drafted nothing in as
"every draft rejected" (0.2 and 0.0 -> 0.10 while the plot says 0.20); a Ctrl-C loses every completed
run; a trained head cannot be benchmarked; a mistyped --out is a traceback after the sweep.
"""

from __future__ import annotations

import argparse
import csv
import json
import re

import pytest

from launcher.bench import sweep_report
from launcher.bench.sweep import BenchConfig, add_bench_args, sweep_configs
from launcher.cli.main import main

pytestmark = pytest.mark.timeout(60)

SPEC = BenchConfig(2, "speed", "hybrid", 1)
PLAIN = BenchConfig(2, "none", "-", 1)


def _run(repeat: int, *, tps: float, acceptance: float | None, verified: int) -> dict:
    stats = {"tokens_per_s": tps, "bubble_fraction": 0.5, "ttft_ms_p50": 10.0, "tpot_ms_p50": 20.0,
             "tpot_ms_p99": 30.0, "acceptance_rate": acceptance, "verified_drafts": verified,
             "accepted_tokens": round((acceptance or 0.0) * verified),
             "stages": [{"busy_fraction": 0.5, "idle_fraction": 0.5}] * 2}
    return {"repeat": repeat, "stats": stats, "num_tokens": [4], "trace": "t", "timeline": "tl"}


def _runs() -> dict[str, list[dict]]:
    # the reviewer's case: one repeat verified drafts (0.2), the other verified none
    return {PLAIN.name: [_run(0, tps=10.0, acceptance=None, verified=0), _run(1, tps=10.0, acceptance=None, verified=0)],
            SPEC.name: [_run(0, tps=12.0, acceptance=0.2, verified=5), _run(1, tps=11.0, acceptance=0.0, verified=0)]}


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(["--out", str(tmp_path / "out"), "--no-plots", "--repeats", "2", *kw.get("argv", [])])


def test_acceptance_is_aggregated_only_over_runs_that_verified_drafts():
    rows = {r["name"]: r for r in sweep_report.summarise([PLAIN, SPEC], _runs())}
    assert rows[SPEC.name]["summary"]["acceptance_rate"]["median"] == pytest.approx(0.2)
    assert rows[SPEC.name]["summary"]["acceptance_rate"]["samples"] == [0.2]
    assert rows[PLAIN.name]["summary"]["acceptance_rate"]["median"] is None
    table = sweep_report.format_table(list(rows.values())).splitlines()
    plain_line, spec_line = (next(line for line in table if line.startswith(n)) for n in (PLAIN.name, SPEC.name))
    assert " 0.20 " in spec_line and " 0.10 " not in spec_line
    assert re.search(r" 20\.0 +- +1\.000 vs", plain_line), plain_line  # TPOT, acceptance "-", ratio


def test_results_json_is_strict_and_csv_has_empty_acceptance_without_drafts(tmp_path, capsys):
    args = _args(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    runs = _runs()
    runs[SPEC.name][0]["stats"]["tpot_ms_p99"] = float("inf")  # a non-finite value must not become Infinity
    sweep_report.write_results(args, [PLAIN, SPEC], runs, [], out)
    text = (out / "results.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    assert data["partial"] is False
    rows = {r["name"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert rows[PLAIN.name]["acceptance_rate_median"] == "" == rows[PLAIN.name]["acceptance_rate_pooled"]
    assert float(rows[SPEC.name]["acceptance_rate_median"]) == pytest.approx(0.2)
    assert float(rows[SPEC.name]["acceptance_rate_pooled"]) == pytest.approx(0.2)
    assert b"\r" not in (out / "results.csv").read_bytes()  # plain line ends (csv's default is \r\n)


def test_the_table_reports_acceptance_pooled_over_drafts_not_a_median_of_runs():
    """α is accepted / verified drafts (ARCHITECTURE.md §1): runs that accepted 1 of 4 and 1 of 1
    have α 0.40; the median of their rates (0.625) gave the 1-draft run the weight of the other."""
    runs = {SPEC.name: [_run(0, tps=12.0, acceptance=0.25, verified=4), _run(1, tps=11.0, acceptance=1.0, verified=1)]}
    [row] = sweep_report.summarise([SPEC], runs)
    acceptance = row["summary"]["acceptance_rate"]
    assert acceptance["pooled"] == pytest.approx(0.4) and acceptance["median"] == pytest.approx(0.625)
    assert " 0.40 " in sweep_report.format_table([row]).splitlines()[1]


def test_ctrl_c_keeps_the_completed_repeats_as_partial_results(tmp_path, capsys):
    args = _args(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    runs = _runs()
    runs[SPEC.name].pop()  # repeat 1 was interrupted after the plain run
    sweep_report.write_partial(args, [PLAIN, SPEC], runs, [], out)
    data = json.loads((out / "results.json").read_text())
    assert data["partial"] is True and all(r["repeats"] == 1 for r in data["configs"])
    assert "1 of 2 completed repeat(s)" in capsys.readouterr().err
    (out / "results.json").unlink()
    sweep_report.write_partial(args, [PLAIN, SPEC], {PLAIN.name: runs[PLAIN.name][:1], SPEC.name: []}, [], out)
    assert not (out / "results.json").exists()
    assert "no results written" in capsys.readouterr().err


def test_a_trained_predictor_file_is_a_sweep_configuration_named_by_its_stem(tmp_path):
    head = tmp_path / "h1.safetensors"
    head.write_bytes(b"")
    args = _args(tmp_path, argv=["--speculate", "speed", "--predictor", f"hybrid,{head}"])
    configs, _ = sweep_configs(args)
    assert [c.name for c in configs] == ["s2-speed-hybrid-c1", "s2-speed-h1-c1"]
    assert configs[1].predictor == str(head)
    args = _args(tmp_path, argv=["--speculate", "speed", "--predictor", str(tmp_path / "missing.safetensors")])
    with pytest.raises(ValueError, match="--predictor .*missing.safetensors: no such predictor file"):
        sweep_configs(args)
    args = _args(tmp_path, argv=["--speculate", "speed", "--predictor", "bogus"])
    with pytest.raises(ValueError, match="bogus not supported"):
        sweep_configs(args)


def test_out_that_is_a_file_is_a_one_line_error_before_anything_starts(tmp_path, capsys, monkeypatch):
    target = tmp_path / "results"
    target.write_text("")
    monkeypatch.setattr("launcher.bench.sweep.read_bench_prompts", lambda spec: pytest.fail("prompts were read"))
    assert main(["bench", "sweep", "--out", str(target), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"speedpipe bench sweep: error: --out {target}: exists and is not a directory (give a folder)"


def test_runs_that_shared_the_cpu_are_named(tmp_path, capsys):
    """A sweep on a host that became busy gave ratios of 0.72 and 1.17 for one configuration with
    nothing in results.json to tell which runs to trust: each run records foreign_cpu_fraction
    (launcher/cli/cpu_meter.py) and the sweep names the runs above 10 %."""
    runs = _runs()
    runs[SPEC.name][1]["stats"]["foreign_cpu_fraction"] = 0.35
    runs[PLAIN.name][0]["stats"]["foreign_cpu_fraction"] = 0.02
    rows = sweep_report.summarise([PLAIN, SPEC], runs)
    assert sweep_report.busy_runs(rows) == [f"{SPEC.name} repeat 1: 35%"]
    out = tmp_path / "out"
    out.mkdir()
    sweep_report.write_results(_args(tmp_path), [PLAIN, SPEC], runs, [], out)
    assert "1 run(s) shared the CPU with other work" in capsys.readouterr().err


def test_results_are_written_before_the_run_records_and_survive_their_failure(tmp_path, monkeypatch, capsys):
    """The records (timelines.json) refuse a timeline field they do not know, by design; written
    before results.json, that cost every sweep its results (exit 2 after all the runs)."""
    from launcher.bench import sweep

    monkeypatch.setattr(sweep, "_session_options", lambda args, configs, prompts: {})
    monkeypatch.setattr(sweep, "_run_sweep", lambda args, configs, options, prompts, out: (_runs(), None))
    args = _args(tmp_path, argv=["--stages", "2", "--speculate", "none,speed"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "timelines.json").write_text('{"format": 1, "records": {"OLD": {}}}')  # an earlier sweep's
    assert sweep.cmd_bench(args) == 0  # the runs' timeline files ("tl") do not exist: the records fail
    assert json.loads((tmp_path / "out" / "results.json").read_text())["configs"]
    assert not (tmp_path / "out" / "timelines.json").exists()  # calibration would have read the old runs
    assert "bench: no timelines.json (the runs/ timelines stay)" in capsys.readouterr().err


def test_the_sweep_s_stages_log_at_speedpipe_log_level_unless_the_flag_says_otherwise(tmp_path, monkeypatch):
    from launcher.bench import sweep

    monkeypatch.setattr(sweep, "resolve", lambda options: pytest.skip("the model is resolved after the level"))
    seen = {}
    monkeypatch.setattr(sweep, "PipelineOptions", lambda **kw: seen.update(kw) or pytest.skip("options built"))
    monkeypatch.setenv("SPEEDPIPE_LOG_LEVEL", "debug")
    for argv, want in (([], "DEBUG"), (["--log-level", "error"], "ERROR")):
        seen.clear()
        with pytest.raises(pytest.skip.Exception):
            sweep._session_options(_args(tmp_path, argv=argv), [PLAIN], ["hi"])
        assert seen["log_level"] == want
