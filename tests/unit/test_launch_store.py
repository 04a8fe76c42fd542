"""The launch store of the torchrun-style mode (launcher/backends/launch_store.py): node 0's checks
before anything starts (--master-addr is its own, --master-port + 1 is free), and a member node's
Node0Watch, which reads node 0's outcome from `done` and gives up on a frozen node 0 within
--placement-timeout-s ([Note: node 0 silent])."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from launcher.backends.launch_store import Node0Watch, check_master_addr_is_local, hold_data_port
from launcher.backends.placement import PlacementError, PlacementOptions
from workers.channel import release_listener

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(port: int, *, placement_timeout_s: float = 60.0, node_rank: int = 1) -> PlacementOptions:
    return PlacementOptions(nnodes=2, node_rank=node_rank, master_addr="127.0.0.1", master_port=port,
                            placement_timeout_s=placement_timeout_s)


def test_a_master_addr_of_another_machine_is_one_line_naming_the_flag():
    with pytest.raises(PlacementError) as info:
        check_master_addr_is_local("192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert str(info.value).startswith("--master-addr 192.0.2.1 is not an address of this machine")
    check_master_addr_is_local("127.0.0.1")
    check_master_addr_is_local("localhost")


def test_a_busy_data_plane_port_names_the_port_and_master_port():
    port = _free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        with pytest.raises(PlacementError) as info:
            hold_data_port(_options(port, node_rank=0))
    assert f"data-plane port {port + 1} (--master-port {port} + 1)" in str(info.value)
    assert hold_data_port(_options(port, node_rank=0)) == port + 1  # free again: held for the data plane
    release_listener("127.0.0.1", port + 1)


@pytest.mark.parametrize(("done", "expected"), [("ok", ("done", "")), ("failed: coordinator failed to load",
                                                                      ("failed", "coordinator failed to load"))])
def test_node0_watch_reads_node_0s_outcome_from_done(done, expected):
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
    watch = Node0Watch(client, _options(port)).start()
    assert watch.wait(threading.Event(), timeout_s=1.5) is None  # not done yet: no outcome
    master.set("done", done)
    assert watch.wait(threading.Event(), timeout_s=10) == expected


def test_node0_watch_gives_up_on_a_frozen_node_0_within_the_placement_timeout():
    port = _free_port()
    node0 = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import datetime, time, torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", {port}, None, True, timeout=datetime.timedelta(seconds=30),
                              wait_for_workers=False)
        print("ready", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert node0.stdout.readline().strip() == "ready"
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        watch = Node0Watch(client, _options(port, placement_timeout_s=2)).start()
        os.kill(node0.pid, signal.SIGSTOP)  # its store accepts nothing more, and resets nothing
        start = time.monotonic()
        outcome = watch.wait(threading.Event())
        elapsed = time.monotonic() - start
    finally:
        os.kill(node0.pid, signal.SIGKILL)
        node0.wait()
    assert outcome == ("error", f"node 0 at 127.0.0.1:{port} has not answered for 2 s (--placement-timeout-s): "
                                f"it is frozen or unreachable")
    assert elapsed < 6, f"took {elapsed:.1f} s with --placement-timeout-s 2"


@pytest.mark.parametrize(("cpp_log_level", "frames_expected"), [(None, False), ("WARNING", True)])
def test_a_member_whose_node_0_dies_prints_no_cpp_frames_unless_asked(cpp_log_level, frames_expected):
    """[Note: torch's C++ warnings] in launcher/__init__.py: node 0 killed under a member's watch gives
    one outcome line, not torch's 20-line "recvValue failed" warning, unless TORCH_CPP_LOG_LEVEL asks."""
    port = _free_port()
    node0 = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import datetime, time, torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", {port}, None, True, timeout=datetime.timedelta(seconds=30),
                              wait_for_workers=False)
        print("ready", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    if cpp_log_level is not None:
        env["TORCH_CPP_LOG_LEVEL"] = cpp_log_level
    member_code = textwrap.dedent(f"""
        import datetime, threading
        from launcher.backends.launch_store import Node0Watch
        from launcher.backends.placement import PlacementOptions
        import torch.distributed as dist
        options = PlacementOptions(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port={port},
                                   placement_timeout_s=20)
        store = dist.TCPStore("127.0.0.1", {port}, None, False, timeout=datetime.timedelta(seconds=10))
        watch = Node0Watch(store, options).start()
        print("watching", flush=True)
        print(watch.wait(threading.Event()), flush=True)""")
    try:
        assert node0.stdout.readline().strip() == "ready"
        member = subprocess.Popen([sys.executable, "-c", member_code], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        assert member.stdout.readline().strip() == "watching"
        node0.kill()
        out, err = member.communicate(timeout=30)
    finally:
        node0.kill()
        node0.wait()
    assert out.startswith(f"('error', 'node 0 at 127.0.0.1:{port} went away"), (out, err)
    assert ("frame #" in err) == frames_expected, err


def test_an_interrupted_member_refuses_node_0s_next_restart_at_once_and_ends_its_restart_thread():
    """SIGTERM to a member node's launcher: its restart thread sat in a blocking store call (the
    interpreter then aborted, exit 134), and node 0 waited --placement-timeout-s for a respawn that
    could not come. Now the thread polls, and on leaving answers node 0's next request in advance."""
    from types import SimpleNamespace

    from launcher.backends import multinode

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    watch = multinode._MemberWatch.__new__(multinode._MemberWatch)  # no stages: only the restart thread
    watch.placement, watch.leaving, watch.lock = _options(port), threading.Event(), threading.Lock()
    watch.monitor = SimpleNamespace(stop=lambda: None)
    thread = threading.Thread(target=watch.answer_restarts, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()  # waiting for node 0's requests
    watch.leaving.set()
    thread.join(5)
    assert not thread.is_alive()
    n = master.add("restarts/1", 1)  # node 0's restart_stage, after the member left
    assert n == 1 and master.check([f"respawned/1/{n}"])
    assert master.get(f"respawned/1/{n}").decode() == "gone: node 1's launcher was stopped (Ctrl-C or SIGTERM)"

    # node 0's side: the answer fails this restart and every later one for that node at once
    node0 = multinode.MultiNodeStages.__new__(multinode.MultiNodeStages)
    node0.num_stages, node0.options, node0.stages = 2, _options(port, node_rank=0), range(0, 1)
    node0.store, node0._missed, node0.addresses = master, {}, ["a", "b"]
    master.set("restarts/1", "0")  # as before the member answered
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="node 1 could not respawn stage 1: node 1's launcher was stopped"):
            node0.restart_stage(1)
        assert time.monotonic() - started < 5  # not --placement-timeout-s (60 s)
