"""Grammar-aware drafting: a constrained sequence's drafts follow its grammar.

Owns the drafting matcher of each constrained sequence (a second `GrammarState`, apart from the
verifier's), the draft rules below and their counters. Pure: no I/O; the scheduler asks it at the
point where it makes a draft (`Scheduler._try_draft`) and where a real item takes its FIRP chain
(`Scheduler._queue_real`).
Must not: choose committed tokens (verify masks with its own matcher: [Note: grammar masks] in
pipeline/speculation/grammar.py) or touch the ledger.

[Note: grammar-aware drafting]
The verifier masks every row, so any draft is safe; but a draft the grammar forbids has p = 0 (a
wasted row and a squash), and a token the grammar *forces* (exactly one allowed token: in JSON with
a schema the keys, their quotes, `": "`, `, "`; the EOS after a complete document) is a draft with
acceptance 1, greedy or sampled. So, at the draft's prefix (the committed output plus the in-flight
chain's tokens, `seq.context()` minus the prompt):
  * the grammar allows exactly one token -> draft it, whatever the predictor says, and without
    waiting for the exit head's guess (`forced`);
  * the predictor's draft is allowed -> keep it;
  * it is forbidden -> the predictor's best allowed candidate (its ranked `alternatives`, as token
    trees use) replaces it; with none, no draft is sent (`draft`). Tree siblings are filtered too
    (`filtered`).
A real item's FIRP chain is cut before its first forbidden draft, and a forced position takes the
forced token (`chain`).

Jump-forward (SGLang, Zheng et al., arXiv 2312.07104 §4): a forced draft takes with it the whole
run the grammar forces after it (`run`: `"name": "` after `{`, `, "age": ` after a value, a choice's
tail), as ONE draft item of L rows instead of L one-row items, each waiting for a slot in the run-ahead
chain. Once its first token is committed (the result of the item before it), its rows are verified
as a chain in one pass ([Note: chain verify] in pipeline/speculation/ledger.py): row i's token is the
masked choice after the committed prefix, the only allowed one, so p = 1 and it is accepted, greedy
and sampled alike; a wrong draft before the item squashes it as any draft. The run stops before EOS
(the last row's result commits it), at the token budget (`SequenceLedger.last_item_position`), and
at MAX_JUMP_ROWS / the row-cost table (`max_jump_rows`). Its later rows are counted apart
(`grammar_jump_tokens`, `SpecCounters.jump_verified` / `jump_accepted`, `InFlight.jump`): never as
FIRP drafts (FIRP's counters, RowBudget's depth table) nor in the SPEED run-ahead acceptance, which
is per item. A tree draft far behind a jump item gets no siblings ([Note: token trees], scratch).
The exit stage does not run its head on an item whose next draft is forced: nothing reads that guess
([Note: exit-head skipping] in pipeline/engine/row_budget.py). `SchedulerConfig.grammar_jump=False`
sends forced tokens one per item again.

Riding: a real item (nothing of the sequence in flight: after a squash, the corrected token; after
the first token; after a chain that drained) whose next token is forced carries the forced run as
its own extra rows instead of a draft item behind it (`real_rows`), when it carries no FIRP chain
(a chain already takes the forced token at a forced position). The real item is then a FIRP-shaped
item whose drafts are the run (`InFlight.jump`, `SequenceState.pending_jump`), and nothing new is
needed for exactness: its rows go through the one chain rule ([Note: chain verify]), row 0's result
checked against the run's first token, row i's against token i + 1, each the only token the mask
allows after the committed prefix (so accepted, p = 1); the ledger records it with `add_real`
(contiguous from the committed length, within the budget, at most MAX_JUMP_ROWS rows with the real
token's), and any other outcome (a non-finite row) stops the commit there as for any chain, the next
real item truncating the KV at the committed length. tests/unit/test_grammar_paths.py's checked ring
asserts it at every item (KV and context in step, a real item at the committed length - 1). What it
buys: the run commits one result earlier (no draft item waiting for the slot behind the real item)
and needs no free micro-batch slot (a loaded pipeline, where draft items rarely go, gets it too).
Its FIRP rows hang off its last row only (the run is sure). It rides with SPEED or FIRP on; plain
decoding (`--speculate none`) stays one row per pass (`GrammarDrafts.of`). Jump-forward, riding or
not, is a multi-row verify pass whose last row gives a free token, so it is exact only where a row of
a multi-row pass computes what a 1-row pass does: dense bfloat16/float16 runs without it (forced
tokens one per item), as it refuses FIRP and token trees (`RunConfig.rows_pass_alone`).

Counters count what was sent (`count_sent`): `grammar_forced` the draft items whose token the grammar
forced, `grammar_jump_tokens` the forced rows items carried after their first (a jump draft item's,
a riding real item's); a run made but never sent (no free slot, dropped at a squash) counts nothing,
so jump_accepted <= jump_verified <= grammar_jump_tokens. `grammar_replaced` / `grammar_dropped`
count decisions (a proposal made again after its draft was never sent counts again).

Stage-local drafting (pipeline/engine/local_draft.py) has no grammar: a constrained
sequence is drafted by the coordinator alone. The drafting matcher is separate from the verifier's so that neither's sync
rolls the other back: the verifier's prefix only grows, the drafter's runs ahead and rolls back
after a squash (its answer is a function of the prefix it is asked about: a squash shortens the
chain, so the next prefix rolls it back). Each mask costs ~0.1 ms here (llguidance on the default
model's 49k vocabulary); the result of the last prefix is kept, so an exit event after a send (or
the send after a jump run) does not compute it twice, and so is the last forced run's tokens
(`DraftMatcher.forced_after`), so a run made again one token on (a draft item that found no free
slot, dropped at its real item's result: a full pipeline's steady state) computes one mask, not L.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pipeline.speculation.grammar import GrammarError, GrammarState
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import Draft, ExitGuess

if TYPE_CHECKING:
    from pipeline.engine.records import SchedulerConfig, SequenceState, SpecCounters
    from pipeline.speculation.tree import RowCosts

GRAMMAR_SOURCE = "grammar"  # Draft.source of a forced draft (its own draft-gate bucket: acceptance 1)
# Longest jump-forward item (rows). A schema's forced runs (a key with its quotes and `": "`) are a few
# tokens of a BPE vocabulary; the cap bounds what a long constant (a `const` string, a choice's tail)
# adds to a pass that every stage runs and other sequences' items share.
MAX_JUMP_ROWS = 16


def max_jump_rows(row_costs: RowCosts | None) -> int:
    """Rows a jump-forward item may hold: MAX_JUMP_ROWS, or with the measured table
    (pipeline/measure/row_cost.py) the n <= MAX_JUMP_ROWS of the lowest cost per row, cost_s(n) / n,
    the largest on a tie ([Note: rows worth sending] there with every draft certain: a pass of n sure
    rows commits n tokens, so tokens per second peak there). The minimum over the whole table, not the
    first n where the cost per row rises: timing noise is one-sided (interference only adds time), so a
    single slow point makes a bump that a first-rise rule stops at, shortening every run, while the
    global minimum steps over it; a point can only win by being cheap per row."""
    if row_costs is None:
        return MAX_JUMP_ROWS
    per_row = {n: row_costs.cost_s(n) / n for n in range(1, MAX_JUMP_ROWS + 1)}
    best = min(per_row.values())
    return max(n for n, cost in per_row.items() if cost <= best * (1 + 1e-9))  # (1e-9: rounding is a tie)


@dataclasses.dataclass
class DraftView:
    """What the grammar allows after one prefix: allowed [vocab] bool, and the one allowed token when
    there is exactly one (forced), else -1."""

    prefix: tuple[int, ...]
    allowed: torch.Tensor
    forced: int


class DraftMatcher:
    """A constrained sequence's drafting matcher, its last answer and its last forced run (see the note)."""

    def __init__(self, grammar: GrammarState) -> None:
        self.state = GrammarState(grammar.spec, grammar.vocab)
        self.last: DraftView | None = None
        # The forced token after run_base + run[:i] is run[i] (-1: none forced there), so a jump run made
        # again one token further on (the draft item never sent, e.g. no free slot, and the next real
        # item's output one token longer) reads its masks instead of computing them again.
        self.run_base: tuple[int, ...] = ()
        self.run: list[int] = []

    def view(self, prefix: Sequence[int]) -> DraftView | None:
        """The grammar's answer after `prefix` (output tokens); None when the prefix breaks it (a chain
        holding a forbidden token: it is doomed, nothing is drafted after it)."""
        key = tuple(prefix)
        if self.last is not None and self.last.prefix == key:
            return self.last
        try:
            allowed = self.state.allowed(key, self.state.vocab.ll.vocab_size)
        except GrammarError:
            return None
        forced = int(allowed.nonzero()[0, 0]) if int(allowed.sum()) == 1 else -1
        self.last = DraftView(key, allowed, forced)
        return self.last

    def forced_after(self, prefix: Sequence[int]) -> int | None:
        """`view(prefix).forced` (None for a broken prefix), read from the last forced run when `prefix`
        lies along it, and the run extended when `prefix` is its next prefix."""
        key, n = tuple(prefix), len(self.run_base)
        i = len(key) - n
        on_run = 0 <= i <= len(self.run) and key[:n] == self.run_base and list(key[n:]) == self.run[:i]
        if on_run and i < len(self.run):
            return self.run[i]
        view = self.view(key)
        if view is None:
            return None
        if on_run and (not self.run or self.run[-1] >= 0):
            self.run.append(view.forced)
        else:
            self.run_base, self.run = key, [view.forced]
        return view.forced


class GrammarDrafts:
    """The rules of [Note: grammar-aware drafting] for every constrained sequence of one scheduler.
    enabled: False leaves every draft as the predictor made it; jump: forced runs go as one item
    (jump-forward). Each rule counts what it did in the `spec` it is given (the scheduler's
    SpecCounters: grammar_forced, grammar_replaced, grammar_dropped, grammar_jump_tokens)."""

    def __init__(self, *, enabled: bool = True, jump: bool = True) -> None:
        self.enabled, self.jump = enabled, jump
        self.skip_exit = True  # False: the exit head runs before forced drafts too (the benchmark's `:noskip`)

    @classmethod
    def of(cls, config: SchedulerConfig) -> GrammarDrafts:
        """The rules `config` asks for (`grammar_drafts`, `grammar_jump`); jump-forward only where drafts
        are verified (SPEED or FIRP): plain decoding stays one row per pass."""
        return cls(enabled=config.grammar_drafts, jump=config.grammar_jump and (config.speculate or config.firp_k > 0))

    def _view(self, seq: SequenceState, extra: Sequence[int] = ()) -> DraftView | None:
        if not self.enabled or seq.grammar is None:
            return None
        if seq.draft_grammar is None:
            seq.draft_grammar = DraftMatcher(seq.grammar)
        return seq.draft_grammar.view([*seq.context()[len(seq.prompt_ids):], *extra])

    def _forced_after(self, seq: SequenceState, extra: Sequence[int] = ()) -> int | None:
        """The token the grammar forces after the chain plus `extra` (-1: none; None: a broken prefix or
        no grammar-aware drafting), by `DraftMatcher.forced_after`."""
        if not self.enabled or seq.grammar is None:
            return None
        if seq.draft_grammar is None:
            seq.draft_grammar = DraftMatcher(seq.grammar)
        return seq.draft_grammar.forced_after([*seq.context()[len(seq.prompt_ids):], *extra])

    def skips_exit_head(self, seq: SequenceState) -> bool:
        """Whether the item just sent (the chain's end) needs no exit-head guess: the grammar forces
        the draft after it, which is made without one (see the note)."""
        return self.skip_exit and self.forced(seq) is not None

    def forced(self, seq: SequenceState) -> Draft | None:
        """The draft after the chain's end when the grammar forces it, else None."""
        token = self._forced_after(seq)
        return None if token is None or token < 0 else Draft(token, 1.0, GRAMMAR_SOURCE)

    def draft(self, seq: SequenceState, predictor, guess: ExitGuess | None, forced: Draft | None,
              spec: SpecCounters) -> Draft | None:
        """The draft after the chain's end: `forced` (from `forced`) when the grammar forces one;
        else the predictor's `propose(context, guess)` if the grammar allows it (or the sequence is
        unconstrained); else its best allowed `alternatives(context, guess)` (replaced), else None
        (dropped; so is a proposal after a chain the grammar already rejects)."""
        if forced is not None:  # (counted as it is sent: `count_sent`)
            return forced
        draft = predictor.propose(seq.context(), guess)
        view = self._view(seq)
        if draft is None or seq.grammar is None or not self.enabled:
            return draft
        if view is not None and 0 <= draft.token < len(view.allowed) and bool(view.allowed[draft.token]):
            return draft
        more = getattr(predictor, "alternatives", None)
        for alt in more(seq.context(), guess) if more is not None and view is not None else ():
            if 0 <= alt.token < len(view.allowed) and bool(view.allowed[alt.token]):
                spec.grammar_replaced += 1
                return alt
        spec.grammar_dropped += 1
        return None

    def run(self, seq: SequenceState, draft: Draft, *, limit: int, row_costs: RowCosts | None = None) -> tuple[int, ...]:
        """The tokens of the draft item after the chain's end: `draft`, and when it is forced (from
        `forced`) the run the grammar forces after it (jump-forward, see the note), at most `limit`
        tokens (positions left before the token budget) and `max_jump_rows(row_costs)`, up to EOS."""
        out = [draft.token]
        if not self.jump or draft.source != GRAMMAR_SOURCE or seq.grammar is None:
            return tuple(out)
        eos, cap = seq.grammar.vocab.eos_token_ids, min(limit, max_jump_rows(row_costs))
        while len(out) < cap and out[-1] not in eos:
            token = self._forced_after(seq, out)
            if token is None or token < 0 or token in eos:
                break
            out.append(token)
        return tuple(out)

    def real_rows(self, seq: SequenceState, firp_drafts: Sequence[int], spec: SpecCounters, *,
                  row_costs: RowCosts | None = None) -> tuple[tuple[int, ...], bool]:
        """(the drafts the real item after the committed output carries, whether they are a forced run):
        its FIRP chain (`chain` of `firp_drafts`, within the token budget); with none and jump-forward on,
        the run the grammar forces after the committed output (`run`), riding on the real item as its
        extra rows (see the note): within the budget, and with the real token's row at most
        `max_jump_rows(row_costs)` rows in all; else ()."""
        drafts = self.chain(seq, firp_drafts[:seq.ledger.max_firp_drafts()], spec)
        limit = min(seq.ledger.max_firp_drafts(), max_jump_rows(row_costs) - 1)  # (the real token's row counts)
        forced = None if drafts or not self.jump or limit < 1 else self.forced(seq)
        if forced is None or forced.token in seq.grammar.vocab.eos_token_ids:  # (the real row's result commits EOS)
            return drafts, False
        return self.run(seq, forced, limit=limit), True

    @staticmethod
    def count_sent(seq: SequenceState, item: Item, spec: SpecCounters) -> None:
        """Count `item` of `seq` as it is sent (the scheduler's `_take`, before `seq.pending` is read
        again): a draft item the grammar forced (grammar_forced) and the forced rows an item carries
        after its first (grammar_jump_tokens: a jump draft item's, or a real item's with
        `seq.pending_jump`). A run made and never sent (no free slot, dropped at a squash) counts nothing."""
        if item.kind == ItemKind.DRAFT:
            spec.grammar_forced += seq.pending_key is not None and seq.pending_key[0] == GRAMMAR_SOURCE
            spec.grammar_jump_tokens += item.num_tokens - 1  # (only a jump run makes a draft item of several rows)
        elif item.kind != ItemKind.PREFILL and seq.pending_jump:
            spec.grammar_jump_tokens += item.num_tokens - 1

    def filtered(self, seq: SequenceState, predictor):
        """`predictor` for the token tree of the draft after the chain's end: its `alternatives`
        without the tokens the grammar forbids there (the predictor itself when unconstrained). The
        mask is computed when they are asked for (a jump item asks none: the matcher stays at its run's end)."""
        more = getattr(predictor, "alternatives", None)
        if not self.enabled or seq.grammar is None or more is None:
            return predictor
        return _Allowed(more, lambda: self._view(seq))

    def chain(self, seq: SequenceState, drafts: Sequence[int], spec: SpecCounters) -> tuple[int, ...]:
        """The FIRP `drafts` a real item carries after its committed token (nothing of `seq` in flight),
        up to the first the grammar forbids (dropped, with the rest); a forced position takes the
        forced token (replaced, when it differs)."""
        out: list[int] = []
        while len(out) < len(drafts):
            view, draft = self._view(seq, out), drafts[len(out)]
            if view is None:
                return tuple(drafts)
            if view.forced >= 0:
                spec.grammar_replaced += draft != view.forced
                out.append(view.forced)
            elif 0 <= draft < len(view.allowed) and bool(view.allowed[draft]):
                out.append(draft)
            else:
                spec.grammar_dropped += 1
                break
        return tuple(out)


class _Allowed:
    """A predictor's `alternatives` without the tokens the grammar forbids (`view()`: the grammar's
    answer at the draft's prefix; None: a broken prefix, nothing filtered)."""

    def __init__(self, alternatives, view: Callable[[], DraftView | None]) -> None:
        self._alternatives, self._view = alternatives, view

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        view, out = self._view(), self._alternatives(context, guess)
        if view is None:
            return out
        n = len(view.allowed)
        return [d for d in out if 0 <= d.token < n and bool(view.allowed[d.token])]
