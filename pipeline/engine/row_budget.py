"""Which extra rows an item spends: its FIRP chains (lengths from a measured row-cost table and the
measured acceptance), its exit-head row, and none at all under load (`speculation_paused`).

Owns, split out of pipeline/engine/scheduler.py (which asks them): `RowBudget` (an item's FIRP fields
`Item.firp_k` / `Item.firp_anchors`, the per-depth FIRP acceptance counters), `next_firp_drafts`
(which FIRP drafts a result leaves for the next item, [Note: FIRP policy] in
pipeline/speculation/firp.py), `wants_exit` (whether the exit stage runs its head on an item) and
`speculation_paused` and `without_speculation` ([Note: speculation under load]), with the load
limit's one default and one check (`default_disable_by_batch_size`, `check_disable_by_batch_size`:
launch's options, RunConfig, SimConfig and `speedpipe simulate` ask them).
Must not: form micro-batches, commit tokens, or measure anything itself (the table comes from
tests/benchmarks/row_cost.py via `--row-cost file:PATH`, or from the stages' start-up
calibration, `--row-cost calibrate`; pipeline/measure/row_cost.py owns the rules), including the
SPEED run-ahead depth (`RowBudget.run_ahead`, [Note: run-ahead depth] in pipeline/measure/row_cost.py).

[Note: row-cost-driven chains]
Without a row-cost table every item asks for chains of `firp_k` rows (the run's fixed choice);
FIRP runs get a table by default (`--row-cost auto` calibrates at start-up: RunConfig.calibrates_row_costs).
With one, the chain length of the next item is `best_firp_k` over the table and the acceptance
measured so far: conditional acceptance of draft depth i = accepted_i / verified_i (a depth is
verified when every shallower draft of its chain was accepted), smoothed toward PRIOR_ACCEPTANCE
with PRIOR_WEIGHT pseudo-trials, so the first items follow the prior and a few dozen passes
follow the measurement ([Note: rows worth sending] in pipeline/measure/row_cost.py). Pseudo rows
count `pseudo_weight` of a real row: the share of the model's layers after the FIRP layer.
When the rule says "shorter than the longest chain", every EXPLORE_EVERY-th item still asks for
one depth more, so the depth that was cut keeps being measured and the choice can grow back.
The table prices one sequence's pass; with several sequences in a micro-batch the real marginal
cost of a row is lower, so the rule errs towards short chains there. A chain length never
changes committed tokens, only how many drafts are verified (exactness: ARCHITECTURE.md §5).

[Note: exit-head skipping]
The exit head (final norm + LM head on the exit hidden state) costs the exit stage several layers
of work per decode item. Its guess is only worth computing when a draft made from it could be
sent, so every item the scheduler sends carries `Item.want_exit`, cleared (`wants_exit`) when:
- speculation is off or the predictor needs no exit head;
- the item is a prefill (no draft follows a prefill: `Item.may_precede_draft`);
- `max_inflight` < 2 (a draft after the item would be a second item in flight);
- a draft after the item would lie past the token budget (`SequenceLedger.can_draft_after`);
- the running sequences fill the pipeline (at least `max_inflight_batches` of them): every
  running sequence keeps a real item ready or in flight, and real work goes first, so drafts find
  no free micro-batch slot ([Note: micro-batching] in pipeline/engine/scheduler.py). This one is a heuristic: a sequence that
  ends opens a gap, and an item sent just before it skipped its guess; the next one wants it.
- (the scheduler's own check, at send time) a structured output's grammar forces the token after
  the item: that draft is made without a guess ([Note: grammar-aware drafting] in
  pipeline/engine/grammar_drafts.py), so no guess of this item is ever read.
Deliberately NOT a reason: the per-sequence run-ahead being full when the item is sent. The
draft after that item is proposed later from the same guess, when an older result frees room
(the steady state of a single speculating sequence). The draft gate neither, since it judges a
draft by the confidence that only the head produces. Skipping never changes committed tokens:
without a guess the exit event still arrives, an exit-head predictor then proposes nothing
(hybrid falls back to its n-gram half). `SpecCounters.exit_rows` / `exit_rows_skipped` count
decode items at the exit stage with and without the head.

[Note: speculation under load]
vLLM's `--speculative-disable-by-batch-size N` (`disable_by_batch_size`): with many running
requests the batch is full of real work and drafts only add rows. Here the same:
`SchedulerConfig.disable_by_batch_size` N > 0 (`--speculative-disable-by-batch-size`) pauses
speculation while the running sequences (those holding a KV slot) number N or more: the scheduler
proposes no draft item (SPEED's, a grammar's forced one, and so no token-tree siblings), sends no
draft already queued, asks no FIRP pseudo rows and carries no FIRP drafts on real items, wants no
exit guess, and grants the exit stage no new drafting bounds (authorisations, CREDITs; a stage
may still use a grant it already holds, at most its run-ahead depth, [Note: stage-local drafting]
5 in pipeline/engine/local_draft.py). This holds for what is sent, not only for what is queued:
a real item queued before the count reached N (its result came in the step that admitted the Nth
sequence, or an earlier admission of the same burst) is sent without its FIRP rows
(`without_speculation`). Items already in flight are verified or squashed as always, so
committed tokens never change (ARCHITECTURE.md §5.3). Kept: a grammar's forced run riding on a
real item (jump-forward: rows the grammar makes certain, not guesses). Speculation
resumes as soon as the count falls below N (a sequence ends). `SpecCounters.spec_disabled_steps`
counts the micro-batches sent while paused (`--json` `spec_disabled_steps`, the serve metric
`spec_decode_disabled_steps`).
The CLI's default under `--speculate auto` is N = S + 1 (S = `num_stages`, the scheduler's
`max_inflight_batches`): with S or more running sequences every micro-batch slot already carries
real work ([Note: micro-batching] in pipeline/engine/scheduler.py), and drafts are sent only into a
free slot, so at S they already fill just the gap a sequence that ends leaves (exit-head skipping
above treats S as full too, as a heuristic). From S + 1 on even that gap is filled by real work: one
sequence ending still leaves S, so no slot ever waits for a draft, and what speculation still
sends (FIRP rows, token-tree rows) only lengthens passes (`default_disable_by_batch_size`). An
explicitly chosen mode keeps speculating at any load unless the flag is given.
The simulator applies the same rule through the same scheduler (`SimConfig.speculative_disable_by_batch_size`,
pipeline/engine/simulator.py), and `speedpipe simulate` takes the flag with the same default,
stages + 1, for its speculating configurations (their `spec_disabled_steps` in simulate.json/.csv).
"""

from __future__ import annotations

import dataclasses
import itertools

from pipeline.engine.records import SchedulerConfig, SequenceState, SpecCounters
from pipeline.measure.row_cost import RowCostTable, best_firp_k, best_run_ahead
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import Predictor

PRIOR_ACCEPTANCE = 0.5  # conditional acceptance of a depth before any measurement
PRIOR_WEIGHT = 2.0  # pseudo-trials behind the prior
EXPLORE_EVERY = 16  # every n-th item asks for one depth more than the rule chose
RUN_AHEAD_PRIOR_WEIGHT = 8.0  # pseudo-trials behind the run-ahead prior: two early misses must not end
# run-ahead for a whole run (the draft gate already refuses unlikely drafts one by one)


class RowBudget:
    """FIRP chain lengths of one scheduler's items.

    max_firp_k: the FIRP maps the stages run (0 = FIRP off); row_costs: the measured table of the
    run's numeric mode, or None (fixed chains of max_firp_k); pseudo_weight: a pseudo row's cost
    in real rows, in (0, 1].
    """

    def __init__(self, *, max_firp_k: int, row_costs: RowCostTable | None = None, pseudo_weight: float = 1.0) -> None:
        self.max_firp_k = max_firp_k
        self.row_costs = row_costs
        self.pseudo_weight = pseudo_weight
        self.verified = [0] * max_firp_k  # per depth 1..max_firp_k
        self.accepted = [0] * max_firp_k
        self._chosen = max_firp_k if row_costs is None else self._choose()
        self._asked = 0
        self._asked_run_ahead = 0
        self.run_ahead_depth = 0  # the last table-driven run-ahead depth (0: none chosen yet)

    def acceptance(self) -> list[float]:
        """Smoothed conditional acceptance of every draft depth 1..max_firp_k ([Note: row-cost-driven chains])."""
        return [(a + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (v + PRIOR_WEIGHT)
                for a, v in zip(self.accepted, self.verified, strict=True)]

    def _choose(self) -> int:
        return best_firp_k(self.row_costs, self.acceptance(), max_k=self.max_firp_k, pseudo_weight=self.pseudo_weight)

    def use_table(self, row_costs: RowCostTable) -> None:
        """Price rows with `row_costs` from now on (a start-up calibration arrives after the scheduler exists)."""
        self.row_costs = row_costs
        self._chosen = self._choose()

    def run_ahead(self, config: SchedulerConfig, spec: SpecCounters, *, shared_rows: int, explore: bool = True) -> int:
        """Items of one sequence allowed in flight now ([Note: run-ahead depth] in
        pipeline/measure/row_cost.py): `config.max_inflight`, unless the run asked for a table-driven
        depth and has a table; then `best_run_ahead` at the SPEED acceptance measured so far
        (smoothed toward PRIOR_ACCEPTANCE with RUN_AHEAD_PRIOR_WEIGHT pseudo-trials), at most
        max_inflight. When that is 1 (no run-ahead), every EXPLORE_EVERY-th ask allows 2, so
        acceptance keeps being measured and depth can grow back.
        shared_rows: rows of other sequences a draft's pass would carry; explore: False for a
        look that neither counts as an ask nor explores (stage-local drafting's grants, which then
        never exceed the coordinator's own depth, pipeline/engine/local_draft.py)."""
        if not config.run_ahead_from_table or self.row_costs is None or config.max_inflight < 2:
            return config.max_inflight
        verified = spec.verified_drafts - spec.firp_verified - spec.jump_verified  # one per run-ahead item:
        accepted = spec.accepted_tokens - spec.firp_accepted - spec.jump_accepted  # a jump item's later rows are sure
        alpha = (accepted + PRIOR_ACCEPTANCE * RUN_AHEAD_PRIOR_WEIGHT) / (verified + RUN_AHEAD_PRIOR_WEIGHT)
        depth = best_run_ahead(self.row_costs, min(1.0, max(0.0, alpha)), num_stages=config.num_stages,
                               max_depth=config.max_inflight, shared_rows=shared_rows)
        if not explore:
            return depth
        self.run_ahead_depth = depth
        if depth == 1:
            self._asked_run_ahead += 1
            if self._asked_run_ahead % EXPLORE_EVERY == 0:
                return 2
        return depth

    def record(self, *, verified: int, accepted: int) -> None:
        """A pass verified the item's first `verified` FIRP drafts and accepted the first `accepted`
        of them (accepted <= verified): depths 1..min(accepted + 1, verified) were tried."""
        assert 0 <= accepted <= verified <= self.max_firp_k, (accepted, verified, self.max_firp_k)
        for depth in range(min(accepted + 1, verified)):
            self.verified[depth] += 1
            self.accepted[depth] += depth < accepted
        if self.row_costs is not None and verified:
            self._chosen = self._choose()

    def firp_fields(self, *, last_item_position: int, first_anchor: int, num_anchors: int) -> dict[str, int]:
        """Item.firp_k / firp_anchors for an item whose pseudo chains hang off `num_anchors` rows
        from position `first_anchor` on: the chosen length, cut so that no draft lies past the
        token budget (`last_item_position`: the last position an item may hold)."""
        k = self._chosen
        if self.row_costs is not None and k < self.max_firp_k:
            self._asked += 1
            if self._asked % EXPLORE_EVERY == 0:
                k += 1
        k = min(k, last_item_position - first_anchor - 1)
        return {"firp_k": k, "firp_anchors": num_anchors} if k > 0 else {}


def next_firp_drafts(item: Item, num_committed: int, firp: list[int | None]) -> tuple[int, ...]:
    """The FIRP drafts a result leaves for the sequence's next item: the chain anchored at the row
    that produced the last of the `num_committed` tokens, up to its first cut draft (None).
    firp: the item's pseudo-row drafts [num_pseudo], chain by chain."""
    if not item.firp_k:
        return ()
    anchor = item.num_tokens - item.num_result_rows + num_committed - 1 - (item.num_tokens - item.firp_anchors)
    if not 0 <= anchor < item.firp_anchors:
        return ()
    chain = firp[anchor * item.firp_k:(anchor + 1) * item.firp_k]
    return tuple(itertools.takewhile(lambda t: t is not None, chain))


def default_disable_by_batch_size(num_stages: int) -> int:
    """The limit `--speculate auto` runs with, and `speedpipe simulate` projects, when
    `--speculative-disable-by-batch-size` is not given: num_stages + 1 running sequences
    ([Note: speculation under load] says why)."""
    return num_stages + 1


def check_disable_by_batch_size(limit: int | None) -> None:
    """Raises ValueError naming `speculative_disable_by_batch_size` unless `limit` is None (never
    pause) or >= 1 (RunConfig's and SimConfig's one check: launch and simulate word it alike)."""
    if limit is not None and limit < 1:
        raise ValueError(f"speculative_disable_by_batch_size must be >= 1 (running sequences from which on "
                         f"speculation pauses), got {limit}")


def speculation_paused(config: SchedulerConfig, *, num_running: int) -> bool:
    """Whether `num_running` running sequences pause speculation ([Note: speculation under load])."""
    return 0 < config.disable_by_batch_size <= num_running


def without_speculation(item: Item, *, jump: bool) -> Item:
    """A real `item` queued before speculation paused, as it is sent under load ([Note: speculation
    under load]): without FIRP pseudo rows, and without the FIRP drafts after its token; a forced
    run riding on it (jump: `SequenceState.pending_jump`) stays. Returns `item` itself when it has neither."""
    drop = item.kind == ItemKind.FIRP and not jump
    if not drop and not item.firp_k:
        return item
    tokens = item.token_ids[:1] if drop else item.token_ids
    return dataclasses.replace(item, kind=ItemKind.DECODE if drop else item.kind, num_tokens=len(tokens),
                               token_ids=tokens, firp_k=0, firp_anchors=0)


def wants_exit(config: SchedulerConfig, predictor: Predictor | None, seq: SequenceState, item: Item, *,
               pipeline_full: bool) -> bool:
    """Whether a draft made from `item`'s exit guess could ever be sent, so the exit stage
    should run its head on it. pipeline_full: the running sequences fill every micro-batch
    slot. See [Note: exit-head skipping]; when unsure, True."""
    if not config.speculate or predictor is None or not predictor.needs_exit_head:
        return False
    if not item.may_precede_draft or config.max_inflight < 2:
        return False
    last_budget_position = seq.ledger.prompt_len + seq.ledger.max_new_tokens - 1
    if item.end >= last_budget_position:  # as SequenceLedger.can_draft_after(item.end - 1, ...)
        return False
    return not pipeline_full
