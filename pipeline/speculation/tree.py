"""Token trees of depth 1: sibling candidates on a SPEED draft, and the rescue when one is right.

Owns which alternative candidates a draft item carries (`TokenTree.siblings`), where their KV goes
(`scratch_of`), the rescue record kept when the real token turns out to be a sibling, and the
tree counters. Pure: no I/O (torch only as a result's logits, sliced); pipeline/engine/scheduler.py
calls it at a few hooks.
Must not: commit tokens or touch the ledger's chain itself (the scheduler does both).

[Note: token trees]
EAGLE-2 (arXiv 2406.16858 §3) and SpecPipe (arXiv 2504.04104) draft a tree of candidates instead of
one guess per position. Here the tree has depth 1: a DRAFT item for position p carries its primary
guess plus up to W - 1 siblings (`--draft-tree W`): the other predictor's proposal when the hybrid's
n-gram lookup and exit head disagree, then the exit head's next most likely tokens. Each sibling is
one extra row at RoPE position p that attends to the committed context [0, p) and to itself only,
and whose K/V go to a per-slot scratch position ([Note: sibling rows] in
pipeline/model/row_layout.py). Younger run-ahead drafts continue only from the primary: the tree's
"children of the likely one" are the primary's chain, siblings have no children.

When the parent's result shows the real token x_p:
  * x_p == primary: as today (the siblings' rows and scratch are simply ignored);
  * x_p == sibling j (a *rescue*): commit x_p, squash everything younger (epoch bump, as today),
    but keep the draft item alive: it is the chain's head again, now real, in the new epoch. Its
    result (tagged with the old epoch, since it was sent before the squash) carries row j's argmax
    = the real x_{p+1}: the scheduler commits it and sends the real item at p + 1 with
    `keep_sibling` = scratch of j, so every stage first copies that scratch entry to position p
    (in the in-band squash step, [Note: in-band squash] in pipeline/engine/stage_executor.py) and
    then truncates to p + 1. No draft follows a rescued item until that real item is sent (a draft
    would attend to the primary's KV at p). The rescue saves the S - 1 stage steps the real token
    would otherwise spend going through the pipeline again.
  * x_p is neither: as today (squash, real item at p).
Exactness: a sibling row computes exactly what a plain 1-row item with its token at p computes
(tests/unit/test_token_tree_rows.py: bitwise in the int modes, whose kernels and the attention
are batch-invariant), so a rescued x_{p+1} is the token plain greedy decoding makes there. Dense
GEMM is not batch-invariant ([Note: batch invariance] in pipeline/weights/quant.py): a tree draft's
rows (primary included) are a 2..W-row pass where plain decoding runs 1 row. In float32 that is
~1e-9, as for FIRP chains and micro-batching ("within rounding"); in dense bfloat16 it changed
the greedy output in every held-out set (tests/benchmarks/results/speculation_trees_bf16.json),
so RunConfig refuses trees there. Trees with FIRP chains (`speed+firp`) are not built: RunConfig
refuses them.

Sampling (temperature > 0, top-p, penalties, logprobs: items with `want_logits`): the last stage
returns the logits of the sibling rows too (after the draft's own row). The token at p is chosen
as without trees: the primary draft x is accepted with probability p(x), else y is drawn from p
without x (`verify_draft`, Leviathan et al. arXiv 2211.17192 §2.3), so the committed token is
distributed as p whatever the siblings are. A rescue only happens when that token *is* sibling j,
and then takes the token at p + 1 from row j's logits: the model's distribution given that
token, as a plain pass would compute it. So the output stays distributed exactly as plain
sampling's. The candidates are then right with probability p(x) + sum over siblings of p(s_j):
what SpecInfer's multi-round verification (arXiv 2305.09781 §4) gives candidates drawn
deterministically, as these are, so no other rule is needed. (Token-identical output is a
greedy guarantee; with sampling the guarantee is the distribution, as for every SPEED draft.)
Each sibling of a sampled sequence also brings a [vocab] float32 logits row back to the
coordinator (196 KiB for the default model); the tree-size rule below prices compute rows only.

Scratch: positions p are in flight at most `max_inflight` at once per sequence, and nothing of a
sequence is sent between a rescue and its fix-up, so sibling j of the draft at p uses scratch
(p mod (max_inflight + 1)) * (W - 1) + j, never overwritten before its fix-up. (A draft item holding a
grammar's forced run, jump-forward, spans several positions: a tree draft whose scratch an in-flight
tree draft holds then gets no siblings, which keeps the rule.)

Tree size ([Note: rows worth sending] in pipeline/measure/row_cost.py): the row-cost table holds
T(n), the seconds of a pass of n rows through the whole model, so a stage step costs about T(n) / S.
The sibling of rank r is sent when its calibrated probability q_r (the measured rescue rate of
rank r, prior 0.25 worth 4 trials) times the work a rescue saves, S - 1 one-row stage steps
(q_r * (S - 1) / S * T(1)), beats what its row costs on all S stages, T(r + 1) - T(r). One tree
decision in 16 may add one rank more, so a rank the rule cuts keeps being measured. Without a
table every candidate up to W - 1 is sent (the flag is then the run's fixed choice, as `--firp-k`
is for FIRP chains). With the measured table of this machine (tests/benchmarks/results/row_cost.json)
on 2 stages that means: in float32, where a second row costs ~1.7x one, never; in `auto` / int4
(a second row +16-19 %) from q > 0.32-0.37 (q > 0.21 on 4 stages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from pipeline.speculation.items import MAX_DRAFT_TREE, Item, ItemKind
from pipeline.speculation.predictors import Draft, ExitGuess

if TYPE_CHECKING:
    import torch

    from pipeline.speculation.ledger import InFlight

PRIOR_HIT, PRIOR_TRIALS = 0.25, 4  # a sibling rank's rescue-rate prior and its weight in trials
EXPLORE_EVERY = 16  # one tree decision in this many may add a rank the cost rule cuts


class RowCosts(Protocol):
    """What the tree size rule reads of the measured row-cost table (pipeline/measure/row_cost.py's
    RowCostTable, which measures and therefore sits above this package)."""

    def cost_s(self, num_rows: int) -> float:
        """Seconds of a pass of `num_rows` rows through the whole model."""


def scratch_positions(width: int, max_inflight: int) -> int:
    """KV scratch positions per slot a run of `--draft-tree width` with chain cap `max_inflight`
    needs: `TokenTree.scratch_of` names (p mod (max_inflight + 1)) * (width - 1) + j, j < width - 1."""
    return (width - 1) * (max_inflight + 1) if width > 1 else 0


def validate_draft_tree(width: int) -> int:
    """Return `width` if it is a valid --draft-tree (1 = off .. MAX_DRAFT_TREE), else raise ValueError."""
    if not 1 <= width <= MAX_DRAFT_TREE:
        raise ValueError(f"--draft-tree must be between 1 (off) and {MAX_DRAFT_TREE} candidates, got {width}")
    return width


@dataclasses.dataclass(frozen=True)
class Rescue:
    """A draft item whose sibling turned out to be the real token at `position`: its result (tagged
    `old_epoch`) is taken from result row `row` (1 + the sibling's index) and its KV from `scratch`."""

    position: int
    old_epoch: int
    row: int
    scratch: int


@dataclasses.dataclass
class TreeCounters:
    """Token-tree totals: drafts sent with siblings, sibling rows sent, verified tree drafts, those
    whose real token was among the candidates (tree acceptance), and rescues (a sibling was right)."""

    tree_drafts: int = 0
    sibling_rows: int = 0
    tree_verified: int = 0
    tree_hits: int = 0
    rescues: int = 0

    @property
    def tree_acceptance(self) -> float:
        """Verified tree drafts whose real token was a candidate (primary or sibling), per verified."""
        return self.tree_hits / self.tree_verified if self.tree_verified else 0.0

    @property
    def rows_per_tree_draft(self) -> float:
        """Rows a tree draft ran through every stage (1 + its siblings), on average."""
        return 1 + self.sibling_rows / self.tree_drafts if self.tree_drafts else 0.0

    def to_json(self) -> dict:
        """The launch report's tree fields (README "Token trees")."""
        return {**dataclasses.asdict(self), "tree_acceptance": round(self.tree_acceptance, 4),
                "rows_per_tree_draft": round(self.rows_per_tree_draft, 4)}


class TokenTree:
    """Sibling choice, rescue records and counters for `--draft-tree width` ([Note: token trees]).

    num_stages: S; max_inflight: a sequence's chain cap; row_costs: the measured table or None.
    """

    def __init__(self, *, width: int, num_stages: int, max_inflight: int, row_costs: RowCosts | None) -> None:
        self.width = validate_draft_tree(width)
        self.num_stages, self.depth, self.row_costs = num_stages, max_inflight + 1, row_costs
        self.rescues: dict[int, Rescue] = {}  # seq_id -> rescue waiting for its result
        self.fixups: dict[int, int] = {}  # seq_id -> scratch the next real item keeps
        self.trials = [0] * width  # per sibling rank (index 1..): verified, and rescued
        self.decisions = 0
        self.hits = [0] * width
        self.counters = TreeCounters()

    @property
    def enabled(self) -> bool:
        return self.width > 1

    def scratch_of(self, position: int) -> int:
        """First scratch position of the siblings of the draft at `position`."""
        return (position % self.depth) * (self.width - 1)

    def probability(self, rank: int) -> float:
        """Calibrated probability that the sibling of `rank` (1 = first) is the real token."""
        return (self.hits[rank] + PRIOR_HIT * PRIOR_TRIALS) / (self.trials[rank] + PRIOR_TRIALS)

    def worth_sending(self, rank: int) -> bool:
        """[Note: token trees], tree size: a rescue's saving against the extra row's cost."""
        if self.row_costs is None:
            return True
        c, s = self.row_costs, self.num_stages
        return self.probability(rank) * (s - 1) / s * c.cost_s(1) > c.cost_s(rank + 1) - c.cost_s(rank)

    def siblings(self, predictor, context: Sequence[int], guess: ExitGuess | None, primary: Draft) -> tuple[int, ...]:
        """Sibling tokens for a draft whose primary is `primary`: the predictor's other candidates
        (`alternatives(context, guess)`, most likely first; none if it has no such method), without
        the primary or repeats, while `worth_sending`, at most width - 1."""
        more = getattr(predictor, "alternatives", None)
        if not self.enabled or more is None:
            return ()
        self.decisions += 1
        explore = self.decisions % EXPLORE_EVERY == 0  # one rank past the rule ([Note: token trees])
        candidates = list(dict.fromkeys(c.token for c in more(context, guess) if c.token != primary.token))
        out: list[int] = []
        for token in candidates[:self.width - 1]:
            if not self.worth_sending(len(out) + 1):
                if not explore:
                    break
                explore = False
            out.append(token)
        return tuple(out)

    def verify(self, *, primary: int, siblings: Sequence[int], real: int) -> int:
        """Record a verified tree draft whose real token is `real`; returns the rescued sibling's
        index (0-based) or -1 when the primary was right or no candidate was."""
        self.counters.tree_verified += 1
        index = siblings.index(real) if real != primary and real in siblings else -1
        self.counters.tree_hits += real == primary or index >= 0
        for rank in range(1, len(siblings) + 1):
            if real == primary:
                break  # a sibling is only measured where it could have rescued
            self.trials[rank] += 1
            self.hits[rank] += rank == index + 1
        return index

    def hold(self, seq, rescue: Rescue) -> None:
        """After the parent's result committed the sibling (seq.output_ids[-1]) and squashed the
        chain: the rescued draft item becomes the chain's real head in the new epoch."""
        seq.ledger.add_real(seq.output_ids[-1])
        seq.firp_drafts = ()  # (FIRP drafts for the position after the parent: one too early now)
        self.rescues[seq.seq_id] = rescue

    def rescue_of(self, seq_id: int, item: Item) -> Rescue | None:
        """The rescue waiting for `item`'s result (the draft at its position, sent in the old epoch),
        or None. Once taken, the next real item of the sequence carries its KV fix-up (`fixups`)."""
        r = self.rescues.get(seq_id)
        if r is None or (item.start, item.epoch) != (r.position, r.old_epoch) or not item.alt_token_ids:
            return None
        del self.rescues[seq_id]
        self.fixups[seq_id] = r.scratch
        return r

    @staticmethod
    def as_real(item: Item, epoch: int) -> Item:
        """The rescued draft item as the real one-token item the ledger now holds at its position."""
        return dataclasses.replace(item, epoch=epoch, kind=ItemKind.DECODE, token_ids=(), alt_token_ids=(),
                                   tree_scratch=0)

    def forget(self, seq_id: int) -> None:
        """The sequence finished or was replayed: drop its rescue and fix-up."""
        self.rescues.pop(seq_id, None)
        self.fixups.pop(seq_id, None)

    def exit_top_k(self, want_exit: bool) -> int:
        """Item.exit_top_k of an item whose exit guess may start a tree draft (any sampling
        settings: [Note: token trees], sampling)."""
        return self.width if want_exit and self.enabled else 1

    def draft_fields(self, predictor, context: Sequence[int], guess: ExitGuess | None, draft: Draft, *,
                     start: int, chain: Sequence[InFlight], has_firp: bool) -> dict:
        """Item fields (alt_token_ids, tree_scratch) of a draft at `start`: none with trees off, nor on
        a draft with more rows than its own (FIRP rows, a grammar's jump-forward run), nor when a tree
        draft of the sequence's in-flight `chain` has the same scratch (possible only after a jump item,
        which spans several positions: [Note: token trees], scratch)."""
        clash = any(f.alts and self.scratch_of(f.position) == self.scratch_of(start) for f in chain)
        alts = self.siblings(predictor, context, guess, draft) if self.enabled and not has_firp and not clash else ()
        if not alts:
            return {}
        self.counters.tree_drafts += 1
        self.counters.sibling_rows += len(alts)
        return {"alt_token_ids": alts, "tree_scratch": self.scratch_of(start)}

    def rescue_for(self, seq, item: Item, tokens: Sequence[int], *, eos_token_ids: Collection[int]) -> Rescue | None:
        """Call with the tokens the result of `item` (the chain's head) commits, before the ledger
        applies them: when the next in-flight item is a tree draft at item.end whose sibling is the
        real token there, the rescue to make; None otherwise, or when that token ends the sequence
        (EOS, a stop token id, budget): nothing would follow it."""
        chain, end = seq.ledger.inflight, item.end
        if len(chain) < 2 or chain[1].position != end or not chain[1].alts or len(tokens) != item.num_tokens:
            return None
        index = self.verify(primary=chain[1].token, siblings=chain[1].alts, real=tokens[-1])
        room = (seq.finish_reason_at(tokens[-1], tuple(eos_token_ids)) is None
                and len(seq.output_ids) + len(tokens) < seq.params.max_new_tokens)
        if index < 0 or not room:
            return None
        self.counters.rescues += 1
        return Rescue(end, chain[1].epoch, 1 + index, self.scratch_of(end) + index)

    def result_rows(self, seq, item: Item, argmax: list[int],
                    logits: torch.Tensor | None = None) -> tuple[Item, list[int], torch.Tensor | None]:
        """(item, argmax of the rows to verify, their logits) of one returned item: a tree draft's
        own row without its siblings' rows; for the draft a rescue waits for (`seq` live), the
        rescued item as the real one in the sequence's epoch, with its sibling row's argmax (the
        real next token under greedy) and logits (the distribution it is sampled from).
        logits: [num_result_rows, vocab] of an item with want_logits, else None."""
        own, siblings = argmax[:item.num_tokens], argmax[item.num_tokens:]
        rescue = self.rescue_of(item.seq_id, item) if seq is not None and not seq.finished else None
        if rescue is None:
            return item, own, None if logits is None else logits[:item.num_tokens]
        rows = None if logits is None else logits[rescue.row:rescue.row + 1]
        return self.as_real(item, seq.epoch), [siblings[rescue.row - 1]], rows
