"""The scheduler's records: its configuration, one sequence's state, a commit, the finish
reasons and the speculation counters (pipeline/engine/scheduler.py holds the policy that updates them),
and the bookkeeping of a sent item and of a result's verdict (`SequenceState.record_sent`,
`SpecCounters.add_pass`). Pure data: no I/O, no policy.
"""

from __future__ import annotations

import dataclasses
import enum

from pipeline.engine.grammar_drafts import DraftMatcher
from pipeline.measure.row_cost import RowCostTable
from pipeline.speculation.grammar import GrammarState
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.ledger import SequenceLedger, Verdict
from pipeline.speculation.logprobs import TokenLogprob
from pipeline.speculation.masks.token_masks import ends_sequence
from pipeline.speculation.predictors import ExitGuess
from pipeline.speculation.sampling import Sampler, SamplingParams
from pipeline.speculation.verify import NON_FINITE_TOKEN  # noqa: F401 (re-exported)


class FinishReason(enum.Enum):
    """Why a sequence stopped: token budget, end-of-sequence token, stop string or stop token id, aborted, or its
    logits were not finite (ERROR: [Note: non-finite logits])."""

    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORTED = "aborted"
    ERROR = "error"


# [Note: non-finite logits]
# A logits row holding NaN or inf (weights with NaN, or activations past float16's range) has no
# meaningful argmax: torch would pick the NaN's index and decode garbage without a word. The last
# stage marks such a row's token NON_FINITE_TOKEN (pipeline/engine/stage_executor.py); the scheduler
# then ends that sequence alone with FinishReason.ERROR (after the tokens it commits before that
# row, usually none), and frees its KV slot (its
# cache may hold the NaNs); the coordinator fails only that request, naming the likely cause. The
# other sequences of the micro-batch are untouched (rows do not mix), and the pipeline stays up.
# Only a row the sequence uses counts (pipeline/speculation/verify.py): rows after a rejected draft
# are never read, as plain decoding never computes them, and the accepted tokens before the
# non-finite row are committed first, as plain decoding commits them.


# A deep draft (one past the run-ahead depth) made by the exit stage needs its parent's draft-gate
# bucket to be right at least this often ([Note: stage-local drafting] 5-6 in pipeline/engine/local_draft.py;
# `--deep-draft-min-acceptance`).
DEEP_ACCEPTANCE = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of the pipeline the scheduler feeds: a view of the run configuration
    (`pipeline.run_config.RunConfig.scheduler_config`), which validates them. AssertionError on
    out-of-range values (an invariant, not user input)."""

    num_stages: int
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_inflight_batches: int = 0  # 0 = num_stages
    eos_token_ids: tuple[int, ...] = ()
    # eos_token_ids[0] is the tokenizer's eos_token (vLLM's primary EOS: it ends a sequence as EOS); False for a
    # tokenizer without one, whose generation-config ids all end it as stop token ids ([Note: token masks])
    primary_eos: bool = True
    speculate: bool = False
    max_inflight: int = 0  # items of one sequence in flight; 0 = num_stages
    min_acceptance: float = 0.0  # adaptive drafting threshold (0 = send every draft), see DraftGate
    firp_k: int = 0  # FIRP drafts per chain ([Note: FIRP policy]); 0 = FIRP off
    firp_min_prob: float = 0.0  # a chain is cut before its first draft less probable than this
    row_costs: RowCostTable | None = None  # measured pass costs: chain lengths follow them (pipeline/engine/row_budget.py)
    firp_pseudo_weight: float = 1.0  # a pseudo row's cost in real rows (layers after the FIRP layer / all)
    run_ahead_from_table: bool = False  # max_inflight is a cap; the depth follows row_costs (row_budget.py)
    draft_at_stage: bool = False  # the exit stage (stage 0) drafts itself: pipeline/engine/local_draft.py
    decode_feed: bool = False  # the last stage, when it is stage 0, feeds greedy decode itself: decode_feed.py
    deep_acceptance: float = DEEP_ACCEPTANCE  # see DEEP_ACCEPTANCE
    draft_tree: int = 1  # candidates per draft position, siblings included ([Note: token trees]); 1 = off
    grammar_drafts: bool = True  # constrained drafts follow the grammar ([Note: grammar-aware drafting])
    grammar_jump: bool = True  # with grammar_drafts: a forced run goes as one multi-row draft item (jump-forward)
    # no new drafts while this many sequences or more run ([Note: speculation under load] in row_budget.py); 0 = never
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        # Invariants only: the values come from a validated RunConfig (`RunConfig.scheduler_config`)
        # or a validated SimConfig; user input is checked there, once.
        if self.max_inflight_batches == 0:
            object.__setattr__(self, "max_inflight_batches", self.num_stages)
        if self.max_inflight == 0:
            object.__setattr__(self, "max_inflight", self.num_stages)
        assert self.num_stages >= 1 and self.max_num_seqs >= 1 and self.max_model_len >= 2, self
        assert self.max_inflight >= 1 and self.firp_k >= 0, self
        assert 0.0 <= self.min_acceptance <= 1.0 and 0.0 <= self.firp_min_prob <= 1.0, self
        assert 0.0 < self.firp_pseudo_weight <= 1.0 and 0.0 <= self.deep_acceptance <= 1.0, self
        assert self.disable_by_batch_size >= 0, self
        assert not (self.draft_at_stage and self.draft_tree > 1), "token trees need draft_at coordinator"


@dataclasses.dataclass
class SequenceState:
    """One sequence as the coordinator sees it. `output_ids` are committed tokens only."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    ledger: SequenceLedger
    slot: int = -1
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    pending: Item | None = None  # the next item to send (real or draft)
    exit_seen: tuple[int, int, ExitGuess | None] | None = None  # (position, epoch, guess) of the last exit event
    pending_ready_ns: int = 0  # when the pending draft became available (caller's clock)
    pending_key: tuple[str, int] | None = None  # the pending draft's DraftGate bucket (the ledger keeps it once sent)
    pending_jump: bool = False  # the pending real item's drafts are a grammar's forced run, not FIRP's (InFlight.jump)
    firp_drafts: tuple[int, ...] = ()  # FIRP drafts for the positions after the last committed token
    grammar: GrammarState | None = None  # the structured output's matcher (`SamplingParams.grammar`)
    draft_grammar: DraftMatcher | None = None  # its drafting matcher (pipeline/engine/grammar_drafts.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    def finish_reason_at(self, token: int, eos_token_ids: tuple[int, ...], *,
                         primary_eos: bool = True) -> FinishReason | None:
        """Why committing `token` ends the sequence: EOS (the primary EOS id, eos_token_ids[0] when `primary_eos`,
        unless ignore_eos), STOP (a secondary EOS id, every EOS id without a primary, unless ignore_eos, or one of
        the request's `stop_token_ids`: the id is vLLM's stop_reason; [Note: token masks] in
        pipeline/speculation/masks/token_masks.py), or None."""
        p = self.params
        if not ends_sequence(token, eos_token_ids=eos_token_ids, ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids):
            return None
        primary = primary_eos and eos_token_ids[:1] == (token,)
        return FinishReason.EOS if primary and not p.ignore_eos else FinishReason.STOP

    def wants_logits(self, position: int) -> bool:
        """Whether an item whose first result row sits at absolute `position` brings its logits rows back:
        `SamplingParams.needs_logits_at` of the output token that row chooses (position + 1 - prompt length).
        Its later rows need them no more (a greedy request's min_tokens mask only stops acting)."""
        return self.params.needs_logits_at(position + 1 - len(self.prompt_ids))

    def logits_upto(self) -> int:
        """The position from which on no row needs its logits: past the prompt, `wants_logits(q)` is True
        exactly for q < logits_upto() (`needs_logits_at` depends on the output position only through
        min_tokens, acting before min_tokens tokens, so it falls once); past the token budget when every
        row needs them. Stage-made drafts ask for logits by it (`Item.draft_logits_upto`)."""
        p = self.params
        if p.needs_logits_at(p.min_tokens):  # needed after min_tokens tokens too: by every row
            return len(self.prompt_ids) + p.max_new_tokens
        return len(self.prompt_ids) + p.min_tokens - 1  # the row choosing output token min_tokens needs none

    def record_sent(self, item: Item, spec: SpecCounters) -> None:
        """Record `item`, this sequence's pending item, as sent: the ledger's new chain end (a draft with
        its gate key `pending_key`, token-tree siblings and forced run; a prefill; a real item with its
        FIRP drafts or forced run, `pending_jump`) and the draft tokens it carries in `spec`."""
        if item.kind == ItemKind.DRAFT:  # (more than one token: a forced run, [Note: grammar-aware drafting])
            self.ledger.add_draft(item.token_ids[0], gate_key=self.pending_key, alts=item.alt_token_ids,
                                  jump=item.token_ids[1:])
            spec.drafted_tokens += item.num_tokens
        elif item.kind == ItemKind.PREFILL:
            self.ledger.add_real(item.token_ids[-1])
        else:
            self.ledger.add_real(item.token_ids[0], item.token_ids[1:], jump=self.pending_jump)
            spec.drafted_tokens += item.num_tokens - 1
            spec.firp_drafted += 0 if self.pending_jump else item.num_tokens - 1

    @property
    def num_tokens(self) -> int:
        """Prompt plus committed tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def context(self) -> list[int]:
        """Prompt, committed and in-flight draft tokens, up to the chain's end (predictor input)."""
        # In-flight items at positions < known_len carry committed tokens (an accepted draft stays in
        # flight until its own result comes back); only later positions are still guesses.
        known = self.ledger.known_len
        drafts = [t for f in self.ledger.inflight for p, t in enumerate(f.tokens, f.position) if p >= known]
        return self.prompt_ids + self.output_ids + drafts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Items sent to stage 0 together (at most one per sequence, token ids included), and, for a
    micro-batch of drafts only, when its last draft became available (caller's clock, for the
    control overhead of `Timeline.draft_gap`); None otherwise."""

    items: tuple[Item, ...]
    drafts_ready_ns: int | None = None


@dataclasses.dataclass(frozen=True)
class Commit:
    """Tokens newly committed for one sequence by one result, and its finish reason if it ended.
    logprobs: one per token when the request asks (`SamplingParams.logprobs`), else None;
    prompt_logprobs: on the prefill's commit, one per prompt token (None for the first) when the
    request asks (`SamplingParams.prompt_logprobs`), else None. With FinishReason.ERROR, token_ids
    are the tokens committed before the non-finite row ([Note: non-finite logits]), often none, and
    `error` says why when it is not non-finite logits (a structured output that cannot go on); `error_fields`
    name the request's fields whose masks left no token ([Note: no token left] in pipeline/speculation/verify.py:
    bad input found mid-generation), () for an internal failure."""

    seq_id: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: str | None = None
    error_fields: tuple[str, ...] = ()


@dataclasses.dataclass
class SpecCounters:
    """Speculation totals: drafts sent, drafts verified and accepted (SPEED, FIRP and jump-forward
    rows together), items squashed; FIRP's own share and jump-forward's; and real passes (results
    that committed) with their tokens."""

    drafted_tokens: int = 0
    verified_drafts: int = 0
    accepted_tokens: int = 0
    squashed_items: int = 0
    gated_drafts: int = 0  # proposals the adaptive-drafting gate did not send
    stage_drafted: int = 0  # drafts the exit stage made itself (pipeline/engine/local_draft.py)
    withdrawn_drafts: int = 0  # of those, stopped on the exit stage by a squash (local_draft.py, note 6)
    fed_items: int = 0  # decode items the last stage fed, registered (pipeline/engine/decode_feed.py)
    fed_withdrawn: int = 0  # fed items withdrawn after a RELEASE (decode_feed.py, notes 4 and 6b)
    firp_drafted: int = 0
    firp_verified: int = 0
    firp_accepted: int = 0
    passes: int = 0
    committed_tokens: int = 0
    exit_rows: int = 0  # decode items the exit head ran on ([Note: exit-head skipping])
    exit_rows_skipped: int = 0  # decode items that passed the exit stage without it
    grammar_forced: int = 0  # draft items sent whose token the grammar forced ([Note: grammar-aware drafting])
    grammar_replaced: int = 0  # forbidden drafts replaced by an allowed candidate (or a FIRP draft by a forced token)
    grammar_dropped: int = 0  # forbidden drafts not sent (no allowed candidate); a FIRP chain cut counts once
    grammar_jump_tokens: int = 0  # forced rows sent after an item's first (a jump draft item's, a riding real item's)
    jump_verified: int = 0  # of those, verified (their share of verified_drafts; never FIRP's)
    jump_accepted: int = 0  # and accepted (their share of accepted_tokens)
    spec_disabled_steps: int = 0  # micro-batches sent with speculation paused by load ([Note: speculation under load])

    def add_pass(self, verdict: Verdict, *, own_drafts: int, jump: bool) -> tuple[int, int]:
        """Count one result's verdict (`SequenceLedger.on_result`); own_drafts: the drafts its item
        carried after its first row, FIRP's or, with `jump`, a forced run's (`InFlight.jump`): each
        kind counted apart. Returns FIRP's (verified, accepted) of them."""
        own_verified = min(len(verdict.tokens), own_drafts)
        own_accepted = min(verdict.num_accepted, own_verified)
        self.passes += 1
        self.committed_tokens += len(verdict.tokens)
        self.verified_drafts += verdict.num_verified
        self.accepted_tokens += verdict.num_accepted
        if jump:
            self.jump_verified += own_verified
            self.jump_accepted += own_accepted
            own_verified = own_accepted = 0
        self.firp_verified += own_verified
        self.firp_accepted += own_accepted
        self.squashed_items += verdict.squashed
        return own_verified, own_accepted

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per result (1 without speculation; 1 + accepted drafts per pass)."""
        return self.committed_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts (0 when none were verified)."""
        return self.accepted_tokens / self.verified_drafts if self.verified_drafts else 0.0
