"""Acceptance processes of the simulator: what stands in for the model and the predictor deciding
whether a draft is right (pipeline/engine/simulator.py, [Note: simulated model]).

Owns the synthetic processes (`Bernoulli`: every draft right at a fixed rate) and the replays of
a measured run (`Replay`: its verified outcomes in order; `DraftsAt`: where it drafted and whether
each was right; `FirpReplay`: its FIRP chains). The replays' records come from
pipeline/measure/calibrate.py (`draft_outcomes`, `draft_positions`, `firp_chains`). Pure: no
torch, no I/O. Must not: simulate.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence


class Bernoulli:
    """Acceptance process: each draft is right with probability `alpha`, independently (seeded)."""

    def __init__(self, alpha: float, *, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._rng = random.Random(seed)

    def accept(self) -> bool:
        return self._rng.random() < self.alpha


class Replay:
    """Acceptance process replaying recorded draft outcomes (True = accepted) in order, cyclically,
    one per proposal. A draft squashed before it is verified (a rejection earlier in its chain)
    also uses up an outcome, so with more than one draft in flight per sequence the verified
    acceptance can differ from the record's. Raises ValueError for an empty record."""

    def __init__(self, outcomes: Sequence[bool]) -> None:
        if not outcomes:
            raise ValueError("replayed acceptance needs at least one recorded draft outcome")
        self.outcomes = list(outcomes)
        self.alpha = sum(self.outcomes) / len(self.outcomes)
        self._next = itertools.cycle(self.outcomes)

    def accept(self) -> bool:
        return next(self._next)


class FirpReplay:
    """FIRP acceptance replaying a run's recorded chains (`pipeline.measure.calibrate.firp_chains`,
    one list per sequence): sequence i of the simulation (i modulo the recorded sequences) takes
    its list's pairs in order, cyclically, one (length, accepted) per item of it that returns FIRP
    drafts, so its next item carries a chain of `length` drafts (the rest cut as unlikely, as the
    runtime cuts below `firp_min_prob`) whose first `accepted` are right. A Bernoulli draw per
    draft cannot do this: FIRP's acceptance falls with depth and its chains are cut by confidence
    ([Note: FIRP policy] in pipeline/speculation/firp.py). Raises ValueError for an empty record."""

    MIN_PROB = 0.5  # the simulated scheduler's firp_min_prob: replayed drafts have probability 1 or 0

    def __init__(self, chains: Sequence[Sequence[tuple[int, int]]]) -> None:
        pooled = [c for seq in chains for c in seq]
        if not pooled:
            raise ValueError("replayed FIRP acceptance needs at least one recorded chain")
        if any(not 0 <= a <= n for n, a in pooled):
            raise ValueError(f"FIRP chains must be (length, accepted) with 0 <= accepted <= length, got {pooled}")
        self._next = [itertools.cycle(list(seq) or pooled) for seq in chains]

    def next_chain(self, seq_id: int) -> tuple[int, int]:
        return next(self._next[seq_id % len(self._next)])


class DraftsAt:
    """Acceptance replaying where a measured run drafted and whether each draft was right: per
    sequence (sequence i of the simulation takes record i modulo their number), position -> right.
    The simulated predictor proposes only at recorded positions (`accept_at` None elsewhere): a
    Bernoulli process drafts at every chance, while an n-gram predictor has no proposal at most
    positions of ordinary text (7 to 24 drafts in 48 tokens here) and the draft gate refuses
    others, so one run's drafting, not its acceptance rate alone, is what a prediction of it needs.
    """

    def __init__(self, per_sequence: Sequence[Mapping[int, bool]]) -> None:
        self.per_sequence = [dict(m) for m in per_sequence]
        outcomes = [ok for m in self.per_sequence for ok in m.values()]
        self.alpha = sum(outcomes) / len(outcomes) if outcomes else 0.0

    def accept_at(self, seq_id: int, position: int) -> bool | None:
        """Whether the draft of `seq_id`'s token at `position` is right; None: no draft there."""
        if not self.per_sequence:
            return None
        return self.per_sequence[seq_id % len(self.per_sequence)].get(position)
