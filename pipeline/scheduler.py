"""Scheduler: which items enter stage 0 next, and what the last stage's results commit.

Owns every sequence's state (prompt, committed tokens, KV slot, epoch, finish reason), admission
into KV slots, micro-batch formation, and turning results into committed tokens.
Pure: the real coordinator (launcher/coordinator.py) and the discrete-event simulator drive the
same object with the same calls. Must not: do I/O, know about ranks, tokenizers or clocks.

[Note: micro-batching]
With S stages, at most `max_inflight_batches` (default S) micro-batches are in the pipeline at
once. Sequences whose last item came back are "ready"; each new micro-batch takes up to
ceil(running / S) ready sequences, so M sequences settle into S interleaved groups and every stage
has work whenever M >= S (utilisation min(M, S) / S, ARCHITECTURE.md §5). Prefills join the same
micro-batches as decodes (packed rows, no padding).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Sequence

import torch

from pipeline.items import Item, ItemKind
from pipeline.sampling import Sampler, SamplingParams


class FinishReason(enum.Enum):
    """Why a sequence stopped: token budget, end-of-sequence token, stop string, or aborted."""

    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORTED = "aborted"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of the pipeline the scheduler feeds. Raises ValueError on out-of-range values."""

    num_stages: int
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_inflight_batches: int = 0  # 0 = num_stages
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.num_stages}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_inflight_batches == 0:
            object.__setattr__(self, "max_inflight_batches", self.num_stages)


@dataclasses.dataclass
class SequenceState:
    """One sequence as the coordinator sees it. `output_ids` are committed tokens only."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    slot: int = -1
    epoch: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    in_flight: int = 0  # items of this sequence sent and not yet returned

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus committed tokens."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclasses.dataclass(frozen=True)
class Commit:
    """Tokens newly committed for one sequence by one result, and its finish reason if it ended."""

    seq_id: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


class Scheduler:
    """Admission, micro-batching and commit for plain pipelined decoding. See [Note: micro-batching]."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.seqs: dict[int, SequenceState] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.ready: collections.deque[int] = collections.deque()
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.inflight_batches = 0
        self.to_release: list[tuple[int, int]] = []  # (seq_id, slot) to free on every stage

    # -- requests ---------------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> SequenceState:
        """Queue a new sequence. Raises ValueError for an empty or too long prompt."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence id {seq_id} is already in use")
        if not prompt_ids:
            raise ValueError("prompt is empty (0 tokens)")
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max new tokens ({params.max_new_tokens}) = {need} "
                f"exceeds --max-model-len {self.config.max_model_len}"
            )
        seq = SequenceState(seq_id=seq_id, prompt_ids=list(prompt_ids), params=params, sampler=Sampler(params))
        self.seqs[seq_id] = seq
        self.waiting.append(seq_id)
        return seq

    def abort(self, seq_id: int) -> None:
        """Finish a sequence early (client gone); its slot is released on every stage."""
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.ABORTED)

    def finish_on_stop_string(self, seq_id: int) -> None:
        """The coordinator found a stop string in the detokenised output."""
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.STOP)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.seqs.values() if s.slot >= 0 and not s.finished)

    @property
    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self.seqs.values())

    def pop(self, seq_id: int) -> SequenceState:
        """Forget a finished sequence (after its output was delivered)."""
        seq = self.seqs[seq_id]
        assert seq.finished, f"sequence {seq_id} is not finished"
        return self.seqs.pop(seq_id)

    # -- micro-batches ----------------------------------------------------------------------------
    def next_batch(self) -> list[Item] | None:
        """The next micro-batch to send to stage 0, or None if the pipeline is full or idle."""
        if self.inflight_batches >= self.config.max_inflight_batches:
            return None
        self._admit_waiting()
        if not self.ready:
            return None
        size = max(1, math.ceil(self.num_running / self.config.num_stages))
        batch = []
        while self.ready and len(batch) < size:
            seq = self.seqs[self.ready.popleft()]
            if seq.finished:
                continue
            batch.append(self._next_item(seq))
            seq.in_flight += 1
        if not batch:
            return None
        self.inflight_batches += 1
        return batch

    def _admit_waiting(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.seqs[self.waiting.popleft()]
            if seq.finished:
                continue
            seq.slot = self.free_slots.pop()
            self.ready.append(seq.seq_id)

    def _next_item(self, seq: SequenceState) -> Item:
        want_logits = not seq.params.is_greedy
        if not seq.output_ids:
            return Item(seq_id=seq.seq_id, slot=seq.slot, start=0, num_tokens=len(seq.prompt_ids),
                        epoch=seq.epoch, kind=ItemKind.PREFILL, token_ids=tuple(seq.prompt_ids),
                        want_logits=want_logits)
        return Item(seq_id=seq.seq_id, slot=seq.slot, start=seq.num_tokens - 1, num_tokens=1, epoch=seq.epoch,
                    kind=ItemKind.DECODE, token_ids=(seq.output_ids[-1],), want_logits=want_logits)

    # -- results ----------------------------------------------------------------------------------
    def on_result(self, sent: Sequence[Item], returned: Sequence[Item], token_ids: torch.Tensor,
                  logits: torch.Tensor | None) -> list[Commit]:
        """Commit the last stage's output for one micro-batch.

        sent: the micro-batch as sent; returned: the items that ran on every stage (a subset, in
        order); token_ids: [len(returned)] argmax of each returned item's last row; logits:
        [num returned items with want_logits, vocab] float32 in item order. Results of finished
        sequences or older epochs are ignored.
        """
        self.inflight_batches -= 1
        assert self.inflight_batches >= 0, "more results than micro-batches sent"
        for item in sent:
            seq = self.seqs.get(item.seq_id)
            if seq is not None:
                seq.in_flight -= 1
        commits, logit_row = [], 0
        for i, item in enumerate(returned):
            row = None
            if item.want_logits:
                row, logit_row = logits[logit_row], logit_row + 1
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq.finished or item.epoch != seq.epoch:
                continue
            token = int(token_ids[i]) if row is None else seq.sampler.sample(row)
            commits.append(self._commit(seq, token))
        return commits

    def _commit(self, seq: SequenceState, token: int) -> Commit:
        seq.output_ids.append(token)
        if token in self.config.eos_token_ids and not seq.params.ignore_eos:
            self._finish(seq, FinishReason.EOS)
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
        else:
            self.ready.append(seq.seq_id)
        return Commit(seq.seq_id, (token,), seq.finish_reason)

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        seq.finish_reason = reason
        if seq.slot >= 0:
            self.to_release.append((seq.seq_id, seq.slot))
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def take_releases(self) -> list[tuple[int, int]]:
        """(seq_id, slot) pairs to free on every stage; the caller sends them in-band, in order."""
        out, self.to_release = self.to_release, []
        return out
