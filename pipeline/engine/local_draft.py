"""Stage-local drafting: the exit stage turns its exit guess into the next draft item itself.

Owns both halves of [Note: stage-local drafting]: the coordinator side (`authorise` the items it
sends, `register` a draft the stage announced, `guard_unannounced` and `credit` after a result) and
the stage side (`StageDrafter`: the exit stage's copy of each sequence's tokens and the decision).
Pure: no I/O, no clock (`StageDrafter` holds a lock because credits arrive on a reader thread).
Must not: commit or squash (the coordinator's scheduler alone does), or decide a draft by another
rule than the coordinator's (the stage runs the same predictor on the same tokens, under the
coordinator's ledger limit and draft-gate state).

[Note: stage-local drafting]
Coordinator drafting (SPEED, ARCHITECTURE.md §5.1) costs a round trip on the critical path: the
exit stage sends EXIT_GUESS, the coordinator proposes, gates and sends the draft back, and stage 0
waits (`draft_gap_share`, measured 6-12 % of a stage step at --stages 2). With `--draft-at stage`
and the exit layer on stage 0 (ARCHITECTURE.md §5.6):
1. Authorise. Each item the coordinator sends as its sequence's chain end, that wants an exit
   guess, carries `draft_cap` / `draft_upto` (a draft may follow position p only while p <
   draft_upto, and p < draft_cap is the ledger's own `can_draft_after` as a position bound; the
   one position in between is a "deep" draft, see 5), `draft_gate` (the DraftGate's open
   (source, bucket) bits, `DraftGate.would_allow`, and the deep bits) and `draft_with` (which
   built-in predictor the stage runs; CUSTOM for a test's object), and `draft_logits_upto`
   (`SequenceState.logits_upto`: a draft at position q wants logits rows exactly when q < it, the
   coordinator's `wants_logits`; copying the parent's `want_logits` instead made every draft of a
   chain begun before min_tokens ship a float32 logits row the coordinator no longer needed).
2. Decide. Stage 0 keeps every sequence's tokens as its KV cache holds them (each item truncates
   to its start and appends its tokens, like `KVCache.truncate`), so the context it proposes
   from is the coordinator's `SequenceState.context()` up to the chain end. After running an
   authorised item it calls the same `Predictor.propose(context, guess)`, checks the gate bits,
   and makes the DRAFT item (start = item.end, same slot and epoch, `self_made`), which it runs
   next, alone, before any other message; the draft inherits the authorisation, so drafts chain.
3. Announce. The EXIT_GUESS of the item carries the draft token and its gate key
   ("self_drafts", "self_draft_keys"); the coordinator `register`s the draft in the ledger
   (`add_draft`, counters, the gate's bookkeeping) exactly as if it had sent it, and does not
   propose one itself. A refused draft is announced as a plain exit guess: the coordinator then
   drafts as without this mode (its gate may have changed since), so nothing is lost.
4. Stale is harmless. The draft runs right after its parent on stage 0, so on every stage it
   follows its parent and precedes anything newer: never dropped, never reordered. If the
   coordinator squashed meanwhile, the draft's epoch is old: its result is ignored and the new
   epoch's item truncates every KV cache (ARCHITECTURE.md §5.2). One race remains: the parent's
   result arrives before its announcement and empties the chain. The coordinator would then
   send the next real item at the same position and epoch as the stage's draft, so
   `guard_unannounced` bumps the epoch first (the draft becomes stale, and a late announcement
   is refused by `register`). The engine matches a self-made micro-batch's result to its
   announcement by its items' (seq, start, epoch) in either arrival order.
5. Credits and deep drafts. The chain cap (the coordinator's run-ahead depth, `RowBudget.run_ahead`:
   `max_inflight`, or the table-driven depth) moves as results commit, which the
   stage does not see: after each result the coordinator sends an in-band CREDIT to stage 0
   with the new bounds and gate bits. In the steady state of one sequence the stage finishes
   draft p+1 when the last stage finishes p: the chain is full, and waiting for p's commit would
   put the round trip back on the critical path. The stage may then go one deeper (the chain
   holds max_inflight + 1 items, one of them with its result on the way), but such a draft
   costs about a stage step when p+1 turns out wrong (stage 0 is busy with it when the real
   token arrives) and saves only the round trip g when p+1 is right: it pays when p+1's
   acceptance exceeds 1 - g / T (measured g / T ≈ 0.1 at --stages 2). With 6 a wrong parent costs
   much less, and the bar is `SchedulerConfig.deep_acceptance` (`--deep-draft-min-acceptance`,
   default DEEP_ACCEPTANCE; the deep bits: the parent must be a draft this stage made, from a gate
   bucket right at least that often); otherwise the stage leaves the draft to the coordinator,
   which drafts when the result frees room, as without this mode.
6. Withdrawal. A squash that makes a running self-made draft stale is seen by stage 0's reader
   thread (a FORWARD of a newer epoch, or a RELEASE, of its sequence) while the draft runs. The
   stage checks between layers (`StageModel.forward_rows(interrupt=...)`), stops the pass
   (PassInterrupted: KV lengths are unchanged, the rows written past them are overwritten by the
   next item), sends nothing on, and tells the coordinator (a WITHDRAWN message, behind the
   draft's announcement on the same channel), which stops counting the micro-batch in flight
   (`Engine`: `Withdrawn`). For the squash's real item to reach the stage while the draft runs,
   the engine counts only self-made micro-batches that still hold a current item as filling the
   pipeline (`Engine._live_inflight`); counting the stale ones made the real item wait for their
   results, and the withdrawal never came. So a deep draft after a wrong parent costs stage 0 the
   time until the squash arrives (which it would have idled) plus at most one layer, instead of a
   whole step: it pays when its parent is right more often than (one layer) / (g + one layer),
   under the gate's own bar; the default bar is the gate's break-even at --stages 2 (0.5), not the
   1 - g / T (0.9) uninterruptible deep drafts needed. What this leaves out: a stage that runs
   ahead computes at the same time as the next one more often, and on a CPU whose stages share
   cores and memory that slows both (measured in the README: `draft_gap_share` fell from 5-13 % to
   1.5-7 % while speed stayed within the noise of coordinator drafting).
Committed tokens never depend on any of this: every draft is verified (ARCHITECTURE.md §5.3).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from pipeline.engine.records import DEEP_ACCEPTANCE, SchedulerConfig, SequenceState, SpecCounters
from pipeline.speculation.draft_gate import DraftGate
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import (
    Draft,
    EarlyExitPredictor,
    ExitGuess,
    HybridPredictor,
    LogitLensPredictor,
    NGramPredictor,
    Predictor,
    make_predictor,
)

GATE_SOURCES = ("ngram", "logit-lens", "early-exit")  # draft sources the gate bits cover
NUM_GATE_BUCKETS = 10  # DraftGate's default number of confidence buckets
NUM_KEYS = len(GATE_SOURCES) * NUM_GATE_BUCKETS  # gate bits 0..29: open; 30..59: deep; 60: gate off
GATE_OFF_BIT = 2 * NUM_KEYS
STAGE_PREDICTORS = {1: "ngram", 2: "logit-lens", 3: "early-exit", 4: "hybrid"}  # Item.draft_with
CUSTOM = 255  # Item.draft_with of a predictor object the stage was handed (in-process tests)
_TYPES = {NGramPredictor: 1, LogitLensPredictor: 2, EarlyExitPredictor: 3, HybridPredictor: 4}
_NGRAM_DEFAULTS = (NGramPredictor().max_ngram, NGramPredictor().min_ngram, NGramPredictor().window)


# -- coordinator side -------------------------------------------------------------------------------
def predictor_code(predictor: Predictor) -> int:
    """`Item.draft_with` for the coordinator's predictor: a built-in one with default settings
    (which the stage rebuilds by name), else CUSTOM."""
    code = _TYPES.get(type(predictor), CUSTOM)
    ngram = predictor if isinstance(predictor, NGramPredictor) else getattr(predictor, "ngram", None)
    if ngram is not None and (ngram.max_ngram, ngram.min_ngram, ngram.window) != _NGRAM_DEFAULTS:
        return CUSTOM
    return code


def gate_bits(gate: DraftGate, deep: float = DEEP_ACCEPTANCE) -> int:
    """`Item.draft_gate` of `gate`: for key k = i * NUM_GATE_BUCKETS + b (GATE_SOURCES[i], bucket
    b), bit k is set when `DraftGate.would_allow` it, bit NUM_KEYS + k when its acceptance
    estimate is at least `deep` (SchedulerConfig.deep_acceptance); bit GATE_OFF_BIT when the gate is off (any source)."""
    assert gate.num_buckets == NUM_GATE_BUCKETS, gate.num_buckets
    bits = 1 << GATE_OFF_BIT if gate.min_acceptance <= 0.0 else 0
    for i, source in enumerate(GATE_SOURCES):
        for b in range(NUM_GATE_BUCKETS):
            k = i * NUM_GATE_BUCKETS + b
            bits |= gate.would_allow((source, b)) << k | (gate.estimate((source, b)) >= deep) << NUM_KEYS + k
    return bits


def draft_limit(seq: SequenceState, depth: int) -> tuple[int, int]:
    """(`Item.draft_cap`, `Item.draft_upto`): `SequenceLedger.can_draft_after` as position bounds
    (single-row items: the chain holds the positions next_real_position .. p), with the chain cap
    `depth` (the coordinator's run-ahead depth, `RowBudget.run_ahead`: max_inflight, or the
    table-driven depth), and depth + 1 for a deep draft (see the note, 5)."""
    ledger = seq.ledger
    return (min(ledger.next_real_position + depth - 1, ledger.last_item_position),
            min(ledger.next_real_position + depth, ledger.last_item_position))


def authorise(config: SchedulerConfig, predictor: Predictor, gate: DraftGate, seq: SequenceState, item: Item,
              *, pipeline_full: bool, depth: int) -> Item:
    """`item` (just sent, now the chain's end) with the stage-local drafting fields when the
    exit stage may draft after it; unchanged otherwise (see the note, 1). depth: the run-ahead
    depth (`RowBudget.run_ahead`) the coordinator's own drafts get now."""
    if (not config.draft_at_stage or pipeline_full or not predictor.needs_exit_head or config.firp_k
            or not item.wants_exit_guess or item.kind == ItemKind.FIRP or _grammar_drafts(config, seq)):
        return item
    cap, upto = draft_limit(seq, depth)
    if item.end - 1 >= upto:
        return item
    return dataclasses.replace(item, draft_cap=cap, draft_upto=upto, draft_gate=gate_bits(gate, config.deep_acceptance),
                               draft_with=predictor_code(predictor), draft_logits_upto=seq.logits_upto())


def _grammar_drafts(config: SchedulerConfig, seq: SequenceState) -> bool:
    """A constrained sequence under grammar-aware drafting is drafted by the coordinator alone: the
    stage has no grammar, and a forced draft the coordinator queues at send time would race the
    stage's own ([Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py)."""
    return config.grammar_drafts and seq.grammar is not None


def credit(config: SchedulerConfig, gate: DraftGate, seq: SequenceState, *, depth: int) -> list[Item]:
    """The CREDIT for a sequence after a result: its new `draft_upto` and gate bits (as an Item
    of its slot and epoch) under the run-ahead depth `depth` (`RowBudget.run_ahead`), or none
    when no stage-made draft can follow its chain."""
    if not config.draft_at_stage or not seq.ledger.inflight or seq.finished or _grammar_drafts(config, seq):
        return []
    cap, upto = draft_limit(seq, depth)
    return [Item(seq_id=seq.seq_id, slot=seq.slot, start=seq.ledger.next_real_position, num_tokens=1,
                 epoch=seq.epoch, draft_cap=cap, draft_upto=upto,
                 draft_gate=gate_bits(gate, config.deep_acceptance))]


def register(config: SchedulerConfig, gate: DraftGate, spec: SpecCounters, seq: SequenceState, item: Item,
             token: int, key_code: int) -> None:
    """The exit stage announced a draft `token` right after `item` (gate key `key_code`, -1: none):
    record it as if the coordinator had sent it, if it is still current (see the note, 3-4).
    The chain bound here is max_inflight + 1, the loosest depth any grant had: the stage keeps
    to its grant (`draft_limit` at the run-ahead depth), and the depth may fall between the grant
    and this announcement; refusing a draft of the current epoch would let the coordinator send
    its own item at the draft's position and epoch. Only a stale draft is refused."""
    if not seq.ledger.can_draft_after(item.end - 1, item.epoch, max_inflight=config.max_inflight + 1):
        return  # stale: a squash or `guard_unannounced` came first; its result will be ignored
    key = None
    if 0 <= key_code < NUM_KEYS:
        key = (GATE_SOURCES[key_code // NUM_GATE_BUCKETS], key_code % NUM_GATE_BUCKETS)
        bucket_mid = (key[1] + 0.5) / NUM_GATE_BUCKETS
        gate.allow(Draft(token, bucket_mid, key[0]))  # the gate's own bookkeeping (probe counters)
    seq.ledger.add_draft(token, gate_key=key)
    spec.drafted_tokens += 1
    spec.stage_drafted += 1


def guard_unannounced(seq: SequenceState, item: Item) -> None:
    """After the result of `item` left the chain empty: if `item` was authorised and its exit
    announcement has not arrived, the stage may have a draft of it in flight at the position
    the next real item takes; bump the epoch so that draft is stale (see the note, 4)."""
    if item.draft_upto and not seq.ledger.inflight and (
            seq.exit_seen is None or seq.exit_seen[:2] != (item.end - 1, item.epoch)):
        seq.ledger.finish()  # nothing is in flight: this only bumps the epoch


# -- stage side -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Grant:
    """The coordinator's latest bounds and gate bits for one sequence at one epoch."""

    epoch: int
    cap: int
    upto: int
    gate: int

    def merge(self, item: Item) -> _Grant:
        """This grant updated by a coordinator item or credit of the same or a newer epoch. Within
        an epoch bounds only grow, and the gate bits are the newest send's: credits are applied
        on arrival (reader thread), items when they run, so an older item may come after a
        newer credit; the bigger bound is the newer."""
        if item.epoch > self.epoch:
            return _Grant(item.epoch, item.draft_cap, item.draft_upto, item.draft_gate)
        gate = item.draft_gate if item.draft_upto >= self.upto else self.gate
        return _Grant(self.epoch, max(self.cap, item.draft_cap), max(self.upto, item.draft_upto), gate)


class StageDrafter:
    """The exit stage's half (stage 0): each live sequence's tokens and the coordinator's latest
    grant, and the decision of [Note: stage-local drafting] 2.

    custom: the predictor object to run for `draft_with == CUSTOM` (in-process tests hand the
    coordinator's own); without one such items are not drafted here.
    """

    def __init__(self, *, custom: Predictor | None = None) -> None:
        self.custom = custom
        self.tokens: dict[int, list[int]] = {}
        self.grants: dict[int, _Grant] = {}
        self.made: dict[int, dict[int, tuple[int, int]]] = {}  # seq -> {draft start: (epoch, gate key code)}
        self._predictors: dict[int, Predictor] = {}
        self._lock = threading.Lock()

    def observe(self, sent: Sequence[Item], x: torch.Tensor, ran: Sequence[Item]) -> None:
        """Items `ran` (the current ones of `sent`, whose token ids `x` [sum of sent num_tokens]
        int64 are in order) are now in the KV cache: mirror their tokens, take their grants."""
        current = {(it.seq_id, it.start, it.epoch) for it in ran}
        row, ids = 0, x.tolist()
        with self._lock:
            for it in sent:
                if (it.seq_id, it.start, it.epoch) in current:
                    tokens = self.tokens.setdefault(it.seq_id, [])
                    del tokens[it.start:]
                    if len(tokens) == it.start:  # else a gap (the stage was reset): unknown until a prefill
                        tokens.extend(ids[row:row + it.num_tokens])
                    if it.draft_upto and not it.self_made:  # a self-made item carries a grant we had
                        self._grant(it)
                row += it.num_rows  # x also holds a tree draft's sibling tokens after its own

    def credit(self, credits: Sequence[Item]) -> None:
        """A CREDIT from the coordinator: raise each sequence's bound and update its gate bits (a
        credit of an older epoch than the grant held, or for a sequence this stage does not
        track, is ignored)."""
        with self._lock:
            for c in credits:
                self._grant(c)

    def _grant(self, item: Item) -> None:
        if item.seq_id not in self.tokens:
            return  # released (a CREDIT after the RELEASE) or never run here: nothing to draft for
        grant = self.grants.get(item.seq_id)
        if grant is None:
            self.grants[item.seq_id] = _Grant(item.epoch, item.draft_cap, item.draft_upto, item.draft_gate)
        elif grant.epoch <= item.epoch:
            self.grants[item.seq_id] = grant.merge(item)

    def drafts(self, ran: Sequence[Item], exit_tokens: torch.Tensor | None,
               exit_probs: torch.Tensor | None) -> tuple[list[Item], list[int], list[int]]:
        """The draft items to run next (token ids included), and per item of `ran` the draft token
        and gate key code made after it (-1: none). exit_tokens / exit_probs: [len(ran)] the exit
        head's guesses (token -1: none), [len(ran), k] its top k (token trees: the top one is
        the guess), or None."""
        made, tokens, keys = [], [-1] * len(ran), [-1] * len(ran)
        if exit_tokens is not None and exit_tokens.dim() == 2:
            exit_tokens, exit_probs = exit_tokens[:, 0], exit_probs[:, 0]
        for i, it in enumerate(ran):
            if not it.draft_upto:
                continue  # not authorised (the coordinator drafts after it)
            guess = None
            if exit_tokens is not None and int(exit_tokens[i]) >= 0:
                guess = ExitGuess(int(exit_tokens[i]), float(exit_probs[i]))
            draft = self._decide(it, guess)
            if draft is None:
                continue
            grant = self.grants[it.seq_id]
            tokens[i], keys[i] = draft.token, _key_code(draft)
            mine = self.made.setdefault(it.seq_id, {})
            mine[it.end] = (it.epoch, keys[i])
            for old in [p for p in mine if p < it.end - 64]:
                del mine[old]
            made.append(Item(seq_id=it.seq_id, slot=it.slot, start=it.end, num_tokens=1, epoch=it.epoch,
                             kind=ItemKind.DRAFT, token_ids=(draft.token,), want_logits=it.end < it.draft_logits_upto,
                             want_exit=it.want_exit, draft_cap=grant.cap, draft_upto=grant.upto,
                             draft_gate=grant.gate, draft_with=it.draft_with, self_made=True,
                             draft_logits_upto=it.draft_logits_upto))
        return made, tokens, keys

    def _decide(self, it: Item, guess: ExitGuess | None) -> Draft | None:
        """The coordinator's `_try_draft` for an item that just ran here (see the note, 2)."""
        if not it.draft_upto or not it.wants_exit_guess:
            return None
        with self._lock:
            grant = self.grants.get(it.seq_id)
            context = self.tokens.get(it.seq_id, [])
            if grant is None or grant.epoch != it.epoch or it.end - 1 >= grant.upto or len(context) != it.end:
                return None
            gate = grant.gate
            if it.end - 1 >= grant.cap:  # a deep draft: only after a draft of ours that is right often
                epoch, parent = self.made.get(it.seq_id, {}).get(it.start, (-1, -1))
                if not it.self_made or epoch != it.epoch or parent < 0 or not gate >> (NUM_KEYS + parent) & 1:
                    return None
            context = list(context)
        predictor = self._predictor(it.draft_with)
        draft = None if predictor is None else predictor.propose(context, guess)
        if draft is None or gate >> GATE_OFF_BIT & 1:
            return draft
        code = _key_code(draft)
        return draft if code >= 0 and gate >> code & 1 else None

    def _predictor(self, code: int) -> Predictor | None:
        if code == CUSTOM:
            return self.custom
        if code not in self._predictors and code in STAGE_PREDICTORS:
            self._predictors[code] = make_predictor(STAGE_PREDICTORS[code])
        return self._predictors.get(code)

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget finished sequences."""
        with self._lock:
            for seq_id in seq_ids:
                self.tokens.pop(seq_id, None)
                self.grants.pop(seq_id, None)
                self.made.pop(seq_id, None)


def _key_code(draft: Draft) -> int:
    """A draft's DraftGate key as one int (source index * NUM_GATE_BUCKETS + bucket), -1 for a
    source the gate bits do not cover."""
    if draft.source not in GATE_SOURCES:
        return -1
    return GATE_SOURCES.index(draft.source) * NUM_GATE_BUCKETS + DraftGate.bucket(draft.confidence, NUM_GATE_BUCKETS)
