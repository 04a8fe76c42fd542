"""Property tests for pipeline.speculation.ledger.SequenceLedger, driven through a simulated FIFO pipeline.

What breaks when these fail: SPEED commits a token that the model did not produce after the true
prefix (a token lost, duplicated or reordered), a squash that leaves items of the old chain live,
a stale result that commits, more items of one sequence in flight than --max-inflight, drafts past
the token budget, or a stage whose KV cache holds a squashed draft's keys under a committed token
(so greedy output with speculation would differ from plain decoding). See [Note: verify] in
pipeline/speculation/ledger.py and [Note: in-band squash] in pipeline/engine/stage_executor.py.

The simulator: `num_stages` stages joined by FIFO queues, each stage a real `StageExecutor` whose
`admit` (epochs + KV truncation) is applied to every item, with the KV *contents* modelled as the
list of tokens written at each position. A history is a random interleaving of: inject a real item
when the sequence has nothing in flight (with probability `firp_prob` carrying FIRP drafts, each
right or wrong, verified as a chain: [Note: chain verify]), propose a draft after an item that passed the exit stage
(right or wrong w.r.t. a fixed true sequence), and advance any one stage by one item (the last
stage delivers the result to the ledger). The model's result for an item is the true next token
only if every position it attended to (KV contents before it, and its own tokens) holds the true
sequence on every stage; otherwise a wrong token, so a ledger bug shows up as a wrong commit.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.engine.stage_executor import StageExecutor
from pipeline.model.kv_cache import KVCache
from pipeline.model.partition import LayerRange
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.ledger import SequenceLedger
from pipeline.speculation.verify import verify_result

VOCAB = 7
MAX_MODEL_LEN = 64
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass
class Travelling:
    """An item on its way through the simulated pipeline."""

    item: Item
    tokens: tuple[int, ...]
    saw_true_context: list[bool] = dataclasses.field(default_factory=list)  # per stage it ran on


@dataclasses.dataclass
class Log:
    """Everything a history did, for the properties to check."""

    commits: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    squashes: list[dict] = dataclasses.field(default_factory=list)
    stale: list[dict] = dataclasses.field(default_factory=list)
    accepts: int = 0
    max_inflight_seen: int = 0
    drafts: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (seq, position)
    finish_leftovers: list[int] = dataclasses.field(default_factory=list)
    draft_queries: list[dict] = dataclasses.field(default_factory=list)
    blind_commits: list[dict] = dataclasses.field(default_factory=list)  # committed results that saw a wrong KV
    admits: list[dict] = dataclasses.field(default_factory=list)
    dropped: list[dict] = dataclasses.field(default_factory=list)


def _accepted(verdict) -> bool:
    """Some draft was checked and none was rejected (the chain goes on)."""
    return verdict.num_verified > 0 and verdict.num_accepted == verdict.num_verified


class AdmitOnlyModel:
    """Stands in for the StageModel: `StageExecutor.admit` touches only epochs and the KV cache
    (a real StageModel, even on the meta device, costs seconds of torch start-up here)."""

    layer_range = LayerRange(0, 1)


def _admit_only_model() -> AdmitOnlyModel:
    return AdmitOnlyModel()


class PipelineSim:
    """Ledgers of `num_seqs` sequences plus a FIFO pipeline of real StageExecutors (admit only)."""

    def __init__(self, *, truths: list[list[int]], prompt_lens: list[int], max_new_tokens: int, num_stages: int,
                 max_inflight: int, exit_stage: int, seed: int) -> None:
        self.truths, self.prompt_lens, self.max_new = truths, prompt_lens, max_new_tokens
        self.num_stages, self.max_inflight, self.exit_stage = num_stages, max_inflight, exit_stage
        self.rng = random.Random(seed)
        self.draft_prob, self.p_right = self.rng.uniform(0.3, 1.0), self.rng.uniform(0.2, 0.9)
        self.firp_prob = 0.0 if self.rng.random() < 0.3 else self.rng.uniform(0.3, 1.0)
        self.firp_k = self.rng.randint(1, 4)
        self.ledgers = [SequenceLedger(prompt_len=n, max_new_tokens=max_new_tokens) for n in prompt_lens]
        self.done = [False] * len(truths)
        self.queues: list[collections.deque[Travelling]] = [collections.deque() for _ in range(num_stages)]
        self.stages = [StageExecutor(_admit_only_model(), KVCache(num_layers=1, max_num_seqs=len(truths),
                                                            max_model_len=MAX_MODEL_LEN, num_kv_heads=1,
                                                            head_dim=1, dtype=torch.float32))
                       for _ in range(num_stages)]
        self.contents = [[[] for _ in truths] for _ in range(num_stages)]  # [stage][seq] tokens per position
        self.exited: list[list[tuple[int, int]]] = [[] for _ in truths]  # (position, epoch) past the exit stage
        self.log = Log()

    # -- actions ----------------------------------------------------------------------------------
    def inject_real(self, seq: int) -> None:
        ledger = self.ledgers[seq]
        if self.done[seq] or ledger.inflight:
            return
        truth, n = self.truths[seq], self.prompt_lens[seq]
        if ledger.num_committed == 0:
            tokens, start, kind = tuple(truth[:n]), 0, ItemKind.PREFILL
            ledger.add_real(tokens[-1])
        else:
            start, kind = ledger.next_real_position, ItemKind.DECODE
            tokens = (truth[start],)  # the last committed token (the log checks commits == truth)
            drafts: tuple[int, ...] = ()
            if self.rng.random() < self.firp_prob:
                num = self.rng.randint(0, min(self.firp_k, ledger.max_firp_drafts()))
                drafts = tuple(truth[start + 1 + i] if self.rng.random() < self.p_right
                               else (truth[start + 1 + i] + 1) % VOCAB for i in range(num))
                self.log.drafts.extend((seq, start + 1 + i) for i in range(num))
                kind = ItemKind.FIRP if drafts else kind
            ledger.add_real(tokens[0], drafts)
            tokens += drafts
        self._enqueue(seq, start, tokens, kind)

    def draft(self, seq: int, pick: int, right: bool) -> None:
        """Ask for a draft after one of the items that passed the exit stage (any of them, stale too)."""
        if self.done[seq] or not self.exited[seq]:
            return
        position, epoch = self.exited[seq][pick % len(self.exited[seq])]
        self._try_draft(seq, position, epoch, right)

    def _try_draft(self, seq: int, position: int, epoch: int, right: bool) -> None:
        ledger = self.ledgers[seq]
        expected = (epoch == ledger.epoch and bool(ledger.inflight) and ledger.inflight[-1].last_position == position
                    and len(ledger.inflight) < self.max_inflight
                    and position + 2 <= self.prompt_lens[seq] + self.max_new - 1)
        allowed = ledger.can_draft_after(position, epoch, max_inflight=self.max_inflight)
        self.log.draft_queries.append({"seq": seq, "position": position, "epoch": epoch, "ledger_epoch": ledger.epoch,
                                       "chain_end": ledger.inflight[-1].last_position if ledger.inflight else None,
                                       "allowed": allowed, "expected": expected})
        if not allowed:
            return
        truth = self.truths[seq][position + 1]
        token = truth if right else (truth + 1) % VOCAB
        ledger.add_draft(token)
        self.log.drafts.append((seq, position + 1))
        self._enqueue(seq, position + 1, (token,), ItemKind.DRAFT)

    def advance(self, stage: int) -> None:
        """Stage `stage` runs the oldest item of its input queue."""
        if not self.queues[stage]:
            return
        t = self.queues[stage].popleft()
        it, seq = t.item, t.item.seq_id
        executor, content = self.stages[stage], self.contents[stage]
        before = executor.kv.lengths[it.slot]
        [keep] = executor.admit([it])
        if not keep:
            self.log.dropped.append({"seq": seq, "epoch": it.epoch, "ledger_epoch": self.ledgers[seq].epoch})
            return
        after = executor.kv.lengths[it.slot]
        executor.kv.check_write(it.slot, it.start, it.num_tokens)  # raises on a gap
        self.log.admits.append({"stage": stage, "seq": seq, "start": it.start, "before": before, "after": after,
                                "kind": it.kind, "epoch": it.epoch})
        seen = content[seq][:it.start]
        t.saw_true_context.append(seen == self.truths[seq][:it.start])
        content[seq] = seen + list(t.tokens)
        executor.kv.set_length(it.slot, it.end)
        if stage == self.exit_stage and it.kind != ItemKind.PREFILL:
            self.exited[seq].append((it.end - 1, it.epoch))
            if self.rng.random() < self.draft_prob and not self.done[seq]:  # the scheduler's on_exit reaction
                self._try_draft(seq, it.end - 1, it.epoch, right=self.rng.random() < self.p_right)
        if stage + 1 < self.num_stages:
            self.queues[stage + 1].append(t)
        else:
            self._deliver(t)

    # -- internals --------------------------------------------------------------------------------
    def _enqueue(self, seq: int, start: int, tokens: tuple[int, ...], kind: ItemKind) -> None:
        ledger = self.ledgers[seq]
        self.log.max_inflight_seen = max(self.log.max_inflight_seen, len(ledger.inflight))
        item = Item(seq_id=seq, slot=seq, start=start, num_tokens=len(tokens), epoch=ledger.epoch, kind=kind,
                    token_ids=tokens)
        self.queues[0].append(Travelling(item, tokens))

    def _deliver(self, t: Travelling) -> None:
        it, seq = t.item, t.item.seq_id
        ledger, truth = self.ledgers[seq], self.truths[seq]
        num_rows = 1 if it.kind == ItemKind.PREFILL else it.num_tokens
        results, exact = [], []
        for row in range(it.num_tokens - num_rows, it.num_tokens):  # one result per row: the model's next token
            end = it.start + row + 1
            exact.append(all(t.saw_true_context) and list(t.tokens[:row + 1]) == truth[it.start:end])
            results.append(truth[end] if exact[-1] else (truth[end] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB)
        if self.done[seq]:
            return  # the sequence finished: the scheduler ignores its results
        epoch_before, committed_before = ledger.epoch, ledger.num_committed
        chain_before = [f.token for f in ledger.inflight]
        drafts = ledger.drafts_to_verify() if ledger.inflight and it.epoch == ledger.epoch else []
        # the one verify rule (greedy): stop after the first mismatch or at the budget
        commit = verify_result(argmax=results, drafts=drafts, logits=None, sampler=None, eos_token_ids=(),
                               ignore_eos=True, budget_left=self.max_new - committed_before)
        verdict = ledger.on_result(it.end - 1, it.epoch, commit)
        if verdict is None:
            self.log.stale.append({"item_epoch": it.epoch, "ledger_epoch": epoch_before,
                                   "committed_before": committed_before, "committed_after": ledger.num_committed})
            return
        if not all(exact[:len(commit)]):
            self.log.blind_commits.append({"seq": seq, "start": it.start, "saw": t.saw_true_context})
        self.log.commits[seq].extend(verdict.tokens)
        if _accepted(verdict):
            self.log.accepts += 1
        if verdict.num_verified and not _accepted(verdict):
            self.log.squashes.append({"epoch_before": epoch_before, "epoch_after": ledger.epoch,
                                      "inflight_after": len(ledger.inflight), "squashed": verdict.squashed,
                                      "chain_len_before": len(chain_before), "draft": drafts[len(commit) - 1],
                                      "real": verdict.tokens[-1]})
        if ledger.num_committed == self.max_new:
            self.done[seq] = True
            self.log.finish_leftovers.append(ledger.finish())

    def run(self, rnd: random.Random, num_steps: int) -> Log:
        """Apply `num_steps` random events, then drain: real items only, until every sequence finished.

        Events: inject a real item (weight 1), ask for a right or wrong draft after any exited item
        (1), advance a stage (4). An item passing the exit stage also asks for a draft after itself
        with probability `draft_prob` (what the scheduler's on_exit does).
        """
        num_seqs = len(self.truths)
        for _ in range(num_steps):
            kind, seq = rnd.randrange(6), rnd.randrange(num_seqs)
            if kind == 0:
                self.inject_real(seq)
            elif kind == 1:
                self.draft(seq, pick=-1 if rnd.random() < 0.7 else rnd.randrange(64), right=rnd.random() < 0.6)
            else:
                self.advance(rnd.randrange(self.num_stages))
        for _ in range(10_000):
            if all(self.done):
                break
            for seq in range(num_seqs):
                self.inject_real(seq)
            for stage in reversed(range(self.num_stages)):
                self.advance(stage)
        assert all(self.done), "the drained pipeline did not finish every sequence"
        return self.log


def make_history(seed: int, *, max_stages: int = 4, max_seqs: int = 2) -> tuple[PipelineSim, random.Random, int]:
    """(simulator, random source, number of events) for one seed: random shape (stages, exit stage,
    sequences, prompt lengths, budget, --max-inflight), true sequences, and the events' source."""
    rng = random.Random(seed)
    num_seqs, num_stages = rng.randint(1, max_seqs), rng.randint(1, max_stages)
    max_new = rng.randint(1, 3) if rng.random() < 0.2 else rng.randint(4, 24)
    prompt_lens = [rng.randint(1, 4) for _ in range(num_seqs)]
    truths = [[rng.randrange(VOCAB) for _ in range(n + max_new + 1)] for n in prompt_lens]
    sim = PipelineSim(truths=truths, prompt_lens=prompt_lens, max_new_tokens=max_new, num_stages=num_stages,
                      max_inflight=rng.randint(1, 5), exit_stage=rng.randrange(num_stages), seed=seed)
    return sim, rng, rng.randint(20, 400)


# Hypothesis draws only the seed: its own random source drifts to trivial histories (no draft ever
# squashed), while a seeded generator gives uniformly random ones; a failure names its seed.
histories = st.integers(0, 2**32).map(make_history)


def _run(history) -> tuple[PipelineSim, Log]:
    sim, rnd, num_steps = history
    return sim, sim.run(rnd, num_steps)


# -- properties over random histories ----------------------------------------------------------------
@PROPERTY_SETTINGS
@given(histories)
def test_committed_tokens_are_exactly_the_true_continuation_none_lost_duplicated_or_reordered(history):
    sim, log = _run(history)
    for seq, truth in enumerate(sim.truths):
        n = sim.prompt_lens[seq]
        assert log.commits[seq] == truth[n:n + sim.max_new], f"seq {seq}: commits differ from the true sequence"
    assert not log.blind_commits, f"a committed result attended to a wrong prefix: {log.blind_commits[:3]}"


@PROPERTY_SETTINGS
@given(histories)
def test_every_squash_empties_the_chain_bumps_the_epoch_and_counts_the_dropped_drafts(history):
    _, log = _run(history)
    for s in log.squashes:
        assert s["draft"] != s["real"], f"squashed although the draft was right: {s}"
        assert s["inflight_after"] == 0, f"squash left in-flight items: {s}"
        assert s["epoch_after"] == s["epoch_before"] + 1, f"squash did not bump the epoch by one: {s}"
        assert s["squashed"] == s["chain_len_before"] - 1, f"squashed count is not the chain behind the head: {s}"


@PROPERTY_SETTINGS
@given(histories)
def test_stale_epoch_results_return_none_and_never_commit(history):
    _, log = _run(history)
    for s in log.stale:
        assert s["item_epoch"] != s["ledger_epoch"], f"a current-epoch result was ignored: {s}"
        assert s["committed_after"] == s["committed_before"], f"a stale result committed: {s}"


@PROPERTY_SETTINGS
@given(histories)
def test_inflight_items_of_a_sequence_never_exceed_max_inflight(history):
    sim, log = _run(history)
    assert log.max_inflight_seen <= sim.max_inflight


@PROPERTY_SETTINGS
@given(histories)
def test_drafts_never_go_past_the_token_budget(history):
    sim, log = _run(history)
    for seq, position in log.drafts:
        last_budget_position = sim.prompt_lens[seq] + sim.max_new - 1  # position of the last budget token
        assert position < last_budget_position, f"draft at {position} but the last budget token is at {last_budget_position}"
    assert log.finish_leftovers == [0] * len(sim.truths), "items still in flight when the budget was reached"


@PROPERTY_SETTINGS
@given(histories)
def test_can_draft_after_is_false_for_stale_epochs_non_end_positions_full_chains_and_the_budget(history):
    _, log = _run(history)
    for q in log.draft_queries:
        assert q["allowed"] == q["expected"], f"can_draft_after disagrees with the rule: {q}"
        if q["epoch"] != q["ledger_epoch"] or q["chain_end"] != q["position"]:
            assert not q["allowed"], f"draft allowed after a stale or non-end item: {q}"


@PROPERTY_SETTINGS
@given(histories)
def test_every_stage_truncates_kv_to_the_item_start_so_committed_results_never_see_squashed_keys(history):
    sim, log = _run(history)
    for a in log.admits:
        assert a["before"] >= a["start"], f"item admitted past the slot's KV length (gap): {a}"
        assert a["after"] == a["start"], f"admit did not truncate the slot to the item's start: {a}"
    assert not log.dropped, f"FIFO channels never need to drop an item: {log.dropped[:3]}"
    assert not log.blind_commits, f"a committed result saw a squashed draft's KV on some stage: {log.blind_commits[:3]}"


def test_squash_reinjection_rolls_every_stage_back_to_the_committed_length():
    """After the corrected item of a squash is admitted, every stage holds exactly the committed
    prefix for the slot (and nothing of the squashed chain)."""
    truth = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    sim = PipelineSim(truths=[truth], prompt_lens=[2], max_new_tokens=6, num_stages=3, max_inflight=3,
                      exit_stage=0, seed=0)
    sim.draft_prob = sim.firp_prob = 0.0  # only the scripted drafts below
    ledger = sim.ledgers[0]
    sim.inject_real(0)
    for stage in range(3):
        sim.advance(stage)  # prefill -> commits truth[2]
    sim.inject_real(0)  # real item at position 2
    sim.advance(0)
    sim.draft(0, pick=0, right=False)  # wrong draft at 3
    sim.advance(0)
    sim.draft(0, pick=-1, right=True)  # draft at 4 (after the wrong one)
    sim.advance(0)
    for stage in (1, 2, 1, 2):
        sim.advance(stage)  # the real item's result: rejects the draft at 3
    assert ledger.epoch == 1 and not ledger.inflight and ledger.num_committed == 2
    committed_len = ledger.known_len - 1  # positions with a committed input token
    sim.inject_real(0)  # corrected item at position 3, epoch 1
    while any(sim.queues):
        for stage in range(3):
            if sim.queues[stage] and sim.queues[stage][0].item.epoch == 1:
                sim.advance(stage)
                admitted = sim.log.admits[-1]
                assert admitted["epoch"] == 1 and admitted["before"] == 5, admitted  # the squashed drafts' KV
                assert admitted["after"] == committed_len, f"stage {stage} did not roll back: {admitted}"
                assert sim.contents[stage][0] == truth[:committed_len + 1], f"stage {stage} kept squashed KV"
            elif sim.queues[stage]:
                sim.advance(stage)
    assert sim.log.commits[0] == truth[2:5]
    assert len(sim.log.stale) == 2


def test_random_histories_really_exercise_squashes_stale_results_accepts_and_refused_drafts():
    """The generator is not vacuous: over seeded histories all the interesting events occur."""
    rng = random.Random(1234)
    totals = collections.Counter()
    for i in range(200):
        num_stages = rng.randint(1, 4)
        n, max_new = rng.randint(1, 4), rng.randint(2, 10)
        truth = [rng.randrange(VOCAB) for _ in range(n + max_new + 1)]
        sim = PipelineSim(truths=[truth], prompt_lens=[n], max_new_tokens=max_new, num_stages=num_stages,
                          max_inflight=rng.randint(1, 5), exit_stage=rng.randrange(num_stages), seed=i)
        log = sim.run(rng, 150)
        assert log.commits[0] == truth[n:n + max_new]
        totals.update(squash=len(log.squashes), stale=len(log.stale), accept=log.accepts,
                      refused=sum(not q["allowed"] for q in log.draft_queries), drafts=len(log.drafts))
    for event in ("squash", "stale", "accept", "refused", "drafts"):
        assert totals[event] >= 20, f"too few {event} events over the seeded histories: {dict(totals)}"


# -- direct checks of the ledger's rules ---------------------------------------------------------------
def test_stale_result_returns_none_and_leaves_the_ledger_unchanged():
    ledger = SequenceLedger(prompt_len=3, max_new_tokens=8)
    ledger.add_real(9)
    assert ledger.on_result(2, 0, 5).tokens == (5,)  # prefill result
    ledger.add_real(5)
    ledger.add_draft(6)
    ledger.add_draft(7)
    verdict = ledger.on_result(3, 0, 4)  # draft 6 was wrong
    assert verdict.num_verified and not _accepted(verdict) and verdict.squashed == 2
    assert ledger.epoch == 1 and not ledger.inflight
    assert ledger.on_result(4, 0, 6) is None and ledger.on_result(5, 0, 1) is None
    assert ledger.num_committed == 2 and ledger.epoch == 1 and not ledger.inflight


def test_accepted_draft_becomes_the_chain_head_and_is_verified_next():
    ledger = SequenceLedger(prompt_len=2, max_new_tokens=8)
    ledger.add_real(1)
    ledger.on_result(1, 0, 3)
    ledger.add_real(3)
    ledger.add_draft(4)
    assert ledger.drafts_to_verify() == [4]
    verdict = ledger.on_result(2, 0, 4)
    assert _accepted(verdict) and verdict.squashed == 0 and ledger.epoch == 0
    assert [f.position for f in ledger.inflight] == [3] and ledger.next_real_position == 3


@pytest.mark.parametrize("epoch_delta, position_delta", [(-1, 0), (1, 0), (0, -1), (0, 1)])
def test_can_draft_after_refuses_stale_epochs_and_positions_other_than_the_chain_end(epoch_delta, position_delta):
    ledger = SequenceLedger(prompt_len=2, max_new_tokens=20)
    ledger.add_real(1)
    ledger.on_result(1, 0, 3)
    ledger.add_real(3)
    ledger.add_draft(9)
    ledger.on_result(2, 0, 4)  # squash: epoch 1
    ledger.add_real(4)
    ledger.add_draft(5)
    end = ledger.inflight[-1].position
    assert ledger.can_draft_after(end, ledger.epoch, max_inflight=4)
    assert not ledger.can_draft_after(end + position_delta, ledger.epoch + epoch_delta, max_inflight=4)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_can_draft_after_stops_exactly_where_the_draft_result_would_pass_the_budget(max_new_tokens):
    n = 3
    ledger = SequenceLedger(prompt_len=n, max_new_tokens=max_new_tokens)
    ledger.add_real(0)
    ledger.on_result(n - 1, 0, 1)
    if max_new_tokens == 1:  # the prefill result was the whole budget: nothing more may be drafted
        assert ledger.num_committed == 1 and not ledger.can_draft_after(n, ledger.epoch, max_inflight=4)
        return
    ledger.add_real(1)
    drafted = 0
    while ledger.can_draft_after(ledger.inflight[-1].position, 0, max_inflight=100):
        ledger.add_draft(1)
        drafted += 1
    # Items at n .. n + max_new - 2 produce the budget tokens 2 .. max_new: one real plus the drafts.
    assert drafted == max_new_tokens - 2
    assert ledger.inflight[-1].position == n + max_new_tokens - 2


# -- FIRP chains ([Note: chain verify]) ---------------------------------------------------------------
def test_chain_commits_the_longest_correct_prefix_plus_one_real_token_and_squashes_the_rest():
    ledger = SequenceLedger(prompt_len=3, max_new_tokens=10)
    ledger.add_real(9)
    ledger.on_result(2, 0, 5)  # prefill
    ledger.add_real(5, (6, 7, 8))  # positions 3..6
    ledger.add_draft(1)  # SPEED run-ahead at 7
    assert ledger.drafts_to_verify() == [6, 7, 8, 1]
    verdict = ledger.on_result(6, 0, (6, 7, 4))  # draft 8 rejected: commit 6, 7 and the real 4
    assert verdict.tokens == (6, 7, 4) and verdict.num_verified == 3 and verdict.num_accepted == 2
    assert verdict.num_verified and not _accepted(verdict) and verdict.squashed == 1
    assert ledger.epoch == 1 and not ledger.inflight and ledger.num_committed == 4
    assert ledger.next_real_position == 6  # the next item starts right after the committed tokens


def test_fully_accepted_chain_keeps_the_run_ahead_item_and_a_wrong_run_ahead_squashes_it():
    ledger = SequenceLedger(prompt_len=2, max_new_tokens=12)
    ledger.add_real(1)
    ledger.on_result(1, 0, 2)
    ledger.add_real(2, (3, 4))
    ledger.add_draft(5)
    verdict = ledger.on_result(4, 0, (3, 4, 5))
    assert _accepted(verdict) and verdict.num_accepted == 3 and verdict.squashed == 0 and ledger.epoch == 0
    assert [f.position for f in ledger.inflight] == [5]
    ledger2 = SequenceLedger(prompt_len=2, max_new_tokens=12)
    ledger2.add_real(1)
    ledger2.on_result(1, 0, 2)
    ledger2.add_real(2, (3,))
    ledger2.add_draft(5)
    verdict = ledger2.on_result(3, 0, (3, 9))  # the chain is right, the run-ahead draft is not
    assert verdict.num_verified == 2 and verdict.num_accepted == 1 and verdict.squashed == 1 and ledger2.epoch == 1


def test_firp_drafts_never_pass_the_budget():
    ledger = SequenceLedger(prompt_len=4, max_new_tokens=5)
    ledger.add_real(0)
    ledger.on_result(3, 0, 1)
    assert ledger.max_firp_drafts() == 3  # positions 5, 6, 7; the item at 7 yields the last budget token
    with pytest.raises(AssertionError, match="budget"):
        ledger.add_real(1, (2, 3, 4, 5))
    ledger.add_real(1, (2, 3, 4))
    assert ledger.inflight[-1].last_position == ledger.last_item_position
