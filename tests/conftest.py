"""Shared pytest fixtures. Owns test hygiene that applies to every test, nothing model-specific.

`no_leftover_child_processes` (autouse): a test that leaves a child process behind (running or an
unreaped zombie) is a leak of the kind ARCHITECTURE.md §9 forbids; the fixture kills it and fails the
test, naming pids and command lines. Long-lived helpers that the standard library or torch start on
purpose (multiprocessing's resource tracker and forkserver, inductor compile workers) are allowed; a
test that knowingly keeps a process for later tests can use `@pytest.mark.allow_leftover_children`.
`wait_for` is the one bounded wait-on-condition helper (no copies of sleep loops in test modules).
`one_torch_thread` (module scope, opt-in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
a module whose references or tiny models run in the test process itself on one torch thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest

import launcher  # noqa: F401 - first, before torch: its [Note: torch's C++ warnings] holds for the tests too

T = TypeVar("T")


# Substrings of command lines of session-long helper processes that are not leaks.
ALLOWED_CHILD_CMDLINE_MARKERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "multiprocessing.semaphore_tracker",
    "torch._inductor.compile_worker",
)
LEFTOVER_KILL_TIMEOUT_S = 3.0


def wait_for(condition: Callable[[], T], *, timeout_s: float, step_s: float = 0.02) -> T:
    """The one bounded wait on a condition that tests use where no event exists to wait on (another
    process's state, an HTTP server's counters): call `condition` until it returns something truthy
    or `timeout_s` passed, and return its last value (falsy on timeout; the caller asserts on it,
    naming what did not happen). `condition` may raise to end the wait early (e.g. a process died)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(step_s)
    return value


class LockSayingWhenContended:
    """A drop-in for a `threading.Lock` used as a context manager that sets `contended` when a thread has
    to wait for it: a test forcing an interleaving waits on that, not on time."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock, self.contended = threading.Lock(), contended

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()

    def __exit__(self, *exc_info) -> None:
        self._lock.release()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_leftover_children: do not fail the test for child processes it leaves running"
    )


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or f"[{proc.name()}]"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "[zombie or gone]"


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"


CREATE_TIME_SLACK_S = 2.0  # a process seen before: same pid, create_time within this (pid reuse takes longer)


def snapshot_children() -> set[tuple[int, float]]:
    """(pid, create_time) of every descendant of this process; create_time guards against pid reuse."""
    snapshot = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            snapshot.add((proc.pid, proc.create_time()))
    return snapshot


def find_leftover_children(before: set[tuple[int, float]]) -> list[psutil.Process]:
    """Descendants of this process that are not in `before` and not allowed helpers."""
    leftovers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            key = (proc.pid, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(pid == key[0] and abs(created - key[1]) < CREATE_TIME_SLACK_S for pid, created in before):
            continue  # (psutil's create_time is boot time + start ticks: it moves when the clock is set)
        if any(marker in _cmdline(proc) for marker in ALLOWED_CHILD_CMDLINE_MARKERS):
            continue
        leftovers.append(proc)
    return leftovers


def kill_and_reap(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL `procs`, reap those that are our children; returns one description line per process."""
    descriptions = [f"pid {proc.pid} ({_status(proc)}): {_cmdline(proc)}" for proc in procs]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.kill()
    my_pid = os.getpid()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.TimeoutExpired):
            if proc.ppid() == my_pid:
                proc.wait(timeout=LEFTOVER_KILL_TIMEOUT_S)  # reaps our own child, zombie included
    return descriptions


@pytest.fixture(autouse=True)
def no_leftover_child_processes(request: pytest.FixtureRequest):
    """Fail (after killing them) if the test leaves new child processes behind."""
    before = snapshot_children()
    yield
    if request.node.get_closest_marker("allow_leftover_children") is not None:
        return
    leftovers = find_leftover_children(before)
    if leftovers:
        descriptions = kill_and_reap(leftovers)
        pytest.fail(
            f"test left {len(leftovers)} child process(es) behind (now killed):\n  "
            + "\n  ".join(descriptions),
            pytrace=False,
        )


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a whole module, restored after it. Tiny models are faster on one thread,
    and on a 2-core machine shared with stage processes or other test runs, torch's spinning intra-op
    threads make transformers several times slower, starve the stage processes a test waits for and
    make OpenMP's thread hand-offs cost up to a second per forward."""
    import torch  # here, not at module level: hygiene fixtures above must not need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
