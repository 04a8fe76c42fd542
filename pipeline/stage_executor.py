"""Stage executor: what one stage does with the items it receives. Pure (no processes, no wire).

Owns the stage's KV cache, each live sequence's epoch as this stage has seen it, dropping stale
items, and turning a micro-batch of items into the tensors the next hop needs.

[Note: in-band squash]
A squash is never a separate broadcast. When the coordinator squashes a sequence it bumps the
sequence's epoch and sends the corrected item, tagged with the new epoch and starting at the
committed length, down the same ordered channels as all other work. Every stage therefore sees,
for each sequence, all items of the old epoch before the first item of the new one. On that item a
stage truncates the sequence's KV slot to the item's start (the committed length) before running
it; any old-epoch item that arrives later (it cannot, on FIFO channels, but a stale draft created
by an earlier stage may) is dropped. Rollback is carried with the next step (petals' "start from
position N"). Because every item starts where its slot's valid KV ends, each stage simply
truncates the slot to `item.start` before running an item.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pipeline.items import Item, ItemKind
from pipeline.kv_cache import KVCache
from pipeline.model import Span, StageModel
from pipeline.predictors import ExitHead


@dataclasses.dataclass
class StageCounters:
    """Cumulative counters of one stage since the last reset (nanoseconds and counts)."""

    busy_ns: int = 0
    items_processed: int = 0
    tokens_processed: int = 0
    items_dropped: int = 0
    reset_at_ns: int = dataclasses.field(default_factory=time.perf_counter_ns)

    def reset(self) -> None:
        self.busy_ns = self.items_processed = self.tokens_processed = self.items_dropped = 0
        self.reset_at_ns = time.perf_counter_ns()


@dataclasses.dataclass
class StageOutput:
    """What a stage produced for a micro-batch.

    items: the items that ran (stale ones removed), token ids stripped.
    hidden: [num_tokens, hidden_size] for a non-last stage.
    token_ids: [num_items] int64 argmax of each item's last row (last stage).
    logits: [num_items_wanting_logits, vocab_size] float32 (last stage, only items with want_logits).
    exit_tokens, exit_probs: [num_items] the exit head's top token and its probability at each
        item's last row (exit stage with an exit head; prefill items get -1 / 0).
    """

    items: list[Item]
    hidden: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    exit_tokens: torch.Tensor | None = None
    exit_probs: torch.Tensor | None = None


class StageExecutor:
    """Runs `model` on micro-batches, keeping per-sequence epochs and the KV cache consistent.

    See [Note: in-band squash]. Raises ValueError for items that do not fit the KV cache.
    """

    def __init__(self, model: StageModel, kv: KVCache, *, exit_layer: int | None = None,
                 exit_head: ExitHead | None = None) -> None:
        if exit_layer is not None and exit_layer not in model.layer_range:
            raise ValueError(f"exit layer {exit_layer} is not in this stage's layers {model.layer_range}")
        self.model = model
        self.kv = kv
        self.exit_layer = exit_layer
        self.exit_head = exit_head
        self.epochs: dict[int, int] = {}
        self.counters = StageCounters()

    def admit(self, items: list[Item]) -> list[bool]:
        """Apply epochs and truncation for `items`; returns which of them are current (to run)."""
        keep = []
        for it in items:
            known = self.epochs.get(it.seq_id, -1)
            if it.epoch < known:
                keep.append(False)
                continue
            self.epochs[it.seq_id] = it.epoch
            self.kv.truncate(it.slot, it.start)
            keep.append(True)
        return keep

    def run(self, items: list[Item], x: torch.Tensor) -> StageOutput:
        """Run a micro-batch. x: [num_tokens] token ids (first stage) or [num_tokens, hidden]."""
        start_ns = time.perf_counter_ns()
        keep = self.admit(items)
        if not all(keep):
            x = x[_rows(items, keep)]
            self.counters.items_dropped += keep.count(False)
            items = [it for it, k in zip(items, keep, strict=True) if k]
        if not items:
            return StageOutput(items=[])
        spans = [Span(it.slot, it.start, it.num_tokens) for it in items]
        use_head = self.exit_head is not None and any(it.kind != ItemKind.PREFILL for it in items)
        out, exit_hidden = self.model.forward_with_exit(x.to(self._device), spans, self.kv,
                                                        exit_layer=self.exit_layer if use_head else None)
        result = StageOutput(items=[it.without_tokens() for it in items])
        if use_head:
            result.exit_tokens, result.exit_probs = self._exit_guesses(items, exit_hidden)
        if self.model.is_last:
            result.token_ids = out.argmax(dim=-1).cpu()
            want = [i for i, it in enumerate(items) if it.want_logits]
            if want:
                result.logits = out[want].cpu()
        else:
            result.hidden = out
        self.counters.busy_ns += time.perf_counter_ns() - start_ns
        self.counters.items_processed += len(items)
        self.counters.tokens_processed += sum(it.num_tokens for it in items)
        return result

    def _exit_guesses(self, items: list[Item], exit_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exit head on the last row of each non-prefill item (drafts never follow a prefill)."""
        tokens = torch.full((len(items),), -1, dtype=torch.int64)
        probs = torch.zeros(len(items), dtype=torch.float32)
        rows = [i for i, it in enumerate(items) if it.kind != ItemKind.PREFILL]
        t, p = self.exit_head(exit_hidden[rows])
        tokens[rows], probs[rows] = t.cpu(), p.cpu()
        return tokens, probs

    def release(self, seq_ids: list[int], slots: list[int]) -> None:
        """Forget finished sequences and free their KV slots."""
        for seq_id in seq_ids:
            self.epochs.pop(seq_id, None)
        for slot in slots:
            self.kv.free(slot)

    def clear(self) -> None:
        """Drop every sequence and free every KV slot."""
        self.epochs.clear()
        for slot in range(self.kv.max_num_seqs):
            self.kv.free(slot)

    @property
    def _device(self) -> torch.device:
        return self.model.inv_freq.device


def _rows(items: list[Item], keep: list[bool]) -> torch.Tensor:
    """Packed row indices of the kept items."""
    rows, row = [], 0
    for it, k in zip(items, keep, strict=True):
        if k:
            rows.extend(range(row, row + it.num_tokens))
        row += it.num_tokens
    return torch.tensor(rows, dtype=torch.int64)
