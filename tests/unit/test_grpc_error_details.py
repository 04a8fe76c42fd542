"""The gRPC front end's rich error details (google.rpc.Status in `grpc-status-details-bin`), read by a
real client with `grpc_status.rpc_status.from_call`: BadRequest naming the field for invalid
arguments (the validation in grpc_generate.py and the parse interceptor), ErrorInfo and RetryInfo for
a full queue, a draining server and a failed one; the one-line message stays what it was."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from launcher.coordinator.request_handle import PipelineError
from launcher.serving.grpc_generate import DRAINING_RETRY_S, QUEUE_FULL_RETRY_S, GrpcServer
from launcher.serving.serving_engine import ServingEngine, UnavailableError
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.unit.test_serving_grpc import KEY, UNSET_BUDGET, _raw_call, _rpcs, grpc_server  # noqa: F401 (fixture)
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401 (the fixture)
from workers.rpc.request_parse import MAX_NAMED_FIELDS, misread_fields
from workers.rpc.status_details import DOMAIN, status_with_details

pytestmark = pytest.mark.timeout(60)
KINDS = (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo)


def _details(err: grpc.RpcError) -> dict[str, object]:
    """The details of the rich status of a failed call, by type name; checks the status agrees with the
    call's code and message (from_call raises otherwise)."""
    status = rpc_status.from_call(err)
    assert status is not None, f"no grpc-status-details-bin trailer: {err.code()} {err.details()}"
    found = {}
    for packed in status.details:
        kind = next(k for k in KINDS if packed.Is(k.DESCRIPTOR))
        found[kind.__name__] = kind()
        packed.Unpack(found[kind.__name__])
    assert len(found) == len(status.details), status
    return found


def _generate_error(channel: grpc.Channel, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(
            pb_grpc.GenerateServiceStub(channel).Generate(
                pb.GenerateRequest(**fields), metadata=KEY, timeout=10
            )
        )
    return info.value


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"prompt": "hi", "max_new_tokens": 2, "temperature": 3.0},
            "temperature",
            "'temperature' must be in [0, 2], got 3",
        ),
        ({"prompt": "hi"}, "max_new_tokens", UNSET_BUDGET),
        ({"prompt": "hi", "max_new_tokens": 2, "top_p": 0.0}, "top_p", "'top_p' must be in (0, 1], got 0.0"),
        (
            {"prompt": "hi", "max_new_tokens": 2, "min_p": -0.1},
            "min_p",
            "'min_p' must be in [0, 1], got -0.1",
        ),
        (
            {"prompt": "hi", "max_new_tokens": 70},
            "max_new_tokens",
            "'prompt' (2 tokens) + 'max_new_tokens' (70) = 72 exceeds max_model_len 64",
        ),
        (
            {"prompt": "x" * 200, "max_new_tokens": 1},
            "prompt",
            "'prompt' (200 tokens) + 'max_new_tokens' (1) = 201 exceeds max_model_len 64",
        ),
        (
            {"prompt_token_ids": pb.TokenIds(ids=[10**6]), "max_new_tokens": 1},
            "prompt_token_ids",
            "'prompt_token_ids' token id 1000000 is outside the vocabulary",
        ),
        ({"prompt": "hi", "max_new_tokens": 2, "stop": [""]}, "stop", "'stop' strings must not be empty"),
        (
            {"prompt": "hi", "max_new_tokens": 2, "logit_bias": {256: 1.0}},
            "logit_bias",
            "'logit_bias' token id 256 is outside the vocabulary [0, 256)",
        ),
        (
            {"prompt": "hi", "max_new_tokens": 2, "logit_bias": {5: -100.5}},
            "logit_bias",
            "'logit_bias' of token 5 must be a number in [-100, 100], got -100.5",
        ),
        (
            {"prompt": "hi", "max_new_tokens": 2, "logit_bias": {-3: 1.0}},
            "logit_bias",
            "'logit_bias' keys must be token ids (integers >= 0), got -3",
        ),
    ],
)
def test_invalid_argument_carries_a_bad_request_naming_the_field(grpc_server, fields, field, message):  # noqa: F811
    _, _, channel = grpc_server
    err = _generate_error(channel, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(message), err.details()  # the message as before
    details = _details(err)
    assert set(details) == {"BadRequest", "ErrorInfo"}
    [violation] = details["BadRequest"].field_violations
    assert (violation.field, violation.description) == (field, err.details())  # the message users saw
    info = details["ErrorInfo"]
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_FIELD", DOMAIN, {"field": field})


@pytest.mark.parametrize("rpc", ["Generate", "GetModelInfo"])
def test_an_unparsable_request_names_the_whole_request_and_its_type(grpc_server, rpc):  # noqa: F811
    _, _, channel = grpc_server
    method, descriptor = next(r for r in _rpcs() if r[0] == f"/speedpipe.v1.GenerateService/{rpc}")
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, b"\xff\xff\xff", metadata=KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = _details(info.value)
    [violation] = details["BadRequest"].field_violations
    assert violation.field == ""  # the request as a whole, as Google's APIs say of a body they cannot parse
    assert violation.description.startswith(f"not a valid {descriptor.input_type.full_name}: ")
    assert details["ErrorInfo"].reason == "UNPARSABLE_REQUEST"
    assert dict(details["ErrorInfo"].metadata) == {
        "method": method,
        "requestType": descriptor.input_type.full_name,
    }


def test_fields_sent_with_another_wire_type_are_each_a_field_violation(grpc_server):  # noqa: F811
    _, _, channel = grpc_server
    method, descriptor = next(r for r in _rpcs() if r[0].endswith("/Generate"))
    request = (
        pb.GenerateRequest(max_new_tokens=2).SerializeToString() + b"\x1a\x05\x0d" + bytes(4)
    )  # ids as fixed32
    request += b"\x29" + struct.pack("<d", 0.7)  # temperature (field 5) as a double
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, request, metadata=KEY)
    violations = _details(info.value)["BadRequest"].field_violations
    assert {(v.field, v.description) for v in violations} == {
        ("temperature", "field 5 arrived with another wire type than the schema's"),
        ("prompt_token_ids.ids", "field 1 arrived with another wire type than the schema's"),
    }


def test_a_misread_field_inside_a_repeated_message_is_named_by_its_index():
    """BadRequest.FieldViolation.field names an item of a repeated message by its index
    ("email_addresses[0].email" in google/rpc/error_details.proto), not the repeated field as a whole."""
    top = b"\x0d" + bytes(4)  # TopLogprob.token_id (field 1, a varint) as fixed32
    entry = b"\x1a" + bytes([len(top)]) + top  # TokenLogprob.top (field 3)
    raw = pb.GenerateResponse(logprobs=[pb.TokenLogprob(token_id=1)]).SerializeToString()
    raw += b"\x3a" + bytes([len(entry)]) + entry  # a second GenerateResponse.logprobs (field 7)
    assert misread_fields(pb.GenerateResponse.FromString(raw)) == [("logprobs[1].top[0].token_id", 1)]


def test_a_full_queue_is_resource_exhausted_with_retry_info(grpc_server):  # noqa: F811
    _, engine, channel = grpc_server
    engine._outstanding = engine.max_num_seqs + engine.max_queue  # 2 running + 1 waiting
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    engine._outstanding = 0
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in err.details()
    details = _details(err)
    assert set(details) == {"ErrorInfo", "RetryInfo"}
    assert (details["ErrorInfo"].reason, details["ErrorInfo"].domain) == ("QUEUE_FULL", DOMAIN)
    assert dict(details["ErrorInfo"].metadata) == {"maxNumSeqs": "2", "maxQueue": "1"}
    assert details["RetryInfo"].retry_delay.ToMilliseconds() == 1000


def test_a_draining_server_says_so_and_when_to_retry_a_failed_one_says_restart(grpc_server):  # noqa: F811
    _, engine, channel = grpc_server
    engine.fence("draining: the server is shutting down", draining=True)
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "draining: the server is shutting down",
    )
    details = _details(err)
    assert (
        details["ErrorInfo"].reason == "DRAINING"
        and details["RetryInfo"].retry_delay.ToMilliseconds() == 1000
    )
    engine._fence, engine._draining = None, False
    engine.fence("pipeline failed: stage restarts exhausted")
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "pipeline failed: stage restarts exhausted",
    )
    details = _details(err)
    assert set(details) == {"ErrorInfo"} and details["ErrorInfo"].reason == "PIPELINE_FAILED"  # no retry here


def test_a_silent_stage_is_unavailable_without_retry_info(grpc_server, monkeypatch):  # noqa: F811
    _, engine, channel = grpc_server
    silent = type("Silent", (), {"healthy": lambda self: (False, "stage 1 has not answered its heartbeat")})()
    monkeypatch.setattr(engine, "heartbeat", silent)
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    assert (err.code(), err.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "stage 1 has not answered its heartbeat",
    )
    details = _details(err)
    assert set(details) == {"ErrorInfo"} and details["ErrorInfo"].reason == "STAGE_SILENT"


@pytest.mark.parametrize(
    ("end", "message", "reason", "kinds"),
    [
        (
            "drain",
            "server shutting down (grace over); request ended before it finished",
            "DRAINING",
            {"ErrorInfo", "RetryInfo"},
        ),
        ("failure", "pipeline failed: stage 1 died", "PIPELINE_FAILED", {"ErrorInfo"}),
    ],
)
def test_an_error_after_some_responses_carries_the_details_in_the_trailer(
    grpc_server,  # noqa: F811
    end,
    message,
    reason,
    kinds,
):
    """Mid-stream (launcher/serving/drain.py's fail_all, serve.py's on_pipeline_failure): the trailer
    comes after response messages, and from_call still reads it with the call's code and message."""
    coord, engine, channel = grpc_server
    coord.step_s = 0.2  # 50 tokens: far from done when the first one arrives
    call = pb_grpc.GenerateServiceStub(channel).Generate(
        pb.GenerateRequest(prompt="hello", max_new_tokens=50), metadata=KEY, timeout=20
    )
    assert next(call).token_ids  # a response was sent before the error
    if end == "drain":
        engine.fence("draining: the server is shutting down", draining=True)
        engine.fail_all(UnavailableError(message))
    else:
        engine.fence(message)
        engine.fail_all(PipelineError("stage 1 died"))
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, message)
    details = _details(info.value)
    assert set(details) == kinds and details["ErrorInfo"].reason == reason


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"reason": "queue_full"}, "reason 'queue_full' is not UPPER_SNAKE_CASE"),
        (
            {"reason": "QUEUE_FULL", "metadata": {"max_queue": "1"}},
            "keys ['max_queue'] are not lowerCamelCase",
        ),
    ],
)
def test_error_info_reasons_are_upper_snake_and_metadata_keys_lower_camel(kwargs, why):
    """google/rpc/error_details.proto: ErrorInfo.reason is UPPER_SNAKE_CASE, its metadata keys "should
    ideally be lowerCamelCase" (as Google's own: "availableRegions")."""
    assert status_with_details(
        grpc.StatusCode.UNAVAILABLE, "m", reason="QUEUE_FULL", metadata={"maxQueue": "1"}
    )
    with pytest.raises(AssertionError, match=re.escape(why)):
        status_with_details(grpc.StatusCode.UNAVAILABLE, "m", **kwargs)


@pytest.mark.parametrize(
    ("api_key", "printed"),
    [
        (None, "StatusCode.INVALID_ARGUMENT [('temperature', \"'temperature' must be in [0, 2], got 3\")]\n"),
        ("k3y", "StatusCode.UNAUTHENTICATED []\n"),  # details without a BadRequest: ErrorInfo only
    ],
)
def test_the_readme_snippet_prints_the_field_violation(tokenizer, capsys, api_key, printed):  # noqa: F811
    """README's gRPC section shows clients how to read the details: it must run as written, also for
    an error that carries none (the snippet sends no API key)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = re.search(r"gRPC errors carry .+?```python\n(.+?)```", readme, re.S).group(1)
    engine = ServingEngine(
        FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64
    )
    server = GrpcServer(engine, host="127.0.0.1", port=0, api_key=api_key)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            exec(snippet, {"grpc": grpc, "pb": pb, "stub": pb_grpc.GenerateServiceStub(channel)})
    finally:
        server.stop()
    assert capsys.readouterr().out == printed


def _pushback(err: grpc.RpcError) -> list[str]:
    """The values of the grpc-retry-pushback-ms trailer of a failed call (gRFC A6)."""
    return [value for key, value in err.trailing_metadata() or () if key == "grpc-retry-pushback-ms"]


def test_retry_info_comes_with_the_pushback_trailer_that_grpc_retry_policies_read(grpc_server):  # noqa: F811
    """gRPC's client-side retry policy (gRFC A6) waits `grpc-retry-pushback-ms` before its next attempt;
    it does not read RetryInfo. The trailer was missing; it now has RetryInfo's delay, in ms, and only
    where RetryInfo is (a full queue, a drain)."""
    _, engine, channel = grpc_server
    assert _pushback(_generate_error(channel, prompt="hi", max_new_tokens=2, temperature=3.0)) == []
    engine._outstanding = engine.max_num_seqs + engine.max_queue
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    engine._outstanding = 0
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _pushback(err) == [str(round(QUEUE_FULL_RETRY_S * 1000))] == ["1000"]
    engine.fence("draining: the server is shutting down", draining=True)
    err = _generate_error(channel, prompt="hi", max_new_tokens=2)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and _pushback(err) == [str(round(DRAINING_RETRY_S * 1000))]
    engine._fence, engine._draining = None, False
    engine.fence("pipeline failed: stage restarts exhausted")
    assert _pushback(_generate_error(channel, prompt="hi", max_new_tokens=2)) == []  # no RetryInfo either


def test_a_field_sent_thousands_of_times_with_a_wrong_wire_type_is_named_once(grpc_server):  # noqa: F811
    """Each misread occurrence was named: 5000 of them made a 90 KB trailer, over the client's metadata
    limit, so the client saw RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of
    INVALID_ARGUMENT. A field is named once, and at most MAX_NAMED_FIELDS fields (then "and N more")."""
    _, _, channel = grpc_server
    method, descriptor = next(r for r in _rpcs() if r[0].endswith("/Generate"))
    request = pb.GenerateRequest(prompt="hi", max_new_tokens=2).SerializeToString() + b"\x40\x01" * 5000
    with pytest.raises(grpc.RpcError) as info:  # stop (field 8, a string) 5000 times as a varint
        _raw_call(channel, method, descriptor, request, metadata=KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().count("'stop' (field 8)") == 1
    assert [v.field for v in _details(info.value)["BadRequest"].field_violations] == ["stop"]
    every = b"".join(bytes([number << 3 | 1]) + bytes(8) for number in range(1, 15))  # fields 1..14 as fixed64
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, every, metadata=KEY)
    assert f"and {14 - MAX_NAMED_FIELDS} more arrived" in info.value.details()
    assert len(_details(info.value)["BadRequest"].field_violations) == MAX_NAMED_FIELDS
