"""Speculation that steps aside under load: `SchedulerConfig.disable_by_batch_size` (vLLM's
`--speculative-disable-by-batch-size`).

What breaks when these fail: with many running sequences the scheduler still sends drafts, FIRP
pseudo rows or exit-head rows that only add work to a pipeline full of real items; or it never
speculates again once the load falls; or pausing changes greedy output; or the
`spec_disabled_steps` counter of `--json` is wrong.
See [Note: speculation under load] in pipeline/engine/row_budget.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Abort, ExitPassed, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.row_budget import without_speculation
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import ExitGuess, LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.unit.test_speculation_scheduler import (
    BUDGETS,
    MAX_MODEL_LEN,
    PROMPTS,
    FakePipeline,
    MostlyArgmaxPredictor,
    _predictor,
    _submits,
    fake_argmax,
    fake_logits,
    greedy_reference,
)

NUM_STAGES = 4  # 3 running sequences leave a micro-batch slot free: without the limit, drafts go there


def _engine(disable_by_batch_size: int, *, speculate: bool = True, firp_k: int = 0, num_stages: int = NUM_STAGES,
            predictor=None) -> Engine:
    if speculate and predictor is None:
        predictor = LogitLensPredictor()
    return Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                  speculate=speculate, firp_k=firp_k, disable_by_batch_size=disable_by_batch_size),
                  predictor)


def _decode_items(engine: Engine, num_seqs: int) -> list[Item]:
    """Submit PROMPTS[:num_seqs], return each prefill's result (token 42), and collect every
    sequence's first decode item as sent."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sent = engine.step([Submit(seq_id=i, prompt_ids=tuple(p), params=params)
                        for i, p in enumerate(PROMPTS[:num_seqs])]).sends
    decodes = []
    for batch in sent:
        out = engine.step([Result(items=batch, token_ids=torch.full((len(batch),), 42, dtype=torch.int64))])
        decodes.extend(it for b in out.sends for it in b)
    assert len(decodes) == num_seqs and all(it.kind == ItemKind.DECODE for it in decodes), decodes
    return decodes


def _exit_events(engine: Engine, items: list[Item]) -> list[Item]:
    """Every item passes the exit layer with a guess; return what the engine sends after them."""
    out = engine.step([ExitPassed(items=(it,), guesses=(ExitGuess(7, 0.9),)) for it in items])
    return [it for b in out.sends for it in b]


@pytest.mark.parametrize("limit", [0, 2])
def test_three_running_sequences_get_no_draft_at_limit_2(limit):
    engine = _engine(limit)
    decodes = _decode_items(engine, 3)
    sent = _exit_events(engine, decodes)
    if limit == 0:  # the control: this pipeline has room for drafts, and they go
        assert any(it.kind == ItemKind.DRAFT for it in sent), sent
        return
    assert not sent, f"drafts sent with 3 running sequences at disable_by_batch_size 2: {sent}"
    assert not any(it.want_exit for it in decodes), "an exit guess is wanted although no draft may follow"
    assert engine.spec.drafted_tokens == 0
    assert engine.spec.spec_disabled_steps == 6, "3 prefills + 3 decode items were sent while paused"


def test_one_running_sequence_gets_its_draft_at_limit_2():
    engine = _engine(2)
    [decode] = _decode_items(engine, 1)
    assert decode.want_exit
    [draft] = _exit_events(engine, [decode])
    assert draft.kind == ItemKind.DRAFT and draft.start == decode.end
    assert engine.spec.spec_disabled_steps == 0


def test_drafting_resumes_when_the_running_sequences_fall_below_the_limit():
    engine = _engine(2)
    decodes = _decode_items(engine, 3)
    assert not _exit_events(engine, decodes)
    engine.step([Abort(seq_id=1), Abort(seq_id=2)])  # one sequence left running
    out = engine.step([Result(items=(decodes[0],), token_ids=torch.tensor([43]))])
    [nxt] = [it for b in out.sends for it in b]
    assert nxt.kind == ItemKind.DECODE and nxt.want_exit
    [draft] = _exit_events(engine, [nxt])
    assert draft.kind == ItemKind.DRAFT and draft.seq_id == 0


@pytest.mark.parametrize("limit", [0, 2])
def test_no_firp_pseudo_rows_or_drafts_ride_on_real_items_under_load(limit):
    engine = _engine(limit, speculate=False, firp_k=2)
    decodes = _decode_items(engine, 3)
    if limit == 0:
        assert all(it.firp_k == 2 for it in decodes), decodes
        assert engine.spec.spec_disabled_steps == 0
        return
    assert all(it.firp_k == 0 and it.num_tokens == 1 for it in decodes), decodes
    assert engine.spec.spec_disabled_steps == 6


def _submit(seq_id: int) -> Submit:
    return Submit(seq_id=seq_id, prompt_ids=tuple(PROMPTS[seq_id]), params=SamplingParams(max_new_tokens=16,
                                                                                         ignore_eos=True))


def test_firp_drafts_of_a_result_are_not_carried_once_the_load_rose():
    """The decode item went out alone with its FIRP chain; two more sequences arrive, and its result's
    FIRP drafts are then left off the next item (plain decode, no pseudo rows)."""
    engine = _engine(2, speculate=False, firp_k=2)
    [decode] = _decode_items(engine, 1)
    assert decode.firp_k == 2 and decode.num_pseudo == 2
    engine.step([_submit(1), _submit(2)])
    out = engine.step([Result(items=(decode,), token_ids=torch.tensor([43]), firp_tokens=torch.tensor([5, 6]))])
    [nxt] = [it for b in out.sends for it in b]
    assert nxt.kind == ItemKind.DECODE and nxt.token_ids == (43,) and nxt.firp_k == 0, nxt


def test_a_draft_queued_before_the_load_rose_is_not_sent():
    """The exit event queues a draft (one sequence running); in the same step two sequences are
    admitted: their prefills go, the queued draft waits (a micro-batch slot is still free)."""
    engine = _engine(2)
    [decode] = _decode_items(engine, 1)
    out = engine.step([ExitPassed(items=(decode,), guesses=(ExitGuess(7, 0.9),)), _submit(1), _submit(2)])
    sent = [it for b in out.sends for it in b]
    assert [it.kind for it in sent] == [ItemKind.PREFILL, ItemKind.PREFILL], sent
    assert engine.scheduler.seqs[0].pending is not None, "the test needs a queued draft"


class _LoadCheckingPipeline(FakePipeline):
    """FakePipeline that records, for every draft sent, how many sequences were running then."""

    def pump(self, events=()) -> None:
        step = self.engine.step

        def checked(evs):
            out = step(evs)
            running = self.sched.num_running  # what next_batch saw: commits come before the sends
            self.running_at_draft = getattr(self, "running_at_draft", [])
            self.running_at_draft += [running for b in out.sends for it in b if it.kind == ItemKind.DRAFT]
            return out

        self.engine.step = checked
        try:
            super().pump(events)
        finally:
            del self.engine.step


@pytest.mark.parametrize("kind", ["sometimes-right", "perfect", "always-wrong"])
def test_greedy_output_is_the_same_with_and_without_the_limit(kind):
    """4 sequences with budgets 24/10/17/5 on 5 stages at limit 2: paused until only one runs, then
    drafting again; the output equals plain sequential greedy decoding and the unlimited run's."""
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(PROMPTS, params, strict=True)]
    outputs, drafted = {}, {}
    for limit in (0, 2):
        engine = _engine(limit, num_stages=5, predictor=_predictor(kind, PROMPTS, references, seed=3))
        fake = _LoadCheckingPipeline(engine, _submits(PROMPTS, params))
        out = fake.run()
        outputs[limit] = [out.get(i, []) for i in range(len(PROMPTS))]
        drafted[limit] = engine.spec.drafted_tokens
        assert not fake.stats.policy_violations, fake.stats.policy_violations[:3]
        if limit:
            assert fake.running_at_draft and max(fake.running_at_draft) < limit, fake.running_at_draft
            assert engine.spec.spec_disabled_steps > 0
    assert outputs[0] == references and outputs[2] == references, kind
    assert 0 < drafted[2] < drafted[0], drafted


@pytest.mark.parametrize("limit", [0, 2])
def test_the_exit_stage_gets_no_new_drafting_credit_under_load(limit):
    """--draft-at stage: the stage drafted after the lone decode item; two sequences arrive; the
    decode's result accepts that draft, and the CREDIT that would let the stage draft on is not sent."""
    engine = Engine(SchedulerConfig(num_stages=NUM_STAGES, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, speculate=True,
                                    draft_at_stage=True, disable_by_batch_size=limit), LogitLensPredictor())
    [decode] = _decode_items(engine, 1)
    assert decode.draft_upto > 0, "the test needs an authorised item"
    engine.step([ExitPassed(items=(decode,), guesses=(ExitGuess(7, 0.9),), self_drafts=((7, -1),)),
                 _submit(1), _submit(2)])
    out = engine.step([Result(items=(decode,), token_ids=torch.tensor([7]))])
    assert bool(out.credits) == (limit == 0), out.credits


@pytest.mark.parametrize("order", ["result-first", "submit-first"])
def test_a_firp_item_queued_before_the_load_rose_goes_without_its_firp_rows(order):
    """The decode's result queues the next item with its FIRP drafts and pseudo rows (one sequence
    running); a sequence admitted in the same step reaches the limit, so that item is sent plain."""
    engine = _engine(2, speculate=False, firp_k=2)
    [decode] = _decode_items(engine, 1)
    result = Result(items=(decode,), token_ids=torch.tensor([43]), firp_tokens=torch.tensor([5, 6]))
    out = engine.step([result, _submit(1)] if order == "result-first" else [_submit(1), result])
    [nxt] = [it for b in out.sends for it in b if it.seq_id == 0]
    assert (nxt.kind, nxt.token_ids, nxt.firp_k, nxt.firp_anchors) == (ItemKind.DECODE, (43,), 0, 0), nxt
    assert engine.spec.firp_drafted == 0 and engine.spec.drafted_tokens == 0, engine.spec


def test_no_prefill_of_a_burst_that_reaches_the_limit_carries_pseudo_rows():
    """Three sequences admitted in one step at limit 2: the first prefill was queued while it ran alone,
    but it is sent with the others, under load."""
    engine = _engine(2, speculate=False, firp_k=2)
    out = engine.step([_submit(i) for i in range(3)])
    prefills = [it for b in out.sends for it in b]
    assert len(prefills) == 3 and all(it.firp_k == 0 for it in prefills), prefills


def test_a_forced_run_riding_on_a_real_item_stays_under_load():
    """`without_speculation` drops FIRP drafts and pseudo rows, never a grammar's forced run (jump)."""
    item = Item(seq_id=0, slot=0, start=9, num_tokens=3, kind=ItemKind.FIRP, token_ids=(4, 5, 6), firp_k=2,
                firp_anchors=1)
    assert without_speculation(item, jump=True) == dataclasses.replace(item, firp_k=0, firp_anchors=0)
    assert without_speculation(item, jump=False) == dataclasses.replace(
        item, kind=ItemKind.DECODE, num_tokens=1, token_ids=(4,), firp_k=0, firp_anchors=0)
    plain = Item(seq_id=0, slot=0, start=9, num_tokens=1, token_ids=(4,))
    assert without_speculation(plain, jump=False) is plain


def test_seeded_sampling_is_the_same_with_and_without_the_limit():
    """Sampling at temperature 1 with per-request seeds (a draw is keyed by seed and position, so a
    seeded request's tokens do not depend on which drafts ran): paused or not, the tokens are those
    of plain decoding, so the distribution is unchanged."""
    params = [SamplingParams(max_new_tokens=b, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i, b in enumerate(BUDGETS)]
    outputs = {}
    for limit, speculate in ((None, False), (0, True), (2, True)):
        engine = _engine(limit or 0, num_stages=5, speculate=speculate,
                         predictor=MostlyArgmaxPredictor(seed=5) if speculate else None)
        out = FakePipeline(engine, _submits(PROMPTS, params), next_fn=fake_argmax, logits_fn=fake_logits).run()
        outputs[limit] = [out.get(i, []) for i in range(len(PROMPTS))]
        if limit == 2:
            assert engine.spec.spec_disabled_steps > 0 and engine.spec.verified_drafts > 0, engine.spec
    assert outputs[0] == outputs[None] and outputs[2] == outputs[None], outputs
