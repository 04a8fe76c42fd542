"""The stage worker's Rejoin when a fail-over attempt failed while the stage waited at its rendezvous
(workers/stage_worker.py, [Note: superseded rejoin]), without processes: the group and the loop are
stand-ins, the rendezvous a wait the test controls.

What breaks when these fail: a stage whose Rejoin is still waiting for a rendezvous that will never
complete (another stage was killed again while it restarted) makes the next attempt's Rejoin wait
for it until --stage-timeout-s: found by a soak of `serve` on the real model, where killing the
replacement of a killed stage while it loaded stopped the server for two minutes (/health 503,
every request paused) instead of the ~3 s of a restart.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.model.partition import LayerRange
from proto import speedpipe_pb2 as pb
from tests.conftest import wait_for
from tests.unit.test_stage_worker_load import Aborted, FakeContext
from workers import stage_worker
from workers.stage_worker import StageServicer

STALE_PORT, NEW_PORT = 41001, 41002
WAIT_S = 10.0




class Rendezvous:
    """Stand-in DataPlaneGroup factory: the stale port's join waits for `release`, then fails or
    forms (as `stale_forms` says); any other port forms at once."""

    def __init__(self, *, stale_forms: bool) -> None:
        self.stale_forms = stale_forms
        self.stale_waiting = threading.Event()
        self.release = threading.Event()
        self.groups: list[FakeGroup] = []

    def __call__(self, *, master_port: int, **_) -> FakeGroup:
        if master_port == STALE_PORT:
            self.stale_waiting.set()
            assert self.release.wait(WAIT_S), "the test never released the stale rendezvous"
            if not self.stale_forms:
                raise RuntimeError("Timed out waiting for the other ranks (stand-in)")
        group = FakeGroup(master_port)
        self.groups.append(group)
        return group


class FakeGroup:
    def __init__(self, port: int) -> None:
        self.port, self.closed = port, False

    def close(self) -> None:
        self.closed = True


class FakeLoop:
    """Stand-in StageLoop: runs until retired."""

    def __init__(self, *, channel, **_) -> None:
        self.channel, self.retired = channel, False
        self.stopped = threading.Event()
        self.sends = type("Sends", (), {"abandon": lambda self: None})()

    def run(self) -> None:
        self.stopped.wait()


class FakeExecutor:
    model = type("Model", (), {"config": type("Config", (), {"hidden_size": 8, "vocab_size": 16})()})()

    def clear(self) -> None:
        pass


def loaded_servicer(monkeypatch, rendezvous, servicer: StageServicer) -> StageServicer:
    """`servicer` as stage 1 of 2 that has loaded (a fake executor and spec), its data-plane groups
    made by `rendezvous` (DataPlaneGroup's keywords) and its loops fake."""
    monkeypatch.setattr(stage_worker, "DataPlaneGroup", rendezvous)
    monkeypatch.setattr(stage_worker, "StageLoop", FakeLoop)
    servicer.executor = FakeExecutor()
    servicer.spec = StageLoadSpec(model_dir="unused", stage_index=1, num_stages=2, layer_range=LayerRange(2, 4),
                                  max_num_seqs=1, max_model_len=16, dist_master_port=41000)
    return servicer


def rejoin_in_thread(servicer: StageServicer, port: int) -> tuple[threading.Thread, dict]:
    """Rejoin(port) without an attempt number (0: ordered by arrival), as `rejoin_attempt`."""
    return rejoin_attempt(servicer, port, attempt=0)


@pytest.mark.parametrize("stale_forms", [False, True], ids=["stale-rendezvous-times-out", "stale-rendezvous-forms-late"])
def test_a_rejoin_is_not_held_up_by_an_earlier_one_still_waiting_at_its_rendezvous(monkeypatch, stale_forms):
    """Attempt 1's Rejoin waits at a rendezvous a dead stage never reaches; attempt 2's Rejoin must
    join its own group at once (before: it waited for the lock until attempt 1's join gave up). When
    the stale rendezvous ends, its Rejoin fails without touching the new loop; a stale group that did
    form is closed (no leaked sockets)."""
    rendezvous = Rendezvous(stale_forms=stale_forms)
    servicer = loaded_servicer(monkeypatch, rendezvous, StageServicer(1, threading.Event()))
    try:
        stale, stale_out = rejoin_in_thread(servicer, STALE_PORT)
        assert rendezvous.stale_waiting.wait(WAIT_S)
        fresh, fresh_out = rejoin_in_thread(servicer, NEW_PORT)
        fresh.join(timeout=5.0)
        assert not fresh.is_alive(), "the second Rejoin waited for the first one's rendezvous"
        assert "response" in fresh_out, fresh_out
        new_loop = servicer.loop
        assert servicer.spec.dist_master_port == NEW_PORT and new_loop.channel.group.port == NEW_PORT
    finally:
        rendezvous.release.set()
    stale.join(timeout=WAIT_S)
    assert not stale.is_alive()
    assert stale_out.get("code") == grpc.StatusCode.ABORTED, stale_out  # answered when superseded
    expected = [(NEW_PORT, False), (STALE_PORT, True)] if stale_forms else [(NEW_PORT, False)]
    # the stale rendezvous ends in its own thread, after the release
    assert wait_for(lambda: [(g.port, g.closed) for g in rendezvous.groups] == expected, timeout_s=WAIT_S)
    assert servicer.loop is new_loop and servicer.spec.dist_master_port == NEW_PORT and not new_loop.retired
    # a superseded Rejoin's failed rendezvous (its "rejoin" thread, once ended) is not this stage's state: it runs
    # in the new group
    assert wait_for(lambda: not any(t.name == "rejoin" and t.is_alive() for t in threading.enumerate()), timeout_s=WAIT_S)
    assert servicer.Health(pb.HealthRequest(), FakeContext()).status == pb.HealthResponse.SERVING
    new_loop.stopped.set()


def test_superseded_rejoins_do_not_hold_the_control_planes_threads(monkeypatch):
    """Four fail-over attempts in a row failed while this stage waited at their rendezvous (a
    replacement that dies at every Load, with --max-stage-restarts above 4): each of those Rejoins
    held one of the control plane's 4 gRPC threads until its rendezvous timed out (--stage-timeout-s),
    so the fifth attempt's Rejoin, and every Health call (the heartbeat, the fail-over's hung-stage
    probe), waited behind them: the stage was declared hung and killed. A superseded Rejoin now
    answers ABORTED at once; its rendezvous ends in a daemon thread."""
    from proto import speedpipe_pb2_grpc as pb_grpc

    stale_ports = [STALE_PORT + 10 + k for k in range(4)]
    release, reached, groups = threading.Event(), [], []

    def rendezvous(*, master_port: int, **_) -> FakeGroup:
        if master_port in stale_ports:
            reached.append(master_port)
            assert release.wait(WAIT_S), "the test never released the stale rendezvous"
            raise RuntimeError("Timed out waiting for the other ranks (stand-in)")
        groups.append(FakeGroup(master_port))
        return groups[-1]

    server, servicer, port = stage_worker.start_server(stage_index=1, host="127.0.0.1", stop_event=threading.Event())
    loaded_servicer(monkeypatch, rendezvous, servicer)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.StageServiceStub(channel)
    try:
        stale = []
        for k, stale_port in enumerate(stale_ports):
            stale.append(stub.Rejoin.future(pb.RejoinRequest(dist_master_port=stale_port, join_timeout_s=30), timeout=30))
            wait_until = threading.Event()
            for _ in range(200):  # this attempt's Rejoin reached its rendezvous
                if len(reached) > k:
                    break
                wait_until.wait(0.025)
            assert len(reached) == k + 1, f"Rejoin {k} never reached its rendezvous"
        stub.Rejoin(pb.RejoinRequest(dist_master_port=NEW_PORT, join_timeout_s=30), timeout=5)
        assert stub.Health(pb.HealthRequest(), timeout=2).status == pb.HealthResponse.SERVING
        for call in stale:
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=2)
            assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
        assert servicer.spec.dist_master_port == NEW_PORT and [g.port for g in groups] == [NEW_PORT]
    finally:
        release.set()
        if servicer.loop is not None:
            servicer.loop.stopped.set()
        channel.close()
        server.stop(grace=None)


def rejoin_attempt(servicer: StageServicer, port: int, attempt: int) -> tuple[threading.Thread, dict]:
    """Rejoin(port, attempt) in a thread, as the gRPC server runs it; its response or abort lands in the dict."""
    out: dict = {}

    def call() -> None:
        context = FakeContext()
        try:
            out["response"] = servicer.Rejoin(
                pb.RejoinRequest(dist_master_port=port, join_timeout_s=30, attempt=attempt), context)
        except Aborted:
            out["code"], out["details"] = context.code, context.details

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("newer_joined", [False, True], ids=["newer-still-at-its-rendezvous", "newer-already-joined"])
def test_a_rejoin_of_an_older_attempt_arriving_after_a_newer_one_is_refused(monkeypatch, newer_joined):
    """Two fail-over attempts milliseconds apart: attempt 8's Rejoin reaches this stage before attempt
    7's (separate calls on separate threads). Attempt 7's must answer ABORTED naming both numbers and
    leave attempt 8's join alone, whether that one still waits for the other ranks or already joined.
    Before, the later-arriving stale Rejoin superseded the newer one: attempt 8 answered ABORTED (or
    its new loop was retired) and its rendezvous lacked this stage."""
    newer_port, older_port = NEW_PORT, STALE_PORT
    others_joined, at_newer = threading.Event(), threading.Event()
    groups: list[FakeGroup] = []

    def rendezvous(*, master_port: int, **_) -> FakeGroup:
        if master_port == newer_port:  # forms once the test lets the other ranks in
            at_newer.set()
            assert others_joined.wait(WAIT_S), "the test never let the other ranks join"
        groups.append(FakeGroup(master_port))
        return groups[-1]

    servicer = loaded_servicer(monkeypatch, rendezvous, StageServicer(1, threading.Event()))
    try:
        newer, newer_out = rejoin_attempt(servicer, newer_port, attempt=8)
        assert at_newer.wait(WAIT_S), "attempt 8's Rejoin never reached its rendezvous"
        if newer_joined:
            others_joined.set()
            newer.join(timeout=WAIT_S)
        older, older_out = rejoin_attempt(servicer, older_port, attempt=7)
        older.join(timeout=WAIT_S)
        assert not older.is_alive(), "attempt 7's Rejoin did not answer"
        assert older_out.get("code") == grpc.StatusCode.ABORTED, older_out
        assert "attempt 7" in older_out["details"] and "attempt 8" in older_out["details"], older_out["details"]
        others_joined.set()
        newer.join(timeout=WAIT_S)
        assert not newer.is_alive() and "response" in newer_out, newer_out
        assert [g.port for g in groups] == [newer_port], "attempt 7 joined a rendezvous of its own"
        assert servicer.spec.dist_master_port == newer_port and servicer.loop.channel.group.port == newer_port
        assert not servicer.loop.retired and not groups[0].closed
    finally:
        others_joined.set()
        if servicer.loop is not None:
            servicer.loop.stopped.set()


def test_a_stage_whose_rejoin_failed_is_not_serving_naming_the_failure_until_the_next_rejoin(monkeypatch):
    """A fail-over attempt's rendezvous timed out (another stage died again): the stage left its old group and
    joined none, yet kept answering what its retired loop said (SERVING, or UNHEALTHY with the old data-plane
    error). It is NOT_SERVING now, naming the failed join the Rejoin answered, until the next attempt's Rejoin."""
    rendezvous = Rendezvous(stale_forms=False)
    rendezvous.release.set()  # the stale port's rendezvous fails at once
    servicer = loaded_servicer(monkeypatch, rendezvous, StageServicer(1, threading.Event()))
    loops = []
    try:
        for port, attempt in ((NEW_PORT, 1), (STALE_PORT, 2), (NEW_PORT + 1, 3)):
            thread, out = rejoin_attempt(servicer, port, attempt=attempt)
            thread.join(timeout=WAIT_S)
            loops.append(servicer.loop)
            health = servicer.Health(pb.HealthRequest(), FakeContext())
            if port == STALE_PORT:
                assert out.get("code") == grpc.StatusCode.DEADLINE_EXCEEDED, out
                failure = out["details"].removeprefix("stage 1: ")  # the Rejoin names the stage; Health's caller does
                assert (health.status, health.message) == (
                    pb.HealthResponse.NOT_SERVING, f"weights loaded, in no data-plane group: {failure}")
            else:
                assert "response" in out and health.status == pb.HealthResponse.SERVING, (out, health)
    finally:
        for loop in loops:
            loop.stopped.set()
