"""A bench sweep's per-run timeline records (launcher/bench/run_records.py, [Note: timeline record]):
lossless, compact, and enough to calibrate from without the runs/ folder.

What breaks when these fail: a committed study cannot be re-calibrated because its runs/ folder of
traces was not committed (it was not: megabytes), or the records drop a field that calibration
reads (want_exit prices the exit head, num_pseudo FIRP's pseudo rows, commits FIRP's last chain),
so a re-calibration from them silently differs from one from the timelines.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from launcher.bench.run_records import (
    RECORDS_FILE,
    compact_timeline,
    expand_timeline,
    load_bench_runs,
    write_records,
)
from pipeline.engine.simulator import Bernoulli, CostModel, SimConfig, Simulator
from pipeline.measure.calibrate import calibrate

pytestmark = pytest.mark.timeout(60)


def _timeline(num_stages: int, *, concurrency: int = 1, speculate: bool = False, firp_k: int = 0) -> dict:
    """A simulated run's timeline in the JSON form `bench` writes (exit-head drafts carry want_exit,
    FIRP items num_pseudo)."""
    cost = CostModel.uniform(num_stages=num_stages, stage_s=0.02 / num_stages + 5e-4, per_token_s=1e-4,
                             hop_latency_s=3e-4, coordinator_s=8e-4, predictor_s=1e-3)
    cfg = SimConfig(num_stages=num_stages, prompt_lens=tuple(12 + 5 * i for i in range(concurrency)),
                    max_new_tokens=16, speculate=speculate, firp_k=firp_k, firp_alpha=0.5)
    res = Simulator(cfg, cost, acceptance=Bernoulli(0.6, seed=1) if speculate else None).run()
    return res.timeline.to_json(0, round(res.wall_s * 1e9), commits=res.commits)


def _sweep(folder) -> None:
    """A bench folder: results.json and runs/*.timeline.json of five configurations, one repeat each."""
    configs = []
    for stages, speculate, conc in ((1, "none", 1), (2, "none", 1), (2, "none", 2), (2, "speed", 1), (2, "firp", 1)):
        name = f"s{stages}-{speculate}-c{conc}"
        tl = _timeline(stages, concurrency=conc, speculate=speculate == "speed", firp_k=2 if speculate == "firp" else 0)
        (folder / "runs").mkdir(parents=True, exist_ok=True)
        (folder / "runs" / f"{name}_r0.timeline.json").write_text(json.dumps(tl))
        generated = len(tl["commits"])
        stats = {"tokens_per_s": generated / ((tl["end_ns"] - tl["start_ns"]) / 1e9), "acceptance_rate": None}
        configs.append({"name": name, "stages": stages, "speculate": speculate,
                        "predictor": "hybrid" if speculate == "speed" else "-", "concurrency": conc,
                        "runs": [{"repeat": 0, "stats": stats, "num_tokens": [16] * conc,
                                  "trace": f"runs/{name}_r0.trace.json", "timeline": f"runs/{name}_r0.timeline.json"}]})
    (folder / "results.json").write_text(json.dumps({"configs": configs}))


def test_a_record_expands_to_the_timeline_it_was_made_from():
    for tl in (_timeline(2, speculate=True), _timeline(2, firp_k=2), _timeline(3, concurrency=2)):
        tl["slices"][-1]["items"][0]["siblings"] = 2  # a token-tree draft's sibling rows
        record = json.loads(json.dumps(compact_timeline(tl)))  # through JSON, as it is stored
        assert expand_timeline(record) == tl
        assert len(json.dumps(record)) < 0.5 * len(json.dumps(tl))
    kinds = {it.get("want_exit", False) for s in _timeline(2, speculate=True)["slices"] for it in s["items"]}
    assert kinds == {True, False}  # the exit head's items were there to keep


def test_a_field_the_record_cannot_keep_is_an_error_not_dropped():
    tl = _timeline(2)
    tl["slices"][0]["items"][0]["new_field"] = 1
    with pytest.raises(ValueError, match="an item has fields the record format does not keep: new_field"):
        compact_timeline(tl)
    tl = _timeline(2)
    tl["slices"][0]["outcome"] = "maybe"
    with pytest.raises(ValueError, match="a slice has fields .*: outcome"):
        compact_timeline(tl)


def test_a_sweep_calibrates_the_same_from_its_records_without_runs(tmp_path):
    _sweep(tmp_path / "bench")
    from_files = load_bench_runs(tmp_path / "bench" / "results.json")
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    write_records([run for cfg in results["configs"] for run in cfg["runs"]], tmp_path / "bench")
    committed = tmp_path / "committed"  # what a study commits: results.json and timelines.json, no runs/
    committed.mkdir()
    for name in ("results.json", RECORDS_FILE):
        shutil.copy(tmp_path / "bench" / name, committed / name)
    from_records = load_bench_runs(committed / "results.json")
    assert from_records == from_files
    assert dataclasses.asdict(calibrate(from_records)) == dataclasses.asdict(calibrate(from_files))


def test_a_sweep_without_records_or_runs_is_a_one_line_error_naming_what_is_missing(tmp_path):
    _sweep(tmp_path / "bench")
    shutil.rmtree(tmp_path / "bench" / "runs")
    with pytest.raises(ValueError) as err:
        load_bench_runs(tmp_path / "bench" / "results.json", flag="--recalibrate-from")
    text = str(err.value)
    assert text.startswith(f"--recalibrate-from {tmp_path / 'bench' / 'results.json'}: no {RECORDS_FILE} beside it")
    assert "nothing to calibrate from" in text and "\n" not in text
