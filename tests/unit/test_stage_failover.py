"""`StageFailover.may_restart`: a stage that died of the server's own shutdown signal is not restarted; and
`wait_reachable` gives up on a stage that died while the others restarted.

What breaks when these fail: `serve` under systemd / `timeout` / `kill -- -PGID` (every process gets
SIGTERM) restarts the stages it is stopping, or a stage killed any other way waits for nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from launcher.coordinator.request_handle import PipelineError
from launcher.coordinator.stage_failover import SHUTDOWN_SIGNAL_GRACE_S, StageFailover


def _failover() -> StageFailover:
    return StageFailover(budget=None, restart_stage=lambda i: "", dead_stages=lambda: [], data_port=lambda: 0,
                         load_specs=lambda port: [])


def _death(how: str) -> PipelineError:
    return PipelineError(f"stage 1 (pid 42) exited unexpectedly with {how}")


def test_a_stage_killed_by_sigterm_waits_for_the_servers_own_signal():
    fo = _failover()
    threading.Timer(0.2, fo.shutting_down.set).start()  # the server's handler runs a moment later
    assert not fo.may_restart(_death("killed by signal SIGTERM (exit code -15)"))


def test_other_deaths_restart_at_once_and_nothing_restarts_while_draining():
    fo = _failover()
    start = time.monotonic()
    assert fo.may_restart(_death("killed by signal SIGKILL (exit code -9)"))
    assert fo.may_restart(_death("exit code 3")) and fo.may_restart(None)
    assert time.monotonic() - start < SHUTDOWN_SIGNAL_GRACE_S / 2
    fo.shutting_down.set()
    assert not fo.may_restart(_death("killed by signal SIGKILL (exit code -9)"))


def test_waiting_for_a_control_plane_ends_at_once_when_its_stage_died():
    """A stage that dies while the others restart (kill -9 of stage 2, then of stage 0) used to cost
    the 30 s wait_reachable timeout and a second restart; now the wait names it as soon as its
    process is seen dead."""
    import grpc

    from launcher.backends.ports import free_port
    from launcher.coordinator.request_handle import PipelineError
    from launcher.coordinator.stage_control import wait_reachable

    channel = grpc.insecure_channel(f"127.0.0.1:{free_port()}")  # nothing listens: never ready
    try:
        asked = []
        with pytest.raises(PipelineError, match="stage 0 died while the pipeline was being restored"):
            wait_reachable([channel], timeout_s=600.0, dead=lambda: asked.append(1) or [0])
        assert len(asked) == 1  # found at the first poll, not after the timeout
        with pytest.raises(PipelineError, match="stage 0 control plane is not reachable"):
            wait_reachable([channel], timeout_s=0.2)
    finally:
        channel.close()


def test_a_stage_that_dies_while_another_restarts_joins_the_same_restart():
    """kill -9 of stage 2, then of stage 0 while stage 2 restarts: both restart once, in one pass
    (stage 0 used to be found only by the next, failing, step: a second restart from the budget)."""
    import types

    from launcher.coordinator.stage_failover import restart_dead_stages

    answering = types.SimpleNamespace(Health=types.SimpleNamespace(
        future=lambda request, timeout: types.SimpleNamespace(result=lambda: None)))
    dead, restarts, reconnected = {2}, [], []

    def restart_stage(i: int) -> str:
        restarts.append(i)
        dead.discard(i)
        if i == 2:
            dead.add(0)  # stage 0 dies while stage 2 restarts
        return f"127.0.0.1:{9000 + i}"

    fo = StageFailover(budget=None, restart_stage=restart_stage, dead_stages=lambda: sorted(dead),
                       data_port=lambda: 0, load_specs=lambda port: [])
    restarted = restart_dead_stages(fo, [answering] * 3, lambda i, address: reconnected.append((i, address)))
    assert restarted == {0, 2} and restarts == [2, 0] and not dead
    assert reconnected == [(2, "127.0.0.1:9002"), (0, "127.0.0.1:9000")]


def test_a_live_stage_a_failed_attempt_left_unloaded_is_restarted_again():
    """kill -9 of stage 1, then of stage 0 while stage 1's replacement joins: the attempt fails with stage 1
    alive but unloaded, its Load perhaps still waiting at that attempt's rendezvous. The next attempt
    must start it afresh (before: it sent that process a second Load, which waited for the first and
    was then refused "already loaded", attempt after attempt until the budget was spent)."""
    import types

    from launcher.coordinator.stage_failover import restart_dead_stages

    answering = types.SimpleNamespace(Health=types.SimpleNamespace(
        future=lambda request, timeout: types.SimpleNamespace(result=lambda: None)))
    restarts, reconnected = [], []

    def restart_stage(i: int) -> str:
        restarts.append(i)
        return f"127.0.0.1:{9000 + i}"

    fo = StageFailover(budget=None, restart_stage=restart_stage, dead_stages=lambda: [0] if 0 not in restarts else [],
                       data_port=lambda: 0, load_specs=lambda port: [])
    restarted = restart_dead_stages(fo, [answering] * 3, lambda i, address: reconnected.append(i), unloaded={1})
    assert restarted == {0, 1} and sorted(restarts) == [0, 1] and sorted(reconnected) == [0, 1]


def test_a_stage_that_cannot_come_back_fails_at_once_without_spending_the_restart_budget():
    """A member node whose launcher was stopped answers node 0's restart with StageGone: the
    coordinator burnt its whole budget in milliseconds on attempts that could not succeed, then
    said "stage restarts exhausted", pointing at the wrong remedy."""
    import threading
    from types import SimpleNamespace

    from launcher.backends.placement import StageGone
    from launcher.coordinator.coordinator import Coordinator, PipelineError
    from launcher.coordinator.stage_restarts import RestartBudget, RestartLedger

    coord = Coordinator.__new__(Coordinator)
    ledger = RestartLedger(RestartBudget(max_restarts=3, window_s=600))
    coord.failover = SimpleNamespace(may_restart=lambda error: True, budget=ledger)
    coord._stopping, coord.num_restarts, coord.recovering = threading.Event(), 0, None
    coord._notify_recovery = lambda phase: None
    attempts = []

    def restart(fo):
        attempts.append(1)
        raise StageGone("node 1 could not respawn stage 1: node 1's launcher was stopped (Ctrl-C or SIGTERM)")

    coord._restart_and_replay = restart
    error = coord._recover(PipelineError("stage 1 exited"))
    assert str(error) == ("stage restart failed: node 1 could not respawn stage 1: node 1's launcher was stopped "
                          "(Ctrl-C or SIGTERM)")
    assert len(attempts) == 1 and coord.num_restarts == 1


def test_a_failed_recovery_is_over_too():
    """`recovering` stayed set after a recovery failed: /metrics said stage_recovering 1 forever on a
    fenced server, and health said NOT_SERVING (recovers by itself) instead of UNHEALTHY."""
    import threading

    from launcher.coordinator.coordinator import Coordinator, PipelineError

    coord = Coordinator.__new__(Coordinator)
    coord._stopping, failed = threading.Event(), []

    def pump():
        raise PipelineError("stage 1 exited")

    def recover(error):
        coord.recovering = "restarting after a stage failure: stage 1 exited"
        return PipelineError("stage restart failed: node 1 is gone")

    coord._pump, coord._recover, coord._fail = pump, recover, failed.append
    coord._engine_loop()
    assert [str(e) for e in failed] == ["stage restart failed: node 1 is gone"] and coord.recovering is None


def test_restarts_left_is_read_without_changing_the_ledger():
    """/metrics reads restarts left from its own thread: `used` drops expired entries from the deque
    the engine thread appends to; `left` only reads."""
    from launcher.coordinator.stage_restarts import RestartBudget, RestartLedger

    ledger = RestartLedger(RestartBudget(max_restarts=3, window_s=10))
    ledger.record(0.0)
    ledger.record(5.0)
    assert ledger.left(6.0) == 1 and ledger.left(12.0) == 2 and ledger.left(20.0) == 3
    assert len(ledger._times) == 2  # nothing was dropped by reading
    assert ledger.used(12.0) == 1 and ledger.left(12.0) == 2


def test_re_forming_the_data_plane_fails_at_the_first_failure_whatever_the_stages_order():
    """kill -9 of stage 1, then of its replacement while it loads (or of the surviving stage 1 while
    stage 0's replacement loads): that stage's call fails at once, but the stage before it waits at
    the rendezvous for it. rejoin_all waited for the calls in stage order, so the attempt failed only
    when stage 0's rendezvous timed out (--stage-timeout-s: 20 s measured with the tiny model at
    --stage-timeout-s 20, 120 s by default) instead of at once, as it did when the dead stage was stage 0."""
    import types

    import grpc

    from launcher.coordinator.stage_failover import rejoin_all
    from pipeline.engine.stage_assembly import StageLoadSpec
    from pipeline.model.partition import LayerRange

    class Gone(grpc.RpcError):
        def details(self) -> str:
            return "Socket closed"

    released = threading.Event()

    def waits_at_the_rendezvous(request, timeout):
        assert released.wait(10.0)

    def dies(request, timeout):
        raise Gone()

    specs = [StageLoadSpec(model_dir="unused", stage_index=i, num_stages=2, layer_range=LayerRange(2 * i, 2 * i + 2),
                           max_num_seqs=1, max_model_len=16, dist_master_port=41000) for i in range(2)]
    for restarted in ({1}, {0}):  # stage 1's replacement killed while loading / the survivor stage 1 killed
        stage0 = types.SimpleNamespace(Rejoin=waits_at_the_rendezvous, Load=waits_at_the_rendezvous)
        stage1 = types.SimpleNamespace(Rejoin=dies, Load=dies)
        start = time.monotonic()
        try:
            with pytest.raises(PipelineError, match=r"stage 1 \((Load|Rejoin)\) failed while re-forming the data "
                                                    r"plane: Socket closed"):
                rejoin_all([stage0, stage1], specs, restarted, lambda: released.wait(10.0), timeout_s=600.0)
            assert time.monotonic() - start < 5.0
        finally:
            released.set()
        released.clear()


def _listening(port: int) -> bool:
    """Whether some socket listens on 127.0.0.1:`port` (a bind that ignores TIME_WAIT fails only then)."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return True
        return False


def test_a_failed_attempt_gives_back_its_rendezvous_port_and_join_thread():
    """A fail-over attempt fails at once (stage 0's Rejoin: the stage died) while the coordinator's
    join, rank 0 of a real StageLink, waits at the rendezvous for ranks that will never come. Its
    thread must end and the rendezvous port close once the attempt failed ([Note: abandoned
    rendezvous] in workers/channel.py). Before, both stayed until the 600 s rendezvous timed out:
    one more thread and one more listening port per failed attempt."""
    import types

    import grpc

    from launcher.coordinator.stage_failover import rejoin_all
    from launcher.coordinator.stage_link import StageLink
    from pipeline.engine.stage_assembly import StageLoadSpec
    from pipeline.model.partition import LayerRange
    from tests.conftest import wait_for
    from workers.channel import hold_listener

    class Gone(grpc.RpcError):
        def details(self) -> str:
            return "Socket closed"

    def dies(request, timeout):
        raise Gone()

    released = threading.Event()
    port = hold_listener("127.0.0.1")  # as the session's data_port() does
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=port, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    specs = [StageLoadSpec(model_dir="unused", stage_index=i, num_stages=2, layer_range=LayerRange(2 * i, 2 * i + 2),
                           max_num_seqs=1, max_model_len=16, dist_master_port=port) for i in range(2)]
    stage0 = types.SimpleNamespace(Rejoin=dies)
    stage1 = types.SimpleNamespace(Rejoin=lambda request, timeout: released.wait(30.0))  # waits at the rendezvous
    before = set(threading.enumerate())
    try:
        with pytest.raises(PipelineError, match=r"stage 0 \(Rejoin\) failed while re-forming the data plane"):
            rejoin_all([stage0, stage1], specs, set(), link.join, timeout_s=600.0, attempt=1, abandon=link.close)
        joins = [t for t in set(threading.enumerate()) - before if t.name == "join"]
        assert len(joins) == 1, "the coordinator's join did not run in a thread of its own"
        ended = wait_for(lambda: not joins[0].is_alive() and not _listening(port), timeout_s=20.0)
        assert ended, (f"after the failed attempt: join thread alive={joins[0].is_alive()}, "
                       f"port {port} listening={_listening(port)}")
    finally:
        released.set()
        link.close()


def test_an_attempt_given_up_just_as_the_coordinators_group_forms_leaves_no_group_open(monkeypatch):
    """`close` (the failed attempt's `abandon`, on the engine thread) can run after the coordinator's
    rendezvous formed, while the join publishes its channel: then either `close` finds the channel and
    closes its group, or the join sees the flag and closes the group itself ([Note: joined or abandoned,
    never both] in launcher/coordinator/stage_link.py). Before (join looked at `abandoned` first and
    published the channel after, without a lock), a close in between found nothing to close and left the
    group, its store and its port open, and the join answered as if the attempt had succeeded."""
    from launcher.coordinator import stage_link
    from launcher.coordinator.stage_link import StageLink
    from tests.conftest import LockSayingWhenContended
    from workers.channel import Channel, RendezvousAbandoned

    class Group:
        def __init__(self, **_) -> None:
            self.closed = False

        def close(self) -> None:
            self.closed = True

    link = StageLink(num_stages=1, master_addr="127.0.0.1", master_port=41000, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    close_went_on, groups = threading.Event(), []
    link._join_lock = LockSayingWhenContended(close_went_on)  # close waits for the join, or (before) did not

    def formed(**kwargs) -> Group:
        groups.append(Group(**kwargs))
        return groups[-1]

    def closes() -> None:
        link.close()
        close_went_on.set()

    closer = threading.Thread(target=closes, daemon=True)

    def given_up_meanwhile(group, **kwargs) -> Channel:
        closer.start()  # the attempt fails now, on the engine thread
        assert close_went_on.wait(timeout=30.0), "close neither ended nor waited for the join"
        return Channel(group, **kwargs)

    monkeypatch.setattr(stage_link, "DataPlaneGroup", formed)
    monkeypatch.setattr(stage_link, "Channel", given_up_meanwhile)
    with contextlib.suppress(RendezvousAbandoned):
        link.join()
    closer.join(timeout=30.0)
    assert not closer.is_alive()
    assert [g.closed for g in groups] == [True], "the group of an abandoned attempt stayed open"
