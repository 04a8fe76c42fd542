"""Scheduler: which items enter stage 0 next, and what the last stage's results commit.

Owns every sequence's state (prompt, committed tokens, KV slot, epoch, finish reason), admission
into KV slots, micro-batch formation, and turning results into committed tokens. Pure, and driven
only by `pipeline.engine.engine.Engine` (the coordinator's, the simulator's and the test fakes'),
which owns the micro-batches in flight. Must not: do I/O, know about ranks or tokenizers, or read
a clock (callers pass `now_ns`, real or simulated, used only for overhead measurements).

[Note: micro-batching]
With S stages, at most `max_inflight_batches` (default S) micro-batches are in the pipeline at
once. Sequences whose last item came back are "ready"; each new micro-batch takes
ceil(ready / free micro-batch slots) of them, so M sequences settle into S interleaved groups and every stage
has work whenever M >= S (utilisation min(M, S) / S, ARCHITECTURE.md §5). Prefills join the same
micro-batches as decodes (packed rows, no padding). A micro-batch holds at most one item per sequence.

[Note: speculation policy]
With `speculate=True` (SPEED, ARCHITECTURE.md §5) a sequence may get a pending *draft* item right
after the end of its in-flight chain (pipeline/speculation/ledger.py decides whether one is allowed: chain end,
epoch, per-sequence cap `max_inflight`, token budget; never after a prefill). Predictors that need
an exit head propose when the chain end passes the exit layer (an exit event); the others (ngram)
propose as soon as the chain end is sent, so stage 0 finds the draft queued behind it. A proposal
refused for lack of room is retried when a result frees room. Real items always go first: drafts
are sent only when no real item waits and fewer than `max_inflight_batches` micro-batches are in
flight, so drafts fill only the stage slots that real work leaves idle. A proposal whose expected
acceptance is below break-even is not sent (see [Note: adaptive drafting] in pipeline/speculation/draft_gate.py);
nor is anything new under load ([Note: speculation under load] in pipeline/engine/row_budget.py).

Token trees (sibling candidates, rescues): [Note: token trees] in pipeline/speculation/tree.py.
Exit-head skipping and FIRP chain lengths: [Note: exit-head skipping] and [Note: row-cost-driven
chains] in pipeline/engine/row_budget.py. FIRP chains: [Note: FIRP policy] in pipeline/speculation/firp.py.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import torch

from pipeline.engine import decode_feed, local_draft, row_budget
from pipeline.engine.events import item_rows
from pipeline.engine.grammar_drafts import GrammarDrafts
from pipeline.engine.records import (
    NON_FINITE_TOKEN,
    Commit,
    FinishReason,
    MicroBatch,
    SchedulerConfig,
    SequenceState,
    SpecCounters,
)
from pipeline.engine.row_budget import RowBudget, next_firp_drafts, speculation_paused, wants_exit
from pipeline.speculation.draft_gate import DraftGate
from pipeline.speculation.grammar import GrammarError, GrammarState, GrammarVocab
from pipeline.speculation.items import Item, ItemKind, SlotRelease
from pipeline.speculation.ledger import SequenceLedger
from pipeline.speculation.logprobs import prompt_token_logprobs, token_logprob
from pipeline.speculation.predictors import ExitGuess, Predictor
from pipeline.speculation.sampling import Sampler, SamplingParams
from pipeline.speculation.tree import TokenTree
from pipeline.speculation.verify import verify_result


class Scheduler:
    """Admission, micro-batching, speculation and commit. See [Note: micro-batching] and
    [Note: speculation policy]."""

    def __init__(self, config: SchedulerConfig, predictor: Predictor | None = None, *,
                 grammar_vocab: GrammarVocab | None = None) -> None:
        """grammar_vocab: the tokenizer that constrained requests' grammars use (`SamplingParams.grammar`)."""
        if config.speculate and predictor is None:
            raise ValueError("speculation needs a predictor")
        self.config, self.predictor, self.grammar_vocab = config, predictor, grammar_vocab
        self.seqs: dict[int, SequenceState] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.ready: collections.deque[int] = collections.deque()  # sequences with a pending real item
        self.drafting: collections.deque[int] = collections.deque()  # sequences with a pending draft
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.to_release: list[SlotRelease] = []  # slots to free on every stage
        self.credits: list[Item] = []  # CREDITs for the exit stage ([Note: stage-local drafting])
        self.spec = SpecCounters()
        self.gate = DraftGate(min_acceptance=config.min_acceptance)
        self.grammar_drafts = GrammarDrafts.of(config)  # [Note: grammar-aware drafting]
        self.rows = RowBudget(max_firp_k=config.firp_k, row_costs=config.row_costs,
                              pseudo_weight=config.firp_pseudo_weight)  # [Note: row-cost-driven chains]
        self.tree = TokenTree(width=config.draft_tree, num_stages=config.num_stages,  # [Note: token trees]
                              max_inflight=config.max_inflight, row_costs=config.row_costs)

    # -- requests ---------------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> SequenceState:
        """Queue a new sequence whose length the front end checked (`check_prompt_length` in
        pipeline/run_config.py). Raises ValueError for a sequence id already in use, or a grammar
        without the engine's `grammar_vocab`."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence id {seq_id} is already in use")
        if params.grammar is not None and self.grammar_vocab is None:
            raise ValueError("this engine has no tokenizer for structured outputs (grammar_vocab)")
        assert 0 < len(prompt_ids) and len(prompt_ids) + params.max_new_tokens <= self.config.max_model_len, (
            len(prompt_ids), params.max_new_tokens, self.config.max_model_len)
        seq = SequenceState(seq_id=seq_id, prompt_ids=list(prompt_ids), params=params, sampler=Sampler(params),
                            ledger=SequenceLedger(prompt_len=len(prompt_ids), max_new_tokens=params.max_new_tokens),
                            grammar=params.grammar and GrammarState(params.grammar, self.grammar_vocab))
        self.seqs[seq_id] = seq
        self.waiting.append(seq_id)
        return seq

    def abort(self, seq_id: int) -> None:
        """Finish a sequence early (client gone); its slot is released on every stage."""
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.ABORTED)

    def finish_on_stop_string(self, seq_id: int) -> None:
        """The coordinator found a stop string in the detokenised output."""
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.STOP)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.seqs.values() if s.slot >= 0 and not s.finished)

    @property
    def paused(self) -> bool:
        """Speculation is paused by load ([Note: speculation under load] in pipeline/engine/row_budget.py)."""
        return speculation_paused(self.config, num_running=self.num_running)

    @property
    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.seqs.values())

    # -- micro-batches ----------------------------------------------------------------------------
    def next_batch(self, now_ns: int = 0, *, num_inflight: int) -> MicroBatch | None:
        """The next micro-batch to send to stage 0, or None if the pipeline is full or idle.
        num_inflight: micro-batches in flight now (the engine's count); now_ns: the caller's clock
        (real or simulated), used only for the overhead measurements."""
        if num_inflight >= self.config.max_inflight_batches:
            return None
        self._admit_waiting()
        # Spread the ready sequences over the free micro-batch slots (5 sequences on 4 stages ->
        # 2,1,1,1), so every stage has work whenever sequences >= stages.
        free = self.config.max_inflight_batches - num_inflight
        size = max(1, math.ceil(len(self.ready) / free))
        ready_ns: list[int] = []
        paused = self.paused  # (drafts already queued wait too)
        batch = (self._take(self.ready, size, now_ns, ready_ns)
                 or (not paused and self._take(self.drafting, self.config.max_num_seqs, now_ns, ready_ns)))
        if not batch:
            return None
        self.spec.spec_disabled_steps += paused and (self.config.speculate or self.config.firp_k > 0)
        return MicroBatch(items=tuple(batch), drafts_ready_ns=max(ready_ns) if len(ready_ns) == len(batch) else None)

    def _take(self, queue: collections.deque[int], size: int, now_ns: int, ready_ns: list[int]) -> list[Item]:
        """Pop up to `size` pending items off `queue`; appends each draft's ready time to ready_ns."""
        batch: list[Item] = []
        paused = self.paused  # real items queued before the load rose go without FIRP rows ([Note: speculation under load])
        pipeline_full = paused or self.num_running >= self.config.max_inflight_batches  # [Note: exit-head skipping]
        while queue and len(batch) < size:
            seq = self.seqs.get(queue.popleft())
            if seq is None or seq.finished or seq.pending is None:
                continue
            item, seq.pending = row_budget.without_speculation(seq.pending, jump=seq.pending_jump) if paused else seq.pending, None
            seq.record_sent(item, self.spec)  # the ledger's chain end and the draft counters
            if item.kind == ItemKind.DRAFT:
                ready_ns.append(seq.pending_ready_ns)
            self.grammar_drafts.count_sent(seq, item, self.spec)  # forced drafts and jump rows, as sent
            want = self._wants_exit(seq, item, pipeline_full=pipeline_full)  # (item: now the chain's end)
            item = dataclasses.replace(item, want_exit=want, exit_top_k=self.tree.exit_top_k(want))
            item = local_draft.authorise(self.config, self.predictor, self.gate, seq, item, pipeline_full=pipeline_full,
                                         depth=self.rows.run_ahead(self.config, self.spec, shared_rows=self.num_running - 1, explore=False))
            batch.append(decode_feed.authorise(self.config, seq, item, alone=self.num_running == 1 and not self.waiting))
        for item in batch:  # after the batch is formed: one item per sequence per micro-batch
            self._try_draft(self.seqs[item.seq_id], now_ns)  # predictors without an exit head draft at send time
        return batch

    def _wants_exit(self, seq: SequenceState, item: Item, *, pipeline_full: bool) -> bool:
        """[Note: exit-head skipping] in pipeline/engine/row_budget.py (the grammar's case: `skips_exit_head`)."""
        return (wants_exit(self.config, self.predictor, seq, item, pipeline_full=pipeline_full)
                and not self.grammar_drafts.skips_exit_head(seq))

    def _admit_waiting(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.seqs.get(self.waiting.popleft())
            if seq is None or seq.finished:
                continue
            seq.slot = self.free_slots.pop()
            self._queue_real(seq)

    def _queue_real(self, seq: SequenceState) -> None:
        if not seq.output_ids:
            self._queue_prefill(seq)
            return
        # FIRP drafts, cut at the first the grammar forbids, or a forced run ([Note: grammar-aware drafting])
        firp = () if self.paused else seq.firp_drafts  # ([Note: speculation under load])
        drafts, seq.pending_jump = self.grammar_drafts.real_rows(seq, firp, self.spec, row_costs=self.rows.row_costs)
        start = seq.num_tokens - 1
        seq.pending = Item(seq_id=seq.seq_id, slot=seq.slot, start=start, num_tokens=1 + len(drafts), epoch=seq.epoch,
                           kind=ItemKind.FIRP if drafts else ItemKind.DECODE, token_ids=(seq.output_ids[-1], *drafts),
                           want_logits=seq.wants_logits(start), keep_sibling=self.tree.fixups.pop(seq.seq_id, -1),
                           **self._firp_fields(seq, first_anchor=start + len(drafts) * seq.pending_jump,  # (a sure
                                               num_anchors=1 if seq.pending_jump else 1 + len(drafts)))  # run: its end)
        seq.firp_drafts = ()
        self.ready.append(seq.seq_id)

    def _queue_prefill(self, seq: SequenceState) -> None:
        """Queue one prefill of the sequence's whole known context (prompt + committed tokens): the
        prompt at admission, the replayed context after a stage restart ([Note: replay] in pipeline/engine/engine.py)."""
        context = (*seq.prompt_ids, *seq.output_ids)
        n = len(context)
        # prompt logprobs (echo) once, at admission; a replayed prefill only needs its last row
        prompt_logits = seq.params.prompt_logprobs is not None and not seq.output_ids
        seq.pending = Item(seq_id=seq.seq_id, slot=seq.slot, start=0, num_tokens=n, epoch=seq.epoch,
                           kind=ItemKind.PREFILL, token_ids=context,
                           want_logits=seq.wants_logits(n - 1) or prompt_logits, want_prompt_logits=prompt_logits,
                           **self._firp_fields(seq, first_anchor=n - 1, num_anchors=1))
        seq.firp_drafts = ()
        self.ready.append(seq.seq_id)

    def replay_running(self) -> None:
        """Every stage lost its KV cache and the work in flight: turn each running sequence back
        into one prefill of its committed context, under a new epoch. See [Note: replay] in pipeline/engine/engine.py."""
        self.ready.clear()
        self.drafting.clear()
        for seq in self.seqs.values():
            if seq.finished or seq.slot < 0:
                continue  # finished (its release is harmless on a cleared stage) or still waiting
            self.spec.squashed_items += seq.ledger.finish()  # drop the chain, bump the epoch
            self.tree.forget(seq.seq_id)
            seq.pending, seq.exit_seen, seq.pending_key = None, None, None
            self._queue_prefill(seq)

    def _firp_fields(self, seq: SequenceState, *, first_anchor: int, num_anchors: int) -> dict[str, int]:
        """Item.firp_k / firp_anchors (pipeline/engine/row_budget.py chooses the chain length; none under load)."""
        return {} if self.paused else self.rows.firp_fields(
            last_item_position=seq.ledger.last_item_position, first_anchor=first_anchor, num_anchors=num_anchors)

    # -- exit-layer events (speculation) ------------------------------------------------------------
    def on_exit(self, items: Sequence[Item], guesses: Sequence[ExitGuess | None], now_ns: int = 0,
                self_drafts: Sequence[tuple[int, int]] = ()) -> None:
        """Items passed the exit layer: propose a draft after each chain end (see
        [Note: speculation policy]). guesses: the exit head's output per item (None if no head);
        now_ns: when they passed it (caller's clock); self_drafts: per item, (token, gate key code) of
        the draft the exit stage made after it, token -1 for none ([Note: stage-local drafting])."""
        if not self.config.speculate:
            return
        if self.predictor.needs_exit_head:
            wanted = sum(it.wants_exit_guess for it in items)
            self.spec.exit_rows += wanted
            self.spec.exit_rows_skipped += sum(it.may_precede_draft for it in items) - wanted
        for i, (item, guess) in enumerate(zip(items, guesses, strict=True)):
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq.finished:
                continue
            seq.exit_seen = (item.end - 1, item.epoch, guess)
            if self_drafts and self_drafts[i][0] >= 0:
                local_draft.register(self.config, self.gate, self.spec, seq, item, *self_drafts[i])
                continue
            self._try_draft(seq, now_ns)

    def _try_draft(self, seq: SequenceState, now_ns: int) -> None:
        """Queue a draft after the sequence's chain end if the ledger allows one and the chain end
        has passed the exit layer (or the predictor needs no exit head). Called on exit events,
        after sends, and when a result frees room in the chain, so a refused draft is retried."""
        if (not self.config.speculate or seq.finished or seq.pending is not None or not seq.ledger.inflight
                or seq.seq_id in self.tree.rescues or self.paused):  # nothing follows a rescued sibling ([Note: token trees])
            return
        end = seq.ledger.inflight[-1]
        if end.position < seq.ledger.prompt_len:  # the first token after prefill is never drafted
            return
        guess, forced = None, self.grammar_drafts.forced(seq)  # a forced token needs no exit head's guess
        if self.predictor.needs_exit_head and forced is None:
            if seq.exit_seen is None or seq.exit_seen[:2] != (end.last_position, end.epoch):
                return
            guess = seq.exit_seen[2]
        depth = self.rows.run_ahead(self.config, self.spec, shared_rows=self.num_running - 1)  # row_budget.py
        if not seq.ledger.can_draft_after(end.last_position, end.epoch, max_inflight=depth):
            return
        draft = self.grammar_drafts.draft(seq, self.predictor, guess, forced, self.spec)  # the predictor's, steered
        if draft is None:
            return
        if not self.gate.allow(draft):  # see [Note: adaptive drafting] in pipeline/speculation/draft_gate.py
            self.spec.gated_drafts += 1
            return
        seq.pending_key = self.gate.key(draft)
        run = self.grammar_drafts.run(seq, draft, limit=seq.ledger.last_item_position - end.last_position,  # jump-forward
                                      row_costs=self.rows.row_costs)
        start = end.last_position + 1
        firp = self._firp_fields(seq, first_anchor=start + len(run) - 1, num_anchors=1)
        tree = self.tree.draft_fields(self.grammar_drafts.filtered(seq, self.predictor), seq.context(), guess, draft, start=start,
                                      chain=seq.ledger.inflight, has_firp=bool(firp.get("firp_k")) or len(run) > 1)
        seq.pending = Item(seq_id=seq.seq_id, slot=seq.slot, start=start, num_tokens=len(run), epoch=end.epoch,
                           kind=ItemKind.DRAFT, token_ids=run, want_logits=seq.wants_logits(start), **firp, **tree)
        seq.pending_ready_ns = now_ns
        self.drafting.append(seq.seq_id)

    # -- results ----------------------------------------------------------------------------------
    def on_result(self, returned: Sequence[Item], token_ids: torch.Tensor, logits: torch.Tensor | None,
                  now_ns: int = 0, *, firp_tokens: torch.Tensor | None = None,
                  firp_probs: torch.Tensor | None = None, prompt_logprobs=None) -> list[Commit]:
        """Verify and commit the last stage's output for one micro-batch (see [Note: verify] and
        [Note: chain verify]).

        returned: the items of the micro-batch that ran on every stage (a subset, in order); token_ids: [sum of returned items' num_result_rows] argmax of each result row;
        logits: [`num_result_rows` of returned items with want_logits, vocab] float32 in item order;
        firp_tokens: [sum of returned items' num_pseudo] FIRP drafts (pseudo-row argmax), or None;
        firp_probs: the same shape, each draft's probability (None: no confidence cut);
        prompt_logprobs: `Result.prompt_logprobs` (-> `Commit.prompt_logprobs`). Results of finished
        sequences or older epochs are ignored.
        """
        commits = []
        for item, argmax, rows, firp, probs, prompt in item_rows(returned, token_ids, logits, firp_tokens=firp_tokens,
                                                                 firp_probs=firp_probs, prompt_logprobs=prompt_logprobs):
            if firp and probs is not None and self.config.firp_min_prob > 0:
                firp = [t if p >= self.config.firp_min_prob else None for t, p in zip(firp, probs.tolist(), strict=True)]
            seq = self.seqs.get(item.seq_id)
            item, argmax, rows = self.tree.result_rows(seq, item, argmax, rows)  # [Note: token trees]
            if seq is None or seq.finished or item.epoch != seq.epoch:
                continue
            commit = self._verify_and_commit(seq, item, argmax, rows, firp, now_ns)
            if item.want_prompt_logits:  # (a one-token prompt has no prompt row: prompt is None)
                commit = dataclasses.replace(commit, prompt_logprobs=prompt_token_logprobs(
                    seq.prompt_ids, prompt, seq.params.prompt_logprobs or 0))
            commits.append(commit)
        return commits

    def _verify_and_commit(self, seq: SequenceState, item: Item, argmax: list[int], rows: torch.Tensor | None,
                           firp: list[int], now_ns: int) -> Commit:
        head = seq.ledger.inflight[0]  # its drafts: FIRP's, or a forced run's (`InFlight.jump`)
        try:
            tokens = verify_result(argmax=argmax, drafts=seq.ledger.drafts_to_verify(), logits=rows, sampler=seq.sampler,
                                   eos_token_ids=self.config.eos_token_ids, ignore_eos=seq.params.ignore_eos,
                                   budget_left=seq.params.max_new_tokens - len(seq.output_ids),
                                   prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, grammar=seq.grammar)
        except GrammarError as err:  # the request fails rather than going on unconstrained
            seq.output_ids.extend(err.tokens)
            self._finish(seq, FinishReason.ERROR)
            return Commit(seq.seq_id, err.tokens, FinishReason.ERROR, error=str(err), error_fields=err.fields)
        logprobs = None
        if seq.params.logprobs is not None:  # [Note: logprobs and penalties] in pipeline/speculation/logprobs.py
            logprobs = tuple(token_logprob(rows[i], t, seq.params.logprobs) for i, t in enumerate(tokens)
                             if t != NON_FINITE_TOKEN)
        if tokens[-1] == NON_FINITE_TOKEN:  # [Note: non-finite logits] in pipeline/engine/records.py
            seq.output_ids.extend(tokens[:-1])
            self._finish(seq, FinishReason.ERROR)
            return Commit(seq.seq_id, tuple(tokens[:-1]), FinishReason.ERROR, logprobs=logprobs)
        self.gate.record_run_ahead(seq.ledger.inflight, item, tokens)
        rescue = self.tree.rescue_for(seq, item, tokens, eos_token_ids=self.config.eos_token_ids)
        verdict = seq.ledger.on_result(item.end - 1, item.epoch, tokens)
        local_draft.guard_unannounced(seq, item)
        firp_verified, firp_accepted = self.spec.add_pass(verdict, own_drafts=len(head.drafts), jump=head.jump)
        if firp_verified:  # RowBudget's depth table: FIRP chains only
            self.rows.record(verified=firp_verified, accepted=firp_accepted)
        if not seq.ledger.inflight:  # a pending draft followed the finished (or squashed) chain
            seq.pending, seq.firp_drafts = None, next_firp_drafts(item, len(tokens), firp)
        seq.output_ids.extend(tokens)
        if (reason := seq.finish_reason_at(tokens[-1], self.config.eos_token_ids, primary_eos=self.config.primary_eos)):
            self._finish(seq, reason)  # EOS, or a stop token id
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif rescue is not None:
            self.tree.hold(seq, rescue)  # the draft item lives on as the real one ([Note: token trees])
        elif not seq.ledger.inflight:
            self._queue_real(seq)
        elif not self.paused:
            self._try_draft(seq, now_ns)  # the accepted chain has room again
            self.credits += local_draft.credit(self.config, self.gate, seq, depth=self.rows.run_ahead(self.config, self.spec, shared_rows=self.num_running - 1, explore=False))
        return Commit(seq.seq_id, tuple(tokens), seq.finish_reason, logprobs=logprobs)

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        seq.finish_reason, seq.pending = reason, None
        self.spec.squashed_items += seq.ledger.finish()
        self.tree.forget(seq.seq_id)
        if seq.slot >= 0:
            self.to_release.append(SlotRelease(seq.seq_id, seq.slot))
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def take_releases(self) -> list[SlotRelease]:
        """Finished sequences that held a slot: the caller frees the slots on every stage in-band,
        in order, then `pop`s the sequences."""
        out, self.to_release = self.to_release, []
        return out

    def pop(self, seq_id: int) -> SequenceState:
        """Forget a finished sequence. Results of its items still in flight are then ignored, and
        queues skip its id. Raises KeyError for an unknown id."""
        seq = self.seqs[seq_id]
        assert seq.finished, f"sequence {seq_id} is not finished"
        return self.seqs.pop(seq_id)

