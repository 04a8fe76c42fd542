"""The discrete-event simulator (pipeline/engine/simulator.py) against the closed form and pipeline theory.

What breaks when these fail: the simulator no longer reproduces SPEED's expected speed-up
S / (alpha*e + (1-alpha)*S) for one sequence (ARCHITECTURE.md §5), the plain pipeline's
utilisation min(M, S) / S, its timeline's fractions, or the acceptance processes.
"""

from __future__ import annotations

import pytest

from pipeline.engine.engine import Engine
from pipeline.engine.simulator import (
    Bernoulli,
    CostModel,
    Replay,
    SimConfig,
    Simulator,
    closed_form_speedup,
)

STAGE_S = 1e-3


def _steady_speedup(num_stages: int, alpha: float, *, exit_stage: int = 0, seed: int = 1) -> tuple[float, float]:
    """(simulated speed-up of SPEED over plain decode, realised acceptance) for one sequence."""
    cost = CostModel.uniform(num_stages=num_stages, stage_s=STAGE_S)
    cfg = dict(num_stages=num_stages, prompt_len=4, max_new_tokens=120)
    plain = Simulator(SimConfig(**cfg), cost, record_timeline=False).run()
    spec = Simulator(SimConfig(**cfg, speculate=True, exit_stage=exit_stage), cost,
                     acceptance=Bernoulli(alpha, seed=seed), record_timeline=False).run()
    return spec.steady_tokens_per_s() / plain.steady_tokens_per_s(), spec.acceptance_rate


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_stages", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("alpha", [0.5, 0.9, 1.0])
def test_single_sequence_speedup_matches_closed_form_within_2_percent(num_stages: int, alpha: float):
    speedup, realised = _steady_speedup(num_stages, alpha)
    expected = closed_form_speedup(num_stages=num_stages, alpha=realised)
    assert speedup == pytest.approx(expected, rel=0.02), f"S={num_stages} alpha={realised:.3f}"


def test_later_exit_stage_means_a_longer_draft_lag():
    speedup, realised = _steady_speedup(8, 1.0, exit_stage=3)
    assert speedup == pytest.approx(closed_form_speedup(num_stages=8, alpha=realised, draft_lag=4), rel=0.02)


def test_plain_pipeline_utilisation_is_min_of_sequences_and_stages_over_stages():
    for num_stages, concurrency in [(4, 1), (4, 2), (4, 4), (2, 3)]:
        sim = Simulator(SimConfig(num_stages=num_stages, concurrency=concurrency, prompt_len=1, max_new_tokens=200),
                        CostModel.uniform(num_stages=num_stages, stage_s=STAGE_S))
        res = sim.run()
        busy = [f.busy for f in res.timeline.fractions()]
        want = min(concurrency, num_stages) / num_stages
        assert busy == pytest.approx([want] * num_stages, abs=0.03), (num_stages, concurrency, busy)
        assert isinstance(sim.engine, Engine)  # the engine the coordinator drives


def test_two_stage_plain_single_sequence_has_bubble_one_half_and_no_waste():
    res = Simulator(SimConfig(num_stages=2, prompt_len=1, max_new_tokens=100),
                    CostModel.uniform(num_stages=2, stage_s=STAGE_S)).run()
    for f in res.timeline.fractions():
        assert f.idle == pytest.approx(0.5, abs=0.01) and f.wasted == 0.0
    assert res.generated_tokens == 100


def test_rejections_show_up_as_wasted_work_and_acceptance_is_replayed():
    pattern = [True, True, False, True]
    # two stages: one draft in flight at a time, so every proposal is verified in order
    res = Simulator(SimConfig(num_stages=2, prompt_len=2, max_new_tokens=200, speculate=True),
                    CostModel.uniform(num_stages=2, stage_s=STAGE_S), acceptance=Replay(pattern)).run()
    assert res.acceptance_rate == pytest.approx(0.75, abs=0.02)
    fr = res.timeline.fractions()
    assert all(f.wasted > 0.02 for f in fr)
    assert all(f.useful + f.wasted + f.idle == pytest.approx(1.0) for f in fr)


def test_link_latency_and_coordinator_time_slow_plain_decode_by_the_ring_time():
    hop, coord = 2e-4, 3e-4
    cost = CostModel.uniform(num_stages=3, stage_s=STAGE_S, hop_latency_s=hop, coordinator_s=coord)
    res = Simulator(SimConfig(num_stages=3, prompt_len=1, max_new_tokens=50), cost).run()
    per_token_s = 3 * STAGE_S + 4 * hop + coord  # 3 stages, 4 hops of the ring, the coordinator
    assert res.steady_tokens_per_s() == pytest.approx(1 / per_token_s, rel=1e-3)


def test_bad_configurations_raise_value_error():
    with pytest.raises(ValueError, match="exit stage"):
        SimConfig(num_stages=1, speculate=True)
    with pytest.raises(ValueError, match="alpha"):
        Bernoulli(1.5)
    with pytest.raises(ValueError, match="stages"):
        Simulator(SimConfig(num_stages=3), CostModel.uniform(num_stages=2, stage_s=STAGE_S))
    with pytest.raises(ValueError, match=">= 0"):
        CostModel.uniform(num_stages=2, stage_s=-1.0)


def test_context_only_predictor_drafts_at_send_time_with_the_same_lag():
    cost = CostModel.uniform(num_stages=4, stage_s=STAGE_S, predictor_s=STAGE_S)  # no exit head: never charged
    cfg = dict(num_stages=4, prompt_len=4, max_new_tokens=120)
    plain = Simulator(SimConfig(**cfg), cost).run()
    spec = Simulator(SimConfig(**cfg, speculate=True, exit_head=False), cost, acceptance=Bernoulli(0.9, seed=2)).run()
    speedup = spec.steady_tokens_per_s() / plain.steady_tokens_per_s()
    assert speedup == pytest.approx(closed_form_speedup(num_stages=4, alpha=spec.acceptance_rate), rel=0.02)


def test_hop_bandwidth_charges_hidden_state_bytes_per_token_row():
    cost = CostModel.uniform(num_stages=2, stage_s=STAGE_S, hop_bandwidth_bytes_per_s=1e6, bytes_per_token=500)
    res = Simulator(SimConfig(num_stages=2, prompt_len=1, max_new_tokens=40), cost).run()
    per_token_s = 2 * STAGE_S + 500 / 1e6  # one hop carries a hidden-state row; the others carry token ids
    assert res.steady_tokens_per_s() == pytest.approx(1 / per_token_s, rel=1e-3)
