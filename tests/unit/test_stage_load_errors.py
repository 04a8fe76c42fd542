"""Which stage a failed or timed-out start-up names (launcher/coordinator/stage_control.load_and_join),
and whether the failure was the user's input.

A stage hung in its Load (a stuck disk, SIGSTOP) made the message say only "stages did not load
... within N s", or name a neighbour whose rendezvous with the hung stage failed first. With real
stage processes: tests/unit/test_stage_load_report.py."""

from __future__ import annotations

import functools
import threading

import grpc
import pytest

from launcher.coordinator import stage_control
from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.request_handle import StageLoadError

pytestmark = pytest.mark.timeout(30)


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_STATUS = {"unexpected": (grpc.StatusCode.INTERNAL, "KeyError: 'U16'"),
           "refused": (grpc.StatusCode.INVALID_ARGUMENT, "corrupt or truncated safetensors file m"),
           "mismatch": (grpc.StatusCode.FAILED_PRECONDITION, "worker was started as stage 2, Load asks for 1")}


class _Stub:
    def __init__(self, behaviour: str, release: threading.Event) -> None:
        self.behaviour, self.release = behaviour, release

    def Load(self, request, timeout):  # noqa: N802 - gRPC name
        if self.behaviour == "hang":
            self.release.wait(30)  # past any deadline here: released when the test ends
            raise TimeoutError("released")
        if self.behaviour == "fail":
            raise RuntimeError("data plane rendezvous with stage 2 timed out")
        if self.behaviour in _STATUS:
            raise _RpcError(*_STATUS[self.behaviour])
        return f"loaded {request}"


@pytest.fixture()
def release():
    event = threading.Event()
    yield event
    event.set()  # let the hung daemon threads end


def _load(behaviours, release, *, join=lambda: None, timeout_s=0.5, abandon=lambda: None):
    stubs = [_Stub(b, release) for b in behaviours]
    return stage_control.load_and_join(stubs, list(range(len(stubs))), join, timeout_s=timeout_s, abandon=abandon)


@pytest.fixture(autouse=True)
def _plain_specs(monkeypatch):
    monkeypatch.setattr(stage_control, "spec_to_proto", lambda spec: spec)


def test_every_stage_loads(release):
    assert _load(["ok", "ok", "ok"], release) == ["loaded 0", "loaded 1", "loaded 2"]


def test_a_failed_or_timed_out_start_abandons_the_coordinators_rendezvous_at_once(release):
    """The coordinator's join still waiting at the rendezvous is given up (`abandon`, which is
    StageLink.close) before the error is raised, so its thread and port do not wait out their 600 s;
    a start that succeeds abandons nothing."""
    for behaviours, join in ((["ok", "fail"], lambda: release.wait(5)), (["ok", "hang"], lambda: None),
                             (["ok", "ok"], lambda: release.wait(5))):
        abandoned: list[bool] = []
        with pytest.raises(PipelineError):
            _load(behaviours, release, join=join, abandon=functools.partial(abandoned.append, True))
        assert abandoned == [True], behaviours
    kept = []
    assert _load(["ok", "ok"], release, abandon=lambda: kept.append(True)) == ["loaded 0", "loaded 1"]
    assert kept == []


def test_a_timeout_names_the_stages_still_loading(release):
    with pytest.raises(PipelineError, match=r"^stage 2 did not finish loading within 0.5 s"):
        _load(["ok", "ok", "hang"], release)
    with pytest.raises(PipelineError, match=r"^stages 0, 2 did not finish loading"):
        _load(["hang", "ok", "hang"], release)
    with pytest.raises(PipelineError, match=r"^every stage loaded, but the data plane was not joined"):
        _load(["ok", "ok"], release, join=lambda: release.wait(5))


def test_a_failure_beside_a_hung_stage_names_both(release):
    with pytest.raises(PipelineError, match=r"^stage 1 failed to load: data plane rendezvous with stage 2 timed "
                                            r"out \(stage 2 was still loading then\)$"):
        _load(["ok", "fail", "hang"], release)
    with pytest.raises(PipelineError, match=r"^stage 1 failed to load: .* timed out$"):
        _load(["ok", "fail", "ok"], release)


def test_an_unexpected_stage_error_is_one_line_with_its_type_and_not_the_user_s_input(release):
    with pytest.raises(StageLoadError, match=r"^stage 1 failed to load the model: KeyError: 'U16'$") as err:
        _load(["ok", "unexpected"], release)
    assert not err.value.user_input
    with pytest.raises(StageLoadError, match=r"^stage 1 failed to load: corrupt or truncated safetensors file m$") as err:
        _load(["ok", "refused"], release)
    assert err.value.user_input  # INVALID_ARGUMENT: a model file or setting the stage refused (exit 2)


def test_a_load_the_worker_was_not_started_for_is_not_the_user_s_input(release):
    """FAILED_PRECONDITION (the worker's "started as stage X" check): the coordinator's own bookkeeping
    went wrong, an internal error (exit 1), not a model file or setting of the user's (exit 2)."""
    with pytest.raises(StageLoadError, match=r"^stage 1 failed to load: worker was started as stage 2, Load asks "
                                             r"for 1$") as err:
        _load(["ok", "mismatch"], release)
    assert not err.value.user_input



def test_a_load_request_the_stage_cannot_parse_is_a_version_mismatch_not_the_user_s_input(release):
    """A real stage answers INVALID_ARGUMENT with ErrorInfo reason UNPARSABLE_REQUEST to Load bytes
    that are not its LoadStageRequest (a coordinator of another version): an internal error (exit 1)
    saying so. Before: counted as the user's input (exit 2), like a bad model file."""
    from proto import speedpipe_pb2 as pb
    from workers.stage_worker import start_server, stop_server

    stop = threading.Event()
    server, servicer, port = start_server(stage_index=0, host="127.0.0.1", stop_event=stop)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            load = channel.unary_unary("/speedpipe.v1.StageService/Load", request_serializer=lambda raw: raw,
                                       response_deserializer=pb.LoadStageResponse.FromString)
            stub = type("Stub", (), {"Load": staticmethod(lambda request, timeout: load(request, timeout=timeout))})
            with pytest.raises(StageLoadError) as err:
                stage_control.load_and_join([stub], [b"\xff\xff\xff"], lambda: None, timeout_s=10)
    finally:
        stop_server(server, servicer)
    assert not err.value.user_input
    assert str(err.value).startswith("stage 0 failed to load: the coordinator and the stage disagree on the control "
                                     "protocol (different speedpipe versions?): /speedpipe.v1.StageService/Load: the "
                                     "request could not be parsed as speedpipe.v1.LoadStageRequest"), err.value
    assert "\n" not in str(err.value)


def test_an_rpc_error_without_details_has_no_reason():
    assert stage_control.error_reason(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad weights")) == ""
    assert stage_control.error_reason(RuntimeError("rendezvous timed out")) == ""


def test_a_stage_s_message_of_several_lines_is_reported_in_one(release):
    """Before: an unexpected error whose message spans lines (torch's "Error(s) in loading state_dict
    for X:\n\tsize mismatch ...") reached `launch`'s stderr as several lines."""
    _STATUS["multiline"] = (grpc.StatusCode.INTERNAL, "RuntimeError: Error(s) in loading:\n\tsize mismatch for w\n")
    try:
        with pytest.raises(StageLoadError, match=r"^stage 1 failed to load the model: RuntimeError: Error\(s\) in "
                                                 r"loading: size mismatch for w$"):
            _load(["ok", "multiline"], release)
    finally:
        del _STATUS["multiline"]
