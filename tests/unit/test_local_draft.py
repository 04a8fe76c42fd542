"""Stage-local drafting ([Note: stage-local drafting] in pipeline/engine/local_draft.py), without processes.

What breaks when these fail: the exit stage drafts something the coordinator's `_try_draft` would
not (another token, past the ledger's limit, through a closed gate, at a stale epoch); a
self-made draft's result is lost, counted twice, or applied before its announcement; a
self-made draft left in flight by a squash or an unannounced parent corrupts greedy output; the
engine's in-flight count leaks, or a self-made draft the stage withdrew (a squash reached stage 0
before it ran: [Note: stage-local drafting] 6) stays counted in flight.

The fake pipeline is tests/unit/test_speculation_scheduler.py's (lock-step stages, a hash "model"),
with stage 0 running the real `StageDrafter` as workers/stage_loop.py does: a draft it makes runs
next on stage 0, before anything else. Announcements (exit events) and results travel on two
channels, each FIFO, delivered with independent delays, so every arrival order happens.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import random

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ExitPassed, ReplayRunning, Result, Submit, Withdrawn
from pipeline.engine.local_draft import (
    CUSTOM,
    GATE_OFF_BIT,
    GATE_SOURCES,
    NUM_GATE_BUCKETS,
    StageDrafter,
    authorise,
    gate_bits,
    predictor_code,
)
from pipeline.engine.local_draft import (
    credit as local_credit,
)
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.scheduler import Scheduler
from pipeline.measure.timeline import StageTiming
from pipeline.speculation.draft_gate import DraftGate
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import ExitGuess, HybridPredictor, LogitLensPredictor, NGramPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    RandomPredictor,
    ReferenceTable,
    SometimesRightPredictor,
)
from tests.unit.test_speculation_scheduler import MAX_MODEL_LEN, VOCAB, FakePipeline, greedy_reference

PROMPTS = [[5, 9, 11], [20, 4], [33, 33, 33, 33, 33], [8]]
BUDGETS = [24, 10, 17, 5]


class LocalFakePipeline(FakePipeline):
    """FakePipeline whose stage 0 (the exit stage) drafts itself; announcements and results are
    delivered `delay()` steps late, each channel in order."""

    def __init__(self, engine: Engine, submits, *, predictor, seed: int = 0, max_delay: tuple[int, int] = (0, 0),
                 lens_offset: int = 0, replay_at: int | None = None, withdraw: bool = False) -> None:
        super().__init__(engine, submits, exit_stage=0, lens_offset=lens_offset)
        self.withdraw = withdraw  # stage 0 withdraws self-made drafts a queued squash made stale
        self.withdrawn = 0
        self.withdrawn_by_squash = 0  # of those, superseded by a newer epoch rather than a release
        self.drafter = StageDrafter(custom=predictor)
        self.rng = random.Random(seed)
        self.max_delay = max_delay  # (announcements, results): up to this many steps late
        self.channels = {"exit": collections.deque(), "result": collections.deque()}
        self.announced: set[frozenset] = set()
        self.self_made = 0
        self.results_before_announcement = 0
        self.stale_self_made = 0  # self-made drafts whose result came back after a squash
        self.replay_at = replay_at

    def pump(self, events=()) -> None:
        """FakePipeline.pump, and CREDITs straight to stage 0's drafter (its reader thread)."""
        step = self.engine.step

        def step_and_credit(evs):
            out = step(evs)
            self.drafter.credit(out.credits)
            return out

        self.engine.step = step_and_credit
        try:
            super().pump(events)
        finally:
            self.engine.step = step

    def step(self) -> None:
        if self.replay_at is not None and self.stats.steps == self.replay_at:
            self._replay()
        for j in reversed(range(self.num_stages)):
            if self.queues[j]:
                self._run_entry(j, self.queues[j].popleft())
        self.stats.steps += 1
        self._deliver()

    def _run_entry(self, j: int, entry) -> None:
        if entry[0] == "release":
            seq_ids, slots = zip(*entry[1], strict=True)
            self.executors[j].release(list(seq_ids), list(slots))
            if j == 0:
                self.drafter.release(list(seq_ids))
            if j + 1 < self.num_stages:
                self.queues[j + 1].append(entry)
            return
        _, sent, items = entry
        if j == 0 and self.withdraw and items and all(it.self_made for it in items) and self._superseded(items):
            self.withdrawn += len(items)  # workers/stage_loop.py: stopped, and WITHDRAWN to the coordinator
            self.withdrawn_by_squash += sum(it.seq_id in self.engine.scheduler.seqs for it in items)
            self._send("exit", Withdrawn(items=tuple(items)))
            return
        kept = self._run_stage(j, items)
        if j == 0:
            x = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64)
            self.drafter.observe(items, x, kept)
            if any(it.kind != ItemKind.PREFILL for it in kept):
                self._exit(kept)
        if j + 1 < self.num_stages:
            self.queues[j + 1].append(("batch", sent, kept))
        else:
            tokens = [self.next_fn(self.contents[j][it.slot][:it.end]) for it in kept]
            self._send("result", Result(items=tuple(kept), token_ids=torch.tensor(tokens, dtype=torch.int64)))

    def _superseded(self, drafts: list[Item]) -> bool:
        """Whether stage 0's queue holds a newer epoch (or a release) of every draft's sequence:
        what the stage's reader thread would have seen (workers/stage_loop.py `_superseded`)."""
        newest: dict[int, int] = {}
        for entry in self.queues[0]:
            if entry[0] == "release":
                newest.update((seq_id, 1 << 62) for seq_id, _ in entry[1])
            else:
                for it in entry[2]:
                    newest[it.seq_id] = max(it.epoch, newest.get(it.seq_id, -1))
        return all(newest.get(it.seq_id, -1) > it.epoch for it in drafts)

    def _exit(self, kept: list[Item]) -> None:
        guesses = [None if it.kind == ItemKind.PREFILL or not it.want_exit else
                   ExitGuess((self.next_fn(self.contents[0][it.slot][:it.end]) + self.lens_offset) % VOCAB, 0.97)
                   for it in kept]
        tokens = torch.tensor([-1 if g is None else g.token for g in guesses], dtype=torch.int64)
        probs = torch.tensor([0.0 if g is None else g.prob for g in guesses], dtype=torch.float32)
        drafts, made, keys = self.drafter.drafts(kept, tokens, probs)
        self.exit_passed.update((it.seq_id, it.end - 1, it.epoch) for it in kept)
        self._send("exit", ExitPassed(items=tuple(kept), guesses=tuple(guesses),
                                      self_drafts=tuple(zip(made, keys, strict=True)) if drafts else ()))
        if drafts:  # runs next on stage 0, before anything else (workers/stage_loop.py)
            self.self_made += len(drafts)
            self.queues[0].appendleft(("batch", drafts, drafts))

    def _send(self, channel: str, event) -> None:
        delay = self.rng.randint(0, self.max_delay[channel == "result"])
        self.channels[channel].append((self.stats.steps + delay, event))

    def _deliver(self) -> None:
        """Deliver due events, each channel in order; the two channels interleave at random."""
        due = {name: [] for name in self.channels}
        for name, q in self.channels.items():
            while q and q[0][0] <= self.stats.steps:
                due[name].append(q.popleft()[1])
        events = due["exit"] + due["result"]
        self.rng.shuffle(events)
        for name in self.channels:  # restore each channel's own order
            ordered = iter(due[name])
            events = [next(ordered) if (e in due[name]) else e for e in events]
        for event in events:
            if isinstance(event, ExitPassed) and event.self_drafts:
                self.announced.add(frozenset((it.seq_id, it.end, it.epoch) for it, (t, _) in
                                             zip(event.items, event.self_drafts, strict=True) if t >= 0))
            elif isinstance(event, Result) and event.items and event.items[0].self_made:
                key = frozenset((it.seq_id, it.start, it.epoch) for it in event.items)
                self.results_before_announcement += key not in self.announced
                seqs = self.engine.scheduler.seqs
                self.stale_self_made += sum(it.seq_id not in seqs or seqs[it.seq_id].epoch != it.epoch
                                            for it in event.items)
            self.pump([event])

    def _replay(self) -> None:
        """A stage restart: the ring, its messages and every stage's state are gone."""
        for q in [*self.queues, *self.channels.values()]:
            q.clear()
        for ex in self.executors:
            ex.clear()
        self.contents = [collections.defaultdict(list) for _ in range(self.num_stages)]
        self.drafter = StageDrafter(custom=self.drafter.custom)
        self.pump([ReplayRunning()])

    def run(self, *, max_steps: int = 20_000) -> dict[int, list[int]]:
        self.pump(self.submits)
        for _ in range(max_steps):
            if not self.engine.has_unfinished and not any(self.queues) and not any(self.channels.values()):
                return dict(self.outputs)
            self.step()
        raise AssertionError(f"the fake pipeline did not finish in {max_steps} steps")


def _config(num_stages: int, *, min_acceptance: float = 0.0, draft_at_stage: bool = True) -> SchedulerConfig:
    return SchedulerConfig(num_stages=num_stages, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, speculate=True,
                           min_acceptance=min_acceptance, draft_at_stage=draft_at_stage)


def _predictor(kind: str, prompts, references, seed: int):
    table = ReferenceTable(zip(prompts, references, strict=True))
    if kind == "always-wrong":
        return AlwaysWrongPredictor(table, vocab_size=VOCAB, needs_exit_head=True)
    if kind == "random":
        return RandomPredictor(seed=seed, vocab_size=VOCAB, needs_exit_head=True)
    if kind == "sometimes-right":
        return SometimesRightPredictor(table, seed=seed, vocab_size=VOCAB, needs_exit_head=True)
    return {"logit-lens": LogitLensPredictor, "hybrid": HybridPredictor}[kind]()


def _run(num_stages: int, kind: str, num_seqs: int, *, seed: int = 0, max_delay=(0, 0), lens_offset: int = 0,
         min_acceptance: float = 0.0, replay_at: int | None = None, withdraw: bool = False):
    prompts = PROMPTS[:num_seqs]
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS[:num_seqs]]
    refs = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(prompts, params, strict=True)]
    predictor = _predictor(kind, prompts, refs, seed)
    engine = Engine(_config(num_stages, min_acceptance=min_acceptance), predictor)
    fake = LocalFakePipeline(engine, [Submit(seq_id=i, prompt_ids=tuple(p), params=sp) for i, (p, sp) in
                                      enumerate(zip(prompts, params, strict=True))],
                             predictor=predictor, seed=seed, max_delay=max_delay, lens_offset=lens_offset,
                             replay_at=replay_at, withdraw=withdraw)
    outputs = fake.run()
    assert [outputs.get(i, []) for i in range(num_seqs)] == refs, "stage-local drafting changed greedy output"
    assert engine.num_inflight == 0 and not engine._early, "a self-made micro-batch was never matched"
    return engine, fake


# -- exactness and accounting ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_delay", [(0, 0), (3, 0), (0, 3), (4, 4)], ids=["prompt", "late-exit", "late-result", "both"])
@pytest.mark.parametrize("kind", ["always-wrong", "random", "sometimes-right", "logit-lens", "hybrid"])
@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_stage_made_drafts_keep_greedy_output_and_every_result_matched(num_stages, num_seqs, kind, max_delay):
    for seed in range(3):
        engine, fake = _run(num_stages, kind, num_seqs, seed=seed, max_delay=max_delay,
                            lens_offset=1 if kind == "hybrid" else 0)
        assert fake.self_made > 0, "the exit stage never drafted"
        assert engine.spec.drafted_tokens >= engine.spec.verified_drafts > 0
        if kind == "always-wrong":
            assert engine.spec.accepted_tokens == 0 and engine.spec.squashed_items > 0


@pytest.mark.parametrize("max_delay", [(0, 0), (3, 0), (0, 3), (4, 4)], ids=["prompt", "late-exit", "late-result", "both"])
@pytest.mark.parametrize("kind", ["always-wrong", "random", "sometimes-right", "hybrid"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_withdrawn_self_made_drafts_keep_greedy_output_and_leave_nothing_in_flight(num_stages, kind, max_delay):
    """Stage 0 withdraws a self-made draft whose sequence a queued squash (or release) made stale
    ([Note: stage-local drafting] 6): output stays the reference's (`_run`), the engine stops
    counting it in flight (`_run`: num_inflight == 0 at the end), and counts it once."""
    by_squash = 0
    for seed in range(3):
        for num_seqs in (1, 4):
            engine, fake = _run(num_stages, kind, num_seqs, seed=seed, max_delay=max_delay, withdraw=True,
                                lens_offset=1 if kind == "hybrid" else 0)
            assert engine.spec.withdrawn_drafts == fake.withdrawn
            by_squash += fake.withdrawn_by_squash
    if kind == "hybrid":  # a wrong exit head beside a right n-gram: deep drafts after wrong parents
        assert by_squash > 0, "no self-made draft was ever superseded by a squash before it ran"


def test_a_squash_sends_the_real_item_at_once_past_stale_self_made_drafts():
    """Two self-made drafts in flight (the second a deep one) when the result shows the first
    wrong: they are stale, so the real item goes out at once (the stage can then withdraw the deep
    draft); counted as in flight they held it back until their stale results came."""
    engine = Engine(_config(2), LogitLensPredictor())
    out = engine.step([Submit(seq_id=0, prompt_ids=(5, 6, 7), params=SamplingParams(max_new_tokens=20,
                                                                                    ignore_eos=True))])
    prefill = out.sends[0][0].without_tokens()
    decode = engine.step([Result(items=(prefill,), token_ids=torch.tensor([8]))]).sends[0][0].without_tokens()
    assert decode.draft_upto > 0, "the decode item was not authorised for stage drafting"
    d1 = Item(seq_id=0, slot=decode.slot, start=decode.end, num_tokens=1, epoch=decode.epoch, kind=ItemKind.DRAFT,
              self_made=True)
    d2 = dataclasses.replace(d1, start=d1.end)
    engine.step([ExitPassed(items=(decode,), guesses=(ExitGuess(9, 0.9),), self_drafts=((9, -1),))])
    engine.step([ExitPassed(items=(d1,), guesses=(ExitGuess(10, 0.9),), self_drafts=((10, -1),))])
    assert engine.spec.drafted_tokens == 2 and engine.num_inflight == 3
    out = engine.step([Result(items=(decode,), token_ids=torch.tensor([11]))])  # the real token is 11, not 9
    sent = [(it.kind, it.start, it.epoch > decode.epoch) for batch in out.sends for it in batch]
    assert sent == [(ItemKind.DECODE, d1.start, True)], sent
    engine.step([Withdrawn(items=(d2,)), Result(items=(d1,), token_ids=torch.tensor([12]))])
    assert engine.num_inflight == 1 and engine.spec.withdrawn_drafts == 1


def test_a_withdrawn_draft_counts_its_wait_in_draft_gap_and_its_time_as_wasted():
    """A withdrawn self-made draft waited like any other before it started: its gap (start - max(the
    announcement, the stage's previous end)) enters draft_gap, and its partial pass is wasted time."""
    engine = Engine(_config(2), LogitLensPredictor())
    out = engine.step([Submit(seq_id=0, prompt_ids=(5, 6, 7), params=SamplingParams(max_new_tokens=20,
                                                                                    ignore_eos=True))])
    prefill = out.sends[0][0].without_tokens()
    decode = engine.step([Result(items=(prefill,), token_ids=torch.tensor([8]),
                                 timing=(StageTiming(0, 0, 1_000), StageTiming(1, 1_000, 2_000)))]
                         ).sends[0][0].without_tokens()
    draft = Item(seq_id=0, slot=decode.slot, start=decode.end, num_tokens=1, epoch=decode.epoch,
                 kind=ItemKind.DRAFT, self_made=True)
    engine.step([ExitPassed(items=(decode,), guesses=(ExitGuess(9, 0.9),), self_drafts=((9, -1),), at_ns=3_000)])
    engine.step([Result(items=(decode,), token_ids=torch.tensor([11]))])  # 9 was wrong: the draft is stale
    engine.step([Withdrawn(items=(draft,), timing=(StageTiming(0, 3_400, 3_600),))])
    assert engine.spec.withdrawn_drafts == 1
    assert list(engine.timeline.draft_gaps_ns) == [400]
    assert engine.timeline.wasted_ns[0] == 200


def test_a_withdrawal_after_a_replay_is_ignored():
    """A replay forgets every announced micro-batch; a withdrawal of one of them changes nothing."""
    engine = Engine(_config(2), NGramPredictor())
    engine.step([ReplayRunning()])
    draft = Item(seq_id=0, slot=0, start=3, num_tokens=1, epoch=0, kind=ItemKind.DRAFT, self_made=True)
    engine.step([Withdrawn(items=(draft,))])
    assert engine.num_inflight == 0 and engine.spec.withdrawn_drafts == 0


def test_a_result_before_its_announcement_is_buffered_then_applied():
    engine, fake = _run(2, "logit-lens", 1, seed=1, max_delay=(4, 0))
    assert fake.results_before_announcement > 0, "the test never delivered a result before its announcement"
    assert engine.spec.accepted_tokens > 0


def test_perfect_stage_drafts_run_without_a_coordinator_round_trip():
    """A perfect exit head at --stages 2: after the first draft, the stage makes every draft
    (the credits keep the chain going), and all of them are accepted."""
    engine, fake = _run(2, "logit-lens", 1)
    spec = engine.spec
    assert spec.accepted_tokens == spec.verified_drafts > 0 and spec.squashed_items == 0
    assert fake.self_made == spec.drafted_tokens, f"{spec.drafted_tokens - fake.self_made} drafts came from the coordinator"


def test_squashes_make_in_flight_self_made_drafts_stale():
    engine, fake = _run(3, "always-wrong", 2, max_delay=(2, 2))
    assert engine.spec.squashed_items > 0 and fake.stale_self_made > 0


def test_replay_after_a_stage_restart_leaves_no_self_made_draft_behind():
    for at in (6, 11, 17):
        engine, fake = _run(2, "sometimes-right", 2, replay_at=at, max_delay=(2, 1))
        assert fake.self_made > 0


# -- the stage's decision is the coordinator's ------------------------------------------------------------
def _scheduler_at_first_decode(prompt: list[int], *, min_acceptance: float = 0.0, predictor=None):
    """A scheduler (draft_at_stage) whose sequence has just been sent its first decode item."""
    sched = Scheduler(_config(2, min_acceptance=min_acceptance), predictor or HybridPredictor())
    sched.add(0, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    prefill = sched.next_batch(num_inflight=0).items[0]
    sched.on_result([prefill], torch.tensor([prompt[-1]]), None)
    decode = sched.next_batch(num_inflight=0).items[0]
    return sched, prefill, decode


def _stage_draft(prefill: Item, decode: Item, guess: ExitGuess, drafter: StageDrafter | None = None):
    drafter = drafter or StageDrafter()
    drafter.observe([prefill], torch.tensor(prefill.token_ids), [prefill.without_tokens()])
    drafter.observe([decode], torch.tensor(decode.token_ids), [decode.without_tokens()])
    d = decode.without_tokens()
    drafts, tokens, keys = drafter.drafts([d], torch.tensor([guess.token]), torch.tensor([guess.prob]))
    return (drafts[0] if drafts else None), tokens[0], keys[0]


@pytest.mark.parametrize("seed", range(40))
def test_stage_draft_is_the_draft_try_draft_makes(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(rng.randrange(2, 30))]  # small alphabet: n-gram matches happen
    guess = ExitGuess(rng.randrange(VOCAB), rng.random())
    sched, prefill, decode = _scheduler_at_first_decode(prompt)
    assert decode.draft_upto > 0 and decode.draft_with == predictor_code(HybridPredictor()) != CUSTOM
    draft, token, key = _stage_draft(prefill, decode, guess)
    coordinator = copy.deepcopy(sched)
    coordinator.on_exit([decode], [guess])  # what the coordinator would do without the stage
    pending = coordinator.seqs[0].pending
    assert (draft is None) == (pending is None)
    if pending is not None:
        assert draft.token_ids == pending.token_ids and (draft.start, draft.epoch, draft.slot) == (
            pending.start, pending.epoch, pending.slot)
        assert draft.self_made and draft.kind == ItemKind.DRAFT
        source, bucket = coordinator.seqs[0].pending_key
        assert key == GATE_SOURCES.index(source) * NUM_GATE_BUCKETS + bucket
        sched.on_exit([decode], [guess], self_drafts=[(token, key)])  # the announcement registers it
        chain = sched.seqs[0].ledger.inflight
        assert [f.token for f in chain][-1] == token and chain[-1].gate_key == (source, bucket)
        assert sched.seqs[0].pending is None, "the coordinator must not send a second draft"


def test_stage_refuses_an_item_that_was_not_authorised():
    sched, prefill, decode = _scheduler_at_first_decode([1, 2, 1, 2, 1])
    draft, _, _ = _stage_draft(prefill, Item(**{**decode.__dict__, "draft_upto": 0}), ExitGuess(3, 0.9))
    assert draft is None
    assert _stage_draft(prefill, decode, ExitGuess(3, 0.9))[0] is not None


def test_stage_refuses_a_stale_epoch():
    sched, prefill, decode = _scheduler_at_first_decode([1, 2, 1, 2, 1])
    drafter = StageDrafter()
    newer = Item(seq_id=0, slot=decode.slot, start=0, num_tokens=1, epoch=decode.epoch + 1, draft_cap=50,
                 draft_upto=50, draft_gate=1 << GATE_OFF_BIT)
    drafter.observe([prefill], torch.tensor(prefill.token_ids), [prefill.without_tokens()])
    drafter.credit([newer])  # the coordinator squashed meanwhile
    assert _stage_draft(prefill, decode, ExitGuess(3, 0.9), drafter)[0] is None


def test_stage_refuses_when_the_gate_is_closed_and_follows_its_bits():
    sched, prefill, decode = _scheduler_at_first_decode([7, 8, 9], predictor=LogitLensPredictor(), min_acceptance=0.5)
    gate = sched.gate
    key = gate.key(LogitLensPredictor().propose([], ExitGuess(3, 0.95)))
    assert gate_bits(gate) >> (GATE_SOURCES.index(key[0]) * NUM_GATE_BUCKETS + key[1]) & 1  # prior: open
    assert _stage_draft(prefill, decode, ExitGuess(3, 0.95))[0] is not None
    for _ in range(6):
        gate.record(key, accepted=False)
    assert not gate.would_allow(key)
    closed = authorise(sched.config, sched.predictor, gate, sched.seqs[0], decode.without_tokens(), pipeline_full=False,
                       depth=sched.config.max_inflight)
    assert _stage_draft(prefill, Item(**{**closed.__dict__, "token_ids": decode.token_ids}), ExitGuess(3, 0.95))[0] is None


def test_stage_refuses_past_the_ledger_limit_until_a_credit_raises_it():
    sched, prefill, decode = _scheduler_at_first_decode([1, 2, 3])
    capped = Item(**{**decode.__dict__, "draft_cap": decode.end - 1, "draft_upto": decode.end - 1})
    drafter = StageDrafter()
    assert _stage_draft(prefill, capped, ExitGuess(3, 0.9), drafter)[0] is None  # p < draft_upto fails
    credit = Item(seq_id=0, slot=decode.slot, start=0, num_tokens=1, epoch=decode.epoch,
                  draft_cap=decode.end - 1, draft_upto=decode.end, draft_gate=decode.draft_gate)
    drafter.credit([credit])
    assert _stage_draft(prefill, capped, ExitGuess(3, 0.9), drafter)[0] is None, "a deep draft after a coordinator item"
    drafter.credit([Item(**{**credit.__dict__, "draft_cap": decode.end})])
    assert _stage_draft(prefill, capped, ExitGuess(3, 0.9), drafter)[0] is not None


def test_a_deep_draft_needs_a_parent_made_here_whose_bucket_is_right_often():
    """Past the coordinator's own cap, the stage drafts only after its own draft of a bucket with
    acceptance >= DEEP_ACCEPTANCE ([Note: stage-local drafting] 5)."""
    sched, prefill, decode = _scheduler_at_first_decode([7, 8, 9], predictor=LogitLensPredictor())
    drafter = StageDrafter()
    first, token, key = _stage_draft(prefill, decode, ExitGuess(3, 0.95), drafter)  # within the cap
    assert first is not None and first.draft_cap == decode.draft_cap
    deep = dict(draft_cap=first.start, draft_upto=first.start + 1)  # first's position is past the cap
    confident = Item(**{**first.__dict__, **deep})
    drafter.credit([Item(seq_id=0, slot=first.slot, start=0, num_tokens=1, epoch=first.epoch,
                         draft_gate=first.draft_gate, **deep)])
    x = torch.tensor(confident.token_ids)
    drafter.observe([confident], x, [confident.without_tokens()])
    made, _, _ = drafter.drafts([confident.without_tokens()], torch.tensor([4]), torch.tensor([0.95]))
    assert made, "the parent's bucket (0.95, prior 0.95) is deep: the stage must draft"
    gate = sched.gate
    for _ in range(4):
        gate.record((GATE_SOURCES[key // NUM_GATE_BUCKETS], key % NUM_GATE_BUCKETS), accepted=False)
    drafter.credit([Item(seq_id=0, slot=first.slot, start=0, num_tokens=1, epoch=first.epoch,
                         draft_gate=gate_bits(gate), **deep)])
    drafter.observe([confident], x, [confident.without_tokens()])
    made, _, _ = drafter.drafts([confident.without_tokens()], torch.tensor([4]), torch.tensor([0.95]))
    assert not made, "a parent whose bucket is often wrong must not get a deep draft"


def test_only_default_built_in_predictors_are_rebuilt_on_the_stage():
    assert predictor_code(HybridPredictor()) != CUSTOM and predictor_code(LogitLensPredictor()) != CUSTOM
    assert predictor_code(HybridPredictor(NGramPredictor(max_ngram=3))) == CUSTOM
    assert predictor_code(RandomPredictor(seed=0, vocab_size=8)) == CUSTOM
    assert gate_bits(DraftGate(min_acceptance=0.0)) >> GATE_OFF_BIT & 1
    assert not gate_bits(DraftGate(min_acceptance=0.5)) >> GATE_OFF_BIT & 1


def test_nothing_is_authorised_without_the_flag():
    sched = Scheduler(_config(2, draft_at_stage=False), HybridPredictor())
    sched.add(0, [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    prefill = sched.next_batch(num_inflight=0).items[0]
    sched.on_result([prefill], torch.tensor([4]), None)
    assert sched.next_batch(num_inflight=0).items[0].draft_upto == 0


# -- review fixes: the table-driven run-ahead depth bounds the stage too; no grant after a release ------
def test_stage_grants_follow_the_table_driven_run_ahead_depth():
    """With `run_ahead_from_table`, the stage's bounds come from the same depth the coordinator's
    `_try_draft` uses (a table and measured acceptance 0.1 at 4 stages: depth 1), not max_inflight."""
    from pipeline.measure.row_cost import RowCostTable
    table = RowCostTable(mode="fp32", num_rows=(1, 2, 4, 8), pass_s=(1.0, 1.7, 3.0, 5.0))
    config = SchedulerConfig(num_stages=4, max_num_seqs=1, max_model_len=MAX_MODEL_LEN, speculate=True,
                             row_costs=table, run_ahead_from_table=True, draft_at_stage=True)
    engine = Engine(config, LogitLensPredictor())
    sched = engine.scheduler
    sched.spec.verified_drafts, sched.spec.accepted_tokens = 1000, 100
    prefill = engine.step([Submit(seq_id=1, prompt_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=50))]).sends[0]
    item = engine.step([Result(items=prefill, token_ids=torch.tensor([9]))]).sends[0][0]
    depth = sched.rows.run_ahead(config, sched.spec, shared_rows=0, explore=False)
    assert depth < config.max_inflight
    nrp = sched.seqs[1].ledger.next_real_position
    assert (item.draft_cap, item.draft_upto) == (nrp + depth - 1, nrp + depth)
    credits = local_credit(config, sched.gate, sched.seqs[1], depth=depth)
    assert [(c.draft_cap, c.draft_upto) for c in credits] == [(nrp + depth - 1, nrp + depth)]


def test_a_credit_after_a_release_creates_no_grant():
    sched, prefill, decode = _scheduler_at_first_decode([1, 2, 3])
    drafter = StageDrafter()
    drafter.observe([decode], torch.tensor(decode.token_ids), [decode.without_tokens()])
    drafter.release([0])
    drafter.credit([Item(seq_id=0, slot=decode.slot, start=0, num_tokens=1, epoch=decode.epoch,
                         draft_cap=decode.end, draft_upto=decode.end + 1, draft_gate=decode.draft_gate)])
    assert drafter.grants == {} and drafter.tokens == {}


def test_the_scheduler_config_refuses_stage_drafting_with_token_trees():
    """The CLI / PipelineOptions refuse `--draft-at stage` with `--draft-tree` > 1 in one line; the
    scheduler's config holds it as an invariant (stage-made drafts carry no siblings)."""
    SchedulerConfig(num_stages=2, speculate=True, draft_at_stage=True, draft_tree=1)
    SchedulerConfig(num_stages=2, speculate=True, draft_tree=3)
    with pytest.raises(AssertionError, match="token trees need draft_at coordinator"):
        SchedulerConfig(num_stages=2, speculate=True, draft_at_stage=True, draft_tree=3)


def test_the_exit_stage_drafter_takes_top_k_exit_tensors_of_token_trees():
    """Stage 0 always holds a drafter when it runs the exit head; with --draft-tree the head's
    tensors are [n, k] (top k), and items without a grant must pass through untouched."""
    sched, prefill, decode = _scheduler_at_first_decode([1, 2, 1, 2, 1])
    drafter = StageDrafter()
    plain = Item(**{**decode.without_tokens().__dict__, "draft_upto": 0, "draft_cap": 0})
    made, tokens, keys = drafter.drafts([plain], torch.tensor([[3, 4, 5]]), torch.tensor([[0.9, 0.05, 0.01]]))
    assert (made, tokens, keys) == ([], [-1], [-1])
    top1 = _stage_draft(prefill, decode, ExitGuess(3, 0.9))
    drafter = StageDrafter()
    drafter.observe([prefill], torch.tensor(prefill.token_ids), [prefill.without_tokens()])
    drafter.observe([decode], torch.tensor(decode.token_ids), [decode.without_tokens()])
    made, tokens, keys = drafter.drafts([decode.without_tokens()], torch.tensor([[3, 4]]), torch.tensor([[0.9, 0.05]]))
    assert (tokens[0], keys[0]) == top1[1:] and [d.token_ids for d in made] == [top1[0].token_ids]
