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
truncates the slot to `item.start` before running an item. The real item that follows a rescued
token-tree sibling also carries a KV fix-up (`Item.keep_sibling`): in the same step, before the
truncation, the stage copies the sibling's scratch entry to position start - 1 ([Note: token
trees] in pipeline/speculation/tree.py).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pipeline.engine.records import NON_FINITE_TOKEN
from pipeline.model.kv_cache import KVCache
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel
from pipeline.speculation.firp import FirpMaps
from pipeline.speculation.items import Item
from pipeline.speculation.logprobs import reduce_prompt_rows
from pipeline.speculation.predictors import ExitHead


@dataclasses.dataclass
class StageCounters:
    """Cumulative counters of one stage since the last reset (nanoseconds and counts)."""

    busy_ns: int = 0
    items_processed: int = 0
    tokens_processed: int = 0
    reset_at_ns: int = dataclasses.field(default_factory=time.perf_counter_ns)

    def reset(self) -> None:
        self.busy_ns = self.items_processed = self.tokens_processed = 0
        self.reset_at_ns = time.perf_counter_ns()


@dataclasses.dataclass
class StageOutput:
    """What a stage produced for a micro-batch.

    items: the items that ran (stale ones removed), token ids stripped.
    hidden: [num_rows, hidden_size] for a non-last stage (`Item.num_rows`: token-tree siblings too).
    pseudo: [num_pseudo, hidden_size] FIRP pseudo rows for the next stage (non-last stage, once
        they exist), in item order.
    token_ids: [sum of items' num_result_rows] int64 argmax of each result row (last stage): the
        last row of a prefill, every row of any other item.
    logits: [`num_result_rows` of each item with want_logits, summed, vocab_size] float32 (last stage).
    prompt_next: [sum of items' `num_prompt_rows`] int64, the next prompt token of each prompt row
        (non-last stage: passed on as it arrived, rows of stale items removed).
    prompt_logprobs: (chosen [P], top_ids [P, k], top_logprobs [P, k], rank [P]) of those P prompt rows
        (last stage; `reduce_prompt_rows`), or None when no item wants them.
    firp_tokens: [num_pseudo] int64 argmax of every pseudo row (last stage; the FIRP drafts).
    firp_probs: [num_pseudo] float32 softmax probability of each FIRP draft (its confidence).
    exit_tokens, exit_probs: [num_items] the exit head's top token and its probability at each
        item's last row (exit stage with an exit head; prefill items and items without
        `want_exit` get -1 / 0; None when no item wanted a guess, so the head did not run).
    """

    items: list[Item]
    hidden: torch.Tensor | None = None
    pseudo: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    firp_tokens: torch.Tensor | None = None
    firp_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    prompt_next: torch.Tensor | None = None
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    exit_tokens: torch.Tensor | None = None
    exit_probs: torch.Tensor | None = None


class StageExecutor:
    """Runs `model` on micro-batches, keeping per-sequence epochs and the KV cache consistent.

    See [Note: in-band squash]. Raises ValueError for items that do not fit the KV cache.
    FIRP: `firp_layer` is the layer whose output feeds the FIRP maps (known to every stage, so a
    stage after it can check that pseudo rows arrived); `firp_maps` is held by the stage that has
    that layer, which turns each item's anchors into pseudo rows ([Note: pseudo rows] in
    pipeline/model/row_layout.py).
    max_scratch: token-tree KV scratch positions per slot an item may use (the load spec's
    `tree_scratch`); the cache grows to all of them at the first tree item if it has fewer (one
    growth per run). None: as many as the items name (in-process use).
    """

    def __init__(self, model: StageModel, kv: KVCache, *, exit_layer: int | None = None,
                 exit_head: ExitHead | None = None, firp_layer: int | None = None,
                 firp_maps: FirpMaps | None = None, max_scratch: int | None = None) -> None:
        if exit_layer is not None and exit_layer not in model.layer_range:
            raise ValueError(f"exit layer {exit_layer} is not in this stage's layers {model.layer_range}")
        if (firp_maps is not None) != (firp_layer is not None and firp_layer in model.layer_range):
            raise ValueError(f"FIRP maps belong to the stage holding the FIRP layer {firp_layer} "
                             f"(this stage holds {model.layer_range})")
        self.model = model
        self.firp_layer = firp_layer
        self.firp_maps = firp_maps
        self.kv = kv
        self.exit_layer = exit_layer
        self.exit_head = exit_head
        self.max_scratch = max_scratch
        self.epochs: dict[int, int] = {}
        self.counters = StageCounters()

    def admit(self, items: list[Item]) -> list[bool]:
        """Apply epochs and truncation for `items`; returns which of them are current (to run).
        Raises ValueError for an item whose token-tree siblings need scratch past `max_scratch`."""
        for it in items:
            if it.alt_token_ids and self.max_scratch is not None and it.tree_scratch + len(it.alt_token_ids) > self.max_scratch:
                raise ValueError(f"item of seq {it.seq_id}: token-tree scratch {it.tree_scratch} + "
                                 f"{len(it.alt_token_ids)} siblings past this stage's {self.max_scratch} positions")
        keep = admit_epochs(self.epochs, items)
        for it, current in zip(items, keep, strict=True):
            if current:
                if it.keep_sibling >= 0:  # a rescued sibling's KV ([Note: token trees] in pipeline/speculation/tree.py)
                    self.kv.keep_scratch(it.slot, it.keep_sibling, it.start - 1)
                self.kv.truncate(it.slot, it.start)  # the item starts at the committed length
                if it.alt_token_ids:
                    self.kv.ensure_scratch(self.max_scratch or it.tree_scratch + len(it.alt_token_ids))
        return keep

    def run(self, items: list[Item], x: torch.Tensor, pseudo: torch.Tensor | None = None, *,
            interrupt=None, prompt_next: torch.Tensor | None = None) -> StageOutput:
        """Run a micro-batch. x: [num_tokens] token ids (first stage) or [num_tokens, hidden];
        pseudo: [num_pseudo, hidden] FIRP pseudo rows from the previous stage, or None;
        prompt_next: [sum of items' num_prompt_rows] int64 (`StageOutput.prompt_next`), or None;
        interrupt: checked between layers (`StageModel.forward_rows`). Raises ValueError if pseudo
        rows are missing on a stage after the FIRP layer, or the last stage's prompt_next does not
        match its items, PassInterrupted when `interrupt()` stopped it."""
        start_ns = time.perf_counter_ns()
        keep = self.admit(items)
        if not all(keep):
            x = x[_rows(items, keep)]
            if pseudo is not None:
                pseudo = pseudo[_rows(items, keep, rows_of=lambda it: it.num_pseudo)]
            if prompt_next is not None:
                prompt_next = prompt_next[_rows(items, keep, rows_of=lambda it: it.num_prompt_rows)]
            items = [it for it, k in zip(items, keep, strict=True) if k]
        if not items:
            return StageOutput(items=[])
        spans, primary = item_spans(items)
        num_pseudo = sum(it.num_pseudo for it in items)
        if not num_pseudo:
            pseudo = None
        elif pseudo is None and self.firp_layer is not None and self.firp_layer < self.model.layer_range.start:
            raise ValueError(f"items need {num_pseudo} FIRP pseudo rows, but none arrived from the stage before")
        use_head = self.exit_head is not None and any(it.wants_exit_guess for it in items)
        make_pseudo = None
        if self.firp_maps is not None and pseudo is None and num_pseudo:
            lens = [it.firp_k for it in items for _ in range(it.firp_anchors if it.firp_k else 0)]
            make_pseudo = lambda anchors: self.firp_maps.chains(anchors, lens)  # noqa: E731
        logit_rows = result_index = order = None
        if self.model.is_last:
            rows, result_index = _logit_rows(items)
            logit_rows, order = _head_rows(rows, result_index, self._device)
        fwd = self.model.forward_rows(x.to(self._device), spans, self.kv, logit_rows=logit_rows,
                                      exit_layer=self.exit_layer if use_head else None,
                                      pseudo=None if pseudo is None else pseudo.to(self._device),
                                      firp_layer=self.firp_layer, make_pseudo=make_pseudo, interrupt=interrupt)
        result = StageOutput(items=[it.without_tokens() for it in items])
        if use_head:
            result.exit_tokens, result.exit_probs = self._exit_guesses(items, fwd.exit_hidden[primary])
        if self.model.is_last:
            # [logit rows, vocab]: result rows, plus the prompt rows of want_prompt_logits items
            out = fwd.out if order is None else fwd.out[order]
            # every logit row a result row (decode, drafts): `out` itself, no 200 KB gather per row
            rows_out = out if len(result_index) == out.shape[0] else out[result_index]
            result.token_ids = _argmax_or_non_finite(rows_out).cpu()
            result.logits, result.prompt_logprobs = _returned_logits(items, out, prompt_next)
            if fwd.pseudo is not None:
                probs, tokens = torch.softmax(fwd.pseudo, dim=-1).max(dim=-1)
                result.firp_tokens, result.firp_probs = tokens.cpu(), probs.cpu()
        else:
            result.hidden = fwd.out
            result.pseudo = fwd.pseudo
            result.prompt_next = prompt_next
        self.counters.busy_ns += time.perf_counter_ns() - start_ns
        self.counters.items_processed += len(items)
        self.counters.tokens_processed += sum(it.num_rows for it in items)
        return result

    def _exit_guesses(self, items: list[Item], exit_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exit head on the last row of each item that wants a guess (`Item.wants_exit_guess`); the
        others get token -1 / probability 0."""
        rows = [i for i, it in enumerate(items) if it.wants_exit_guess]
        k = max(items[i].exit_top_k for i in rows)  # token trees want the head's top-k
        tokens = torch.full((len(items), k) if k > 1 else (len(items),), -1, dtype=torch.int64)
        probs = torch.zeros(tokens.shape, dtype=torch.float32)
        t, p = self.exit_head(exit_hidden[rows], top_k=k) if k > 1 else self.exit_head(exit_hidden[rows])
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


def admit_epochs(epochs: dict[int, int], items: list[Item]) -> list[bool]:
    """The stage's epoch rule ([Note: in-band squash]): an item older than the newest epoch this
    stage has seen of its sequence is stale (False); any other is current (True) and its epoch
    becomes the newest. `epochs` (seq_id -> newest epoch seen) is updated in place. The simulator
    applies the same rule to its simulated stages."""
    keep = []
    for it in items:
        current = it.epoch >= epochs.get(it.seq_id, -1)
        if current:
            epochs[it.seq_id] = it.epoch
        keep.append(current)
    return keep


def item_spans(items: list[Item]) -> tuple[list[Span], list[int]]:
    """The spans of `items` in packed row order (each item's own span, then one per token-tree
    sibling: [Note: sibling rows] in pipeline/model/row_layout.py), and each item's own span index."""
    spans, primary = [], []
    for it in items:
        primary.append(len(spans))
        spans.append(Span(it.slot, it.start, it.num_tokens, it.firp_anchors, it.firp_k))
        spans.extend(Span(it.slot, it.start, 1, scratch=it.tree_scratch + j) for j in range(len(it.alt_token_ids)))
    return spans, primary


def _rows(items: list[Item], keep: list[bool], rows_of=lambda it: it.num_rows) -> torch.Tensor:
    """Packed row indices of the kept items (`rows_of(item)` rows each: real rows by default)."""
    rows, row = [], 0
    for it, k in zip(items, keep, strict=True):
        if k:
            rows.extend(range(row, row + rows_of(it)))
        row += rows_of(it)
    return torch.tensor(rows, dtype=torch.int64)


def _logit_rows(items: list[Item]) -> tuple[list[int], list[int]]:
    """(packed row indices the LM head runs on, index of each result row among them): every item's
    result rows (`Item.num_result_rows`, its last rows), or all its rows for an item with
    `want_prompt_logits` (`Item.num_logit_rows`; its result row is the last of them)."""
    rows, result_index, row = [], [], 0
    for it in items:
        row += it.num_rows
        rows.extend(range(row - it.num_logit_rows, row))
        result_index.extend(range(len(rows) - it.num_result_rows, len(rows)))
    return rows, result_index


def _head_rows(rows: list[int], result_index: list[int], device) -> tuple:
    """(`forward_rows`'s logit_rows, and the order that puts its output back into `rows`' order, or
    None). [Note: prompt rows apart] When prompt rows want logits (prompt logprobs), the head runs on
    the result rows alone, as in a pass without them, and on the prompt rows in a matmul of its own:
    a GEMM's row need not be bitwise the same at another row count (here, AMD EPYC float32: 5e-7 in
    a logprob), and the generated tokens' logits and logprobs must not depend on whether the
    request also asked for prompt logprobs (tests/distributed/test_openai_prompt_logprobs.py)."""
    if len(result_index) == len(rows):
        return torch.tensor(rows, dtype=torch.int64, device=device), None
    result = set(result_index)
    prompt_index = [i for i in range(len(rows)) if i not in result]
    order = torch.empty(len(rows), dtype=torch.int64)
    order[torch.tensor(result_index + prompt_index)] = torch.arange(len(rows))
    as_tensor = lambda idx: torch.tensor([rows[i] for i in idx], dtype=torch.int64, device=device)  # noqa: E731
    return (as_tensor(result_index), as_tensor(prompt_index)), order.to(device)


def _returned_logits(items: list[Item], out: torch.Tensor, prompt_next: torch.Tensor | None):
    """(logits of the result rows of items with want_logits, or None; prompt logprobs of the
    prompt rows of items with want_prompt_logits, or None), from the last stage's `out`: [logit
    rows of `_logit_rows(items)`, vocab]. Raises ValueError if prompt_next does not match."""
    want, prompt, row = [], [], 0
    for it in items:
        if it.want_logits:
            prompt.extend(range(row, row + it.num_prompt_rows))
            want.extend(range(row + it.num_prompt_rows, row + it.num_logit_rows))
        row += it.num_logit_rows
    reduced = None
    if prompt:
        if prompt_next is None or prompt_next.shape != (len(prompt),):
            got = None if prompt_next is None else tuple(prompt_next.shape)
            raise ValueError(f"items want the logprobs of {len(prompt)} prompt rows, but prompt_next is {got}")
        reduced = tuple(t.cpu() for t in reduce_prompt_rows(out[prompt], prompt_next))
    return (out[want].cpu() if want else None), reduced


def _argmax_or_non_finite(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits -> [rows] int64 argmax, NON_FINITE_TOKEN where a row holds NaN or inf
    ([Note: non-finite logits] in pipeline/engine/records.py).

    [Note: cheap finiteness check]
    `max(dim=-1)` gives the argmax (the first maximal value, as `argmax` picks it) and the row's
    maximum in one pass, 2.5x cheaper than `argmax` here; with `amin` (one more cheap pass) a row is
    finite exactly when its maximum and minimum are (both reductions propagate NaN; +inf is a maximum,
    -inf a minimum). The per-element `isfinite(...).all()` it replaces cost ~0.2 ms a 49k-vocab row,
    on the critical path of every token."""
    top, tokens = logits.max(dim=-1)
    finite = torch.isfinite(top) & torch.isfinite(logits.amin(dim=-1))
    return tokens if bool(finite.all()) else torch.where(finite, tokens, NON_FINITE_TOKEN)
