"""The restart budget (pure) and `LocalStageProcesses.respawn` against tests/fake_stage_worker.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import psutil
import pytest

from launcher.backends.stage_group import LocalStageProcesses, StageStartupError
from launcher.backends.stage_monitor import StageProcessMonitor
from launcher.coordinator.stage_restarts import RestartBudget, RestartLedger
from tests.distributed.test_local_backend import fake_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]


def test_restart_budget_is_a_sliding_window():
    ledger = RestartLedger(RestartBudget(max_restarts=2, window_s=10.0))
    ledger.record(0.0)
    ledger.record(5.0)
    assert not ledger.allows(9.9) and ledger.used(9.9) == 2
    with pytest.raises(RuntimeError, match="--max-stage-restarts"):
        ledger.record(9.9)
    assert ledger.allows(10.0) and ledger.used(10.0) == 1  # the restart at 0 s left the window
    assert not RestartLedger(RestartBudget(max_restarts=0)).allows(0.0)
    for kwargs, flag in (({"max_restarts": -1}, "--max-stage-restarts"), ({"window_s": 0}, "--restart-window-s")):
        with pytest.raises(ValueError, match=flag):
            RestartBudget(**kwargs)


def test_a_dead_stage_is_respawned_in_place_and_watched_again():
    procs = LocalStageProcesses(fake_config(2))
    try:
        first = procs.start()
        old_pid = procs.pids[1]
        died = threading.Event()
        monitor = StageProcessMonitor(procs, lambda stage, code: died.set()).start()
        os.kill(old_pid, signal.SIGKILL)
        assert died.wait(10)
        monitor.stop()
        address = procs.respawn(1)
        assert procs.addresses == [first[0], address] and procs.pids[1] != old_pid
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
        assert procs.dead_stages() == []
        died.clear()
        monitor = StageProcessMonitor(procs, lambda stage, code: died.set()).start()  # watches the new pid
        os.kill(procs.pids[1], signal.SIGKILL)
        assert died.wait(10)
        monitor.stop()
    finally:
        procs.stop(grace_s=1.0)
    assert [stage for stage, _ in procs.dead_stages()] == [0, 1]


def test_a_respawn_that_fails_to_start_raises_and_leaves_the_other_stages_running():
    procs = LocalStageProcesses(fake_config(2), log_stream=open(os.devnull, "w"))
    try:
        procs.start()
        with pytest.raises(ValueError, match="outside"):
            procs.respawn(5)
        procs.config = dataclasses.replace(procs.config, extra_args=("--die-before-ready", "1"))
        with pytest.raises(StageStartupError, match="stage 1 could not be respawned") as info:
            procs.respawn(1)
        assert "simulated startup failure" in str(info.value)
        assert [stage for stage, _ in procs.dead_stages()] == [1]  # stage 0 still runs
        procs.stop(grace_s=1.0)
        with pytest.raises(RuntimeError, match="respawn"):
            procs.respawn(0)
    finally:
        procs.stop(grace_s=1.0)
