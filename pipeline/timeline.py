"""Timeline: per-stage compute slices of every micro-batch, and what they were worth.

Owns the record of [stage, start_ns, end_ns] slices that stages attach to each micro-batch
(CLOCK_MONOTONIC of one host), which items the slice ran and whether their results were
committed, and the metrics derived from it: per-stage useful / wasted time (ARCHITECTURE.md §8)
and the control overhead of speculation (the gap a stage waits before a draft item). Pure.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from pipeline.items import Item, ItemKind


@dataclasses.dataclass(frozen=True)
class Slice:
    """One stage's compute on one micro-batch: times in ns, item kinds, share of useful work."""

    stage: int
    start_ns: int
    end_ns: int
    kinds: tuple[ItemKind, ...]
    seq_ids: tuple[int, ...]
    useful_share: float

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class Timeline:
    """Slices of the last `max_slices` micro-batch stage-runs, plus running useful/wasted totals."""

    def __init__(self, num_stages: int, *, max_slices: int = 200_000) -> None:
        self.num_stages = num_stages
        self.slices: collections.deque[Slice] = collections.deque(maxlen=max_slices)
        self.useful_ns = [0] * num_stages
        self.wasted_ns = [0] * num_stages
        self.draft_gaps_ns: list[int] = []
        self._last_end_ns = [0] * num_stages

    def record(self, timing: list, items: list[Item], useful_share: float, draft_ready_ns: int | None = None) -> None:
        """Add one micro-batch: timing = [[stage, start_ns, end_ns], ...]; useful_share in [0, 1] is
        the fraction of its items whose results were committed (the rest was squashed work).
        draft_ready_ns: for a drafts-only micro-batch, when its drafts became available; the first
        stage's wait start - max(ready, its previous slice's end) is the control overhead."""
        kinds = tuple(it.kind for it in items)
        seq_ids = tuple(it.seq_id for it in items)
        if timing and draft_ready_ns and self._last_end_ns[timing[0][0]]:
            stage, start_ns, _ = timing[0]
            self.draft_gaps_ns.append(max(0, start_ns - max(draft_ready_ns, self._last_end_ns[stage])))
        for stage, start_ns, end_ns in timing:
            self._last_end_ns[stage] = max(self._last_end_ns[stage], end_ns)
            s = Slice(stage, start_ns, end_ns, kinds, seq_ids, useful_share)
            self.slices.append(s)
            useful = round(s.duration_ns * useful_share)
            self.useful_ns[stage] += useful
            self.wasted_ns[stage] += s.duration_ns - useful

    def reset(self) -> None:
        self.slices.clear()
        self.useful_ns = [0] * self.num_stages
        self.wasted_ns = [0] * self.num_stages
        self.draft_gaps_ns = []
        self._last_end_ns = [0] * self.num_stages

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
