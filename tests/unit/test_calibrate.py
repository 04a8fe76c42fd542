"""Calibration maths (pipeline/measure/calibrate.py) on recorded timelines with known costs.

The recorded data are timelines of the simulator under a known cost model, in the same JSON form
`bench` writes; calibration must recover the costs and, fed back into the simulator, predict every
run's tokens/s. What breaks when these fail: `simulate --calibrate` fits wrong stage, hop,
coordinator or exit-head costs, or the draft outcomes replayed from a run are not the verified ones;
or the table-driven terms (multi-row pass costs, the exit head per item, FIRP pseudo rows, the exit
event's delay, a run's own load) are fitted wrong or stop mattering.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.engine.simulator import Bernoulli, CostModel, Replay, SimConfig, Simulator
from pipeline.measure.calibrate import calibrate, draft_outcomes, scaled_fits
from pipeline.measure.calibrate_tables import run_load_factor
from pipeline.measure.row_cost import RowCostTable

HOP_S, COORD_S, PRED_S = 3e-4, 8e-4, 2e-3
BASES = {1: (0.030,), 2: (0.016, 0.017)}
PER_TOKEN_S = 1e-4


def _cost(num_stages: int) -> CostModel:
    return CostModel(stage_base_s=BASES[num_stages], stage_per_token_s=(PER_TOKEN_S,) * num_stages,
                     hop_latency_s=HOP_S, coordinator_s=COORD_S, predictor_s=PRED_S)


def _recorded(num_stages: int, *, concurrency: int = 1, speculate: bool = False, alpha: float = 0.6) -> dict:
    cfg = SimConfig(num_stages=num_stages, prompt_lens=tuple(12 + 5 * i for i in range(concurrency)),
                    max_new_tokens=24, speculate=speculate)
    res = Simulator(cfg, _cost(num_stages), acceptance=Bernoulli(alpha, seed=3) if speculate else None).run()
    timeline = res.timeline.to_json(0, round(res.wall_s * 1e9), commits=res.commits)
    return {"num_stages": num_stages, "speculate": "speed" if speculate else "none", "concurrency": concurrency,
            "timeline": timeline, "tokens_per_s": res.tokens_per_s, "acceptance": res.acceptance_rate,
            "config": cfg}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return [_recorded(1), _recorded(1, concurrency=2), _recorded(2), _recorded(2, concurrency=2),
            _recorded(2, speculate=True)]


def test_calibration_recovers_stage_hop_coordinator_and_exit_head_costs(runs):
    cal = calibrate(runs)
    for s, bases in BASES.items():
        cost = cal.cost_model(s)
        assert cost.stage_base_s == pytest.approx(bases, rel=1e-3)
        assert cost.stage_per_token_s == pytest.approx([PER_TOKEN_S] * s, rel=1e-3)
    assert cal.hop_latency_s == pytest.approx(HOP_S, rel=1e-6)
    assert cal.coordinator_s == pytest.approx(COORD_S, rel=1e-6)
    # one exit-head item per micro-batch here: the per-item cost is the per-batch one ([Note: table calibration])
    assert cal.exit_row_s == pytest.approx(PRED_S, rel=1e-3) and cal.predictor_s == 0.0


def test_calibrated_simulator_predicts_every_recorded_run(runs):
    cal = calibrate(runs)
    for r in runs:
        acceptance = Replay(draft_outcomes(r["timeline"])) if r["speculate"] == "speed" else None
        pred = Simulator(r["config"], cal.cost_model(r["num_stages"]), acceptance=acceptance).run()
        assert pred.tokens_per_s == pytest.approx(r["tokens_per_s"], rel=0.02), r["config"]


def test_replayed_outcomes_are_the_verified_drafts(runs):
    spec = runs[-1]
    outcomes = draft_outcomes(spec["timeline"])
    assert outcomes and sum(outcomes) / len(outcomes) == pytest.approx(spec["acceptance"], abs=0.05)


def test_unmeasured_stage_counts_split_compute_and_keep_the_per_stage_overhead(runs):
    fits = calibrate(runs).stage_fits
    four = scaled_fits(fits, 4)
    one, two = (sum(f.base_s for f in fits[s]) for s in (1, 2))
    assert two - one == pytest.approx(sum(BASES[2]) - sum(BASES[1]) + PER_TOKEN_S, rel=0.05)  # per-stage overhead
    assert sum(f.base_s for f in four) == pytest.approx(one + 3 * (two - one), rel=1e-6)  # linear in stages
    assert len({f.base_s for f in four}) == 1


def test_calibration_without_decode_slices_is_a_value_error():
    with pytest.raises(ValueError, match="no one-token"):
        calibrate([{"num_stages": 1, "speculate": "none", "timeline": {"num_stages": 1, "slices": []}}])


# -- the table-driven terms ([Note: table calibration] in pipeline/measure/calibrate.py) -----------------
# Known costs with what the linear model cannot follow: a 2-row pass of the one-stage pipeline costs
# 1.7x a 1-row pass (a line through 1 row and the prefills says 1.05x), the exit head is priced per
# item that wants it, FIRP pseudo rows cost per row, and the exit event takes longer than a hop.
TABLES = {1: (RowCostTable(mode="known", num_rows=(1, 2, 12, 40), pass_s=(0.030, 0.051, 0.066, 0.150)),),
          2: (RowCostTable(mode="known", num_rows=(1, 12, 40), pass_s=(0.016, 0.038, 0.094)),
              RowCostTable(mode="known", num_rows=(1, 12, 40), pass_s=(0.017, 0.039, 0.095)))}
PSEUDO_S, EXIT_ROW_S, EXIT_EVENT_S = (1.0e-3, 1.5e-3), 3e-3, 4e-3


def _table_cost(num_stages: int) -> CostModel:
    return CostModel(stage_base_s=(0.0,) * num_stages, stage_per_token_s=(0.0,) * num_stages,
                     stage_tables=TABLES[num_stages], pseudo_row_s=PSEUDO_S[:num_stages] if num_stages == 2 else (0.0,),
                     hop_latency_s=HOP_S, coordinator_s=COORD_S, exit_row_s=EXIT_ROW_S, exit_event_s=EXIT_EVENT_S)


def _table_run(num_stages: int, *, concurrency: int = 1, speculate: str = "none") -> dict:
    cfg = SimConfig(num_stages=num_stages, prompt_lens=tuple(12 + 5 * i for i in range(concurrency)),
                    max_new_tokens=24, speculate=speculate == "speed", firp_k=2 if speculate == "firp" else 0,
                    firp_alpha=0.5)
    res = Simulator(cfg, _table_cost(num_stages), acceptance=Bernoulli(0.6, seed=3) if cfg.speculate else None).run()
    return {"num_stages": num_stages, "speculate": speculate, "concurrency": concurrency, "config": cfg,
            "timeline": res.timeline.to_json(0, round(res.wall_s * 1e9), commits=res.commits),
            "tokens_per_s": res.tokens_per_s, "exit_head": speculate == "speed"}


@pytest.fixture(scope="module")
def table_runs() -> list[dict]:
    return [_table_run(1), _table_run(1, concurrency=2), _table_run(2), _table_run(2, concurrency=2),
            _table_run(2, speculate="speed"), _table_run(2, speculate="firp")]


def test_calibration_recovers_row_tables_exit_head_pseudo_rows_and_exit_event(table_runs):
    cal = calibrate(table_runs)
    for s, known in TABLES.items():
        for fitted, table in zip(cal.stage_tables[s], known, strict=True):
            for n in (1, 2, 3, 12, 17, 29):
                assert fitted.cost_s(n) == pytest.approx(table.cost_s(n), rel=1e-3), (s, n)
    assert cal.exit_row_s == pytest.approx(EXIT_ROW_S, rel=1e-3) and cal.predictor_s == 0.0
    assert cal.pseudo_row_s[2] == pytest.approx(PSEUDO_S, rel=1e-3)
    assert cal.exit_event_s == pytest.approx(EXIT_EVENT_S, rel=1e-3)
    assert all(run_load_factor(r["timeline"], cal.stage_tables[r["num_stages"]]) == pytest.approx(1.0)
               for r in table_runs)


def test_the_table_calibrated_simulator_predicts_every_recorded_run_and_the_linear_one_does_not(table_runs):
    cal = calibrate(table_runs)
    linear = dataclasses.replace(cal, stage_tables={}, pseudo_row_s={}, exit_row_s=0.0, exit_event_s=None)
    worst_linear = 0.0
    for r in table_runs:
        acceptance = Replay(draft_outcomes(r["timeline"])) if r["speculate"] == "speed" else None
        pred = Simulator(r["config"], cal.cost_model(r["num_stages"]), acceptance=acceptance).run()
        assert pred.tokens_per_s == pytest.approx(r["tokens_per_s"], rel=0.02), r["config"]
        acceptance = Replay(draft_outcomes(r["timeline"])) if r["speculate"] == "speed" else None
        lin = Simulator(r["config"], linear.cost_model(r["num_stages"]), acceptance=acceptance).run()
        worst_linear = max(worst_linear, abs(lin.tokens_per_s / r["tokens_per_s"] - 1))
    assert worst_linear > 0.05  # the terms matter: without them some run is missed by more than 5 %


def test_a_run_under_load_is_predicted_at_its_own_load(table_runs):
    cal = calibrate(table_runs)
    slow = _table_run(2, speculate="speed")
    factor = 1.8  # everything in this run took 1.8x (other jobs on the machine)
    for s in slow["timeline"]["slices"]:
        s["start_ns"], s["end_ns"] = round(s["start_ns"] * factor), round(s["end_ns"] * factor)
    assert run_load_factor(slow["timeline"], cal.stage_tables[2]) == pytest.approx(factor, rel=0.02)
    scaled = cal.cost_model(2).scaled(factor)
    assert scaled.stage_s(0, 1, exit_rows=1) == pytest.approx(factor * cal.cost_model(2).stage_s(0, 1, exit_rows=1))
    assert scaled.hop_latency_s == cal.hop_latency_s
