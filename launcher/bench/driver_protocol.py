"""Line protocol between a benchmark parent and a long-lived driver child process: both sides.

A driver is a child process that loads something slow once (a pipeline session, a model) and then
answers requests: it prints `{"ready": true}` once it is up, then one JSON reply line per JSON
request line on stdin, `{"error": str}` when a request failed; stdin EOF ends it. Everything else the
driver or its libraries print goes to stderr, so stdout carries replies only. `speedpipe bench`
(launcher/bench/sweep.py, launcher/bench/driver.py) and tests/benchmarks/core_speed.py both speak it.
Must not: decide what a request means or what is measured (the callers do).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

# One thread per driver process: drivers are measured side by side and must not compete for cores.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
CLOSE_TIMEOUT_S = 60.0


# -- child side ------------------------------------------------------------------------------------
def take_stdout_for_replies() -> TextIO:
    """A line-buffered stream on the real stdout for replies; fd 1 then points at stderr.

    Call it first in a driver, so that whatever the driver or its libraries print later cannot
    corrupt the reply lines.
    """
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return replies


def driver_main(serve: Callable[[], int]) -> int:
    """Run a driver's `serve()` and return its exit code; Ctrl-C ends it quietly with 130.

    Ctrl-C in a terminal sends SIGINT to the whole process group, the drivers included: the parent
    reports the interruption (and what it kept), so a driver stops its work (`with` blocks close
    their sessions as the KeyboardInterrupt unwinds) without a traceback of its own.
    """
    try:
        return serve()
    except KeyboardInterrupt:
        return 130


def serve_requests(replies: TextIO, handle_request: Callable[[dict], dict]) -> int:
    """Print the ready line, then answer every JSON request line on stdin until EOF; returns 0.

    `handle_request(request) -> reply`; an exception it raises becomes the reply
    `{"error": "<Type>: <message>"}` and the driver goes on with the next request.
    """
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            reply = handle_request(request)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


# -- parent side -----------------------------------------------------------------------------------
class DriverProcess:
    """Parent side of one driver process started with `command`.

    `name` prefixes error messages; `extra_env` is added to this process's environment for the child.
    `reply` and `request` raise RuntimeError when the driver reports an error, exits, or gives no
    reply within the timeout.
    """

    def __init__(self, command: Sequence[str], *, name: str,
                 extra_env: Mapping[str, str] = SINGLE_THREAD_ENV) -> None:
        self.name = name
        env = dict(os.environ, **extra_env)
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{name}-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def reply(self, timeout_s: float) -> dict:
        """The next reply line (the first one is the ready line), parsed."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no reply within {timeout_s:g} s") from None
        if line is None:
            raise RuntimeError(f"{self.name} exited with code {self.proc.wait()} (see its stderr above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def request(self, request: dict, timeout_s: float) -> dict:
        """Send one request line and wait up to `timeout_s` for its reply."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout_s)

    def close(self) -> None:
        """Close stdin (the driver stops and exits); kill it if it does not within CLOSE_TIMEOUT_S."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
