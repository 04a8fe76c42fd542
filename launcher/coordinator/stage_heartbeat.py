"""Liveness of the stages by heartbeat, separate from how long a step takes: StageHeartbeat.

Owns the thread that sends every stage a `Health` call every `interval_s` (in parallel, each with
that deadline), the time each stage last answered, and the verdict "hung": a stage that has not
answered for `timeout_s` (`--stage-heartbeat-timeout-s`) is reported once through `on_hung`. A stage
in a long prefill still answers (its control plane runs on gRPC threads next to the data-plane
thread), so a slow step is never a hang; a stopped (SIGSTOP) or wedged process is.
Must not: stop, kill or restart stages, or touch requests (the callback decides: serve fences).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from proto import speedpipe_pb2 as pb

log = logging.getLogger("speedpipe.serve")


class StageHeartbeat:
    """Beats every stage's `Health` RPC; calls `on_hung(stage_index, message)` once for the first
    stage silent for `timeout_s`.

    stubs: StageService stubs in stage order (authenticated). interval_s: seconds between beats
    (default timeout_s / 5, at most 1 s). Raises ValueError if timeout_s <= 0 or interval_s is not
    in (0, timeout_s). `healthy()` is the verdict of the latest beats (no RPC).
    """

    def __init__(self, stubs: Sequence, *, timeout_s: float, on_hung: Callable[[int, str], None],
                 interval_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"--stage-heartbeat-timeout-s must be > 0, got {timeout_s}")
        interval_s = min(1.0, timeout_s / 5) if interval_s is None else interval_s
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"heartbeat interval must be in (0, {timeout_s:g}) s, got {interval_s}")
        self.stubs, self.timeout_s, self.interval_s, self.on_hung = list(stubs), timeout_s, interval_s, on_hung
        now = time.monotonic()
        self._last_ok = [now] * len(self.stubs)
        self._status: list[pb.HealthResponse | None] = [None] * len(self.stubs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-heartbeat", daemon=True)
        self.hung: int | None = None  # the stage reported hung, once

    def start(self) -> StageHeartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def silent_s(self) -> list[float]:
        """Seconds since each stage last answered a heartbeat."""
        now = time.monotonic()
        return [now - t for t in self._last_ok]

    def healthy(self) -> tuple[bool, str]:
        """(True, "") while every stage answered its last beats with SERVING; else (False, why)."""
        if self.hung is not None:
            return False, self._hung_message(self.hung)
        for i, silent in enumerate(self.silent_s()):
            if silent > 2 * self.interval_s + 0.5:
                return False, f"stage {i} has not answered its heartbeat for {silent:.1f} s"
            status = self._status[i]
            if status is not None and status.status != pb.HealthResponse.SERVING:
                return False, (f"stage {i} is {pb.HealthResponse.Status.Name(status.status)}"
                               + (f": {status.message}" if status.message else ""))
        return True, ""

    def _hung_message(self, stage_index: int) -> str:
        return (f"stage {stage_index} missed its heartbeats for {self.timeout_s:g} s "
                f"(--stage-heartbeat-timeout-s): declared hung")

    def _beat(self) -> None:
        calls = [stub.Health.future(pb.HealthRequest(), timeout=self.interval_s) for stub in self.stubs]
        for i, call in enumerate(calls):
            try:
                self._status[i] = call.result()
                self._last_ok[i] = time.monotonic()
            except grpc.RpcError:
                pass  # silent this beat; the deadline decides

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._beat()
            silent = self.silent_s()
            worst = max(range(len(silent)), key=silent.__getitem__, default=None)
            if worst is not None and silent[worst] > self.timeout_s and not self._stop.is_set():
                self.hung = worst
                message = self._hung_message(worst)
                log.error("%s", message)
                try:
                    self.on_hung(worst, message)
                except Exception:
                    log.exception("heartbeat callback failed")
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))


def probe_stages(stubs: Sequence, *, timeout_s: float = 1.0) -> tuple[list[int], list[int]]:
    """(hung, unreachable): the indices of stages whose `Health` call runs into its `timeout_s`
    deadline, and of those that refuse it (UNAVAILABLE: nothing listens, the process is gone).
    Every stage is asked at once, so this takes at most `timeout_s`. Never raises."""
    calls = [stub.Health.future(pb.HealthRequest(), timeout=timeout_s) for stub in stubs]
    hung, unreachable = [], []
    for i, call in enumerate(calls):
        try:
            call.result()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                hung.append(i)
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                unreachable.append(i)
    return hung, unreachable


def blame_hung_stages(message: str, hung: Sequence[int], *, timeout_s: float = 1.0) -> str:
    """`message` prefixed with the `hung` stages (from `probe_stages(..., timeout_s=timeout_s)`).

    A hung stage makes its neighbours' data-plane waits time out too, so the first timeout to fire
    may name a stage that is only waiting for it ("timed out ... waiting to receive from stage 2"
    while stage 1 is stopped); asking every control plane names the one that is silent.
    """
    if not hung:
        return message
    who = ", ".join(f"stage {i}" for i in hung)
    return f"{who} {'is' if len(hung) == 1 else 'are'} hung (no control-plane answer within {timeout_s:g} s); {message}"
