"""SPEED run-ahead depth from a row-cost table and the measured acceptance, and the start-up
calibration that makes the table (pipeline/measure/row_cost.py, pipeline/measure/stage_calibration.py,
pipeline/engine/row_budget.py).

What breaks when these fail: with `--row-cost` the scheduler keeps several drafts of a sequence in
flight where they only get squashed (low acceptance) or make every shared pass slower (costly
rows), or keeps one where drafts are nearly free and mostly right; an explicit `--max-inflight`
stops being obeyed; a stage's calibration reports nonsense (non-positive, shrinking with rows, a
table that does not survive JSON); or the stages' tables are combined into something other than
the pipeline's pass cost.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.engine.records import SchedulerConfig, SpecCounters
from pipeline.engine.row_budget import EXPLORE_EVERY, RowBudget
from pipeline.measure import stage_calibration
from pipeline.measure.row_cost import (
    RowCostTable,
    best_run_ahead,
    combine_stage_tables,
    expected_tokens,
    ratio_line,
)
from pipeline.measure.stage_calibration import calibrate_stage, calibration_rows
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import build_stage_model
from pipeline.run_config import RunConfig
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names
from pipeline.weights.quant_load import load_stage_model
from tests.tiny_model import write_tiny_model

CHEAP = RowCostTable(mode="int4", num_rows=(1, 2, 4, 8), pass_s=(0.010, 0.0101, 0.0102, 0.0105))
COSTLY = RowCostTable(mode="fp32", num_rows=(1, 2, 4, 8), pass_s=(0.050, 0.100, 0.190, 0.380))


def _rate(table, alpha, d, *, stages, shared):
    step = table.cost_s(1)
    row = table.cost_s(shared + 1) - table.cost_s(shared) if shared else 0.0
    return expected_tokens([alpha] * (d - 1), d - 1) / (stages * step + (1 - alpha ** (d - 1)) * step
                                                       + (d - 1) * stages * row)


def test_the_depth_maximises_expected_tokens_per_second():
    for table in (CHEAP, COSTLY):
        for alpha in (0.0, 0.2, 0.5, 0.9):
            for shared in (0, 1, 3):
                d = best_run_ahead(table, alpha, num_stages=4, max_depth=4, shared_rows=shared)
                rates = [_rate(table, alpha, j, stages=4, shared=shared) for j in range(1, 5)]
                assert rates[d - 1] == pytest.approx(max(rates)), (table.mode, alpha, shared, d, rates)


def test_cheap_rows_and_likely_drafts_run_deeper_than_costly_rows_or_unlikely_drafts():
    assert best_run_ahead(CHEAP, 0.8, num_stages=4, max_depth=4, shared_rows=2) == 4
    assert best_run_ahead(COSTLY, 0.8, num_stages=4, max_depth=4, shared_rows=2) == 1  # a row costs a pass
    assert best_run_ahead(CHEAP, 0.1, num_stages=4, max_depth=4, shared_rows=2) == 1  # below 1 / (S + 1)
    assert best_run_ahead(COSTLY, 0.8, num_stages=4, max_depth=4) == 4  # alone in its pass: costs only squashes
    assert best_run_ahead(CHEAP, 0.0, num_stages=2, max_depth=2) == 1  # never right: never worth it
    assert best_run_ahead(CHEAP, 0.9, num_stages=8, max_depth=3) == 3  # never past the cap
    with pytest.raises(ValueError, match="alpha"):
        best_run_ahead(CHEAP, 1.5, num_stages=2, max_depth=2)


def _config(**kw):
    return SchedulerConfig(num_stages=4, speculate=True, **kw)


def test_the_scheduler_cap_follows_the_table_only_when_asked_and_an_explicit_cap_wins():
    spec = SpecCounters()
    spec.verified_drafts, spec.accepted_tokens = 100, 90  # measured alpha 0.9
    assert RowBudget(max_firp_k=0, row_costs=CHEAP).run_ahead(_config(), spec, shared_rows=2) == 4  # not asked: S
    assert RowBudget(max_firp_k=0).run_ahead(_config(run_ahead_from_table=True), spec, shared_rows=2) == 4  # no table
    assert RowBudget(max_firp_k=0, row_costs=COSTLY).run_ahead(
        _config(run_ahead_from_table=True), spec, shared_rows=2) == 1
    assert RowBudget(max_firp_k=0, row_costs=CHEAP).run_ahead(
        _config(run_ahead_from_table=True, max_inflight=3), spec, shared_rows=2) == 3
    spec.accepted_tokens = 5  # alpha 0.05: no run-ahead, but every EXPLORE_EVERY-th ask still measures one
    rows = RowBudget(max_firp_k=0, row_costs=CHEAP)
    asks = [rows.run_ahead(_config(run_ahead_from_table=True), spec, shared_rows=0) for _ in range(2 * EXPLORE_EVERY)]
    assert asks.count(2) == 2 and set(asks) == {1, 2}
    assert RunConfig(row_cost="calibrate").scheduler_config(eos_token_ids=(), firp_k=0).run_ahead_from_table
    assert not RunConfig(row_cost="calibrate", max_inflight=2).scheduler_config(
        eos_token_ids=(), firp_k=0).run_ahead_from_table


def test_row_cost_sources_are_validated_and_the_old_flag_is_an_alias():
    assert RunConfig(row_cost="file:costs.json").row_cost_path == "costs.json"
    assert RunConfig(row_cost_file="costs.json").row_cost_path == "costs.json"
    assert RunConfig(row_cost="calibrate").calibrates_row_costs
    assert RunConfig().row_cost_path is None and not RunConfig().calibrates_row_costs
    with pytest.raises(ValueError, match="row_cost must be"):
        RunConfig(row_cost="measure")
    with pytest.raises(ValueError, match="both"):
        RunConfig(row_cost="calibrate", row_cost_file="costs.json")
    with pytest.raises(ValueError, match="both"):
        RunConfig(row_cost="file:a.json", row_cost_file="costs.json")
    with pytest.raises(ValueError, match="json"):
        RunConfig(row_cost="file:costs.txt")


def test_the_default_row_cost_calibrates_exactly_when_firp_is_on_and_no_table_is_named():
    """`auto` (the default): FIRP runs size their chains from a start-up calibration (fixed chains
    lose where a multi-row pass is dear); every other run keeps the fixed behaviour."""
    assert RunConfig().row_cost == "auto"
    for speculate in ("firp", "speed+firp"):
        config = RunConfig(speculate=speculate, num_stages=2)
        assert config.calibrates_row_costs
        assert config.scheduler_config(eos_token_ids=(), firp_k=2).run_ahead_from_table
        assert not RunConfig(speculate=speculate, num_stages=2, row_cost="none").calibrates_row_costs
        named = RunConfig(speculate=speculate, num_stages=2, row_cost_file="costs.json")
        assert not named.calibrates_row_costs and named.row_cost_path == "costs.json"
    for speculate in ("none", "speed"):
        config = RunConfig(speculate=speculate, num_stages=2)
        assert not config.calibrates_row_costs and config.row_cost_path is None
        assert not config.scheduler_config(eos_token_ids=(), firp_k=0).run_ahead_from_table


def test_stage_tables_combine_into_the_pipeline_pass_cost():
    a = RowCostTable(mode="fp32", num_rows=(1, 2, 4), pass_s=(0.02, 0.03, 0.05))
    b = RowCostTable(mode="fp32", num_rows=(1, 2, 3, 4), pass_s=(0.01, 0.01, 0.02, 0.02))
    both = combine_stage_tables([a, b])
    assert both.num_rows == (1, 2, 4) and both.pass_s == pytest.approx((0.03, 0.04, 0.07))
    with pytest.raises(ValueError, match="mode"):
        combine_stage_tables([a, RowCostTable(mode="bf16", num_rows=(1,), pass_s=(0.01,))])
    assert ratio_line(both).startswith("1/2/4 rows = 1.00/1.33/2.33x")


def test_calibration_rows_cover_what_the_scheduler_may_send():
    assert calibration_rows(1) == (1, 2, 4, 8)
    assert calibration_rows(20)[-1] == 20 and 16 in calibration_rows(20)
    assert calibration_rows(500)[-1] == 32
    with pytest.raises(ValueError, match="max_rows"):
        calibration_rows(0)


@pytest.mark.parametrize("stage", ["first", "middle", "last"])
def test_a_stage_calibrates_its_own_passes(tmp_path, stage, monkeypatch):
    """Each count's pass runs with that many rows after the cached context (the last stage scoring
    every row, as a verify pass does), once to warm up and `repeats` times timed, and the table
    keeps the fastest round. The clock is a fake one that a pass of n rows moves by n seconds (a
    real clock under load makes no assertion about its readings safe)."""
    torch.set_num_threads(1)
    model_dir = write_tiny_model(tmp_path / "model")
    config = ModelConfig.from_model_dir(model_dir)
    tensors = CheckpointReader(model_dir).read(all_tensor_names(config), dtype=torch.float32)
    layers = {"first": LayerRange(0, 2), "middle": LayerRange(1, 3), "last": LayerRange(2, config.num_hidden_layers)}
    model = build_stage_model(config, layers[stage], is_first=stage == "first", is_last=stage == "last",
                              tensors={k: v for k, v in tensors.items()})
    now, passes, real_forward = [0.0], [], model.forward_rows
    slowdown = (50.0, 2.0, 1.0, 3.0)  # per round: warm-up (dropped), then the min must win

    def counted_forward(x, spans, kv, **extra):
        out = real_forward(x, spans, kv, **extra)
        rows = sum(span.num_tokens for span in spans)
        passes.append((rows, spans[0].start, len(extra.get("logit_rows", ()))))
        now[0] += rows * slowdown[sum(n == rows for n, start, _ in passes if start) - 1]
        return out

    monkeypatch.setattr(model, "forward_rows", counted_forward)
    monkeypatch.setattr(stage_calibration, "stage_clock", lambda device, num_threads: lambda: now[0])
    table = calibrate_stage(model, mode="fp32", max_rows=16, repeats=3, context=16)
    rows = calibration_rows(16)
    assert table.num_rows == rows and table.mode == "fp32"
    # the context pass, then warm-up + 3 rounds of every count, counts interleaved
    assert [(n, start) for n, start, _ in passes] == [(16, 0)] + [(n, 16) for _ in range(4) for n in rows]
    assert all(scored == (n if stage == "last" else 0) for n, start, scored in passes if start)
    assert table.pass_s == tuple(float(n) for n in rows)
    assert RowCostTable.from_json(json.loads(json.dumps(table.to_json()))) == table


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_later_stage_calibrates_in_its_quantised_mode_with_bfloat16_rows(tmp_path, quantization):
    """A quantised stage's activations are bfloat16 ([Note: numeric modes] in pipeline/weights/quant.py):
    the calibration pass must feed rows of that dtype (int kernels refuse float32 rows)."""
    torch.set_num_threads(1)
    model_dir = write_tiny_model(tmp_path / "model")
    n = ModelConfig.from_model_dir(model_dir).num_hidden_layers
    for layers in (LayerRange(1, 3), LayerRange(2, n)):
        model = load_stage_model(str(model_dir), layers, is_first=False, is_last=layers.stop == n,
                                 quantization=quantization)
        assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
        table = calibrate_stage(model, mode=quantization, max_rows=4, repeats=1, context=8)
        assert table.mode == quantization and min(table.pass_s) > 0
