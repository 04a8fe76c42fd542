"""The leftover-child fixture's identity of a child: pid and create_time, with slack.

What broke: psutil computes create_time as the boot time (/proc/stat btime, which moves when the
wall clock is set) plus the start ticks, so a module-scoped pipeline's stage processes, snapshotted
before a test, read a create_time one second off after it: the fixture took them for the test's
leftovers, SIGKILLed and reaped them, and the coordinator then heard "stage 0 exited unexpectedly with
exit code 0" (Popen.poll after the reap) in every later test of the module (seen once in CI).
"""

from __future__ import annotations

import subprocess
import sys

import psutil

from tests.conftest import find_leftover_children, snapshot_children


def test_a_child_seen_before_is_no_leftover_when_its_create_time_moves_by_a_second(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = snapshot_children()
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 1.0)  # the clock was set
        assert child.pid not in [p.pid for p in find_leftover_children(before)]
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 30.0)  # another process
        assert child.pid in [p.pid for p in find_leftover_children(before)]
    finally:
        child.kill()
        child.wait()
