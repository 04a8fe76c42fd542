"""Calibration maths (pipeline/measure/calibrate.py) on recorded timelines with known costs.

The recorded data are timelines of the simulator under a known cost model, in the same JSON form
`bench` writes; calibration must recover the costs and, fed back into the simulator, predict every
run's tokens/s. What breaks when these fail: `simulate --calibrate` fits wrong stage, hop,
coordinator or exit-head costs, or the draft outcomes replayed from a run are not the verified ones.
"""

from __future__ import annotations

import pytest

from pipeline.measure.calibrate import calibrate, draft_outcomes, scaled_fits
from pipeline.measure.simulator import Bernoulli, CostModel, Replay, SimConfig, Simulator

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
