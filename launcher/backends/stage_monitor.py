"""Watching the local stage processes for an unexpected death: StageProcessMonitor.

Owns the monitor thread that notices when a stage process of a LocalStageProcesses exits before
`stop()` began and reports it once through a callback (select() on pidfds on Linux, polling
elsewhere). Must not: stop or restart processes itself (the callback decides).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

from launcher.backends.stage_group import LocalStageProcesses
from launcher.backends.stage_process import describe_returncode

logger = logging.getLogger(__name__)


class StageProcessMonitor:
    """Calls `on_stage_death(local_index, returncode)` once, when the first stage dies unexpectedly.

    `local_index` counts the processes of `processes` from 0; the log line names the pipeline stage
    index (`config.first_stage_index` + local index: in multi-node mode, node R's first process is
    not stage 0). "Unexpectedly" means before `LocalStageProcesses.stop()` began; deaths during a stop are not
    reported. If several stages are found dead at once, the lowest stage index is reported. The
    callback runs on the monitor thread and may call `processes.stop()` and `monitor.stop()`.
    On Linux it sleeps in select() on pidfds (no polling); elsewhere it polls every `poll_s`.
    """

    def __init__(self, processes: LocalStageProcesses, on_stage_death: Callable[[int, int], None],
                 *, poll_s: float = 0.2) -> None:
        if not 0 < poll_s <= 0.2:
            raise ValueError(f"poll_s must be in (0, 0.2], got {poll_s!r}")
        self._processes = processes
        self._on_stage_death = on_stage_death
        self._poll_s = poll_s
        self._stop_event = threading.Event()
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="speedpipe-stage-monitor", daemon=True)
        self.fired = threading.Event()

    def start(self) -> StageProcessMonitor:
        """Start watching (after `processes.start()`); returns self."""
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """True while the monitor thread is watching."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the monitor thread and wait for it (unless called from the callback); idempotent."""
        self._stop_event.set()
        with self._wake_lock:
            if self._wake_w is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and self._thread.ident is None:
            self._close_fds()  # never started

    def __enter__(self) -> StageProcessMonitor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        pidfds = self._processes.dup_pidfds()
        try:
            while not self._stop_event.is_set():
                if pidfds is None:
                    self._stop_event.wait(self._poll_s)
                else:
                    readable, _, _ = select.select([self._wake_r, *pidfds.values()], [], [])
                    if readable == [self._wake_r]:
                        continue
                if self._processes.stopping or self._stop_event.is_set():
                    return
                dead = self._processes.dead_stages()
                if not dead:
                    if pidfds is not None:  # exited but another thread is reaping it right now
                        self._stop_event.wait(0.05)
                    continue
                if self._processes.stopping:
                    return
                local_index, returncode = dead[0]
                # exit code 0: the stage obeyed a Shutdown RPC (on a member node, node 0's; not an error)
                logger.log(logging.INFO if returncode == 0 else logging.ERROR, "[Stage %d] process %s (%s)",
                           self._processes.config.first_stage_index + local_index,
                           "exited" if returncode == 0 else "died unexpectedly", describe_returncode(returncode))
                self.fired.set()
                try:
                    self._on_stage_death(local_index, returncode)
                except Exception:
                    logger.exception("stage-death callback failed")
                return
        finally:
            for fd in (pidfds or {}).values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._close_fds()

    def _close_fds(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wake_r = self._wake_w = None  # type: ignore[assignment]
