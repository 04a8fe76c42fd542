"""Handoff latency: how long a stage waits for work that is already done upstream.

Owns one metric of the timeline (pipeline/measure/timeline.py): the part of the bubble that is
latency on the critical path, not a lack of work. Pure: reads `Slice`s, no clock, no I/O.

[Note: handoff latency]
A stage's idle time (the bubble, ARCHITECTURE.md §8) has two causes: nothing to do yet (its input is
still being computed upstream), or input already computed and on its way (the message path:
encode, a send thread, gloo, decode; and on the way back to stage 0, the coordinator). Only the
second is overhead of the runtime. For every micro-batch, "ready" is the later of the moment its
input was computed and the moment the stage finished its previous slice; the handoff is the start
minus ready (clipped at 0):
- stage to stage, link i -> i+1: the input is the micro-batch's own slice on stage i;
- the ring return, last stage -> coordinator -> stage 0: the input of a DECODE or FIRP item at
  position p is the last stage's result of the same sequence's item that ended at p (its most
  recent slice there that ended before this one started); a micro-batch waits for the latest of its
  items' inputs. Drafts and prefills have no such input and are not counted.
In a single-stream decode with S stages, the time per token is the sum of the stage slices plus the
S - 1 handoffs and the ring return.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable

from pipeline.measure.timeline import Slice
from pipeline.speculation.items import ItemKind


def _waits_ms(pairs: Iterable[tuple[int, int]]) -> list[float]:
    return [max(0, start - ready) / 1e6 for start, ready in pairs]


def _summary(waits: list[float]) -> dict:
    if not waits:
        return {"p50_ms": 0.0, "mean_ms": 0.0, "count": 0}
    return {"p50_ms": round(statistics.median(waits), 3), "mean_ms": round(statistics.mean(waits), 3),
            "count": len(waits)}


def _previous_end(slices: list[Slice]) -> dict[int, int]:
    """id(slice) -> end of the stage's previous slice (0 for its first), for slices of one stage."""
    out, last = {}, 0
    for s in sorted(slices, key=lambda s: s.start_ns):
        out[id(s)] = last
        last = max(last, s.end_ns)
    return out


def handoff_latency(slices: Iterable[Slice], num_stages: int) -> dict:
    """[Note: handoff latency] of a timeline's slices: {"stage_handoff": [one summary per link i -> i+1],
    "ring_return": summary}, each summary {"p50_ms", "mean_ms", "count"} (zeros when nothing was
    counted). num_stages >= 1; with one stage there is no link and the ring return is the
    coordinator's round trip. Raises ValueError for num_stages < 1."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    per_stage: dict[int, list[Slice]] = collections.defaultdict(list)
    by_batch: dict[int, dict[int, Slice]] = collections.defaultdict(dict)
    for s in slices:
        per_stage[s.stage].append(s)
        by_batch[s.batch][s.stage] = s
    prev = {}
    for stage_slices in per_stage.values():
        prev.update(_previous_end(stage_slices))
    links = [[] for _ in range(num_stages - 1)]
    for stages in by_batch.values():
        for i in range(num_stages - 1):
            up, down = stages.get(i), stages.get(i + 1)
            if up is not None and down is not None:
                links[i].append((down.start_ns, max(up.end_ns, prev[id(down)])))
    return {"stage_handoff": [_summary(_waits_ms(pairs)) for pairs in links],
            "ring_return": _summary(_waits_ms(_ring_returns(per_stage, prev, num_stages)))}


def _ring_returns(per_stage: dict[int, list[Slice]], prev: dict[int, int], num_stages: int) -> list[tuple[int, int]]:
    """(stage-0 start, ready) of every stage-0 slice whose DECODE / FIRP items' inputs were found."""
    results: dict[tuple[int, int], list[int]] = collections.defaultdict(list)  # (seq, end position) -> ends
    for s in per_stage.get(num_stages - 1, []):
        for it in s.items:
            results[(it.seq_id, it.start + it.num_tokens)].append(s.end_ns)
    pairs = []
    for s in per_stage.get(0, []):
        inputs = []
        for it in s.items:
            if it.kind in (ItemKind.DECODE, ItemKind.FIRP):
                ends = [e for e in results.get((it.seq_id, it.start), ()) if e <= s.start_ns]
                if ends:
                    inputs.append(max(ends))
        if inputs:
            pairs.append((s.start_ns, max(max(inputs), prev[id(s)])))
    return pairs
