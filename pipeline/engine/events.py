"""The engine's inputs and outputs: events in, one `StepOutput` out (see pipeline/engine/engine.py).

Pure records: no policy; `item_rows` splits a `Result`'s rows by item (the layout its docstring
gives; the scheduler's `on_result` reads them so). Times are the caller's clock in ns (real `time.perf_counter_ns`, or
simulated); they feed only the measurements (timeline, control overhead, commit log).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from pipeline.engine.records import Commit
from pipeline.measure.timeline import StageTiming
from pipeline.speculation.items import Item, SlotRelease
from pipeline.speculation.predictors import ExitGuess
from pipeline.speculation.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class Submit:
    """A new sequence. The engine raises ValueError for an empty or too long prompt."""

    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class Abort:
    """Finish a sequence early (client gone); unknown or finished ids are ignored."""

    seq_id: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopStringHit:
    """The detokenised output of a sequence reached one of its stop strings."""

    seq_id: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExitPassed:
    """Items passed the exit layer (an EXIT_GUESS message): guesses[i] is the exit head's guess at
    items[i]'s last row, or None (no head, or the head skipped it). self_drafts: empty, or per item
    (token, gate key code) of the draft the exit stage made and runs right after it (token -1:
    none; [Note: stage-local drafting] in pipeline/engine/local_draft.py)."""

    items: tuple[Item, ...]
    guesses: tuple[ExitGuess | None, ...]
    at_ns: int = 0
    self_drafts: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """The last stage's output for the oldest micro-batch in flight (the ring is FIFO), or for a
    micro-batch the exit stage made (its items are `self_made`: matched to its ExitPassed).

    items: the micro-batch's items that ran on every stage (a subset, in order).
    token_ids: [sum of items' num_result_rows] int64 argmax of each result row.
    logits: [result rows of items with want_logits, vocab_size] float32, or None.
    firp_tokens / firp_probs: [sum of items' num_pseudo] FIRP drafts and their probabilities, or None.
    prompt_logprobs: (chosen [P], top_ids [P, k], top_logprobs [P, k], rank [P]) of the prompt rows of items
        with want_prompt_logits, in item order (`reduce_prompt_rows`), or None.
    timing: one StageTiming per stage that ran it (empty when not recorded).
    fed: empty, or per item 1 where the last stage (stage 0) fed the next DECODE item after it
        itself ([Note: self-fed decode] in pipeline/engine/decode_feed.py), else 0.
    """

    items: tuple[Item, ...]
    token_ids: torch.Tensor
    logits: torch.Tensor | None = None
    firp_tokens: torch.Tensor | None = None
    firp_probs: torch.Tensor | None = None
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    timing: tuple[StageTiming, ...] = ()
    at_ns: int = 0
    fed: tuple[int, ...] = ()


class ItemRows(NamedTuple):
    """One item's share of a `Result`'s rows (`item_rows`)."""

    item: Item
    argmax: list[int]  # [num_result_rows]
    logits: torch.Tensor | None  # [num_result_rows, vocab] float32; None without want_logits
    firp: list[int]  # [num_pseudo] FIRP drafts ([] without firp_tokens)
    firp_probs: torch.Tensor | None  # [num_pseudo] their probabilities, or None
    prompt: list[torch.Tensor] | None  # one slice of each prompt_logprobs tensor, or None (no prompt rows)


def item_rows(items: Sequence[Item], token_ids: torch.Tensor, logits: torch.Tensor | None, *,
              firp_tokens: torch.Tensor | None = None, firp_probs: torch.Tensor | None = None,
              prompt_logprobs: tuple[torch.Tensor, ...] | None = None) -> Iterator[ItemRows]:
    """Split a `Result`'s rows by item, in item order (the layout its docstring gives; the same
    arguments as its fields)."""
    row = logit_row = pseudo_row = prompt_row = 0
    for item in items:
        n, k = item.num_result_rows, item.num_pseudo
        argmax = [int(t) for t in token_ids[row:row + n]]
        rows = prompt = None
        if item.want_logits:
            rows, logit_row = logits[logit_row:logit_row + n], logit_row + n
        if item.num_prompt_rows:
            prompt = [t[prompt_row:prompt_row + item.num_prompt_rows] for t in prompt_logprobs]
            prompt_row += item.num_prompt_rows
        firp = [] if firp_tokens is None else [int(t) for t in firp_tokens[pseudo_row:pseudo_row + k]]
        probs = None if firp_probs is None else firp_probs[pseudo_row:pseudo_row + k]
        row, pseudo_row = row + n, pseudo_row + k
        yield ItemRows(item, argmax, rows, firp, probs, prompt)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Withdrawn:
    """The exit stage stopped a micro-batch of drafts it made itself (a WITHDRAWN message) before
    sending it on: a newer epoch of every one of its sequences had reached the stage, so its
    result would have been stale ([Note: stage-local drafting] 6 in pipeline/engine/local_draft.py);
    or stage 0 stopped a decode item it fed itself ([Note: self-fed decode] 4 in decode_feed.py).
    No result will come for `items`; `timing`: the stage's StageTiming up to the stop (empty when
    not recorded), which the timeline counts as wasted work."""

    items: tuple[Item, ...]
    timing: tuple[StageTiming, ...] = ()
    at_ns: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayRunning:
    """The pipeline lost its in-flight work and every stage's KV cache (a stage was restarted:
    launcher/coordinator/stage_failover.py): drop every micro-batch in flight and turn each running sequence
    back into one prefill of its committed context (prompt + committed tokens), under a new epoch.
    See [Note: replay] in pipeline/engine/scheduler.py."""


Event = Submit | Abort | StopStringHit | ExitPassed | Result | Withdrawn | ReplayRunning


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one `Engine.step` asks the caller to do, in this order: send `releases` down the ring
    (one RELEASE), then each micro-batch of `sends` to stage 0; stream `commits`; forget the
    sequences in `forgotten` (released, or aborted before they held a slot). `credits`: one CREDIT
    to stage 0, before the sends ([Note: stage-local drafting] in pipeline/engine/local_draft.py)."""

    sends: Sequence[tuple[Item, ...]] = ()
    commits: Sequence[Commit] = ()
    releases: Sequence[SlotRelease] = ()
    forgotten: Sequence[int] = ()
    credits: Sequence[Item] = ()
