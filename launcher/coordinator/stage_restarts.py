"""The restart budget of a pipeline's stages: how many restarts within which window (issue 16 part 1).

Owns `RestartBudget` (`--max-stage-restarts`, `--restart-window-s`) and `RestartLedger`, which says
whether one more restart fits the budget and records it. The fail-over that uses it (a dead or
hung stage respawned by its backend, `LocalStageProcesses.respawn` for local processes, then the
coordinator replaying every running sequence: [Note: fail-over] in launcher/coordinator/stage_failover.py)
stops restarting past the budget: every request fails, /health 503, the server keeps answering.
Must not: start or stop processes.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartBudget:
    """At most `max_restarts` stage restarts within any `window_s` seconds (all stages together).
    Raises ValueError naming the flag for a negative count or a non-positive window."""

    max_restarts: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-stage-restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"--restart-window-s must be > 0, got {self.window_s}")


class RestartLedger:
    """The restarts of one pipeline, in a sliding window of `budget.window_s` seconds."""

    def __init__(self, budget: RestartBudget) -> None:
        self.budget = budget
        self._times: collections.deque[float] = collections.deque()

    def _forget(self, now_s: float) -> None:
        while self._times and self._times[0] <= now_s - self.budget.window_s:
            self._times.popleft()

    def allows(self, now_s: float) -> bool:
        """Whether one more restart at monotonic time `now_s` fits the budget."""
        self._forget(now_s)
        return len(self._times) < self.budget.max_restarts

    def record(self, now_s: float) -> None:
        """Count a restart at `now_s`. Raises RuntimeError if it does not fit (check `allows` first)."""
        if not self.allows(now_s):
            raise RuntimeError(f"restart budget spent: {self.budget.max_restarts} restarts within "
                               f"{self.budget.window_s:g} s (--max-stage-restarts, --restart-window-s)")
        self._times.append(now_s)

    def left(self, now_s: float) -> int:
        """Restarts the budget still allows at `now_s`. Read-only: safe from another thread (a
        /metrics scrape) while the engine thread records restarts."""
        recent = sum(1 for t in tuple(self._times) if t > now_s - self.budget.window_s)
        return max(0, self.budget.max_restarts - recent)

    def used(self, now_s: float) -> int:
        """Restarts counted in the window that ends at `now_s`."""
        self._forget(now_s)
        return len(self._times)
