"""How much of the machine's CPU other work took while a run was measured ([Note: foreign load]).

Owns `CpuMeter`: the busy CPU seconds of the whole machine (hypervisor steal included) minus those
of this process and its children (the local stage workers), over wall seconds times cores. `launch`
records it with every run (stats `foreign_cpu_fraction`, so `bench sweep` keeps it per run) and
gives no speed-up estimate above MAX_FOREIGN; tests/benchmarks/core_speed.py discards such runs.
Must not: count a Ray actor or another node's stage as this run's (they are not children: their CPU
shows as foreign, so a run with them gets no estimate rather than a wrong one).
"""

from __future__ import annotations

import contextlib
import os
import time

MAX_FOREIGN = 0.10  # a run whose foreign CPU fraction is above this was measured on a busy host


class CpuMeter:
    """CPU time the rest of the machine used while a measurement ran ([Note: foreign load]).

    [Note: foreign load]
    On a shared machine other jobs steal cores from the measured configuration. For every
    measurement the benchmark records foreign_cpu_fraction = (busy CPU seconds of the whole machine,
    hypervisor steal included, minus those of this benchmark's own processes) / (wall seconds * cores).
    0 means the machine was otherwise quiet; 0.5 on 2 cores means another job held a whole core.
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._start: tuple[float, float, float] | None = None

    def _machine_busy_s(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _ours_s(self) -> float:
        me = self._psutil.Process()
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(self._psutil.Error):
                t = proc.cpu_times()  # children_*: its children that exited and were waited for
                total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        return total

    def start(self) -> None:
        self._start = (time.perf_counter(), self._machine_busy_s(), self._ours_s())

    def foreign_fraction(self) -> float:
        """Foreign CPU fraction since `start`."""
        wall0, machine0, ours0 = self._start
        wall_s = time.perf_counter() - wall0
        foreign_s = (self._machine_busy_s() - machine0) - (self._ours_s() - ours0)
        return max(0.0, foreign_s / (wall_s * (os.cpu_count() or 1)))

    def wait_quiet(self, max_fraction: float, timeout_s: float, *, window_s: float = 1.0) -> float:
        """Sleep in `window_s` windows until one has foreign load <= max_fraction, or timeout_s passed.

        Returns the seconds waited. Between measurements the benchmark's own processes are idle.
        """
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            self.start()
            time.sleep(window_s)
            if self.foreign_fraction() <= max_fraction:
                break
        return time.perf_counter() - started
