"""The stage worker's Load handler on bad calibration input (workers/stage_worker.py), without
processes, and its StageService on requests it cannot parse (one in-process server).

What breaks when these fail: a Load asking for a calibration the stage cannot run (calibrate_max_rows
out of range) reaches the client as gRPC UNKNOWN (an unhandled exception) instead of INVALID_ARGUMENT
naming the field, or leaves the worker "already loaded" so a corrected Load is refused.
"""

from __future__ import annotations

import errno
import threading

import grpc
import pytest

from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.measure.stage_calibration import MAX_CALIBRATION_ROWS
from pipeline.model.partition import LayerRange
from tests.tiny_model import write_tiny_model
from workers.load_spec_codec import spec_to_proto
from workers.rpc.status_details import error_reason
from workers.stage_worker import StageServicer


class Aborted(Exception):
    """What grpc's `context.abort` raises, standing in for the RPC's end."""


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


@pytest.mark.parametrize("rows", [-3, MAX_CALIBRATION_ROWS + 1])
def test_a_calibration_out_of_range_is_failed_precondition_and_leaves_the_stage_unloaded(tmp_path, rows):
    """The coordinator caps calibrate_max_rows (session.calibration_max_rows): out of range is its own
    bookkeeping, an internal error. Before: INVALID_ARGUMENT, the user's input (exit 2)."""
    model_dir = write_tiny_model(tmp_path / "model", seed=4)
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=1, layer_range=LayerRange(0, 4),
                         max_num_seqs=1, max_model_len=16, calibrate_max_rows=rows)
    servicer = StageServicer(0, threading.Event())
    servicer._join_data_plane = lambda spec: pytest.fail("Load went on to join the data plane")
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Load(spec_to_proto(spec), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    # The message does not name the stage (before: "stage 0: calibrate..."): the coordinator adds
    # "stage 0 failed to load: ", and the stage was named twice.
    assert context.details.startswith(f"calibrate_max_rows must be in [1, {MAX_CALIBRATION_ROWS}]")
    assert str(rows) in context.details
    assert servicer.executor is None


def test_a_load_for_another_stage_is_failed_precondition_not_the_user_s_input(tmp_path):
    """The coordinator asked the worker of stage 0 to load stage 1: its own bookkeeping, an internal
    error (launch exits 1). Before: INVALID_ARGUMENT, which `launch` reports as the user's input (exit 2)."""
    model_dir = write_tiny_model(tmp_path / "model", seed=4)
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=1, num_stages=2, layer_range=LayerRange(2, 4),
                         max_num_seqs=1, max_model_len=16)
    servicer = StageServicer(0, threading.Event())
    servicer._load_model = lambda spec: pytest.fail("Load went on to load the model")
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Load(spec_to_proto(spec), context)
    assert (context.code, context.details) == (grpc.StatusCode.FAILED_PRECONDITION,
                                               "worker was started as stage 0, Load asks for 1")
    assert servicer.executor is None


# Fields of a LoadStageRequest: only the coordinator's bookkeeping sets the first four (FAILED_PRECONDITION,
# launch exits 1), the user's settings the rest (INVALID_ARGUMENT, exit 2).
@pytest.mark.parametrize(("changes", "code", "message"), [
    ({"stage_index": 2, "dist_rank": 3}, "FAILED_PRECONDITION", "stage_index 2 out of range [0, 2)"),
    ({"layer_start": 3, "layer_stop": 1}, "FAILED_PRECONDITION", "invalid layer range [3, 1)"),
    ({"dist_world_size": 5}, "FAILED_PRECONDITION", "dist rank/world 1/5 disagree with stage 0 of 2"),
    ({"firp_layer": 1, "firp_k": 0}, "FAILED_PRECONDITION", "FIRP needs both firp_layer and firp_k"),
    ({"dtype": "float64"}, "INVALID_ARGUMENT", "dtype must be one of"),
    ({"quantization": "int3"}, "INVALID_ARGUMENT", "quantization must be one of"),
    ({"dense_layout": "fast", "dtype": "bfloat16"}, "INVALID_ARGUMENT", "dense_layout fast needs"),
    ({"stage_timeout_s": -1.0}, "INVALID_ARGUMENT", "stage_timeout_s must be > 0"),
    ({"tree_scratch": 10**6}, "INVALID_ARGUMENT", "tree_scratch must be in"),
])
def test_a_spec_the_coordinator_got_wrong_is_failed_precondition_and_the_user_s_settings_invalid_argument(
    tmp_path, changes, code, message
):
    """Before: every StageLoadSpec the worker refused was INVALID_ARGUMENT, the user's input (exit 2),
    a stage index outside num_stages included."""
    spec = StageLoadSpec(model_dir=str(tmp_path), stage_index=0, num_stages=2, layer_range=LayerRange(0, 2),
                         max_num_seqs=1, max_model_len=16)
    request = spec_to_proto(spec)
    for name, value in changes.items():
        setattr(request, name, value)
    servicer = StageServicer(changes.get("stage_index", 0), threading.Event())
    servicer._load_model = lambda spec: pytest.fail("Load went on to load the model")
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Load(request, context)
    assert (context.code, context.details.startswith(message)) == (getattr(grpc.StatusCode, code), True), \
        context.details


def test_launch_exits_1_when_the_coordinator_s_own_spec_is_inconsistent(tmp_path, monkeypatch, capsys):
    """A SpecBookkeepingError is a ValueError, which `launch` answers with exit 2 (the user's input):
    the same refusal before any stage starts must be internal, as it is from a stage's Load."""
    from launcher.cli.main import main
    from launcher.coordinator.session import PipelineSession
    from pipeline.engine.stage_assembly import SpecBookkeepingError

    def inconsistent(self):
        raise SpecBookkeepingError("stage_index 2 out of range [0, 2)")

    monkeypatch.setattr(PipelineSession, "_start", inconsistent)
    model_dir = write_tiny_model(tmp_path / "m")
    assert main(["launch", "--model", str(model_dir), "--stages", "2", "--prompt", "hi", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "speedpipe launch: internal error: stage_index 2 out of range [0, 2)", err


def test_an_unexpected_load_error_is_internal_with_its_type_and_the_traceback_only_at_debug(tmp_path, caplog):
    """Before: the exception escaped to gRPC, which logged its traceback at ERROR and answered UNKNOWN
    ("Exception calling application: 'boom'", without the exception's type)."""
    import logging

    model_dir = write_tiny_model(tmp_path / "model", seed=4)
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=1, layer_range=LayerRange(0, 4),
                         max_num_seqs=1, max_model_len=16)
    servicer = StageServicer(0, threading.Event())

    def unexpected(spec):
        raise KeyError("boom")

    servicer._load_model = unexpected
    context = FakeContext()
    with caplog.at_level(logging.DEBUG), pytest.raises(Aborted):
        servicer.Load(spec_to_proto(spec), context)
    assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "KeyError: 'boom'")
    assert servicer.executor is None
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.levelno == logging.DEBUG and "loading the model failed" in record.getMessage()


def _stage_rpcs() -> list[tuple[str, object]]:
    from proto import speedpipe_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["StageService"]
    return [(f"/{service.full_name}/{m.name}", m) for m in service.methods]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("method", "descriptor"), _stage_rpcs(), ids=[name for name, _ in _stage_rpcs()])
def test_a_request_the_stage_cannot_parse_is_invalid_argument_after_the_secret_check(method, descriptor):
    """grpcio answered INTERNAL "Exception deserializing request!" to a coordinator built from
    another .proto (a mixed-version cluster), which reads as a crashed stage, not a version mismatch;
    and the secret must still be checked before anything is parsed (workers/rpc/request_parse.py)."""
    from workers.rpc.control_auth import SECRET_METADATA_KEY
    from workers.stage_worker import start_server, stop_server

    stop = threading.Event()
    server, servicer, port = start_server(stage_index=0, host="127.0.0.1", stop_event=stop, control_secret="s3cret")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            kind = ("stream" if descriptor.client_streaming else "unary") + "_" + \
                   ("stream" if descriptor.server_streaming else "unary")

            def call(metadata):
                payload = iter([b"\xff\xff\xff"]) if descriptor.client_streaming else b"\xff\xff\xff"
                answer = getattr(channel, kind)(method)(payload, metadata=metadata, timeout=10)
                return list(answer) if descriptor.server_streaming else answer

            with pytest.raises(grpc.RpcError) as info:
                call(())
            assert (info.value.code(), error_reason(info.value)) == (grpc.StatusCode.UNAUTHENTICATED,
                                                                     "CREDENTIALS_MISSING")
            with pytest.raises(grpc.RpcError) as info:
                call(((SECRET_METADATA_KEY, "wrong"),))
            assert (info.value.code(), error_reason(info.value)) == (grpc.StatusCode.UNAUTHENTICATED,
                                                                     "CREDENTIALS_INVALID")
            with pytest.raises(grpc.RpcError) as info:
                call(((SECRET_METADATA_KEY, "s3cret"),))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details().startswith(f"{method}: the request could not be parsed as "
                                                   f"{descriptor.input_type.full_name} (")
    finally:
        stop_server(server, servicer)


@pytest.mark.parametrize(("error", "code", "details"), [
    (FileNotFoundError("safetensors file m/model.safetensors does not exist"), grpc.StatusCode.INVALID_ARGUMENT,
     "safetensors file m/model.safetensors does not exist"),
    (OSError(errno.EACCES, "Permission denied", "m/model.safetensors"), grpc.StatusCode.INVALID_ARGUMENT,
     "[Errno 13] Permission denied: 'm/model.safetensors'"),
    (OSError(errno.EISDIR, "Is a directory", "m/model.safetensors"), grpc.StatusCode.INVALID_ARGUMENT,
     "[Errno 21] Is a directory: 'm/model.safetensors'"),
    (OSError(errno.EMFILE, "Too many open files", "m/model.safetensors"), grpc.StatusCode.INTERNAL,
     "OSError: [Errno 24] Too many open files: 'm/model.safetensors' (EMFILE: a limit or fault of this machine, "
     "not of the model's files)"),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), grpc.StatusCode.INTERNAL,
     "OSError: [Errno 12] Cannot allocate memory (ENOMEM: a limit or fault of this machine, not of the model's "
     "files)"),
    (OSError(errno.EIO, "Input/output error"), grpc.StatusCode.INTERNAL,
     "OSError: [Errno 5] Input/output error (EIO: a limit or fault of this machine, not of the model's files)"),
    (OSError("no errno"), grpc.StatusCode.INTERNAL, "OSError: no errno"),
], ids=["missing", "EACCES", "EISDIR", "EMFILE", "ENOMEM", "EIO", "no-errno"])
def test_an_os_error_is_the_user_s_input_only_when_it_is_about_their_files(tmp_path, error, code, details):
    """Before: every OSError was INVALID_ARGUMENT, the user's input (exit 2), "Too many open files"
    and "Cannot allocate memory" too. Now a missing or unreadable file stays the user's input; a
    resource of the machine is INTERNAL (exit 1) naming the errno; the stage is left unloaded."""
    model_dir = write_tiny_model(tmp_path / "model", seed=4)
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=1, layer_range=LayerRange(0, 4),
                         max_num_seqs=1, max_model_len=16)
    servicer = StageServicer(0, threading.Event())

    def failing(spec):
        raise error

    servicer._load_model = failing
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Load(spec_to_proto(spec), context)
    assert (context.code, context.details) == (code, details)
    assert servicer.executor is None

