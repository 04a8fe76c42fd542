"""Where an item's rows sit in a packed micro-batch: `Span`, and the layout of FIRP pseudo rows.

[Note: pseudo rows]
FIRP (arXiv 2410.20488 §3) adds *pseudo rows*: hidden states predicted at an intermediate layer
for future positions. A span with `num_anchors` A and `chain_len` k owns A chains of k pseudo rows;
chain a hangs off real row n - A + a (position p_a) and its rows sit at positions p_a + 1 .. p_a + k.
Pseudo rows follow all real rows of the micro-batch, span by span, chain by chain. A pseudo row
attends to the cached keys of positions <= p_a (including this pass's real rows up to its anchor)
and causally to the earlier rows of its own chain; real rows never see pseudo rows. Pseudo rows
are never written into the KV cache: running them is exactly running the chain as real tokens
on a copy of the cache truncated after the anchor (tests/unit/test_pseudo_rows.py checks this).

[Note: sibling rows]
A token-tree sibling (EAGLE-2 arXiv 2406.16858 §3, SpecPipe arXiv 2504.04104: a depth-1 tree of
alternative candidates for one draft position) is a span of one row with `scratch` >= 0: it sits
at RoPE position `start` like the primary candidate of its item, attends to the slot's keys
[0, start) and to its own key only (never to the primary's, which this pass writes at `start`),
and its keys/values go to scratch position `scratch` of the slot, not to `start`. In the attention
its own key takes the place of key `start`, so the row computes exactly what a plain 1-row item
with that token at `start` computes (bitwise on the batch-invariant path,
tests/unit/test_token_tree_rows.py). `KVCache.keep_scratch` later copies the scratch entry to
`start` if the sibling turns out to be the real token; otherwise it is only ever read as a masked
key (a block read near max_model_len, pipeline/model/kv_cache.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Span:
    """Where one item's rows sit: KV `slot`, first position `start`, `num_tokens` rows; plus its
    FIRP pseudo chains: `chain_len` rows hanging off each of its last `num_anchors` rows
    (see [Note: pseudo rows]); `scratch` >= 0: a one-row token-tree sibling whose keys/values go
    to that scratch position of the slot ([Note: sibling rows]); -1: an ordinary span."""

    slot: int
    start: int
    num_tokens: int
    num_anchors: int = 0
    chain_len: int = 0
    scratch: int = -1

    def __post_init__(self) -> None:
        assert self.scratch < 0 or (self.num_tokens == 1 and not self.num_pseudo), self

    @property
    def is_sibling(self) -> bool:
        """A token-tree sibling row ([Note: sibling rows])."""
        return self.scratch >= 0

    @property
    def num_pseudo(self) -> int:
        """Pseudo rows of this span (0 without FIRP chains)."""
        return self.num_anchors * self.chain_len if self.chain_len else 0

    def pseudo_positions(self) -> list[int]:
        """Positions of the pseudo rows, chain by chain: [num_pseudo]."""
        first_anchor = self.start + self.num_tokens - self.num_anchors
        return [first_anchor + a + 1 + j for a in range(self.num_anchors) for j in range(self.chain_len)]

    def pseudo_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Attention mask of this span's real then pseudo queries over cached then pseudo keys:
        [num_tokens + num_pseudo, start + num_tokens + num_pseudo] bool (True = may attend)."""
        n, p, end = self.num_tokens, self.num_pseudo, self.start + self.num_tokens
        mask = torch.zeros(n + p, end + p, dtype=torch.bool)
        key_pos = torch.arange(end)
        mask[:n, :end] = key_pos[None, :] <= torch.arange(self.start, end)[:, None]
        k = self.chain_len
        causal = torch.ones(k, k, dtype=torch.bool).tril()
        for a in range(self.num_anchors):
            anchor_pos = end - self.num_anchors + a
            rows = slice(n + a * k, n + (a + 1) * k)
            mask[rows, :anchor_pos + 1] = True
            mask[rows, end + a * k:end + (a + 1) * k] = causal
        return mask.to(device)


@dataclasses.dataclass
class PseudoLayout:
    """Where the pseudo rows of a packed micro-batch sit: after the real rows; span i's rows start
    at `offsets[i]`; `masks[i]` from `Span.pseudo_mask` (None: span has none)."""

    offsets: list[int]
    masks: list[torch.Tensor | None]

    @classmethod
    def build(cls, spans: Sequence[Span], device: torch.device | str) -> PseudoLayout:
        num_real = sum(s.num_tokens for s in spans)
        offsets, masks, row = [], [], num_real
        for s in spans:
            offsets.append(row)
            masks.append(s.pseudo_mask(device) if s.num_pseudo else None)
            row += s.num_pseudo
        return cls(offsets, masks)


def last_rows_of(spans: Sequence[Span]):
    """Packed row index of every span's last real row, in span order."""
    row = 0
    for span in spans:
        row += span.num_tokens
        yield row - 1


def anchor_rows(spans: Sequence[Span]):
    """Packed row indices of the anchors of every span's pseudo chains, in span order."""
    row = 0
    for span in spans:
        if span.num_pseudo:
            yield from range(row + span.num_tokens - span.num_anchors, row + span.num_tokens)
        row += span.num_tokens


class PassInterrupted(Exception):
    """`StageModel.forward_rows` stopped between two layers because its `interrupt()` said so.

    The pass's rows were written into the KV cache for the layers already run, at positions past
    every span's committed length (the lengths move only when a pass completes), so the next item
    of the sequence overwrites them; the model changed nothing else. Used for drafts a squash made stale
    ([Note: stage-local drafting] 6 in pipeline/engine/local_draft.py)."""

    def __init__(self, layers_run: int) -> None:
        super().__init__(f"pass interrupted after {layers_run} layers")
        self.layers_run = layers_run
