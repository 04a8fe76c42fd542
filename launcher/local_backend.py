"""Local placement backend: one OS process per pipeline stage on this machine.

This module owns the life cycle of local stage-worker processes: spawning them, reading their ready
line (the worker contract below), forwarding their output with a `[Stage i]` prefix, noticing when one
dies, and stopping every one of them on every exit path. It must not know anything about models, the
control-plane RPCs or the data plane: it hands back gRPC addresses and process exit codes, nothing else.

Worker contract (`python -m workers.stage_worker --stage-index I --host H --port 0 --log-level L`):

- once its gRPC server listens, the worker prints exactly one line `SPEEDPIPE_STAGE_READY port=<N>`
  to stdout (flushed) and afterwards logs only to stderr;
- it exits by itself when its stdin reaches EOF, so the launcher keeps a pipe open to every stdin.

[Note: no orphan stage processes]
A stage process must never outlive the launcher (ARCHITECTURE.md §9). Three independent mechanisms:

1. `LocalStageProcesses.stop()` closes every stdin, waits `grace_s`, sends SIGTERM, waits
   `term_grace_s`, sends SIGKILL and reaps every child. It is idempotent, runs from `__exit__` and from
   an `atexit` hook, and if it is itself interrupted (Ctrl-C) it SIGKILLs and reaps what is left.
2. If the launcher dies without running Python code (SIGKILL, crash), the kernel closes its end of the
   stdin pipes and the workers exit on EOF.
3. On Linux every child also gets `PR_SET_PDEATHSIG=SIGKILL`, for a worker that is stuck and never
   reads stdin. The kernel ties this to the *thread* that spawned the child: call `start()` from a
   thread that lives as long as the stages (normally the main thread).

Children stay in the launcher's process group, so a Ctrl-C in the terminal reaches them too.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TextIO

logger = logging.getLogger(__name__)

READY_LINE_RE = re.compile(r"^SPEEDPIPE_STAGE_READY port=(\d+)$")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
NUM_STDERR_TAIL_LINES = 20
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


@dataclass(frozen=True, kw_only=True)
class LocalLaunchConfig:
    """How to spawn the local stage processes.

    `threads_per_stage` sets OMP_NUM_THREADS and MKL_NUM_THREADS in each child (None: inherit).
    `first_stage_index` is the pipeline stage index of the first local process (multi-node mode: a
    node runs stages first_stage_index .. first_stage_index + num_stages - 1); messages and log
    prefixes use pipeline stage indices, the methods of LocalStageProcesses local ones (0-based).
    `env` adds or overrides environment variables of every child. `extra_args` is appended to every
    worker command line.
    """

    num_stages: int
    host: str = "127.0.0.1"
    log_level: str = "WARNING"
    startup_timeout_s: float = 60.0
    python: str = sys.executable
    worker_module: str = "workers.stage_worker"
    env: Mapping[str, str] | None = None
    threads_per_stage: int | None = None
    extra_args: tuple[str, ...] = field(default=())
    first_stage_index: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {self.num_stages!r}")
        if not self.host:
            raise ValueError("host must be a non-empty host name or address, got ''")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s!r}")
        if not self.python:
            raise ValueError("python must be a path to a Python interpreter, got ''")
        if not self.worker_module:
            raise ValueError("worker_module must be a module name, got ''")
        if self.threads_per_stage is not None and (
            isinstance(self.threads_per_stage, bool)
            or not isinstance(self.threads_per_stage, int)
            or self.threads_per_stage < 1
        ):
            raise ValueError(f"threads_per_stage must be None or an integer >= 1, got {self.threads_per_stage!r}")
        for key, value in (self.env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key:
                raise ValueError(f"env entries must be str -> str with a non-empty key without '=', got {key!r}")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"extra_args must be a tuple of str, got {self.extra_args!r}")
        if self.first_stage_index < 0:
            raise ValueError(f"first_stage_index must be >= 0, got {self.first_stage_index!r}")

    def command(self, stage_index: int) -> list[str]:
        """The worker command line for local stage `stage_index` (port 0: the worker picks a free port)."""
        return [
            self.python, "-m", self.worker_module,
            "--stage-index", str(self.first_stage_index + stage_index),
            "--host", self.host,
            "--port", "0",
            "--log-level", self.log_level,
            *self.extra_args,
        ]

    def child_env(self) -> dict[str, str]:
        """The environment of every child: ours, plus `env`, plus the thread-count variables."""
        env = dict(os.environ)
        env.update(self.env or {})
        if self.threads_per_stage is not None:
            env["OMP_NUM_THREADS"] = str(self.threads_per_stage)
            env["MKL_NUM_THREADS"] = str(self.threads_per_stage)
        return env


def format_address(host: str, port: int) -> str:
    """`host:port`, with brackets around an IPv6 literal (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind port 0, read it back, close).

    Used for the torch.distributed rendezvous. Another process may take the port before it is used;
    callers that can, should let the server bind port 0 itself instead.
    """
    family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.bind(sockaddr)
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------------
# Parent-death signal (Linux). Resolved once in the parent: the child, between fork and exec, only
# calls an already-resolved C function (no dlopen, no imports).
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def _make_preexec_fn() -> Callable[[], None] | None:
    """A preexec_fn that asks the kernel to SIGKILL the child when the spawning thread dies."""
    if _PRCTL is None:
        return None
    prctl = _PRCTL
    parent_pid = os.getpid()
    sigkill = int(signal.SIGKILL)

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), sigkill)

    return set_parent_death_signal


# ---------------------------------------------------------------------------------------------------
class _OutputForwarder:
    """Writes child output lines to a stream with a `[Stage i]` prefix; one lock for all stages."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, stage_index: int, line: str, *, source: str = "") -> None:
        stream = self._stream if self._stream is not None else sys.stderr  # looked up per line
        tag = f" ({source})" if source else ""
        with self._lock, contextlib.suppress(OSError, ValueError):
            stream.write(f"[Stage {stage_index}]{tag} {line}\n")
            stream.flush()


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


class _Stage:
    """One spawned stage: its Popen, pidfd, reader threads and stderr tail."""

    def __init__(self, stage_index: int, proc: subprocess.Popen[bytes], *, label_index: int) -> None:
        self.stage_index = stage_index
        self.label_index = label_index  # pipeline stage index, for log prefixes
        self.proc = proc
        self.pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.pidfd = os.pidfd_open(proc.pid)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=NUM_STDERR_TAIL_LINES)
        self.threads: list[threading.Thread] = []

    def start_readers(self, events: queue.Queue[tuple[int, str, int]], out: _OutputForwarder) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for name, target, args in (
            ("stdout", self._read_stdout, (self.proc.stdout, events, out)),
            ("stderr", self._read_stderr, (self.proc.stderr, out)),
        ):
            thread = threading.Thread(
                target=target, args=args, daemon=True,
                name=f"speedpipe-stage{self.stage_index}-{name}",
            )
            thread.start()
            self.threads.append(thread)

    def _read_stdout(self, pipe: IO[bytes], events: queue.Queue[tuple[int, str, int]],
                     out: _OutputForwarder) -> None:
        ready_seen = False
        try:
            for raw in iter(pipe.readline, b""):
                line = _decode(raw)
                match = READY_LINE_RE.match(line)
                if match and not ready_seen:
                    ready_seen = True
                    events.put((self.stage_index, "ready", int(match.group(1))))
                else:
                    out.write(self.label_index, line, source="stdout")
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                pipe.close()
            events.put((self.stage_index, "eof", 0))

    def _read_stderr(self, pipe: IO[bytes], out: _OutputForwarder) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = _decode(raw)
                self.stderr_tail.append(line)
                out.write(self.label_index, line)
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                pipe.close()

    def join_readers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def describe_returncode(returncode: int | None) -> str:
    """`exit code 3`, `killed by signal SIGKILL (exit code -9)` or `still running`."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name} (exit code {returncode})"
    return f"exit code {returncode}"


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
        self._out = _OutputForwarder(log_stream)
        self._stages: list[_Stage] = []
        self._addresses: list[str] = []
        self._lock = threading.RLock()
        self._stop_depth = 0
        self._started = False
        self._stopped = False
        self._stopping = threading.Event()

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
        env = config.child_env()
        try:
            for stage_index in range(config.num_stages):
                if self._stopping.is_set():  # stop() ran from a signal handler meanwhile
                    raise StageStartupError("startup interrupted by stop()", stage_index=stage_index,
                                            returncode=None)
                self._stages.append(_Stage(stage_index, self._spawn(stage_index, env),
                                          label_index=config.first_stage_index + stage_index))
        except OSError as exc:
            self.stop(grace_s=1.0)
            raise StageStartupError(
                f"stage {len(self._stages)} could not be spawned ({config.python} -m "
                f"{config.worker_module}): {exc}",
                stage_index=len(self._stages), returncode=None,
            ) from exc
        events: queue.Queue[tuple[int, str, int]] = queue.Queue()
        for stage in self._stages:
            stage.start_readers(events, self._out)
        ports: dict[int, int] = {}
        try:
            while len(ports) < config.num_stages:
                if self._stopping.is_set():
                    missing = min(set(range(config.num_stages)) - set(ports))
                    raise StageStartupError("startup interrupted by stop()", stage_index=missing,
                                            returncode=None)
                remaining_s = deadline - time.monotonic()
                try:
                    stage_index, kind, port = events.get(timeout=max(0.0, remaining_s))
                except queue.Empty:
                    missing = min(set(range(config.num_stages)) - set(ports))
                    self._fail_startup(missing, timed_out=True)
                if kind == "eof" and stage_index not in ports:
                    self._fail_startup(stage_index, timed_out=False)
                elif kind == "ready":
                    if not 0 < port < 65536:
                        self._fail_startup(stage_index, timed_out=False, bad_port=port)
                    ports[stage_index] = port
            dead = self.dead_stages()  # a stage that died after its ready line, while others started
            if dead:
                self._fail_startup(dead[0][0], timed_out=False)
        except BaseException:
            self.stop(grace_s=1.0)  # no-op after _fail_startup; covers Ctrl-C during startup
            raise
        self._addresses = [format_address(config.host, ports[i]) for i in range(config.num_stages)]
        logger.info("started %d stage processes: %s", config.num_stages, ", ".join(self._addresses))
        return self.addresses

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
    def _spawn(self, stage_index: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        command = self.config.command(stage_index)
        logger.debug("[Stage %d] spawning: %s", stage_index, " ".join(command))
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            close_fds=True,  # a sibling must not hold another stage's stdin open
            preexec_fn=_make_preexec_fn(),  # only a resolved prctl call, see _make_preexec_fn
        )

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
            what = f"did not report ready within {timeout_s:g} s (startup_timeout_s)"
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

    def _alive(self) -> list[_Stage]:
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

    def _dup_pidfds(self) -> dict[int, int] | None:
        """Duplicated pidfds by stage index for a monitor, or None where pidfds are unavailable."""
        with self._lock:
            if self._stopped or any(stage.pidfd is None for stage in self._stages):
                return None
            return {stage.stage_index: os.dup(stage.pidfd) for stage in self._stages}  # type: ignore[arg-type]


class StageProcessMonitor:
    """Calls `on_stage_death(stage_index, returncode)` once, when the first stage dies unexpectedly.

    "Unexpectedly" means before `LocalStageProcesses.stop()` began; deaths during a stop are not
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
        pidfds = self._processes._dup_pidfds()
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
                stage_index, returncode = dead[0]
                logger.error("[Stage %d] process died unexpectedly (%s)",
                             stage_index, describe_returncode(returncode))
                self.fired.set()
                try:
                    self._on_stage_death(stage_index, returncode)
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


class LocalStageBackend:
    """The StageBackend role (launcher/placement.py) over LocalStageProcesses and StageProcessMonitor.

    `processes` is the LocalStageProcesses (pids, addresses). Stage indices in `watch` callbacks and
    `describe` are pipeline stage indices (`config.first_stage_index` + local index).
    """

    def __init__(self, config: LocalLaunchConfig, *, log_stream: TextIO | None = None) -> None:
        self.config = config
        self.processes = LocalStageProcesses(config, log_stream=log_stream)
        self.master_addr = config.host
        self.monitor: StageProcessMonitor | None = None

    def start(self) -> list[str]:
        return self.processes.start()

    def data_port(self) -> int:
        return free_port(self.master_addr)

    def describe(self, stage_index: int) -> str:
        local = stage_index - self.config.first_stage_index
        pids = self.processes.pids
        return f"stage {stage_index} (pid {pids[local]})" if 0 <= local < len(pids) else f"stage {stage_index}"

    def watch(self, on_death: Callable[[int, str], None]) -> None:
        """Call `on_death(stage_index, description)` once when a stage process dies before stop()."""
        def died(local: int, returncode: int) -> None:
            index = self.config.first_stage_index + local
            on_death(index, f"{self.describe(index)} exited unexpectedly with {describe_returncode(returncode)}")

        self.monitor = StageProcessMonitor(self.processes, died).start()

    def unwatch(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def stop(self) -> None:
        self.unwatch()
        self.processes.stop()
