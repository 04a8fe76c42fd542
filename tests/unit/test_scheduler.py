"""Unit tests for pipeline.engine.scheduler, driven through the one `pipeline.engine.engine.Engine` by a fake
pipeline (no model, no processes).

The fake pipeline is a FIFO of sent micro-batches: the oldest batch is answered when no more can be
sent, with a deterministic token per item, `fake_token(seq_id, position)`. It also models every stage's
KV slots (items must start exactly where their slot's valid positions end; releases free slots in the
order they are sent), so a scheduler that reuses a slot too early or skips a position fails here.

What breaks when these fail: pipeline utilisation (batches in flight), token order or count, stop
conditions, slot accounting (leaks, double frees, two sequences in one slot), or ignoring stale results.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Abort, Result, StopStringHit, Submit
from pipeline.engine.records import NON_FINITE_TOKEN, FinishReason, SchedulerConfig
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.sampling import SamplingParams

EOS = 2


def fake_token(seq_id: int, position: int) -> int:
    """The token the fake model predicts for `position` of sequence `seq_id` (never EOS)."""
    return (seq_id * 7 + position) % 50 + 3


def prompt_of(seq_id: int) -> list[int]:
    """Prompts of different lengths (1..5 tokens)."""
    return [100 + seq_id] * (1 + seq_id % 5)


def expected_output(seq_id: int, max_new_tokens: int) -> list[int]:
    n = len(prompt_of(seq_id))
    return [fake_token(seq_id, n + i) for i in range(max_new_tokens)]


@dataclasses.dataclass
class Trace:
    """What the fake pipeline saw."""

    inflight_at_answer: list[int] = dataclasses.field(default_factory=list)
    running_at_answer: list[int] = dataclasses.field(default_factory=list)
    releases: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    batches: list[list[Item]] = dataclasses.field(default_factory=list)
    first_finish_answer: int | None = None


class FakePipeline:
    """The stages around the one `Engine`: a FIFO of in-flight micro-batches plus a model of the
    stages' KV slot lengths. It only carries out the engine's output and answers batches."""

    def __init__(self, engine: Engine, submits: list[Submit] = (), *, eos_at: dict[int, int] | None = None) -> None:
        self.engine = engine
        self.sched = engine.scheduler  # inspection only
        self.submits = list(submits)  # submitted with the first step, all at once
        self.fifo: collections.deque[list[Item]] = collections.deque()
        self.kv_len = [0] * self.sched.config.max_num_seqs
        self.slot_owner: dict[int, int] = {}
        self.eos_at = eos_at or {}  # seq_id -> position where the fake model predicts EOS
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)
        self.reasons: dict[int, FinishReason] = {}
        self.forgotten: list[int] = []
        self.trace = Trace()

    def token(self, item: Item) -> int:
        return EOS if self.eos_at.get(item.seq_id) == item.end else fake_token(item.seq_id, item.end)

    def step(self, events=()) -> list:
        """One engine step (pending submits first); carries out releases and sends; returns commits."""
        events, self.submits = [*self.submits, *events], []
        out = self.engine.step(events)
        for r in out.releases:
            assert self.slot_owner.get(r.slot) == r.seq_id, f"release of slot {r.slot} by {r.seq_id}: {self.slot_owner}"
            del self.slot_owner[r.slot]
            self.kv_len[r.slot] = 0
            self.trace.releases.append((r.seq_id, r.slot))
        for batch in out.sends:
            self.send(list(batch))
        assert self.engine.num_inflight == len(self.fifo), "the engine's in-flight count disagrees with the ring"
        for c in out.commits:
            self.outputs[c.seq_id].extend(c.token_ids)
            if c.finish_reason is not None:
                self.reasons[c.seq_id] = c.finish_reason
        self.forgotten.extend(out.forgotten)
        return list(out.commits)

    def send(self, batch: list[Item]) -> None:
        assert batch, "the engine sent an empty micro-batch"
        seqs = [it.seq_id for it in batch]
        assert len(set(seqs)) == len(seqs), f"a sequence twice in one micro-batch: {seqs}"
        for it in batch:
            assert 0 <= it.slot < self.sched.config.max_num_seqs
            owner = self.slot_owner.setdefault(it.slot, it.seq_id)
            assert owner == it.seq_id, f"seq {it.seq_id} given slot {it.slot} still held by seq {owner}"
            assert it.start == self.kv_len[it.slot], f"seq {it.seq_id} item at {it.start}, slot has {self.kv_len[it.slot]}"
            assert len(it.token_ids) == it.num_tokens
            self.kv_len[it.slot] = it.end
        self.fifo.append(batch)
        self.trace.batches.append(batch)
        assert len(self.fifo) <= self.sched.config.max_inflight_batches, "too many micro-batches in flight"

    def fill(self) -> None:
        """A step without events: releases first, then as many batches as allowed."""
        self.step()

    def answer_oldest(self, *, returned: list[Item] | None = None):
        batch = self.fifo.popleft()
        returned = batch if returned is None else returned
        self.trace.inflight_at_answer.append(len(self.fifo) + 1)
        self.trace.running_at_answer.append(self.sched.num_running)
        tokens = torch.tensor([self.token(it) for it in returned], dtype=torch.int64)
        commits = self.step([Result(items=tuple(returned), token_ids=tokens)])
        if self.trace.first_finish_answer is None and any(c.finish_reason for c in commits):
            self.trace.first_finish_answer = len(self.trace.inflight_at_answer) - 1
        return commits

    def run(self, *, max_steps: int = 10_000) -> Trace:
        for _ in range(max_steps):
            self.fill()
            if not self.fifo:
                break
            self.answer_oldest()
        else:
            raise AssertionError("the engine did not finish")
        assert not self.engine.has_unfinished, "idle pipeline with unfinished sequences"
        return self.trace


def _submit(seq_id: int, prompt, params: SamplingParams) -> Submit:
    return Submit(seq_id=seq_id, prompt_ids=tuple(prompt), params=params)


def _pipeline(*, num_stages: int, num_seqs: int, max_new_tokens: int = 6, max_num_seqs: int = 16,
              eos_at: dict[int, int] | None = None, **config) -> FakePipeline:
    engine = Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=max_num_seqs, eos_token_ids=(EOS,), **config))
    submits = [_submit(i, prompt_of(i), SamplingParams(max_new_tokens=max_new_tokens)) for i in range(num_seqs)]
    return FakePipeline(engine, submits, eos_at=eos_at)


# -- pipeline occupancy -------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_stages", "num_seqs"), [(1, 1), (1, 3), (2, 1), (4, 2), (4, 3), (3, 7), (4, 9)])
def test_micro_batches_in_flight_never_exceed_num_stages(num_stages, num_seqs):
    trace = (_pipeline(num_stages=num_stages, num_seqs=num_seqs)).run()
    assert max(trace.inflight_at_answer) <= num_stages


@pytest.mark.parametrize(("num_stages", "num_seqs"), [(2, 1), (4, 2), (4, 3), (3, 3)])
def test_fewer_sequences_than_stages_run_one_micro_batch_each(num_stages, num_seqs):
    trace = (_pipeline(num_stages=num_stages, num_seqs=num_seqs)).run()
    assert max(trace.inflight_at_answer) == num_seqs
    assert {len(b) for b in trace.batches} == {1}


@pytest.mark.parametrize(("num_stages", "num_seqs"), [(2, 2), (4, 4), (4, 8), (3, 6), (2, 6)])
def test_steady_state_keeps_every_stage_busy_when_seqs_are_a_multiple_of_stages(num_stages, num_seqs):
    trace = (_pipeline(num_stages=num_stages, num_seqs=num_seqs)).run()
    steady = trace.inflight_at_answer[:trace.first_finish_answer]
    assert steady and all(n == num_stages for n in steady), f"batches in flight before any finish: {steady}"
    sizes = [len(b) for b in trace.batches]
    assert max(sizes) == num_seqs // num_stages, f"micro-batch sizes {sizes}"


@pytest.mark.parametrize(("num_stages", "num_seqs"), [(4, 5), (4, 6), (3, 4)])
def test_steady_state_keeps_every_stage_busy_when_seqs_exceed_stages(num_stages, num_seqs):
    trace = (_pipeline(num_stages=num_stages, num_seqs=num_seqs)).run()
    steady = trace.inflight_at_answer[:trace.first_finish_answer]
    assert steady and all(n == num_stages for n in steady), f"batches in flight before any finish: {steady}"


def test_max_inflight_batches_caps_the_pipeline_below_num_stages():
    trace = _pipeline(num_stages=4, num_seqs=8, max_inflight_batches=2).run()
    assert max(trace.inflight_at_answer) == 2


# -- tokens -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_stages", "num_seqs", "max_new_tokens"), [(1, 1, 1), (2, 3, 5), (4, 6, 9), (3, 2, 12)])
def test_every_sequence_gets_exactly_max_new_tokens_in_order(num_stages, num_seqs, max_new_tokens):
    pipe = _pipeline(num_stages=num_stages, num_seqs=num_seqs, max_new_tokens=max_new_tokens)
    trace = pipe.run()
    outputs = {seq_id: expected_output(seq_id, max_new_tokens) for seq_id in range(num_seqs)}
    assert dict(pipe.outputs) == outputs
    assert pipe.reasons == dict.fromkeys(range(num_seqs), FinishReason.LENGTH)
    items = [it for b in trace.batches for it in b]
    assert len(items) == num_seqs * max_new_tokens, "one item per generated token"
    for it in items:
        prompt = prompt_of(it.seq_id)
        if it.start == 0:
            assert it.kind is ItemKind.PREFILL and list(it.token_ids) == prompt
        else:
            assert it.kind is ItemKind.DECODE and it.num_tokens == 1
            assert it.token_ids == (outputs[it.seq_id][it.start - len(prompt)],), "fed a wrong token"
        assert not it.want_logits, "greedy sequences need no logits"


def test_commits_stream_one_token_per_result_in_order():
    pipe = _pipeline(num_stages=2, num_seqs=3, max_new_tokens=4)
    streamed: dict[int, list[int]] = collections.defaultdict(list)
    reasons = {}
    for _ in range(100):
        pipe.fill()
        if not pipe.fifo:
            break
        for c in pipe.answer_oldest():
            assert len(c.token_ids) == 1 and c.seq_id not in reasons, "commit after the sequence finished"
            streamed[c.seq_id] += c.token_ids
            if c.finish_reason:
                reasons[c.seq_id] = c.finish_reason
    assert dict(streamed) == {s: expected_output(s, 4) for s in range(3)}
    assert reasons == dict.fromkeys(range(3), FinishReason.LENGTH)


def test_eos_stops_a_sequence_and_is_its_last_token():
    n = len(prompt_of(1))
    pipe = _pipeline(num_stages=2, num_seqs=3, max_new_tokens=8, eos_at={1: n + 3})
    pipe.run()
    assert pipe.outputs[1] == [*expected_output(1, 3), EOS] and pipe.reasons[1] is FinishReason.EOS
    assert pipe.outputs[0] == expected_output(0, 8) and pipe.outputs[2] == expected_output(2, 8)


def test_a_non_finite_result_ends_that_sequence_alone_with_error_and_frees_its_slot():
    """[Note: non-finite logits] in pipeline/engine/records.py: the last stage's NON_FINITE_TOKEN
    ends the sequence with FinishReason.ERROR and no token; the others run to their budget, and the
    fake's slot model sees the slot released and reused cleanly."""
    n = len(prompt_of(1))
    pipe = _pipeline(num_stages=2, num_seqs=4, max_new_tokens=8, max_num_seqs=2)
    plain_token = pipe.token
    pipe.token = lambda it: NON_FINITE_TOKEN if (it.seq_id, it.end) == (1, n + 3) else plain_token(it)
    pipe.run()
    assert pipe.outputs[1] == expected_output(1, 3) and pipe.reasons[1] is FinishReason.ERROR
    assert all(pipe.outputs[i] == expected_output(i, 8) and pipe.reasons[i] is FinishReason.LENGTH for i in (0, 2, 3))
    assert sorted(seq for seq, _ in pipe.trace.releases) == [0, 1, 2, 3]


def test_eos_as_the_first_token_after_prefill_finishes_at_once():
    pipe = _pipeline(num_stages=2, num_seqs=1, max_new_tokens=8, eos_at={0: len(prompt_of(0))})
    pipe.run()
    assert pipe.outputs[0] == [EOS] and pipe.reasons[0] is FinishReason.EOS


def test_ignore_eos_keeps_generating_to_max_new_tokens():
    engine = Engine(SchedulerConfig(num_stages=2, eos_token_ids=(EOS,)))
    pipe = FakePipeline(engine, [_submit(0, [5, 6], SamplingParams(max_new_tokens=5, ignore_eos=True))], eos_at={0: 3})
    pipe.run()
    out = pipe.outputs[0]
    assert len(out) == 5 and out[1] == EOS and pipe.reasons[0] is FinishReason.LENGTH


def test_sampled_sequences_use_their_logits_row_not_the_argmax():
    engine = Engine(SchedulerConfig(num_stages=1, max_num_seqs=4))
    hot = {0: 40, 2: 41}  # seq -> the only token its logits allow
    submits = [_submit(seq_id, [9, 9], SamplingParams(max_new_tokens=3, temperature=0.0 if seq_id == 1 else 1.0,
                                                      seed=seq_id)) for seq_id in range(3)]
    [batch] = engine.step(submits).sends
    assert [it.seq_id for it in batch] == [0, 1, 2]
    assert [it.want_logits for it in batch] == [True, False, True]
    logits = torch.full((2, 64), -1e4)
    logits[0, hot[0]] = logits[1, hot[2]] = 10.0
    commits = engine.step([Result(items=batch, token_ids=torch.tensor([7, 8, 9]), logits=logits)]).commits
    assert [(c.seq_id, c.token_ids) for c in commits] == [(0, (40,)), (1, (8,)), (2, (41,))]


# -- admission and slots --------------------------------------------------------------------------------

def test_duplicate_sequence_id_is_rejected():
    engine = Engine(SchedulerConfig(num_stages=2))
    engine.step([_submit(3, [1], SamplingParams())])
    with pytest.raises(ValueError, match="sequence id 3 is already in use"):
        engine.step([_submit(3, [2], SamplingParams())])


def test_max_inflight_batches_defaults_to_num_stages():
    assert SchedulerConfig(num_stages=3).max_inflight_batches == 3
    assert SchedulerConfig(num_stages=3, max_inflight_batches=1).max_inflight_batches == 1


@pytest.mark.parametrize(("max_num_seqs", "num_seqs", "num_stages"), [(1, 3, 2), (2, 7, 2), (3, 8, 4)])
def test_slots_are_released_once_per_sequence_and_reused_by_waiting_sequences(max_num_seqs, num_seqs, num_stages):
    pipe = _pipeline(num_stages=num_stages, num_seqs=num_seqs, max_num_seqs=max_num_seqs, max_new_tokens=4)
    trace = pipe.run()
    released = [seq_id for seq_id, _ in trace.releases]
    assert sorted(released) == list(range(num_seqs)), f"each sequence releases exactly once: {released}"
    assert max(trace.running_at_answer) == max_num_seqs
    slots_used = {it.slot for b in trace.batches for it in b}
    assert slots_used == set(range(max_num_seqs)), "waiting sequences must reuse freed slots"
    for seq_id in range(num_seqs):
        assert pipe.outputs[seq_id] == expected_output(seq_id, 4)
    assert sorted(pipe.sched.free_slots) == list(range(max_num_seqs)), "a slot leaked or was freed twice"
    assert pipe.engine.num_sequences == 0, "released sequences are forgotten"
    assert sorted(pipe.forgotten) == list(range(num_seqs))


# -- abort and stale results -----------------------------------------------------------------------------

def test_abort_releases_the_slot_once_and_ignores_the_in_flight_result():
    pipe = _pipeline(num_stages=2, num_seqs=3, max_num_seqs=2, max_new_tokens=5)
    pipe.fill()
    pipe.answer_oldest()
    seq0 = pipe.sched.seqs[0]
    slot, before = seq0.slot, list(seq0.output_ids)
    assert slot >= 0 and any(it.seq_id == 0 for b in pipe.fifo for it in b), "seq 0 must be in flight"
    pipe.step([Abort(seq_id=0), Abort(seq_id=0)])  # a second abort is a no-op
    assert seq0.finish_reason is FinishReason.ABORTED and seq0.slot == -1
    assert pipe.trace.releases == [(0, slot)]
    trace = pipe.run()  # seq 0's in-flight result comes back after the abort
    assert seq0.output_ids == before, "a result of an aborted sequence was committed"
    assert [r for r in trace.releases if r[0] == 0] == [(0, slot)]
    assert pipe.outputs[2] == expected_output(2, 5), "the waiting sequence did not get the slot"


def test_abort_of_a_waiting_sequence_releases_nothing_and_never_schedules_it():
    pipe = _pipeline(num_stages=2, num_seqs=3, max_num_seqs=1, max_new_tokens=2)
    pipe.step([Abort(seq_id=2)])
    assert pipe.forgotten == [2], "a sequence that never held a slot is forgotten at once"
    trace = pipe.run()
    assert 2 not in {it.seq_id for b in trace.batches for it in b}
    assert [s for s, _ in trace.releases] == [0, 1]
    assert 2 not in pipe.outputs


def test_stop_string_finish_releases_the_slot():
    pipe = _pipeline(num_stages=1, num_seqs=1, max_new_tokens=5)
    pipe.fill()
    pipe.answer_oldest()
    seq = pipe.sched.seqs[0]
    slot = seq.slot
    pipe.step([StopStringHit(seq_id=0)])
    assert seq.finish_reason is FinishReason.STOP
    assert pipe.trace.releases == [(0, slot)] and pipe.forgotten == [0]


def test_result_of_an_older_epoch_is_ignored():
    pipe = _pipeline(num_stages=2, num_seqs=2, max_new_tokens=5)
    pipe.fill()
    pipe.sched.seqs[0].ledger.epoch += 1  # a squash happened while seq 0's item was in flight
    commits = pipe.answer_oldest()
    assert commits == [] and pipe.sched.seqs[0].output_ids == []
    assert [c.seq_id for c in pipe.answer_oldest()] == [1]
    assert pipe.engine.num_inflight == len(pipe.fifo) == 1, "only seq 1's next item is in flight"


def test_result_of_a_finished_sequence_is_ignored_and_logit_rows_stay_aligned():
    engine = Engine(SchedulerConfig(num_stages=1))
    submits = [_submit(seq_id, [1, 2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1)) for seq_id in range(2)]
    [batch] = engine.step(submits).sends
    engine.step([Abort(seq_id=0)])
    logits = torch.full((2, 16), -1e4)
    logits[0, 5] = logits[1, 11] = 10.0
    commits = engine.step([Result(items=batch, token_ids=torch.tensor([0, 0]), logits=logits)]).commits
    assert [(c.seq_id, c.token_ids) for c in commits] == [(1, (11,))]


def test_a_result_with_nothing_in_flight_is_an_error():
    engine = Engine(SchedulerConfig(num_stages=1))
    with pytest.raises(RuntimeError, match="no micro-batch in flight"):
        engine.step([Result(items=(), token_ids=torch.tensor([], dtype=torch.int64))])
