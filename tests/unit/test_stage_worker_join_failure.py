"""A Load whose data-plane rendezvous fails (workers/stage_worker.py, `join_failure` in workers/rejoin.py),
in one process: the tiny model loads for real, the rendezvous is torch's (a port nobody serves, or a
rank-0 store that goes away as a failed fail-over attempt abandons it).

What breaks when these fail: the coordinator sees gRPC UNKNOWN ("Exception calling application",
the torch exception escaped the handler) instead of a status naming the rank, the port and the
timeout, and the stage is left loaded but not joined: every later Load is refused "already loaded"
and every Rejoin "not loaded", so only a restart of the process could bring it back; its Health says
NOT_LOADED "waiting for Load" though the weights are loaded and a Rejoin would do.
"""

from __future__ import annotations

import datetime
import socket
import threading

import grpc
import pytest
import torch.distributed as dist

from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.model.partition import LayerRange
from proto import speedpipe_pb2 as pb
from tests.conftest import wait_for
from tests.tiny_model import write_tiny_model
from tests.unit.test_stage_worker_load import Aborted, FakeContext
from tests.unit.test_stage_worker_rejoin import FakeGroup, FakeLoop
from workers import rendezvous, stage_worker
from workers.channel import DataPlaneGroup, RendezvousAbandoned, hold_listener
from workers.load_spec_codec import spec_to_proto
from workers.stage_worker import StageServicer

WAIT_S = 30.0


def _unserved_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spec(model_dir, port: int) -> StageLoadSpec:
    """Stage 0 of 2 (rank 1 of 3): its rendezvous needs the coordinator and stage 1."""
    return StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=LayerRange(0, 2),
                         max_num_seqs=1, max_model_len=16, dist_master_port=port, stage_timeout_s=5.0)


def _load(servicer: StageServicer, spec: StageLoadSpec) -> FakeContext:
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Load(spec_to_proto(spec), context)
    return context


def _check_health_names_the_failed_join(servicer: StageServicer, context: FakeContext) -> None:
    """Health after the failed join: NOT_SERVING (not NOT_LOADED "waiting for Load": the weights are loaded),
    naming the failure Load answered, while the stage waits for the coordinator's next Rejoin or Load."""
    health = servicer.Health(pb.HealthRequest(), FakeContext())
    assert health.status == pb.HealthResponse.NOT_SERVING, health
    assert health.message == f"weights loaded, in no data-plane group: {context.details}", health.message


def _short_join(servicer: StageServicer) -> None:
    """The worker's own join, with a 1 s rendezvous instead of 600 s."""
    servicer._join_data_plane = lambda spec: StageServicer._join_data_plane(servicer, spec, connect_timeout_s=1.0)


def _check_the_next_call_works(servicer: StageServicer, spec: StageLoadSpec, monkeypatch, next_call: str) -> None:
    """After the failed join, a Rejoin moves the loaded stage into a new group, or a new Load loads it
    again and joins: both as the coordinator's next attempt would call them (groups stand-ins)."""
    monkeypatch.setattr(stage_worker, "StageLoop", FakeLoop)
    new_port = _unserved_port()
    servicer.__dict__.pop("_join_data_plane", None)  # the worker's own again
    if next_call == "Rejoin":
        monkeypatch.setattr(stage_worker, "DataPlaneGroup", lambda *, master_port, **_: FakeGroup(master_port))
        servicer.Rejoin(pb.RejoinRequest(dist_master_port=new_port, join_timeout_s=5, attempt=1), FakeContext())
    else:
        servicer._join_data_plane = lambda spec: FakeGroup(spec.dist_master_port)
        response = servicer.Load(spec_to_proto(StageLoadSpec(**{**spec.__dict__, "dist_master_port": new_port})),
                                 FakeContext())
        assert response.weights_bytes > 0
    try:
        assert servicer.loop.channel.group.port == new_port
        assert servicer.Health(pb.HealthRequest(), FakeContext()).status == pb.HealthResponse.SERVING
    finally:
        servicer.loop.stopped.set()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("next_call", ["Rejoin", "Load"])
def test_a_load_whose_rendezvous_times_out_is_deadline_exceeded_and_the_stage_takes_the_next_call(
        tmp_path, monkeypatch, next_call):
    """Nobody serves the rendezvous port (the coordinator's attempt was given up before this stage
    connected): torch's client times out, and Load answers DEADLINE_EXCEEDED in one line naming the
    rank and the port, not UNKNOWN."""
    spec = _spec(write_tiny_model(tmp_path / "model", seed=4), _unserved_port())
    servicer = StageServicer(0, threading.Event())
    _short_join(servicer)
    context = _load(servicer, spec)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED, (context.code, context.details)
    assert context.details.startswith(f"joining the data plane as rank 1 at 127.0.0.1:{spec.dist_master_port} ")
    assert "timed out" in context.details and "\n" not in context.details, context.details
    _check_health_names_the_failed_join(servicer, context)
    _check_the_next_call_works(servicer, spec, monkeypatch, next_call)


@pytest.mark.timeout(120)
def test_a_load_whose_rendezvous_is_abandoned_by_rank_0_is_unavailable(tmp_path, monkeypatch):
    """Rank 0 gives its rendezvous up while this stage waits there for the third rank (the attempt
    failed: [Note: abandoned rendezvous] in workers/channel.py): the store goes away and the stage's
    Load answers UNAVAILABLE at once (well within its 600 s rendezvous), then takes the next Load."""
    port = hold_listener("127.0.0.1")
    spec = _spec(write_tiny_model(tmp_path / "model", seed=4), port)
    abandoned, rank0 = threading.Event(), {}

    def coordinator() -> None:
        try:
            DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3, timeout_s=5.0,
                           connect_timeout_s=WAIT_S, abandoned=abandoned)
        except RendezvousAbandoned as exc:
            rank0["error"] = exc

    threading.Thread(target=coordinator, daemon=True).start()
    servicer = StageServicer(0, threading.Event())
    load = threading.Thread(target=lambda: rank0.setdefault("context", _load(servicer, spec)), daemon=True)
    load.start()
    probe = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=WAIT_S))
    assert wait_for(lambda: probe.add(rendezvous.JOINED_KEY, 0) == 2, timeout_s=WAIT_S), "the stage never joined"
    abandoned.set()
    load.join(timeout=WAIT_S)
    assert not load.is_alive(), "the Load still waits at an abandoned rendezvous"
    context = rank0["context"]
    assert context.code == grpc.StatusCode.UNAVAILABLE, (context.code, context.details)
    assert context.details.startswith(f"joining the data plane as rank 1 at 127.0.0.1:{port} (timeout 600 s) failed: ")
    assert "\n" not in context.details
    assert isinstance(rank0.get("error"), RendezvousAbandoned)
    _check_health_names_the_failed_join(servicer, context)
    _check_the_next_call_works(servicer, spec, monkeypatch, "Load")


@pytest.mark.timeout(120)
def test_a_load_after_a_failed_join_supersedes_a_rejoin_still_waiting_at_its_rendezvous(tmp_path, monkeypatch):
    """The stage's Load joined nothing (its rendezvous timed out); a Rejoin then waits at its own
    rendezvous when a Load comes (both are open to this state). The Load's group must be the one the
    stage runs on: the waiting Rejoin answers ABORTED and its group, once it forms, is closed. Before,
    the Rejoin's join started a second loop on its group after the Load's, replacing self.loop while
    the Load's loop kept running on the other group."""
    from tests.unit.test_stage_worker_rejoin import rejoin_attempt

    spec = _spec(write_tiny_model(tmp_path / "model", seed=4), _unserved_port())
    servicer = StageServicer(0, threading.Event())
    _short_join(servicer)
    assert _load(servicer, spec).code == grpc.StatusCode.DEADLINE_EXCEEDED
    servicer.__dict__.pop("_join_data_plane")
    rejoin_port, load_port = _unserved_port(), _unserved_port()
    at_rejoin, release, groups = threading.Event(), threading.Event(), []

    def rendezvous(*, master_port: int, **_) -> FakeGroup:
        if master_port == rejoin_port:
            at_rejoin.set()
            assert release.wait(WAIT_S), "the test never let the Rejoin's rendezvous form"
        groups.append(FakeGroup(master_port))
        return groups[-1]

    monkeypatch.setattr(stage_worker, "DataPlaneGroup", rendezvous)
    monkeypatch.setattr(stage_worker, "StageLoop", FakeLoop)
    rejoin, rejoin_out = rejoin_attempt(servicer, rejoin_port, attempt=1)
    try:
        assert at_rejoin.wait(WAIT_S), "the Rejoin never reached its rendezvous"
        servicer.Load(spec_to_proto(StageLoadSpec(**{**spec.__dict__, "dist_master_port": load_port})), FakeContext())
        load_loop = servicer.loop
        release.set()
        rejoin.join(timeout=WAIT_S)
        assert not rejoin.is_alive() and rejoin_out.get("code") == grpc.StatusCode.ABORTED, rejoin_out
        assert wait_for(lambda: len(groups) == 2, timeout_s=WAIT_S)
        assert servicer.loop is load_loop and load_loop.channel.group.port == load_port
        # the Rejoin's group is closed by its join thread after it is appended: wait for that, not only the count
        expected = [(load_port, False), (rejoin_port, True)]
        assert wait_for(lambda: [(g.port, g.closed) for g in groups] == expected, timeout_s=WAIT_S), [
            (g.port, g.closed) for g in groups]
    finally:
        release.set()
        for loop in {id(servicer.loop): servicer.loop, id(load_loop): load_loop}.values():
            loop.stopped.set()
