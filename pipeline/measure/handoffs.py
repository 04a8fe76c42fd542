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

[Note: plain decode estimate]
That sum, taken from a speculative run's own timeline, estimates what the same run would have cost
per token without speculation (`plain_decode_estimate`): per stage the median of its one-row
slices (a DECODE or draft item alone, no token-tree siblings, no FIRP pseudo rows: the shape of a
plain decode pass), on the exit stage only those without the exit head where at least
MIN_HEAD_FREE_SLICES ran without it, else all of them less the head's cost per row that the exit
stage timed at load (without that cost, all of them, and the estimate says it includes the head),
plus the median handoffs and ring return. It assumes every stage computes on its own cores: passes timed
while stages or other processes compete for the same CPUs are slower than a plain run's would be,
and the estimate then reads high (at --stages 4 on 2 loaded CPUs it said 1.17x for a run at 0.61x). So
`launch` makes none where local stages share CPUs, across nodes (each host has its own clock), or on
a host busier than its CPUs. Only a single sequence decodes like this: with several, plain decode
pipelines them too, and no estimate is made.
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


MIN_HEAD_FREE_SLICES = 3  # exit-stage slices without the exit head that the estimate needs to leave the head out


def _plain_shape(s: Slice) -> bool:
    """A one-row pass of one DECODE or DRAFT item: the shape of a plain decode pass."""
    if len(s.items) != 1:
        return False
    it = s.items[0]
    return it.num_tokens == 1 and not it.siblings and not it.num_pseudo and it.kind in (ItemKind.DECODE, ItemKind.DRAFT)


def plain_decode_estimate(slices: Iterable[Slice], num_stages: int, *, exit_stage: int | None,
                          exit_head_ms: float = 0.0) -> dict | None:
    """[Note: plain decode estimate]: {"plain_tpot_ms": estimated time per token without speculation,
    "exit_head_included": True where the exit stage had fewer than MIN_HEAD_FREE_SLICES one-row
    slices without the exit head and no head cost was given (the estimate then includes the head)},
    or None when a stage has no one-row slice (nothing to estimate from).
    exit_stage: the stage that runs the exit head (None: no head ran); exit_head_ms: the head's
    measured cost per row (the stages' start-up calibration; 0 = unknown), taken off where the exit
    stage's term had to include it. Raises ValueError for num_stages < 1."""
    slices = list(slices)
    hops = handoff_latency(slices, num_stages)
    total_ms, with_head = 0.0, False
    for stage in range(num_stages):
        rows = [s for s in slices if s.stage == stage and _plain_shape(s)]
        if not rows:
            return None
        head_ms = 0.0
        if stage == exit_stage:
            free = [s for s in rows if not s.items[0].want_exit]
            if len(free) >= MIN_HEAD_FREE_SLICES:
                rows = free
            elif exit_head_ms > 0:
                head_ms = exit_head_ms
            else:
                with_head = True
        total_ms += statistics.median(s.duration_ns for s in rows) / 1e6 - head_ms
    total_ms += sum(h["p50_ms"] for h in hops["stage_handoff"]) + hops["ring_return"]["p50_ms"]
    return {"plain_tpot_ms": round(total_ms, 3), "exit_head_included": with_head}
