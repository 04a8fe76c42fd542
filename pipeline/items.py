"""Items: the units of work that travel through the pipeline.

An item is a few consecutive token positions of one sequence, tagged with the sequence's epoch
(ARCHITECTURE.md §1). Owns the `Item` record and its wire form (a plain msgpack-able dict).
Must not: know about torch.distributed or processes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class ItemKind(enum.IntEnum):
    """What an item is: the prompt pass, a committed-token decode pass, a speculative draft (SPEED),
    or a FIRP chain (a committed token followed by FIRP drafts, verified in one pass)."""

    PREFILL = 0
    DECODE = 1
    DRAFT = 2
    FIRP = 3


NO_TOKEN = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Item:
    """Positions [start, start + num_tokens) of sequence `seq_id`, in KV slot `slot`, at `epoch`.

    token_ids: the input token ids, kept by the coordinator (on the wire they travel as the first
        stage's input tensor "x", and items carry none).
    want_logits: the last stage returns float32 logits for this item's last row (sampling needs
        them); otherwise only the argmax id.
    draft_token: the draft injected right after this item (SPEED; NO_TOKEN if none).
    firp_k, firp_anchors: FIRP pseudo chains of `firp_k` rows hang off the item's last
        `firp_anchors` rows (see [Note: pseudo rows] in pipeline/spans.py); 0 = none.
    want_exit: the exit stage runs its exit head on this item's last row (SPEED). The scheduler
        clears it when no draft made from that guess could be sent ([Note: exit-head skipping] in
        pipeline/scheduler.py); prefill items never get a guess either way.
    """

    seq_id: int
    slot: int
    start: int
    num_tokens: int
    epoch: int = 0
    kind: ItemKind = ItemKind.DECODE
    token_ids: tuple[int, ...] = ()
    want_logits: bool = False
    draft_token: int = NO_TOKEN
    firp_k: int = 0
    firp_anchors: int = 0
    want_exit: bool = True

    def __post_init__(self) -> None:
        if self.firp_k < 0 or not 0 <= self.firp_anchors <= self.num_tokens:
            raise ValueError(f"item of seq {self.seq_id} has firp_k {self.firp_k} / firp_anchors "
                             f"{self.firp_anchors} outside [0, num_tokens {self.num_tokens}]")
        if self.num_tokens < 1:
            raise ValueError(f"item of seq {self.seq_id} has num_tokens {self.num_tokens} < 1")
        if self.start < 0 or self.slot < 0 or self.epoch < 0:
            raise ValueError(f"item of seq {self.seq_id} has a negative start/slot/epoch")
        if self.token_ids and len(self.token_ids) != self.num_tokens:
            raise ValueError(
                f"item of seq {self.seq_id} carries {len(self.token_ids)} token ids for {self.num_tokens} positions"
            )

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + self.num_tokens

    @property
    def num_result_rows(self) -> int:
        """Rows whose next-token result the last stage returns: the last row of a prefill, every
        row of any other item (a FIRP chain verifies each of its drafts)."""
        return 1 if self.kind == ItemKind.PREFILL else self.num_tokens

    @property
    def num_pseudo(self) -> int:
        """FIRP pseudo rows this item carries after the FIRP layer."""
        return self.firp_k * self.firp_anchors

    def to_wire(self) -> list[Any]:
        """Compact msgpack-able form (a list, field order fixed by `_WIRE_FIELDS`)."""
        return [self.seq_id, self.slot, self.start, self.num_tokens, self.epoch, int(self.kind),
                list(self.token_ids), self.want_logits, self.draft_token, self.firp_k, self.firp_anchors,
                self.want_exit]

    @classmethod
    def from_wire(cls, raw: Any) -> Item:
        """Parse and validate the wire form. Raises ValueError on anything malformed."""
        if not isinstance(raw, list) or len(raw) != len(_WIRE_FIELDS):
            raise ValueError(f"malformed item: expected a list of {len(_WIRE_FIELDS)} fields")
        fields = dict(zip(_WIRE_FIELDS, raw, strict=True))
        for name in ("seq_id", "slot", "start", "num_tokens", "epoch", "kind", "draft_token", "firp_k", "firp_anchors"):
            if type(fields[name]) is not int:
                raise ValueError(f"malformed item: {name} is not an int")
        for name in ("want_logits", "want_exit"):
            if type(fields[name]) is not bool:
                raise ValueError(f"malformed item: {name} is not a bool")
        tokens = fields["token_ids"]
        if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
            raise ValueError("malformed item: token_ids is not a list of ints")
        try:
            kind = ItemKind(fields["kind"])
        except ValueError:
            raise ValueError(f"malformed item: unknown kind {fields['kind']}") from None
        return cls(seq_id=fields["seq_id"], slot=fields["slot"], start=fields["start"],
                   num_tokens=fields["num_tokens"], epoch=fields["epoch"], kind=kind,
                   token_ids=tuple(tokens), want_logits=fields["want_logits"], draft_token=fields["draft_token"],
                   firp_k=fields["firp_k"], firp_anchors=fields["firp_anchors"], want_exit=fields["want_exit"])

    def without_tokens(self) -> Item:
        """The same item without its token ids (what stages after the first receive)."""
        return dataclasses.replace(self, token_ids=()) if self.token_ids else self


_WIRE_FIELDS = ("seq_id", "slot", "start", "num_tokens", "epoch", "kind", "token_ids", "want_logits", "draft_token",
                "firp_k", "firp_anchors", "want_exit")
