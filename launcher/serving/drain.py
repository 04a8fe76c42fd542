"""The life of a running server after start-up: waiting, fencing after a failure, draining on SIGTERM.

Owns `DrainSignals` (SIGTERM and SIGINT handlers for the serving main thread: the first signal asks
for a drain, a second one for an abort) and `serve_until_stopped`, the serving main loop: it waits
for a signal or a pipeline failure; after a failure it fences the engine, ends every in-flight
request with an error event and stops the remaining stage processes, and keeps the front ends
answering (503, /health 503 with the reason) until a signal; on a signal it drains.
Must not: start or parse anything (launcher/serving/serve.py builds the stack).

[Note: graceful drain]
As vLLM and TGI do on SIGTERM: stop admitting at once (new requests 503 "draining", /health 503
with reason "draining"), let every in-flight request finish for up to --shutdown-grace-s, then end
the rest with an error event; a second SIGTERM (or Ctrl-C) ends them at once. Every stream thus ends
with a final event and `data: [DONE]` before the HTTP server stops, so uvicorn cancels nothing (no
CancelledError tracebacks), and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.serving.serving_engine import UnavailableError

if TYPE_CHECKING:
    from launcher.coordinator.session import PipelineSession
    from launcher.serving.serve import ServingStack

log = logging.getLogger("speedpipe.serve")
FLUSH_S = 5.0  # after ending the streams with an error event: time for the front ends to send it
WATCH_S = 0.5  # how often the main loop looks at the coordinator's failure flag


class DrainSignals:
    """While entered (main thread only): the first SIGTERM/SIGINT sets `drain`, the next `abort`.
    The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_drain: Callable[[], None] | None = None) -> None:
        self.drain = threading.Event()
        self.abort = threading.Event()
        self._on_drain = on_drain  # e.g. stop restarting stages: they may have had the same signal
        self._previous: dict[int, object] = {}

    def request(self, signum: int = signal.SIGTERM, frame=None) -> None:
        """What a signal does (also callable from tests): drain first, abort on the second call."""
        if self._on_drain is not None:
            self._on_drain()
        if self.drain.is_set():
            self.abort.set()
        self.drain.set()
        log.warning("%s received: %s", signal.Signals(signum).name,
                    "ending in-flight requests now" if self.abort.is_set() else "draining")

    def __enter__(self) -> DrainSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self.request)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def reinstall(self) -> None:
        """Put the handlers back where a library replaced them: `ray.shutdown()` restores the default
        SIGTERM action, so a fenced Ray server died of SIGTERM instead of draining. Main thread only
        (elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            if signal.getsignal(sig) != self.request:
                signal.signal(sig, self.request)


def serve_until_stopped(session: PipelineSession, stack: ServingStack, signals: DrainSignals,
                        *, grace_s: float | None = None) -> None:
    """Serve until `signals.drain`; fence and stop the stages if the pipeline fails meanwhile; then
    drain ([Note: graceful drain]). grace_s: default the stack's --shutdown-grace-s."""
    grace_s = stack.options.shutdown_grace_s if grace_s is None else grace_s
    stages_stopped = False
    while not signals.drain.wait(WATCH_S):
        failure = session.coordinator.failure or stack.failure
        if failure is not None and not stages_stopped:
            log.error("pipeline failed (%s); stopping the stages, answering 503 until stopped", failure)
            stack.on_pipeline_failure(failure)
            session.stop_stages()
            signals.reinstall()  # stopping Ray's actors reset SIGTERM to its default
            stages_stopped = True
    drain(stack, signals, grace_s=grace_s)


def drain(stack: ServingStack, signals: DrainSignals, *, grace_s: float) -> bool:
    """Stop admitting, wait for in-flight requests up to `grace_s` (or `signals.abort`), end the rest
    with an error event. Returns True if every request finished by itself."""
    engine = stack.engine
    engine.fence("draining: the server is shutting down", draining=True)
    failed = stack.failure is not None or engine.coordinator.failure is not None
    if failed:
        grace_s = 0.0  # every request already ended with the failure's error event
    outstanding = engine.num_outstanding
    if outstanding:
        log.warning("draining: waiting up to %.0f s for %d in-flight request(s)", grace_s, outstanding)
    deadline = time.monotonic() + grace_s
    while engine.num_outstanding and not signals.abort.is_set() and time.monotonic() < deadline:
        engine.wait_idle(min(WATCH_S, max(0.0, deadline - time.monotonic())))
    if not engine.num_outstanding:
        return True
    why = ("the pipeline failed" if failed else "a second signal" if signals.abort.is_set()
           else f"--shutdown-grace-s {grace_s:g} expired")
    ended = engine.fail_all(UnavailableError(f"server shutting down ({why}); request ended before it finished"))
    log.warning("ended %d in-flight request(s) with an error (%s)", ended, why)
    engine.wait_idle(FLUSH_S)
    return False
