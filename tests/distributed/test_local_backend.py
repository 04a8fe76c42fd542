"""Tests for the local backend (stage processes, monitor) against tests/fake_stage_worker.py
(real processes, no model, < 5 s each). The pure launch-config tests are in tests/unit/test_local_launch_config.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from launcher.backends.stage_group import LocalStageProcesses, StageStartupError
from launcher.backends.stage_monitor import StageProcessMonitor
from launcher.backends.worker_command import LocalLaunchConfig
from tests.conftest import find_leftover_children, kill_and_reap, snapshot_children, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(30)]

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_ENV = {"PYTHONPATH": str(REPO_ROOT), "FAKE_WORKER_TAG": "tag-42"}


def fake_config(num_stages: int, *fake_flags: str, **overrides) -> LocalLaunchConfig:
    kwargs = {
        "num_stages": num_stages,
        "worker_module": "tests.fake_stage_worker",
        "env": FAKE_ENV,
        "extra_args": tuple(fake_flags),
        "startup_timeout_s": 10.0,
    }
    kwargs.update(overrides)
    return LocalLaunchConfig(**kwargs)


def process_gone(pid: int, *, zombie_counts_as_gone: bool = False) -> bool:
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    return zombie_counts_as_gone and status == psutil.STATUS_ZOMBIE




def test_three_workers_give_addresses_in_stage_order_and_stop_leaves_no_process():
    log = io.StringIO()
    procs = LocalStageProcesses(fake_config(3, threads_per_stage=2), log_stream=log)
    with procs:
        addresses = procs.start()
        pids = procs.pids
        assert len(addresses) == 3 and len(set(addresses)) == 3
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in addresses)
        assert all(psutil.Process(pid).is_running() for pid in pids)
        assert procs.dead_stages() == []
    assert all(process_gone(pid) for pid in pids)
    assert procs.dead_stages() == [(0, 0), (1, 0), (2, 0)]  # each exited by itself on stdin EOF
    output = log.getvalue()
    for stage_index, address in enumerate(addresses):
        port = address.rsplit(":", 1)[1]
        assert (f"[Stage {stage_index}] fake worker stage {stage_index}: listening on port {port} "
                "log_level=WARNING OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 FAKE_WORKER_TAG=tag-42") in output
        assert f"[Stage {stage_index}] fake worker stage {stage_index}: stdin closed, exiting" in output
    assert "SPEEDPIPE_STAGE_READY" not in output


def test_stop_is_idempotent_and_start_after_stop_is_refused():
    procs = LocalStageProcesses(fake_config(1))
    procs.start()
    procs.stop()
    procs.stop()
    with pytest.raises(RuntimeError, match="only once"):
        procs.start()


def test_context_manager_stops_workers_when_body_raises():
    with pytest.raises(KeyError), LocalStageProcesses(fake_config(2)) as procs:
        procs.start()
        pids = procs.pids
        raise KeyError("boom")
    assert all(process_gone(pid) for pid in pids)


def test_startup_failure_names_stage_exit_code_and_stderr_and_stops_the_others():
    procs = LocalStageProcesses(fake_config(3, "--die-before-ready", "1", "--exit-code", "3", startup_timeout_s=60.0),
                                log_stream=io.StringIO())
    started = time.monotonic()
    with pytest.raises(StageStartupError) as info:
        procs.start()
    assert time.monotonic() - started < 20.0  # at the death, not the 60-s startup timeout (margin for load)
    message = str(info.value)
    assert "stage 1 exited during startup with exit code 3" in message
    assert "fake worker stage 1: simulated startup failure" in message
    assert (info.value.stage_index, info.value.returncode) == (1, 3)
    assert len(procs.pids) == 3
    assert all(process_gone(pid) for pid in procs.pids)


def test_stage_dying_after_its_ready_line_while_others_start_fails_startup():
    config = fake_config(2, "--die-after", "0", "--die-after-s", "0.05", "--exit-code", "5",
                         "--delay-ready", "1", "--delay-ready-s", "0.8")
    procs = LocalStageProcesses(config, log_stream=io.StringIO())
    with pytest.raises(StageStartupError, match="stage 0 exited during startup with exit code 5"):
        procs.start()
    assert all(process_gone(pid) for pid in procs.pids)


def test_startup_timeout_raises_within_the_deadline_and_stops_all():
    # 3 s: long enough for a fake worker to start and log even on a loaded machine
    procs = LocalStageProcesses(fake_config(3, "--never-ready", "2", startup_timeout_s=3.0),
                                log_stream=io.StringIO())
    started = time.monotonic()
    with pytest.raises(StageStartupError, match=r"stage 2 did not report ready within 3 s") as info:
        procs.start()
    elapsed_s = time.monotonic() - started
    assert 3.0 <= elapsed_s < 3.0 + 10  # the deadline held, not the 60-s default (margin for a loaded machine)
    assert info.value.stage_index == 2 and info.value.returncode is None
    assert "fake worker stage 2: listening on port" in str(info.value)
    assert all(process_gone(pid) for pid in procs.pids)


def test_stop_escalates_to_sigterm_then_sigkill():
    # stage 0 ignores stdin EOF (needs SIGTERM); stage 1 also ignores SIGTERM (needs SIGKILL).
    procs = LocalStageProcesses(
        fake_config(2, "--ignore-stdin-eof", "all", "--ignore-sigterm", "1"), log_stream=io.StringIO()
    )
    procs.start()
    started = time.monotonic()
    procs.stop(grace_s=0.3, term_grace_s=0.3)
    assert time.monotonic() - started < 3.0
    assert procs.dead_stages() == [(0, -signal.SIGTERM), (1, -signal.SIGKILL)]
    assert all(process_gone(pid) for pid in procs.pids)


def test_stop_reentered_from_signal_handler_kills_immediately():
    procs = LocalStageProcesses(
        fake_config(1, "--ignore-stdin-eof", "all", "--ignore-sigterm", "all"), log_stream=io.StringIO()
    )
    procs.start()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: procs.stop())
    timer = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        started = time.monotonic()
        procs.stop(grace_s=10.0, term_grace_s=10.0)  # the "second Ctrl-C" cuts this short
        assert time.monotonic() - started < 3.0
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert procs.dead_stages() == [(0, -signal.SIGKILL)]


# -- monitor --------------------------------------------------------------------------------------
def test_monitor_reports_the_stage_that_died_with_its_exit_code():
    deaths: list[tuple[int, int]] = []
    fired = threading.Event()

    def on_death(stage_index: int, returncode: int) -> None:
        deaths.append((stage_index, returncode))
        fired.set()

    config = fake_config(3, "--die-after", "2", "--die-after-s", "1.5", "--exit-code", "7")
    with LocalStageProcesses(config, log_stream=io.StringIO()) as procs:
        procs.start()
        with StageProcessMonitor(procs, on_death):
            assert fired.wait(8.0), "monitor did not report the dead stage"
        assert procs.dead_stages() == [(2, 7)]
    assert deaths == [(2, 7)]


def test_monitor_logs_the_pipeline_stage_index_of_a_node_whose_first_stage_is_not_0(caplog):
    fired = threading.Event()
    config = fake_config(1, "--die-after", "3", "--die-after-s", "0.5", "--exit-code", "3", first_stage_index=3)
    with LocalStageProcesses(config, log_stream=io.StringIO()) as procs, caplog.at_level("ERROR"):
        procs.start()
        with StageProcessMonitor(procs, lambda i, rc: fired.set()):
            assert fired.wait(8.0), "monitor did not report the dead stage"
    assert "[Stage 3] process died unexpectedly" in caplog.text, caplog.text


def test_monitor_is_silent_on_intentional_stop_and_ends_by_itself():
    deaths: list[tuple[int, int]] = []
    procs = LocalStageProcesses(fake_config(2), log_stream=io.StringIO())
    procs.start()
    monitor = StageProcessMonitor(procs, lambda i, rc: deaths.append((i, rc))).start()
    procs.stop()
    assert wait_for(lambda: not monitor.running, timeout_s=2.0), "monitor thread kept running after stop()"
    monitor.stop()
    assert deaths == [] and not monitor.fired.is_set()


def test_monitor_stop_returns_promptly_while_all_stages_live():
    with LocalStageProcesses(fake_config(2), log_stream=io.StringIO()) as procs:
        procs.start()
        monitor = StageProcessMonitor(procs, lambda i, rc: None).start()
        started = time.monotonic()
        monitor.stop()
        assert time.monotonic() - started < 1.0
        assert not monitor.running and not monitor.fired.is_set()


def test_monitor_callback_may_stop_all_stages():
    config = fake_config(3, "--die-after", "0", "--die-after-s", "1.5", "--exit-code", "9")
    procs = LocalStageProcesses(config, log_stream=io.StringIO())
    procs.start()
    deaths: list[tuple[int, int]] = []

    def on_death(stage_index: int, returncode: int) -> None:
        deaths.append((stage_index, returncode))
        procs.stop(grace_s=1.0)

    monitor = StageProcessMonitor(procs, on_death).start()
    assert wait_for(lambda: not monitor.running, timeout_s=8.0)
    monitor.stop()
    assert deaths == [(0, 9)]
    assert all(process_gone(pid) for pid in procs.pids)


# -- parent death ---------------------------------------------------------------------------------
LAUNCHER_THAT_DIES = textwrap.dedent(
    """
    import json, os, signal, sys
    from launcher.backends.worker_command import LocalLaunchConfig
    from launcher.backends.stage_group import LocalStageProcesses
    config = LocalLaunchConfig(num_stages=2, worker_module="tests.fake_stage_worker",
                               extra_args=tuple(sys.argv[1:]), startup_timeout_s=10.0)
    procs = LocalStageProcesses(config)
    procs.start()
    print(json.dumps(procs.pids), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize(
    "fake_flags",
    [pytest.param((), id="stdin-eof-or-pdeathsig"),
     pytest.param(("--ignore-stdin-eof", "all"), id="pdeathsig-only")],
)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_die_within_5s_when_launcher_is_sigkilled(fake_flags):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_THAT_DIES, *fake_flags],
        cwd=REPO_ROOT, env={**os.environ, **FAKE_ENV}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        worker_pids = json.loads(launcher.stdout.readline())
        assert launcher.wait(timeout=10) == -signal.SIGKILL
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    assert len(worker_pids) == 2
    # The orphans are reparented away from us (so the conftest leak check cannot see them); whoever
    # adopts them may reap them late, hence a zombie counts as gone.
    all_gone = wait_for(lambda: all(process_gone(p, zombie_counts_as_gone=True) for p in worker_pids), timeout_s=5.0)
    if not all_gone:
        for pid in worker_pids:  # do not leave the orphans running after a failure
            with contextlib.suppress(psutil.NoSuchProcess):
                worker = psutil.Process(pid)
                if "tests.fake_stage_worker" in " ".join(worker.cmdline()):
                    worker.kill()
    assert all_gone, f"stage workers {worker_pids} outlived their SIGKILLed launcher"


# -- conftest leak check ----------------------------------------------------------------------------
def test_leftover_child_check_finds_kills_and_reaps_a_leaked_process():
    before = snapshot_children()
    leaked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    leftovers = find_leftover_children(before)
    assert [proc.pid for proc in leftovers] == [leaked.pid]
    descriptions = kill_and_reap(leftovers)
    assert f"pid {leaked.pid}" in descriptions[0] and "time.sleep(30)" in descriptions[0]
    assert process_gone(leaked.pid)
    assert find_leftover_children(before) == []
    leaked.wait(timeout=1.0)  # already reaped by kill_and_reap: returns at once


SPAWN_WITH_GRPC_ACTIVE = """
import subprocess, sys, grpc
from concurrent import futures
from launcher.backends.stage_process import spawn_stage
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=10)
for _ in range(5):
    if sys.argv[1] == "spawn_stage":
        proc = spawn_stage([sys.executable, "-c", "pass"], {}, stage_index=0)
    else:  # control: a preexec_fn makes Python fork(), which runs gRPC's fork handlers
        proc = subprocess.Popen([sys.executable, "-c", "pass"], close_fds=True, preexec_fn=lambda: None,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.communicate(timeout=30)
    print(proc.returncode)  # a forked child can crash (SIGSEGV / SIGABRT): the hazard itself
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork handlers and PR_SET_PDEATHSIG are Linux-only")
def test_spawning_stages_never_runs_grpc_fork_handlers():
    """[Note: no preexec_fn] in workers/parent_death.py: a forked child of a process with live gRPC
    can abort (grpc/grpc issue 43055), so stages are spawned without fork handlers running."""
    def spawn(mode: str) -> tuple[list[str], list[int]]:
        """(gRPC's log lines about fork, the children's exit codes)"""
        proc = subprocess.run([sys.executable, "-c", SPAWN_WITH_GRPC_ACTIVE, mode], cwd=REPO_ROOT,
                              env={**os.environ, "GRPC_VERBOSITY": "INFO"}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [line for line in proc.stderr.splitlines() if "fork" in line], [int(x) for x in proc.stdout.split()]

    if not spawn("control")[0]:
        pytest.skip("this grpcio logs nothing about fork handlers, so their absence proves nothing")
    assert spawn("spawn_stage") == ([], [0] * 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_worker_whose_launcher_is_already_gone_kills_itself():
    code = "from workers.parent_death import arm_parent_death_signal; print(arm_parent_death_signal())"
    alive = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SPEEDPIPE_PARENT_PID": str(os.getpid())})
    assert alive.returncode == 0 and alive.stdout.strip() == "True"
    orphan = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SPEEDPIPE_PARENT_PID": "1"})  # not its parent: "launcher gone"
    assert orphan.returncode == -signal.SIGKILL
    unset = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "SPEEDPIPE_PARENT_PID"})
    assert unset.stdout.strip() == "False"
