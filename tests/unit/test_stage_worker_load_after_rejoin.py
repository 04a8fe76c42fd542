"""A Load to a stage that left its data-plane group for a Rejoin (workers/stage_worker.py, [Note: superseded
rejoin] in workers/rejoin.py), in one process: the tiny model loads for real, a failing Rejoin's rendezvous is
torch's (a port nobody serves), the groups that form and the loops are stand-ins.

What breaks when these fail: a stage that had been in a group (its Load or a Rejoin joined) and whose next
Rejoin failed, or still waits at its rendezvous, refuses every Load FAILED_PRECONDITION "the worker is already
loaded" (its retired loop stayed its `loop`), though it is in no group, as after a failed Load join, which takes
the next Load; and a Load after a data-plane failure leaves that failure's UNHEALTHY in the new group.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.model.partition import LayerRange
from proto import speedpipe_pb2 as pb
from tests.conftest import wait_for
from tests.tiny_model import write_tiny_model
from tests.unit.test_stage_worker_load import Aborted, FakeContext
from tests.unit.test_stage_worker_rejoin import FakeGroup, FakeLoop, rejoin_attempt
from workers import stage_worker
from workers.channel import DataPlaneGroup
from workers.load_spec_codec import spec_to_proto
from workers.stage_worker import StageServicer

WAIT_S = 30.0


def _unserved_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FailingLoop(FakeLoop):
    """Stand-in StageLoop whose data plane breaks (a neighbour died) once `fail` is set."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.fail.wait(0.02):
                self.stopped.set()
                raise RuntimeError("Connection closed by peer (stand-in)")


class Groups:
    """DataPlaneGroup stand-in: torch's real rendezvous at the `real` ports (nobody serves them: it times out),
    a group that forms at once elsewhere, or, at `held`, once `release` is set."""

    def __init__(self, *, real: set[int] = frozenset(), held: int = 0) -> None:
        self.real, self.held = real, held
        self.at_held, self.release = threading.Event(), threading.Event()
        self.formed: list[FakeGroup] = []

    def __call__(self, *, master_port: int, **kwargs):
        if master_port in self.real:
            return DataPlaneGroup(master_port=master_port, **kwargs)
        if master_port == self.held:
            self.at_held.set()
            assert self.release.wait(WAIT_S), "the test never let the held rendezvous form"
        self.formed.append(FakeGroup(master_port))
        return self.formed[-1]


def _load(servicer: StageServicer, spec: StageLoadSpec, port: int) -> pb.LoadStageResponse:
    return servicer.Load(spec_to_proto(StageLoadSpec(**{**spec.__dict__, "dist_master_port": port})), FakeContext())


def _health(servicer: StageServicer) -> pb.HealthResponse:
    return servicer.Health(pb.HealthRequest(), FakeContext())


def _joined_stage(tmp_path, monkeypatch, groups: Groups, loop_class=FakeLoop):
    """Stage 0 of 2 (rank 1 of 3) of the tiny model, loaded for real and SERVING in a stand-in group;
    (servicer, spec, its Load's response). rejoin_wait_s > 0: a broken data plane waits for a Rejoin."""
    monkeypatch.setattr(stage_worker, "DataPlaneGroup", groups)
    monkeypatch.setattr(stage_worker, "StageLoop", loop_class)
    spec = StageLoadSpec(model_dir=str(write_tiny_model(tmp_path / "model", seed=4)), stage_index=0, num_stages=2,
                         layer_range=LayerRange(0, 2), max_num_seqs=1, max_model_len=16,
                         dist_master_port=_unserved_port(), stage_timeout_s=1.0)
    servicer = StageServicer(0, threading.Event(), rejoin_wait_s=WAIT_S)
    first = _load(servicer, spec, spec.dist_master_port)
    assert _health(servicer).status == pb.HealthResponse.SERVING
    return servicer, spec, first


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before", ["rejoined", "data-plane-failed"])
def test_a_stage_whose_rejoin_failed_takes_the_next_load(tmp_path, monkeypatch, before):
    """The stage was in a group (rejoined: a Rejoin moved it there; data-plane-failed: a neighbour died and it
    waits for a Rejoin), then a fail-over attempt's Rejoin timed out at torch's rendezvous: it holds its weights
    in no group (Health NOT_SERVING). The next Load must be taken as after a failed Load join: one that fails
    leaves it NOT_LOADED (not what its retired loop says), the next loads the stage again (the same weights, as
    the first Load's response counts them) and joins; Health SERVING."""
    failing_port = _unserved_port()
    groups = Groups(real={failing_port})
    servicer, spec, first = _joined_stage(tmp_path, monkeypatch, groups, FailingLoop)
    loops = [servicer.loop]
    try:
        if before == "rejoined":
            servicer.Rejoin(pb.RejoinRequest(dist_master_port=_unserved_port(), join_timeout_s=5, attempt=1),
                            FakeContext())
            loops.append(servicer.loop)
            assert _health(servicer).status == pb.HealthResponse.SERVING
        else:
            servicer.loop.fail.set()
            assert wait_for(lambda: servicer.failure, timeout_s=WAIT_S), "the data-plane failure was not recorded"
            assert (health := _health(servicer)).status == pb.HealthResponse.UNHEALTHY, health
        context = FakeContext()
        with pytest.raises(Aborted):
            servicer.Rejoin(pb.RejoinRequest(dist_master_port=failing_port, join_timeout_s=1, attempt=2), context)
        # nothing listens at a Rejoin's port: abandoned by the coordinator ([Note: abandoned rendezvous])
        assert context.code == grpc.StatusCode.UNAVAILABLE, (context.code, context.details)
        health = _health(servicer)
        assert health.status == pb.HealthResponse.NOT_SERVING and "gave this rendezvous up" in health.message, health

        bad = FakeContext()  # a Load that fails (the coordinator's bookkeeping) unloads the stage, as any does
        with pytest.raises(Aborted):
            servicer.Load(spec_to_proto(StageLoadSpec(**{**spec.__dict__, "calibrate_max_rows": -1})), bad)
        assert (bad.code, bad.details[:26]) == (grpc.StatusCode.FAILED_PRECONDITION, "calibrate_max_rows must be"), (
            bad.details)  # before: "the worker is already loaded"
        assert (health := _health(servicer)).status == pb.HealthResponse.NOT_LOADED, health  # not its retired loop's
        load_port = _unserved_port()
        again = _load(servicer, spec, load_port)  # before: FAILED_PRECONDITION "the worker is already loaded"
        loops.append(servicer.loop)
        assert (again.weights_bytes, again.num_parameters, list(again.tensor_names)) == (
            first.weights_bytes, first.num_parameters, list(first.tensor_names))
        assert servicer.loop.channel.group.port == load_port and not servicer.loop.retired
        assert (health := _health(servicer)).status == pb.HealthResponse.SERVING, health
    finally:
        for loop in loops:
            loop.stopped.set()


@pytest.mark.timeout(120)
def test_a_load_supersedes_a_rejoin_that_left_a_group_and_still_waits_at_its_rendezvous(tmp_path, monkeypatch):
    """The stage's Load joined; a Rejoin retired that loop and waits at a rendezvous when a Load comes. As after
    a failed Load join, the Load's group must be the one the stage runs on: the waiting Rejoin answers ABORTED
    and its group, once it forms, is closed. Before, the Load was refused "already loaded"."""
    rejoin_port, load_port = _unserved_port(), _unserved_port()
    groups = Groups(held=rejoin_port)
    servicer, spec, _ = _joined_stage(tmp_path, monkeypatch, groups)
    loops = [servicer.loop]
    try:
        rejoin, out = rejoin_attempt(servicer, rejoin_port, attempt=1)
        assert groups.at_held.wait(WAIT_S), "the Rejoin never reached its rendezvous"
        _load(servicer, spec, load_port)
        loops.append(servicer.loop)
        groups.release.set()
        rejoin.join(timeout=WAIT_S)
        assert not rejoin.is_alive() and out.get("code") == grpc.StatusCode.ABORTED, out
        # the Rejoin's group forms after the release and is closed by its join thread, under the lock
        expected = [(load_port, False), (rejoin_port, True)]
        assert wait_for(lambda: [(g.port, g.closed) for g in groups.formed[1:]] == expected, timeout_s=WAIT_S), [
            (g.port, g.closed) for g in groups.formed]
        assert servicer.loop is loops[-1] and servicer.loop.channel.group.port == load_port
        assert _health(servicer).status == pb.HealthResponse.SERVING
    finally:
        groups.release.set()
        for loop in loops:
            loop.stopped.set()
