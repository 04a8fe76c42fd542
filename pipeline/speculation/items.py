"""Items: the units of work that travel through the pipeline.

An item is a few consecutive token positions of one sequence, tagged with the sequence's epoch
(ARCHITECTURE.md §1). Owns the `Item` record and its wire form (`items_to_wire` / `items_from_wire`: named columns).
Must not: know about torch.distributed or processes.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Sequence
from typing import Any

MAX_DRAFT_TREE = 8  # --draft-tree cap: candidates per draft position (primary + siblings), pipeline/speculation/tree.py
MAX_TREE_SCRATCH = 1 << 16  # token-tree scratch positions per KV slot an item may name (the stage's own
# bound, from its load spec, is tighter: StageExecutor.max_scratch)
MAX_DRAFT_WITH = 255  # Item.draft_with: a built-in predictor code, or local_draft.CUSTOM (255)
MAX_DRAFT_GATE = 1 << 63  # Item.draft_gate: local_draft.gate_bits' bits (61 used) as one int64
MAX_FEED_STOP = 512  # Item.feed_stop: EOS ids + a request's stop_token_ids (token_masks.MAX_STOP_TOKEN_IDS: 300)


class ItemKind(enum.IntEnum):
    """What an item is: the prompt pass, a committed-token decode pass, a speculative draft (SPEED),
    or a FIRP chain (a committed token followed by FIRP drafts, verified in one pass)."""

    PREFILL = 0
    DECODE = 1
    DRAFT = 2
    FIRP = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Item:
    """Positions [start, start + num_tokens) of sequence `seq_id`, in KV slot `slot`, at `epoch`.

    token_ids: the input token ids, kept by the coordinator (on the wire they travel as the first
        stage's input tensor "x", and items carry none).
    want_logits: the last stage returns float32 logits for this item's result rows (sampling,
        penalties and logprobs need them); otherwise only the argmax ids.
    want_prompt_logits: (prefill items with want_logits) the last stage also runs its LM head on
        every prompt row and returns their logprobs (OpenAI `echo`): each row's next prompt token
        travels along the ring as tensor "prompt_next" (`num_prompt_rows` per item), see
        `pipeline.speculation.logprobs.reduce_prompt_rows`.
    firp_k, firp_anchors: FIRP pseudo chains of `firp_k` rows hang off the item's last
        `firp_anchors` rows (see [Note: pseudo rows] in pipeline/model/row_layout.py); 0 = none.
    want_exit: the exit stage runs its exit head on this item's last row (SPEED). The scheduler
        clears it when no draft made from that guess could be sent ([Note: exit-head skipping] in
        pipeline/engine/row_budget.py); prefill items never get a guess either way (`wants_exit_guess`).
    draft_upto, draft_cap, draft_gate, draft_with, self_made: stage-local drafting ([Note:
        stage-local drafting] in pipeline/engine/local_draft.py). draft_upto > 0: the exit stage may
        draft after this item itself while its last position is < draft_upto (< draft_cap: within
        the coordinator's own chain cap); draft_gate: the draft gate's open bits; draft_with: which
        predictor the stage runs; self_made: the exit stage made this draft. Defaults: off.
    draft_logits_upto: (stage-local drafting) a draft the exit stage makes after this item asks for
        logits rows exactly when its start is < draft_logits_upto (`SequenceState.logits_upto`: the
        coordinator's own `wants_logits` rule, which min_tokens makes fall once); 0: never.
    alt_token_ids: token-tree siblings of a one-token DRAFT item: alternative candidates for
        position `start`, one extra row each after the item's own row; sibling j's keys/values go
        to KV scratch position `tree_scratch + j` ([Note: token trees] in pipeline/speculation/tree.py).
        Unlike token_ids they travel to every stage (each stage needs the row count).
    keep_sibling: >= 0 on the real item that follows a rescued sibling: before truncating, every
        stage copies KV scratch position `keep_sibling` of the slot to position start - 1 (the
        sibling, verified, becomes the real entry there); -1: no fix-up.
    exit_top_k: the exit stage returns the exit head's top `exit_top_k` tokens for this item (the
        token-tree candidates of the draft after it); 1: its top token only.
    feed_upto, feed_stop: self-fed decode ([Note: self-fed decode] in pipeline/engine/decode_feed.py).
        feed_upto > 0: the last stage may turn this item's result token into the
        next DECODE item itself (start = end) while that item's start is < feed_upto, and not when
        the token is one of feed_stop (the ids that end the sequence). Defaults: off.
    """

    seq_id: int
    slot: int
    start: int
    num_tokens: int
    epoch: int = 0
    kind: ItemKind = ItemKind.DECODE
    token_ids: tuple[int, ...] = ()
    want_logits: bool = False
    firp_k: int = 0
    firp_anchors: int = 0
    want_exit: bool = True
    want_prompt_logits: bool = False
    draft_upto: int = 0
    draft_cap: int = 0
    draft_gate: int = 0
    draft_with: int = 0
    self_made: bool = False
    draft_logits_upto: int = 0
    alt_token_ids: tuple[int, ...] = ()
    tree_scratch: int = 0
    keep_sibling: int = -1
    exit_top_k: int = 1
    feed_upto: int = 0
    feed_stop: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.alt_token_ids and (self.kind != ItemKind.DRAFT or self.num_tokens != 1 or self.firp_k
                                   or self.tree_scratch < 0):
            raise ValueError(f"item of seq {self.seq_id}: siblings need a one-token draft without FIRP rows, "
                             f"at a scratch position >= 0")
        self._check_tree_and_draft_fields()
        if self.firp_k < 0 or not 0 <= self.firp_anchors <= self.num_tokens:
            raise ValueError(f"item of seq {self.seq_id} has firp_k {self.firp_k} / firp_anchors "
                             f"{self.firp_anchors} outside [0, num_tokens {self.num_tokens}]")
        if self.num_tokens < 1:
            raise ValueError(f"item of seq {self.seq_id} has num_tokens {self.num_tokens} < 1")
        if self.start < 0 or self.slot < 0 or self.epoch < 0:
            raise ValueError(f"item of seq {self.seq_id} has a negative start/slot/epoch")
        if self.want_prompt_logits and (self.kind != ItemKind.PREFILL or not self.want_logits):
            raise ValueError(f"item of seq {self.seq_id}: want_prompt_logits needs a prefill with want_logits")
        if self.token_ids and len(self.token_ids) != self.num_tokens:
            raise ValueError(
                f"item of seq {self.seq_id} carries {len(self.token_ids)} token ids for {self.num_tokens} positions"
            )

    def _check_tree_and_draft_fields(self) -> None:
        """The token-tree and stage-local drafting columns are bounded (they may come off the wire)."""
        if not 1 <= self.exit_top_k <= MAX_DRAFT_TREE or len(self.alt_token_ids) > MAX_DRAFT_TREE - 1:
            raise ValueError(f"item of seq {self.seq_id} has exit_top_k {self.exit_top_k} / "
                             f"{len(self.alt_token_ids)} siblings outside [1, {MAX_DRAFT_TREE}] / [0, {MAX_DRAFT_TREE - 1}]")
        if not 0 <= self.tree_scratch <= MAX_TREE_SCRATCH or not -1 <= self.keep_sibling < MAX_TREE_SCRATCH:
            raise ValueError(f"item of seq {self.seq_id} has tree_scratch {self.tree_scratch} / keep_sibling "
                             f"{self.keep_sibling} outside [0, {MAX_TREE_SCRATCH}] / [-1, {MAX_TREE_SCRATCH})")
        if self.keep_sibling >= 0 and self.start < 1:
            raise ValueError(f"item of seq {self.seq_id}: a KV fix-up needs start >= 1")
        if self.draft_upto < 0 or self.draft_cap < 0 or (self.draft_upto and self.draft_cap > self.draft_upto):
            raise ValueError(f"item of seq {self.seq_id} has draft_cap {self.draft_cap} / draft_upto "
                             f"{self.draft_upto}: need 0 <= draft_cap <= draft_upto")
        if self.draft_logits_upto < 0:
            raise ValueError(f"item of seq {self.seq_id} has draft_logits_upto {self.draft_logits_upto} < 0")
        if self.feed_upto < 0 or len(self.feed_stop) > MAX_FEED_STOP:
            raise ValueError(f"item of seq {self.seq_id} has feed_upto {self.feed_upto} < 0 or "
                             f"{len(self.feed_stop)} feed_stop ids > {MAX_FEED_STOP}")
        if not 0 <= self.draft_with <= MAX_DRAFT_WITH or not 0 <= self.draft_gate < MAX_DRAFT_GATE:
            raise ValueError(f"item of seq {self.seq_id} has draft_with {self.draft_with} / draft_gate "
                             f"{self.draft_gate} outside [0, {MAX_DRAFT_WITH}] / [0, 2**63)")

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + self.num_tokens

    @property
    def num_rows(self) -> int:
        """Packed real rows of the item: one per position, plus one per token-tree sibling."""
        return self.num_tokens + len(self.alt_token_ids)

    @property
    def input_ids(self) -> tuple[int, ...]:
        """The first stage's input tokens, one per row: token_ids, then the siblings."""
        return (*self.token_ids, *self.alt_token_ids)

    @property
    def num_result_rows(self) -> int:
        """Rows whose next-token result the last stage returns: the last row of a prefill, every
        row of any other item (a FIRP chain verifies each of its drafts; a draft's siblings come
        after its own row)."""
        return 1 if self.kind == ItemKind.PREFILL else self.num_rows

    @property
    def num_logit_rows(self) -> int:
        """Rows the last stage runs its LM head on: every row with `want_prompt_logits` (the result
        row is the last of them), else the result rows."""
        return self.num_tokens if self.want_prompt_logits else self.num_result_rows

    @property
    def num_prompt_rows(self) -> int:
        """Prompt rows whose logprobs the last stage returns (`want_prompt_logits`: all rows but the
        last, whose next token is the first generated one), else 0."""
        return self.num_tokens - 1 if self.want_prompt_logits else 0

    @property
    def may_precede_draft(self) -> bool:
        """Whether a draft may follow this item, so it passes the exit layer with an exit event.
        The one rule: never after a prefill (the first token after a prefill is never speculative,
        ARCHITECTURE.md §5.5). The scheduler, the exit stage and the simulator all ask this."""
        return self.kind != ItemKind.PREFILL

    @property
    def wants_exit_guess(self) -> bool:
        """Whether the exit stage runs its exit head on this item's last row: a draft may follow
        it and the scheduler left `want_exit` set ([Note: exit-head skipping] in pipeline/engine/row_budget.py)."""
        return self.may_precede_draft and self.want_exit

    @property
    def num_pseudo(self) -> int:
        """FIRP pseudo rows this item carries after the FIRP layer."""
        return self.firp_k * self.firp_anchors

    def without_tokens(self) -> Item:
        """The same item without its token ids (what stages after the first receive)."""
        return dataclasses.replace(self, token_ids=()) if self.token_ids else self




@dataclasses.dataclass(frozen=True)
class SlotRelease:
    """A finished sequence whose KV slot every stage frees (a RELEASE message carries these)."""

    seq_id: int
    slot: int


# [Note: item wire form]
# A micro-batch's items travel as named columns, {field: [value per item]}: every field is named
# on the wire (a schema, not positions), and the names cost bytes once per message, not per item.
# `token_ids` is a column of lists (empty after the first stage: they travel as tensor "x").
ITEM_WIRE_SCHEMA: dict[str, type] = {
    "seq_id": int, "slot": int, "start": int, "num_tokens": int, "epoch": int, "kind": int,
    "token_ids": list, "want_logits": bool, "firp_k": int, "firp_anchors": int, "want_exit": bool,
    "want_prompt_logits": bool, "draft_upto": int, "draft_cap": int, "draft_gate": int, "draft_with": int, "self_made": bool,
    "draft_logits_upto": int,
    "alt_token_ids": list, "tree_scratch": int, "keep_sibling": int, "exit_top_k": int,
    "feed_upto": int, "feed_stop": list,
}
_ITEM_FIELDS = operator.attrgetter(*ITEM_WIRE_SCHEMA)  # one item's values, in column order


def items_to_wire(items: Sequence[Item]) -> dict[str, list[Any]]:
    """The msgpack-able columns of `items` (see [Note: item wire form]), of the types
    `items_from_wire` accepts."""
    if not items:
        return {name: [] for name in ITEM_WIRE_SCHEMA}
    cols = dict(zip(ITEM_WIRE_SCHEMA, map(list, zip(*map(_ITEM_FIELDS, items), strict=True)), strict=True))
    cols["kind"] = [int(k) for k in cols["kind"]]
    cols["token_ids"] = [list(t) for t in cols["token_ids"]]
    cols["alt_token_ids"] = [list(t) for t in cols["alt_token_ids"]]
    cols["feed_stop"] = [list(t) for t in cols["feed_stop"]]
    return cols


def items_from_wire(raw: Any) -> list[Item]:
    """Parse and validate item columns. Raises ValueError naming the first malformed field."""
    if type(raw) is not dict or raw.keys() != ITEM_WIRE_SCHEMA.keys():
        raise ValueError(f"malformed items: expected the columns {sorted(ITEM_WIRE_SCHEMA)}")
    cols = [raw[name] for name in ITEM_WIRE_SCHEMA]
    if any(type(col) is not list for col in cols) or len(set(map(len, cols))) != 1:
        raise ValueError("malformed items: columns are not lists of one length")
    for (name, kind), col in zip(ITEM_WIRE_SCHEMA.items(), cols, strict=True):
        for v in col:
            if type(v) is not kind:
                raise ValueError(f"malformed item: {name} is not {'an int' if kind is int else 'a ' + kind.__name__}")
            if kind is list and any(type(t) is not int for t in v):
                raise ValueError(f"malformed item: {name} is not a list of ints")
    items = []
    for row in zip(*cols, strict=True):
        fields = dict(zip(ITEM_WIRE_SCHEMA, row, strict=True))
        try:
            fields["kind"] = ItemKind(fields["kind"])
        except ValueError:
            raise ValueError(f"malformed item: unknown kind {fields['kind']}") from None
        fields["token_ids"], fields["alt_token_ids"] = tuple(fields["token_ids"]), tuple(fields["alt_token_ids"])
        fields["feed_stop"] = tuple(fields["feed_stop"])
        items.append(Item(**fields))
    return items
