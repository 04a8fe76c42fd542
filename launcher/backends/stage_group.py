"""Supervision of the N local stage-worker processes of one pipeline: start, wait ready, stop.

Owns the life cycle of the local stage processes as a group: spawning them all, waiting for every
ready line under one deadline, reporting a failed startup (StageStartupError), and stopping every
one of them on every exit path. It must not know anything about models, the control-plane RPCs or
the data plane: it hands back gRPC addresses and process exit codes, nothing else. How one worker is
invoked is in launcher/backends/worker_command.py, one child's pipes in launcher/backends/stage_process.py.

[Note: no orphan stage processes]
A stage process must never outlive the launcher (ARCHITECTURE.md §9). Three independent mechanisms:

1. `LocalStageProcesses.stop()` closes every stdin, waits `grace_s`, sends SIGTERM, waits
   `term_grace_s`, sends SIGKILL and reaps every child (a worker watching its stdin ignores SIGTERM,
   as it ignores SIGINT, so that a signal to the whole group lets the launcher drain first: for it the
   SIGTERM step only costs `term_grace_s` before the SIGKILL; it stops a `--no-stdin-watch` worker). It is idempotent, runs from `__exit__` and from
   an `atexit` hook, and if it is itself interrupted (Ctrl-C) it SIGKILLs and reaps what is left.
2. If the launcher dies without running Python code (SIGKILL, crash), the kernel closes its end of the
   stdin pipes and the workers exit on EOF.
3. On Linux every child also gets `PR_SET_PDEATHSIG=SIGKILL` (armed by the child: workers/parent_death.py), for a worker that is stuck and never
   reads stdin. The kernel ties this to the *thread* that spawned the child: call `start()` from a
   thread that lives as long as the stages (normally the main thread).

Children stay in the launcher's process group, so a Ctrl-C in the terminal, or a SIGTERM to the
group (systemd, `timeout`, `kill -- -PGID`), reaches them too; they ignore both (workers/stage_worker.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from launcher.backends.ports import format_address
from launcher.backends.stage_process import OutputForwarder, StageChild, describe_returncode, spawn_stage
from launcher.backends.worker_command import LocalLaunchConfig

logger = logging.getLogger(__name__)

KILL_REAP_TIMEOUT_S = 5.0
READER_JOIN_TIMEOUT_S = 1.0


class StageStartupError(RuntimeError):
    """A stage process exited, closed stdout or timed out before printing its ready line.

    Attributes: `stage_index`; `returncode` (None if the stage was still running, i.e. timed out);
    `stderr_tail` (its last stderr lines).
    """

    def __init__(self, message: str, *, stage_index: int, returncode: int | None,
                 stderr_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.stage_index = stage_index
        self.returncode = returncode
        self.stderr_tail = tuple(stderr_tail)


class LocalStageProcesses:
    """The N local stage processes of one pipeline; a context manager that always stops them.

    Usage::

        with LocalStageProcesses(LocalLaunchConfig(num_stages=2)) as stages:
            addresses = stages.start()      # ["127.0.0.1:41234", "127.0.0.1:41235"]
            ...

    Child stderr (and any stdout line other than the ready line) is forwarded line by line to
    `log_stream` (default: `sys.stderr` at the time of writing) as `[Stage i] <line>`. See
    [Note: no orphan stage processes] in the module docstring.
    """

    def __init__(self, config: LocalLaunchConfig, *, log_stream: TextIO | None = None) -> None:
        self.config = config
        self._out = OutputForwarder(log_stream)
        self._stages: list[StageChild] = []
        self._addresses: list[str] = []
        self._lock = threading.RLock()
        self._stop_depth = 0
        self._started = False
        self._stopped = False
        self._stopping = threading.Event()
        self._keeper: threading.Thread | None = None  # spawns respawned stages (see respawn())

    # -- public API -------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """PIDs of the spawned stage processes in stage order (empty before `start()`)."""
        return [stage.proc.pid for stage in self._stages]

    @property
    def addresses(self) -> list[str]:
        """gRPC addresses `host:port` in stage order (empty until `start()` succeeded)."""
        return list(self._addresses)

    @property
    def stopping(self) -> bool:
        """True once `stop()` has begun: deaths from then on are expected."""
        return self._stopping.is_set()

    def start(self) -> list[str]:
        """Spawn every stage and wait for all ready lines; returns addresses in stage order.

        All stages start concurrently; the deadline `config.startup_timeout_s` covers all of them.
        Raises StageStartupError (after stopping every stage) if a stage exits, closes stdout or is
        not ready in time; RuntimeError if called twice.
        """
        with self._lock:
            if self._started or self._stopping.is_set():
                raise RuntimeError("LocalStageProcesses.start() may be called only once, and not after stop()")
            self._started = True
        config = self.config
        deadline = time.monotonic() + config.startup_timeout_s
        atexit.register(self._stop_at_exit)
        self._spawn_all()
        events: queue.Queue[tuple[int, str, int]] = queue.Queue()
        for stage in self._stages:
            stage.start_readers(events, self._out)
        try:
            ports = self._wait_ready(events, deadline)
            dead = self.dead_stages()  # a stage that died after its ready line, while others started
            if dead:
                self._fail_startup(dead[0][0], timed_out=False)
        except BaseException:
            self.stop(grace_s=1.0)  # no-op after _fail_startup; covers Ctrl-C during startup
            raise
        self._addresses = [format_address(config.host, ports[i]) for i in range(config.num_stages)]
        logger.info("started %d stage processes: %s", config.num_stages, ", ".join(self._addresses))
        return self.addresses

    def respawn(self, local_index: int) -> str:
        """Replace local stage `local_index` by a fresh process (same command and environment) and wait
        for its ready line; returns its new gRPC address. The old process is SIGKILLed first if it
        still runs, and reaped. For the fail-over of a dead stage (its restart budget is
        launcher/coordinator/stage_restarts.py); a StageProcessMonitor started before must be replaced by a new
        one afterwards (it watches the old pidfd). Raises StageStartupError (the other stages keep
        running) if the new process fails to start, RuntimeError if not started or stopping.
        """
        with self._lock:
            if not self._started or self._stopping.is_set():
                raise RuntimeError("respawn() needs started stages that are not being stopped")
            if not 0 <= local_index < len(self._stages):
                raise ValueError(f"local stage index {local_index} outside [0, {len(self._stages)})")
            old = self._stages[local_index]
            if old.proc.poll() is None:
                with contextlib.suppress(OSError):
                    old.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.proc.wait(timeout=KILL_REAP_TIMEOUT_S)
            old.join_readers(READER_JOIN_TIMEOUT_S)
            if old.pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(old.pidfd)
                old.pidfd = None
            with contextlib.suppress(OSError, ValueError):
                if old.proc.stdin is not None:
                    old.proc.stdin.close()
            proc = self._spawn_from_keeper(local_index)
            child = StageChild(local_index, proc, label_index=old.label_index)
            self._stages[local_index] = child
        events: queue.Queue[tuple[int, str, int]] = queue.Queue()
        child.start_readers(events, self._out)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            try:
                _, kind, port = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                kind, port = "timeout", 0
            if kind == "ready" and 0 < port < 65536:
                address = format_address(self.config.host, port)
                self._addresses[local_index] = address
                logger.info("[Stage %d] respawned as pid %d at %s", child.label_index, proc.pid, address)
                return address
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_REAP_TIMEOUT_S)
            child.join_readers(READER_JOIN_TIMEOUT_S)
            raise StageStartupError(f"stage {child.label_index} could not be respawned ({kind}); last stderr "
                                    f"lines: {' | '.join(child.stderr_tail) or '(none)'}",
                                    stage_index=child.label_index, returncode=proc.poll(),
                                    stderr_tail=list(child.stderr_tail))

    def wait_exited(self, timeout_s: float) -> bool:
        """Wait (reaping) up to `timeout_s` for every stage to exit by itself; True if all did."""
        return self._wait_all(timeout_s)

    def dead_stages(self) -> list[tuple[int, int]]:
        """(stage_index, returncode) of every stage process that has exited, in stage order."""
        dead = []
        for stage in self._stages:
            returncode = stage.proc.poll()
            if returncode is not None:
                dead.append((stage.stage_index, returncode))
        return dead

    def _spawn_from_keeper(self, local_index: int) -> subprocess.Popen[bytes]:
        """Spawn a stage from a thread that lives as long as this object, never from the caller's
        (PR_SET_PDEATHSIG fires when the *spawning thread* exits: [Note: no orphan stage processes])."""
        if self._keeper is None:
            self._keeper_jobs: queue.Queue = queue.Queue()
            self._keeper = threading.Thread(target=self._keep, name="speedpipe-stage-keeper", daemon=True)
            self._keeper.start()
        done: queue.Queue = queue.Queue()
        self._keeper_jobs.put((local_index, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _keep(self) -> None:
        while True:
            local_index, done = self._keeper_jobs.get()
            try:
                done.put(spawn_stage(self.config.command(local_index), self.config.child_env(),
                                     stage_index=local_index))
            except OSError as exc:
                done.put(exc)

    def stop(self, grace_s: float = 5.0, *, term_grace_s: float = 2.0) -> None:
        """Stop and reap every stage process; idempotent.

        Closes every stdin (the workers exit on EOF) and waits up to `grace_s` for all of them, then
        SIGTERMs the rest and waits up to `term_grace_s`, then SIGKILLs and reaps what is left. Safe
        from `atexit`, from another thread and from a signal handler: re-entered while a stop is in
        progress (e.g. a second Ctrl-C), it SIGKILLs immediately. Never leaves a zombie.
        """
        if grace_s < 0 or term_grace_s < 0:
            raise ValueError(f"grace_s and term_grace_s must be >= 0, got {grace_s!r}, {term_grace_s!r}")
        with self._lock:
            if self._stopped:
                return
            self._stop_depth += 1
            try:
                if self._stop_depth > 1:
                    self._kill_and_reap()  # re-entered from a signal handler mid-stop
                    return
                self._stopping.set()
                try:
                    self._graceful_stop(grace_s, term_grace_s)
                finally:
                    self._kill_and_reap()
                    self._finish_stop()
            finally:
                self._stop_depth -= 1

    def __enter__(self) -> LocalStageProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------------------
    def _spawn_all(self) -> None:
        """Spawn every stage process; on failure stop those spawned and raise StageStartupError."""
        config = self.config
        env = config.child_env()
        try:
            for stage_index in range(config.num_stages):
                if self._stopping.is_set():  # stop() ran from a signal handler meanwhile
                    raise StageStartupError("startup interrupted by stop()", stage_index=stage_index,
                                            returncode=None)
                proc = spawn_stage(config.command(stage_index), env, stage_index=stage_index)
                self._stages.append(StageChild(stage_index, proc,
                                               label_index=config.first_stage_index + stage_index))
        except OSError as exc:
            self.stop(grace_s=1.0)
            raise StageStartupError(
                f"stage {len(self._stages)} could not be spawned ({config.python} -m "
                f"{config.worker_module}): {exc}",
                stage_index=len(self._stages), returncode=None,
            ) from exc

    def _wait_ready(self, events: queue.Queue[tuple[int, str, int]], deadline: float) -> dict[int, int]:
        """Ports by local stage index once every stage printed its ready line.

        Raises StageStartupError (via `_fail_startup`, which stops every stage) if a stage closes
        stdout first, reports an invalid port or the `deadline` (time.monotonic) passes.
        """
        num_stages = self.config.num_stages
        ports: dict[int, int] = {}
        while len(ports) < num_stages:
            if self._stopping.is_set():
                missing = min(set(range(num_stages)) - set(ports))
                raise StageStartupError("startup interrupted by stop()", stage_index=missing,
                                        returncode=None)
            remaining_s = deadline - time.monotonic()
            try:
                stage_index, kind, port = events.get(timeout=max(0.0, remaining_s))
            except queue.Empty:
                missing = min(set(range(num_stages)) - set(ports))
                self._fail_startup(missing, timed_out=True)
            if kind == "eof" and stage_index not in ports:
                self._fail_startup(stage_index, timed_out=False)
            elif kind == "ready":
                if not 0 < port < 65536:
                    self._fail_startup(stage_index, timed_out=False, bad_port=port)
                ports[stage_index] = port
        return ports

    def _fail_startup(self, local_index: int, *, timed_out: bool, bad_port: int | None = None) -> None:
        stage = self._stages[local_index]
        stage_index = stage.label_index
        if not timed_out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stage.proc.wait(timeout=1.0)  # it closed stdout; give it a moment to exit
        returncode = stage.proc.poll()
        self.stop(grace_s=1.0, term_grace_s=1.0)  # also joins readers, so the stderr tail is complete
        timeout_s = self.config.startup_timeout_s
        if bad_port is not None:
            what = f"reported invalid port {bad_port} in its ready line"
        elif timed_out:
            what = f"did not report ready within {timeout_s:g} s (the start-up deadline)"
        elif returncode is None:
            what = "closed stdout before its ready line"
        else:
            what = f"exited during startup with {describe_returncode(returncode)}"
        tail = list(stage.stderr_tail)
        last_lines = "\n".join(f"  {line}" for line in tail) if tail else "  (no stderr output)"
        raise StageStartupError(
            f"stage {stage_index} {what}; all stages stopped. Last stderr lines of stage "
            f"{stage_index}:\n{last_lines}",
            stage_index=stage_index, returncode=returncode, stderr_tail=tail,
        )

    def _graceful_stop(self, grace_s: float, term_grace_s: float) -> None:
        for stage in self._stages:
            if stage.proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    stage.proc.stdin.close()
        if not self._wait_all(grace_s):
            for stage in self._alive():
                logger.warning("[Stage %d] still running %.1f s after stdin EOF; sending SIGTERM",
                               stage.stage_index, grace_s)
                with contextlib.suppress(OSError):
                    stage.proc.send_signal(signal.SIGTERM)
            self._wait_all(term_grace_s)

    def _kill_and_reap(self) -> None:
        for stage in self._alive():
            logger.warning("[Stage %d] sending SIGKILL", stage.stage_index)
            with contextlib.suppress(OSError):
                stage.proc.kill()
        if not self._wait_all(KILL_REAP_TIMEOUT_S):
            pids = [stage.proc.pid for stage in self._alive()]
            logger.error("stage processes %s survived SIGKILL for %.0f s", pids, KILL_REAP_TIMEOUT_S)

    def _finish_stop(self) -> None:
        for stage in self._stages:
            stage.join_readers(READER_JOIN_TIMEOUT_S)
        if not self._alive():
            self._stopped = True
            for stage in self._stages:
                if stage.pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(stage.pidfd)
                    stage.pidfd = None
            atexit.unregister(self._stop_at_exit)

    def _alive(self) -> list[StageChild]:
        return [stage for stage in self._stages if stage.proc.poll() is None]

    def _wait_all(self, timeout_s: float) -> bool:
        """Waits (reaping) until every stage exited or `timeout_s` passed; True if all exited.

        Popen.wait always gets a timeout: without one it blocks on a lock a re-entrant call could hold.
        """
        deadline = time.monotonic() + timeout_s
        for stage in self._stages:
            try:
                stage.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return not self._alive()

    def _stop_at_exit(self) -> None:
        self.stop(grace_s=2.0, term_grace_s=1.0)

    def dup_pidfds(self) -> dict[int, int] | None:
        """Duplicated pidfds by local stage index for a monitor (which closes them), or None where
        pidfds are unavailable or the stages are stopped."""
        with self._lock:
            if self._stopped or any(stage.pidfd is None for stage in self._stages):
                return None
            return {stage.stage_index: os.dup(stage.pidfd) for stage in self._stages}  # type: ignore[arg-type]
