"""Timeline: per-stage compute slices of every micro-batch, and what they were worth.

Owns the record of [stage, start_ns, end_ns] slices that stages attach to each micro-batch
(CLOCK_MONOTONIC of one host), the items each slice ran (sequence, positions, epoch, kind) and
whether each item's result was committed or squashed, and the metrics derived from them
(ARCHITECTURE.md §8): per-stage busy / useful / wasted / idle (bubble) fractions over a window,
and the control overhead of speculation (the gap a stage waits before a draft item). Pure.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

from pipeline.speculation.items import Item, ItemKind


@dataclasses.dataclass(frozen=True)
class StageTiming:
    """When one stage computed one micro-batch: [start_ns, end_ns) on the host's CLOCK_MONOTONIC
    (`time.perf_counter_ns`; simulated time in the simulator). Stages append one per FORWARD."""

    stage: int
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True)
class ItemRecord:
    """One item of a micro-batch as the timeline keeps it: positions [start, start + num_tokens)
    of `seq_id` at `epoch`, its kind, and whether its result was committed (False: squashed,
    stale or dropped); the FIRP pseudo rows it carried and whether the exit stage ran its head on
    it (what the simulator's cost model prices, pipeline/measure/calibrate.py), and its token-tree
    sibling rows."""

    seq_id: int
    start: int
    num_tokens: int
    epoch: int
    kind: ItemKind
    committed: bool
    num_pseudo: int = 0
    want_exit: bool = False
    siblings: int = 0  # token-tree sibling rows after the item's own (Item.alt_token_ids)

    def to_json(self) -> dict:
        out = {"seq_id": self.seq_id, "positions": [self.start, self.start + self.num_tokens], "epoch": self.epoch,
               "kind": self.kind.name.lower(), "outcome": "committed" if self.committed else "squashed"}
        if self.num_pseudo:
            out["num_pseudo"] = self.num_pseudo
        if self.want_exit:
            out["want_exit"] = True
        if self.siblings:
            out["siblings"] = self.siblings
        return out


@dataclasses.dataclass(frozen=True)
class Slice:
    """One stage's compute on one micro-batch: times in ns, its items, share of useful work."""

    stage: int
    start_ns: int
    end_ns: int
    items: tuple[ItemRecord, ...]
    useful_share: float
    batch: int = 0  # index of the micro-batch (its slices on every stage share it)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def kinds(self) -> tuple[ItemKind, ...]:
        return tuple(it.kind for it in self.items)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(it.seq_id for it in self.items)

    @property
    def num_tokens(self) -> int:
        """Token rows of the micro-batch (what the stage's compute time scales with)."""
        return sum(it.num_tokens for it in self.items)

    def to_json(self) -> dict:
        return {"stage": self.stage, "batch": self.batch, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "useful_share": round(self.useful_share, 4), "items": [it.to_json() for it in self.items]}


@dataclasses.dataclass(frozen=True)
class StageFractions:
    """Shares of one stage's wall time (a window) spent computing (busy = useful + wasted) and idle."""

    stage: int
    busy: float
    useful: float
    wasted: float
    idle: float

    def to_json(self) -> dict:
        return {"stage": self.stage, "busy_fraction": round(self.busy, 4), "useful_fraction": round(self.useful, 4),
                "wasted_fraction": round(self.wasted, 4), "idle_fraction": round(self.idle, 4)}


class Timeline:
    """Slices of the last `max_slices` micro-batch stage-runs, plus running useful/wasted totals."""

    def __init__(self, num_stages: int, *, max_slices: int = 200_000) -> None:
        self.num_stages = num_stages
        self.slices: collections.deque[Slice] = collections.deque(maxlen=max_slices)
        self.useful_ns = [0] * num_stages
        self.wasted_ns = [0] * num_stages
        self.draft_gaps_ns: list[int] = []
        self._last_end_ns = [0] * num_stages
        self.num_batches = 0

    def record(self, timing: Sequence[StageTiming], items: Sequence[Item], useful_share: float,
               draft_ready_ns: int | None = None, *, committed: Sequence[bool] | None = None) -> None:
        """Add one micro-batch: timing = one StageTiming per stage that ran it; useful_share in [0, 1] is
        the fraction of its items whose results were committed (the rest was squashed work);
        committed: per item, whether its result was committed (default: all if useful_share is 1).
        draft_ready_ns: for a drafts-only micro-batch, when its drafts became available; the first
        stage's wait start - max(ready, its previous slice's end) is the control overhead."""
        if committed is None:
            committed = [useful_share >= 1.0] * len(items)
        records = tuple(ItemRecord(it.seq_id, it.start, it.num_tokens, it.epoch, it.kind, bool(c), it.num_pseudo,
                                   it.wants_exit_guess, it.num_rows - it.num_tokens)
                        for it, c in zip(items, committed, strict=True))
        if timing and draft_ready_ns and self._last_end_ns[timing[0].stage]:
            first = timing[0]
            self.draft_gaps_ns.append(max(0, first.start_ns - max(draft_ready_ns, self._last_end_ns[first.stage])))
        for t in timing:
            stage, start_ns, end_ns = t.stage, t.start_ns, t.end_ns
            self._last_end_ns[stage] = max(self._last_end_ns[stage], end_ns)
            s = Slice(stage, start_ns, end_ns, records, useful_share, self.num_batches)
            self.slices.append(s)
            useful = round(s.duration_ns * useful_share)
            self.useful_ns[stage] += useful
            self.wasted_ns[stage] += s.duration_ns - useful
        self.num_batches += 1

    def reset(self) -> None:
        self.slices.clear()
        self.useful_ns = [0] * self.num_stages
        self.wasted_ns = [0] * self.num_stages
        self.draft_gaps_ns = []
        self._last_end_ns = [0] * self.num_stages
        self.num_batches = 0

    def to_json(self, start_ns: int, end_ns: int, *, commits=()) -> dict:
        """The timeline JSON of `launch`/`bench` (read by pipeline/measure/calibrate.py and the Gantt plot):
        {"start_ns", "end_ns", "num_stages", "slices": [Slice.to_json()], "commits": [[ns, seq, token]]}."""
        return {"start_ns": start_ns, "end_ns": end_ns, "num_stages": self.num_stages,
                "slices": [s.to_json() for s in sorted(self.slices, key=lambda s: (s.start_ns, s.stage))],
                "commits": [list(c) for c in commits]}

    def span_ns(self) -> tuple[int, int]:
        """(first slice start, last slice end) in ns; (0, 0) when empty."""
        if not self.slices:
            return 0, 0
        return min(s.start_ns for s in self.slices), max(s.end_ns for s in self.slices)

    def fractions(self, start_ns: int | None = None, end_ns: int | None = None) -> list[StageFractions]:
        """Per-stage busy / useful / wasted / idle (bubble) shares of the window [start_ns, end_ns)
        (default: the timeline's own span). Slices are clipped to the window; idle = 1 - busy."""
        lo, hi = self.span_ns()
        start_ns = lo if start_ns is None else start_ns
        end_ns = hi if end_ns is None else end_ns
        wall = max(1, end_ns - start_ns)
        useful, wasted = [0.0] * self.num_stages, [0.0] * self.num_stages
        for s in self.slices:
            d = max(0, min(s.end_ns, end_ns) - max(s.start_ns, start_ns))
            useful[s.stage] += d * s.useful_share
            wasted[s.stage] += d * (1.0 - s.useful_share)
        out = []
        for i in range(self.num_stages):
            busy = min(1.0, (useful[i] + wasted[i]) / wall)
            out.append(StageFractions(i, busy, useful[i] / wall, wasted[i] / wall, 1.0 - busy))
        return out

    def draft_gap(self, stage: int = 0) -> dict[str, float]:
        """Control overhead of speculation: the mean time the first stage waited to start a draft
        after it was available and the stage was free (exit event -> coordinator -> stage 0), in
        ms and as a share of `stage`'s mean compute time per slice."""
        mine = [s.duration_ns for s in self.slices if s.stage == stage]
        if not self.draft_gaps_ns or not mine:
            return {"draft_gap_ms": 0.0, "draft_gap_share": 0.0, "num_gaps": 0}
        gap = statistics.mean(self.draft_gaps_ns)
        return {"draft_gap_ms": gap / 1e6, "draft_gap_share": gap / statistics.mean(mine),
                "num_gaps": len(self.draft_gaps_ns)}
