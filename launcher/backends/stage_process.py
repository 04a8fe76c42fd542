"""One spawned stage-worker process and its plumbing.

Owns what the supervisor (launcher/backends/stage_group.py) needs per child: spawning it with stdin,
stdout and stderr pipes and a parent-death signal, the reader threads that spot the ready line
(launcher/backends/worker_command.py) and forward every other line with a `[Stage i]` prefix, the tail
of its stderr, its pidfd, and how an exit code is described. Must not: decide when a child is
started, stopped or given up on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, TextIO

from launcher.backends.worker_command import READY_LINE_RE
from workers.parent_death import PARENT_PID_ENV

logger = logging.getLogger(__name__)

NUM_STDERR_TAIL_LINES = 20


def spawn_stage(command: Sequence[str], env: dict[str, str], *, stage_index: int) -> subprocess.Popen[bytes]:
    """Start one stage worker with piped stdin/stdout/stderr. On Linux the worker arms a parent-death
    SIGKILL itself (workers/parent_death.py: no preexec_fn, see [Note: no preexec_fn] there).

    Raises OSError if the command cannot be executed.
    """
    logger.debug("[Stage %d] spawning: %s", stage_index, " ".join(command))
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, PARENT_PID_ENV: str(os.getpid())},
        close_fds=True,  # a sibling must not hold another stage's stdin open
    )


# ---------------------------------------------------------------------------------------------------
class OutputForwarder:
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


class StageChild:
    """One spawned stage: its Popen, pidfd, reader threads and stderr tail.

    `stage_index` is the local index (0-based on this machine), `label_index` the pipeline stage
    index used in log prefixes. The stdout reader posts `(stage_index, "ready", port)` for the first
    ready line and `(stage_index, "eof", 0)` when stdout closes.
    """

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

    def start_readers(self, events: queue.Queue[tuple[int, str, int]], out: OutputForwarder) -> None:
        """Start the stdout and stderr reader threads (daemon threads, one per pipe)."""
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
                     out: OutputForwarder) -> None:
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

    def _read_stderr(self, pipe: IO[bytes], out: OutputForwarder) -> None:
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
        """Wait up to `timeout_s` in all for the reader threads to finish."""
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
