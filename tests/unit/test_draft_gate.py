"""Adaptive drafting (pipeline/speculation/draft_gate.py) alone and inside the real Scheduler.

What breaks when these fail: drafts of a predictor that is nearly always wrong keep flooding the
pipeline (each rejection costs a stage-step), good drafts get refused, a refused bucket never gets
another chance, or gating changes committed tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.engine.engine import Engine
from pipeline.engine.events import Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.speculation.draft_gate import REJECTION_COST, SHARED_REJECTION_COST, DraftGate
from pipeline.speculation.predictors import Draft
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, PerfectPredictor, ReferenceTable
from tests.unit.test_speculation_scheduler import PROMPTS, FakePipeline, greedy_reference


def test_break_even_is_one_over_stages_for_unit_lag_and_cost():
    for s in (2, 3, 4, 8):
        assert DraftGate.break_even(s, rejection_cost=1.0) == pytest.approx(1 / s)
        assert DraftGate.break_even(s) == pytest.approx(REJECTION_COST / (s - 1 + REJECTION_COST))
    assert DraftGate.break_even(1) == 1.0  # one stage: a draft never fills an idle stage


def test_break_even_with_fewer_parallel_stages_prices_a_rejection_at_a_stage_step():
    """Stages sharing fewer cores than there are stages: a stale pass takes a real pass's core, and a
    right draft can fill only the P - 1 idle cores (measured at --stages 3 and 4 on 2 CPUs)."""
    assert SHARED_REJECTION_COST == 1.0
    assert DraftGate.break_even(4, parallel_stages=2) == pytest.approx(0.5)  # 1 / (2 - 1 + 1)
    assert DraftGate.break_even(3, parallel_stages=2) == pytest.approx(0.5)
    assert DraftGate.break_even(8, parallel_stages=3) == pytest.approx(1 / 3)
    assert DraftGate.break_even(4, parallel_stages=1) == 1.0  # one stage at a time: no draft can gain
    assert DraftGate.break_even(4, parallel_stages=0) == 1.0  # clamped to one
    for p in (None, 2, 3):  # enough cores for every stage: the per-core price
        assert DraftGate.break_even(2, parallel_stages=p) == DraftGate.break_even(2) == pytest.approx(
            REJECTION_COST / (1 + REJECTION_COST))
    assert DraftGate.break_even(4, parallel_stages=2, rejection_cost=0.0) == 0.0  # an explicit price wins


def test_gate_refuses_a_bucket_whose_drafts_are_rejected_and_keeps_a_good_one():
    gate = DraftGate(min_acceptance=0.45, explore_every=1000)
    bad, good = Draft(1, 0.45, "lens"), Draft(2, 0.95, "lens")
    assert gate.allow(bad) and gate.allow(good)  # a new bucket is tried while its prior is the break-even or above
    for _ in range(10):
        gate.record(gate.key(bad), accepted=False)
        gate.record(gate.key(good), accepted=True)
    assert not gate.allow(bad)
    assert gate.allow(good)
    assert gate.estimate(gate.key(bad)) < 0.45 < gate.estimate(gate.key(good))


def test_a_new_bucket_starts_at_its_own_confidence():
    gate = DraftGate(min_acceptance=0.5)
    assert gate.estimate(gate.key(Draft(0, 0.97, "head"))) == pytest.approx(0.95)
    assert gate.estimate(gate.key(Draft(0, 0.12, "head"))) == pytest.approx(0.6)  # the optimistic floor
    assert gate.allow(Draft(0, 0.12, "head")) and gate.allow(Draft(0, 0.97, "head"))
    gate.record(gate.key(Draft(0, 0.12, "head")), accepted=False)  # a low bucket closes on its first miss
    gate.record(gate.key(Draft(0, 0.97, "head")), accepted=False)  # a confident one does not
    assert not gate.allow(Draft(0, 0.12, "head")) and gate.allow(Draft(0, 0.97, "head"))
    flat = DraftGate(min_acceptance=0.5, prior_acceptance=0.6)
    assert flat.estimate(flat.key(Draft(0, 0.12, "head"))) == pytest.approx(0.6)


def test_a_confident_head_right_seven_times_in_ten_keeps_its_bucket_through_an_early_miss():
    """The launch that measured a self-distilled drafter at alpha 0.08 (12 of 92 drafts sent; 0.30
    ungated, its offline acceptance): its first confident draft was wrong and the bucket closed."""
    gate = DraftGate(min_acceptance=0.5)
    draft = Draft(0, 0.95, "early-exit")
    verdicts = [False, True, True, False, True, True, True, False, True, True] * 5
    sent = 0
    for ok in verdicts:
        if gate.allow(draft):
            sent += 1
            gate.record(gate.key(draft), accepted=ok)
    assert sent == len(verdicts), sent


def test_refused_bucket_is_probed_every_explore_every_drafts():
    gate = DraftGate(min_acceptance=0.5, explore_every=4)
    bad = Draft(1, 0.0, "ngram")
    for _ in range(20):
        gate.record(gate.key(bad), accepted=False)
    sent = [gate.allow(bad) for _ in range(12)]
    assert sent == [False, False, False, True] * 3


def test_zero_threshold_sends_everything():
    gate = DraftGate(min_acceptance=0.0)
    for _ in range(5):
        gate.record(("x", 0), accepted=False)
    assert gate.allow(Draft(0, 0.0, "x"))


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_out_of_range_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="min.acceptance"):
        DraftGate(min_acceptance=bad)


@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), max_size=60), st.floats(0.05, 0.95))
def test_estimate_stays_a_probability_and_moves_toward_outcomes(history, threshold):
    gate = DraftGate(min_acceptance=threshold)
    for conf, ok in history:
        key = gate.key(Draft(0, conf, "p"))
        before = gate.estimate(key)
        gate.record(key, accepted=ok)
        after = gate.estimate(key)
        assert 0.0 <= after <= 1.0
        assert (after >= before) if ok else (after <= before)


ONE = PROMPTS[:1]  # a single sequence leaves idle stages for drafts to fill


def _run(predictor, min_acceptance: float, num_stages: int = 2):
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True) for _ in ONE]
    sched = Engine(SchedulerConfig(num_stages=num_stages, max_model_len=128, speculate=True,
                                   min_acceptance=min_acceptance), predictor)
    submits = [Submit(seq_id=i, prompt_ids=tuple(p), params=sp) for i, (p, sp) in enumerate(zip(ONE, params, strict=True))]
    outputs = FakePipeline(sched, submits, exit_stage=0).run()
    return [outputs.get(i, []) for i in range(len(ONE))], sched


@pytest.mark.parametrize("num_stages", [2, 4])
def test_gate_cuts_the_drafts_of_an_always_wrong_predictor_without_changing_output(num_stages):
    refs = [greedy_reference(p, 40) for p in ONE]
    table = ReferenceTable(zip(ONE, refs, strict=True))
    ungated, s0 = _run(AlwaysWrongPredictor(table, vocab_size=64), 0.0, num_stages)
    gated, s1 = _run(AlwaysWrongPredictor(table, vocab_size=64), DraftGate.break_even(num_stages, rejection_cost=1.0),
                     num_stages)
    assert gated == ungated == refs
    assert s1.spec.gated_drafts > 0
    assert s1.spec.drafted_tokens < s0.spec.drafted_tokens / 3, (s1.spec, s0.spec)
    assert s1.spec.drafted_tokens > 0  # the optimistic prior and the probes still try


def test_gate_never_refuses_a_perfect_predictor():
    refs = [greedy_reference(p, 40) for p in ONE]
    out, sched = _run(PerfectPredictor(ReferenceTable(zip(ONE, refs, strict=True))), 0.5)
    assert out == refs
    assert sched.spec.gated_drafts == 0 and sched.spec.acceptance_rate == 1.0
