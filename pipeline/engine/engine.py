"""The engine: the one object that drives the scheduler. Events in, sends and commits out.

Owns the `Scheduler` (sequences, ledgers, drafts, verify and commit through it), the micro-batches
in flight (the only copy: the ring is FIFO, so a result answers the oldest; a micro-batch the exit
stage made itself is matched to its announcement instead, in either arrival order: [Note:
stage-local drafting] in pipeline/engine/local_draft.py; a decode item the last stage fed, to the
RESULT that announced it: [Note: self-fed decode] in pipeline/engine/decode_feed.py), the `Timeline` of
what each micro-batch was worth, and the commit log. The coordinator (launcher/coordinator/coordinator.py)
feeds it real events from its channels, the simulator (pipeline/engine/simulator.py) simulated ones, and
the unit-test fakes scripted ones; none of them touches the scheduler.
Pure: no I/O, no threads, no clock (events carry the caller's time).

[Note: one engine]
`step(events)` applies the events in order (submit, abort, stop string, exit passed, result,
replay after a stage restart),
then, as a pipeline driver must, asks for the slots to release (sent first, so a stage frees a
slot before the slot's next owner arrives) and for as many micro-batches as the scheduler allows.
Every driver therefore sends the same items in the same order for the same events: a recorded
event trace gives the same commits whoever replays it (tests/unit/test_engine.py).

[Note: replay]
When a stage is restarted (launcher/coordinator/stage_failover.py) every stage's KV cache is empty and the
micro-batches in flight are lost. `Scheduler.replay_running` bumps each running sequence's epoch (results
of the old ring, if any arrive, are stale), forgets its chain, pending draft and FIRP drafts, and
queues one PREFILL of prompt + committed tokens in the sequence's own KV slot: its result row is
the next token, exactly the item that would have followed the last commit. Committed tokens are
never touched, so no token is lost, repeated or reordered (tests/unit/test_replay.py). Greedy
output is therefore identical to an undisturbed run (up to the batch-invariance caveat of
ARCHITECTURE.md §3: the context's keys and values are recomputed in one pass). Sampling: the
sequence's Sampler (its generator) is kept as it is, so the next draw continues its stream; with
speculation off that is the draw an undisturbed run makes (same tokens for a seeded request),
with speculation on the draws differ but every token keeps the exact distribution (§5.4).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from pipeline.engine import decode_feed
from pipeline.engine.events import (
    Abort,
    Event,
    ExitPassed,
    ReplayRunning,
    Result,
    StepOutput,
    StopStringHit,
    Submit,
    Withdrawn,
)
from pipeline.engine.records import Commit, MicroBatch, SchedulerConfig, SpecCounters
from pipeline.engine.scheduler import Scheduler
from pipeline.measure.row_cost import RowCostTable
from pipeline.measure.timeline import Timeline
from pipeline.speculation.grammar import GrammarVocab
from pipeline.speculation.items import Item
from pipeline.speculation.predictors import Predictor
from pipeline.speculation.tree import TreeCounters

CommitSink = Callable[[Commit], bool]


class Engine:
    """See [Note: one engine]. Raises ValueError for a bad Submit (empty or too long prompt, id in
    use) and RuntimeError for a Result with nothing in flight.

    config / predictor: the scheduler's (predictor needed when config.speculate).
    record_timeline: keep per-stage slices of every micro-batch (max_slices of them).
    commit_sink: called with each commit as it is made; returns True when the commit completed a
        stop string, and the engine then finishes the sequence before it sends anything more.
    max_commits: length of the commit log (None: unbounded).
    grammar_vocab: the tokenizer of structured outputs (needed to submit a `SamplingParams.grammar`).
    """

    def __init__(self, config: SchedulerConfig, predictor: Predictor | None = None, *,
                 record_timeline: bool = True, max_slices: int = 200_000,
                 commit_sink: CommitSink | None = None, max_commits: int | None = 1_000_000,
                 grammar_vocab: GrammarVocab | None = None) -> None:
        self._scheduler = Scheduler(config, predictor, grammar_vocab=grammar_vocab)
        self._inflight: collections.deque[MicroBatch] = collections.deque()
        self.record_timeline = record_timeline
        self.timeline = Timeline(config.num_stages, max_slices=max_slices)
        self.commit_sink = commit_sink
        self.commit_log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=max_commits)
        # micro-batches the exit stage made ([Note: stage-local drafting] in pipeline/engine/local_draft.py):
        # announced and unanswered (item keys -> when announced), and results that came first
        self._local: dict[frozenset[tuple[int, int, int]], int] = {}
        self._early: list[Result] = []
        self._fed: set[frozenset[tuple[int, int, int]]] = set()  # of `_local`, those the last stage fed ([Note: self-fed decode])

    # -- the interface ------------------------------------------------------------------------------
    def step(self, events: Iterable[Event] = (), now_ns: int = 0) -> StepOutput:
        """Apply `events` in order, then release and send what the scheduler allows.
        now_ns: the caller's clock when it sends (marks when a pending draft was taken)."""
        commits: list[Commit] = []
        forgotten: list[int] = []
        for event in events:
            self._apply(event, commits, forgotten)
        releases = self._scheduler.take_releases()
        for release in releases:
            self._scheduler.pop(release.seq_id)
            forgotten.append(release.seq_id)
        sends: list[tuple[Item, ...]] = []
        while (batch := self._scheduler.next_batch(now_ns, num_inflight=self._live_inflight())) is not None:
            self._inflight.append(batch)
            sends.append(batch.items)
        credits, self._scheduler.credits = self._scheduler.credits, []
        return StepOutput(sends=sends, commits=commits, releases=releases, forgotten=forgotten, credits=credits)

    def use_row_costs(self, table: RowCostTable) -> None:
        """Price rows with `table` from now on: FIRP chains and the run-ahead depth follow it (a
        start-up calibration, `--row-cost calibrate`, arrives after the engine exists; call it
        before the first Submit); so do the token tree's sibling rows ([Note: token trees])."""
        self._scheduler.rows.use_table(table)
        self._scheduler.tree.row_costs = table

    @property
    def spec(self) -> SpecCounters:
        """Speculation totals since the last `reset_stats` (read-only use)."""
        return self._scheduler.spec

    @property
    def tree(self) -> TreeCounters:
        """Token-tree totals ([Note: token trees] in pipeline/speculation/tree.py; read-only use)."""
        return self._scheduler.tree.counters

    @property
    def num_inflight(self) -> int:
        """Micro-batches in flight: sent, or made and announced by the exit stage, without a result."""
        return len(self._inflight) + len(self._local)

    def _live_inflight(self) -> int:
        """Micro-batches in flight that fill the pipeline: every one the coordinator sent, and each
        the exit stage made that still holds a current item. A self-made one whose every item a
        squash made stale (an older epoch, or a finished sequence) will be withdrawn or dropped, so
        it does not hold back the real item the squash queued; counted, it made that item wait for
        the stale results and the withdrawal never came ([Note: stage-local drafting] 6). A fed
        decode item never counts ([Note: self-fed decode] 4)."""
        seqs = self._scheduler.seqs

        def live(keys) -> bool:
            return any((s := seqs.get(seq_id)) is not None and not s.finished and s.epoch == epoch
                       for seq_id, _, epoch in keys)
        return len(self._inflight) + sum(live(keys) for keys in self._local if keys not in self._fed)

    @property
    def num_fed(self) -> int:
        """Fed micro-batches in flight: they do not fill the pipeline, so a new request is sent at
        once and its message ends stage 0's chain ([Note: self-fed decode] 4 in pipeline/engine/decode_feed.py)."""
        return len(self._fed)

    @property
    def num_sequences(self) -> int:
        """Sequences the engine still tracks (running, waiting, or finished but not yet released)."""
        return len(self._scheduler.seqs)

    @property
    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler, for white-box inspection in tests. Drive it only through `step`."""
        return self._scheduler

    def window_buffers(self, max_entries: int) -> None:
        """Keep only the latest `max_entries` commits, timeline slices and draft gaps (a long-running
        server's buffers are windows; counters and totals stay exact). Call while idle."""
        self.commit_log = collections.deque(self.commit_log, maxlen=max_entries)
        self.timeline.slices = collections.deque(self.timeline.slices, maxlen=max_entries)
        self.timeline.draft_gaps_ns = collections.deque(self.timeline.draft_gaps_ns, maxlen=max_entries)

    def reset_stats(self) -> None:
        """Zero the speculation counters, the timeline and the commit log (call while idle)."""
        self._scheduler.spec = SpecCounters()
        self._scheduler.tree.counters = TreeCounters()
        self.timeline.reset()
        self.commit_log.clear()

    # -- events -----------------------------------------------------------------------------------
    def _apply(self, event: Event, commits: list[Commit], forgotten: list[int]) -> None:
        sched = self._scheduler
        if isinstance(event, Result):
            self._on_result(event, commits)
        elif isinstance(event, ExitPassed):
            sched.on_exit(event.items, event.guesses, event.at_ns, event.self_drafts)
            if any(token >= 0 for token, _ in event.self_drafts):
                self._announce(event, commits)
        elif isinstance(event, Withdrawn):
            self._withdraw(event)
        elif isinstance(event, Submit):
            sched.add(event.seq_id, event.prompt_ids, event.params)
        elif isinstance(event, Abort):
            seq = sched.seqs.get(event.seq_id)
            if seq is None or seq.finished:
                return  # unknown, or finished already (its release is on its way)
            admitted = seq.slot >= 0
            sched.abort(event.seq_id)
            if not admitted:  # never held a slot: nothing to release, forget it now
                sched.pop(event.seq_id)
                forgotten.append(event.seq_id)
        elif isinstance(event, StopStringHit):
            sched.finish_on_stop_string(event.seq_id)
        elif isinstance(event, ReplayRunning):
            self._inflight.clear()  # their results will never come: the old ring is gone
            self._local.clear()
            self._early.clear()
            self._fed.clear()
            sched.replay_running()
        else:
            raise TypeError(f"unknown engine event {event!r}")

    def _announce(self, event: ExitPassed, commits: list[Commit]) -> None:
        """The exit stage made a micro-batch of the drafts in `event.self_drafts`: count it in
        flight until its result, or apply its result now if that came first."""
        keys = frozenset((it.seq_id, it.end, it.epoch) for it, (token, _) in zip(event.items, event.self_drafts,
                                                                                 strict=True) if token >= 0)
        early = next((r for r in self._early if _keys(r) == keys), None)
        if early is None:
            self._local[keys] = event.at_ns
            return
        self._early.remove(early)
        self._apply_result(MicroBatch(items=early.items, drafts_ready_ns=event.at_ns), early, commits)

    def _withdraw(self, event: Withdrawn) -> None:
        """The exit stage stopped a micro-batch it made (its announcement came first: both travel
        on the exit stage's channel, in order): nothing of it is in flight any more. Its drafts are
        stale, so the scheduler has dropped them already; the stage time it took is wasted."""
        keys = frozenset((it.seq_id, it.start, it.epoch) for it in event.items)
        ready_ns = self._local.pop(keys, None)
        if ready_ns is None:
            return  # a replay forgot it already (ReplayRunning clears every announced micro-batch)
        if keys in self._fed:
            self._fed.discard(keys)
            self._scheduler.spec.fed_withdrawn += len(event.items)
        else:
            self._scheduler.spec.withdrawn_drafts += len(event.items)
        if self.record_timeline and event.timing:  # its wait before starting counts in draft_gap too
            self.timeline.record(event.timing, event.items, 0.0, ready_ns, committed=[False] * len(event.items))

    def _on_result(self, event: Result, commits: list[Commit]) -> None:
        if event.items and event.items[0].self_made:  # a micro-batch the exit stage made
            keys = _keys(event)
            ready_ns = self._local.pop(keys, None)
            if ready_ns is None:
                self._early.append(event)  # before its announcement: wait for it
            elif keys in self._fed:  # no draft: no draft gap either
                self._fed.discard(keys)
                self._apply_result(MicroBatch(items=event.items), event, commits)
            else:
                self._apply_result(MicroBatch(items=event.items, drafts_ready_ns=ready_ns), event, commits)
            return
        if not self._inflight:
            raise RuntimeError("a result arrived with no micro-batch in flight")
        self._apply_result(self._inflight.popleft(), event, commits)

    def _apply_result(self, batch: MicroBatch, event: Result, commits: list[Commit]) -> None:
        new = self._scheduler.on_result(event.items, event.token_ids, event.logits, event.at_ns,
                                        firp_tokens=event.firp_tokens, firp_probs=event.firp_probs,
                                        prompt_logprobs=event.prompt_logprobs)
        self.commit_log.extend((event.at_ns, c.seq_id, t) for c in new for t in c.token_ids)
        if self.record_timeline:
            self._record(batch, event, {c.seq_id for c in new})
        for commit in new:
            commits.append(commit)
            if self.commit_sink is not None and self.commit_sink(commit):
                self._scheduler.finish_on_stop_string(commit.seq_id)
        if any(event.fed):
            self._register_fed(event)

    def _register_fed(self, event: Result) -> None:
        """The last stage fed a decode item after the items of `event` marked `fed` (applied already): count
        that micro-batch in flight until its result or withdrawal, and record its items in their
        ledgers where their sequences go on ([Note: self-fed decode] 3 in pipeline/engine/decode_feed.py)."""
        sched, tokens = self._scheduler, decode_feed.result_tokens(event.items, event.token_ids)
        fed = [(it, t) for it, t, f in zip(event.items, tokens, event.fed, strict=True) if f]
        keys = frozenset((it.seq_id, it.end, it.epoch) for it, _ in fed)
        self._local[keys] = event.at_ns
        self._fed.add(keys)
        for it, token in fed:
            decode_feed.register(sched.spec, sched.ready, sched.seqs.get(it.seq_id), it, token)

    def _record(self, batch: MicroBatch, event: Result, committed_seqs: set[int]) -> None:
        """Add the micro-batch to the timeline: an item's work was useful iff it ran on every stage
        and its sequence committed from this result."""
        sent = batch.items
        ran = {(it.seq_id, it.start, it.epoch) for it in event.items}
        committed = [it.seq_id in committed_seqs and (it.seq_id, it.start, it.epoch) in ran for it in sent]
        self.timeline.record(event.timing, sent, sum(committed) / len(sent) if sent else 0.0,
                             batch.drafts_ready_ns, committed=committed)


def _keys(result: Result) -> frozenset[tuple[int, int, int]]:
    """(seq_id, start, epoch) of a result's items: a self-made micro-batch's identity."""
    return frozenset((it.seq_id, it.start, it.epoch) for it in result.items)
