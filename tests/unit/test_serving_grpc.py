"""The gRPC front end as a client sees it, over the fake coordinator of test_serving_http.py:
health (speedpipe's own and grpc.health.v1), reflection, the last chunk's stop_reason, error
messages in gRPC's field names, and a request whose RPC ended before it was admitted."""

from __future__ import annotations

import struct
import threading
from types import SimpleNamespace

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from launcher.serving.grpc_generate import GenerateServicer, GrpcServer, request_params
from launcher.serving.http_server import HttpServer
from launcher.serving.serve import served_pipeline
from launcher.serving.serving_engine import InvalidRequestError, ServedPipeline, ServingEngine
from pipeline.run_config import RunConfig
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.conftest import wait_for
from tests.tiny_model import write_tiny_model
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(60)
KEY = [("authorization", "Bearer k3y")]
UNSET_BUDGET = "'max_new_tokens' is unset or 0; it is required, at least 1 (no default, unlike HTTP's max_tokens)"


@pytest.fixture()
def grpc_server(tokenizer):  # noqa: F811 (the fixture imported above)
    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    server = GrpcServer(engine, host="127.0.0.1", port=0, api_key="k3y")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield coord, engine, channel
    channel.close()
    server.stop()


def test_health_is_not_serving_while_draining_or_restarting_and_unhealthy_after_a_failure(grpc_server):
    """The proto's UNHEALTHY means "restart the process": an orchestrator must not be told so while
    the server drains for shutdown or restarts a stage (it recovers by itself). grpc.health.v1
    (probes, load balancers; no API key needed) says SERVING or NOT_SERVING alike."""
    coord, engine, channel = grpc_server
    own, std = pb_grpc.GenerateServiceStub(channel), health_pb2_grpc.HealthStub(channel)

    def states():
        return (own.Health(pb.HealthRequest(), timeout=10).status,
                std.Check(health_pb2.HealthCheckRequest(), timeout=10).status,
                std.Check(health_pb2.HealthCheckRequest(service="speedpipe.v1.GenerateService"), timeout=10).status)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert states() == (pb.HealthResponse.SERVING, serving, serving)
    coord.recovering = "restarting after a stage failure: stage 1 exited"
    assert states() == (pb.HealthResponse.NOT_SERVING, not_serving, not_serving)
    coord.recovering = None
    engine.fence("draining: the server is shutting down", draining=True)
    assert states() == (pb.HealthResponse.NOT_SERVING, not_serving, not_serving)
    engine._fence, engine._draining = None, False
    coord.recovering, coord.failure = "restarting after a stage failure", RuntimeError("stage gone")
    assert states()[0] == pb.HealthResponse.UNHEALTHY  # a failure outranks a recovery still marked
    coord.recovering, coord.failure = None, None
    engine.fence("pipeline failed: stage restarts exhausted")
    assert states() == (pb.HealthResponse.UNHEALTHY, not_serving, not_serving)
    with pytest.raises(grpc.RpcError) as info:
        std.Check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:  # the name echoed as every error echoes a client's value
        std.Check(health_pb2.HealthCheckRequest(service="x" * 100_000), timeout=10)
    assert info.value.details() == "unknown service '" + "x" * 79 + "… (100000 characters)"
    listed = std.List(health_pb2.HealthListRequest(), timeout=10).statuses
    assert {name: s.status for name, s in listed.items()} == {"": not_serving,
                                                              "speedpipe.v1.GenerateService": not_serving}


def test_health_watch_streams_each_change(grpc_server):
    coord, _, channel = grpc_server
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=20)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    coord.recovering = "restarting"
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    coord.recovering = None
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    unknown = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="x"), timeout=10)
    assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # and the call stays open
    unknown.cancel()


def test_reflection_lists_the_services_without_the_api_key(grpc_server):
    _, _, channel = grpc_server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for s in reply.list_services_response.service}
    assert {"speedpipe.v1.GenerateService", "grpc.health.v1.Health"} <= names


def test_the_last_chunk_names_the_stop_string(grpc_server):
    _, _, channel = grpc_server
    stub = pb_grpc.GenerateServiceStub(channel)
    replies = list(stub.Generate(pb.GenerateRequest(prompt="hello world", max_new_tokens=11, stop=["zz", "o w"]),
                                 metadata=KEY, timeout=10))
    assert (replies[-1].finish_reason, replies[-1].stop_reason) == (pb.GenerateResponse.STOP, "o w")
    assert "".join(r.text for r in replies) == "hell" and all(not r.stop_reason for r in replies[:-1])
    replies = list(stub.Generate(pb.GenerateRequest(prompt="abc", max_new_tokens=2), metadata=KEY, timeout=10))
    assert (replies[-1].finish_reason, replies[-1].stop_reason) == (pb.GenerateResponse.LENGTH, "")


def test_logit_bias_reaches_the_sampling_params(tokenizer):  # noqa: F811
    """GenerateRequest had no logit_bias; its map now becomes SamplingParams.logit_bias (float32 as sent)."""
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    _, params = request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, logit_bias={9: -100, 4: 0.5}), engine)
    assert params.logit_bias == ((4, 0.5), (9, -100.0)) and params.needs_logits_at(0)
    with pytest.raises(InvalidRequestError) as info:
        request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, logit_bias={9: 100.1}), engine)
    assert info.value.param == "logit_bias" and str(info.value).endswith("got 100.1"), info.value


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"max_new_tokens": 70}, "max_new_tokens", "'prompt' (2 tokens) + 'max_new_tokens' (70) = 72 exceeds max_model_len 64"),
    ({"min_p": -0.1}, "min_p", "'min_p' must be in [0, 1], got -0.1"),
    ({"repetition_penalty": 2.3}, "repetition_penalty", "'repetition_penalty' must be in (0, 2], got 2.3"),
    ({"logprobs": 21}, "logprobs", "'logprobs' must be in [0, 20] when set, got 21"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "'prompt_logprobs' must be in [0, 20] when set, got 21"),
    ({"top_p": 0.0}, "top_p", "'top_p' must be in (0, 1], got 0.0"),  # was taken as 1; HTTP: 400
    *[({"max_new_tokens": value}, "max_new_tokens", UNSET_BUDGET) for value in (None, 0)],  # said "got 0" when unset
])
def test_errors_name_the_grpc_field_and_print_floats_as_sent(tokenizer, fields, param, message):  # noqa: F811
    """They named HTTP's 'max_tokens', said "None" (a Python word), and printed float32 fields as
    doubles (-0.10000000149011612)."""
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    with pytest.raises(InvalidRequestError) as info:
        request_params(pb.GenerateRequest(**{"prompt": "Hi", "max_new_tokens": 3} | fields), engine)
    assert info.value.param == param and str(info.value).endswith(message), info.value


class _EndedContext:
    """A ServicerContext whose RPC ended (deadline passed, client gone) before the request was
    admitted: grpc then refuses callbacks (add_callback returns False) and never runs them."""

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code, details):
        raise AssertionError(f"unexpected abort {code}: {details}")


def test_a_request_whose_rpc_ended_before_admission_is_cancelled_at_once(tokenizer):  # noqa: F811
    """The callback that aborts a cancelled request was added after the request started; when the
    RPC had ended by then grpc dropped it, and the request ran to its length holding a KV slot."""
    coord = FakeCoordinator(tokenizer, step_s=0.05)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    replies = list(GenerateServicer(engine).Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=40),
                                                     _EndedContext()))
    assert replies == []
    wait_for(lambda: engine.num_outstanding == 0 and coord.aborted, timeout_s=5)
    assert len(coord.aborted) == 1 and threading.active_count() < 50


def _rpcs() -> list[tuple[str, object]]:
    """(full method name, method descriptor) of every RPC the server answers."""
    services = [pb.DESCRIPTOR.services_by_name["GenerateService"], health_pb2.DESCRIPTOR.services_by_name["Health"],
                reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
    return [(f"/{s.full_name}/{m.name}", m) for s in services for m in s.methods]


def _raw_call(channel: grpc.Channel, method: str, descriptor, payload: bytes, metadata=()):
    """Send `payload` as the request bytes of `method` (no serializer) and read the whole answer."""
    kind = ("stream" if descriptor.client_streaming else "unary") + "_" + \
           ("stream" if descriptor.server_streaming else "unary")
    answer = getattr(channel, kind)(method)(iter([payload]) if descriptor.client_streaming else payload,
                                            metadata=metadata, timeout=10)
    return list(answer) if descriptor.server_streaming else answer


@pytest.mark.parametrize(("method", "descriptor"), _rpcs(), ids=[name for name, _ in _rpcs()])
def test_bytes_that_are_not_the_request_type_are_invalid_argument_naming_the_rpc(grpc_server, method, descriptor):
    """grpcio answered INTERNAL "Exception deserializing request!" (a server error, retried by
    clients and alerting operators) to a client with a mismatched .proto or no protobuf at all."""
    _, _, channel = grpc_server
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, b"\xff\xff\xff", metadata=KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"{method}: the request could not be parsed as "
                                           f"{descriptor.input_type.full_name} ("), info.value.details()


def test_a_field_sent_with_another_wire_type_is_invalid_argument_naming_it(grpc_server):
    """A client whose .proto has `double temperature = 5` sends field 5 as 8 bytes: protobuf kept
    it as an unknown field, so the request ran greedy without a word."""
    _, _, channel = grpc_server
    method, descriptor = next(r for r in _rpcs() if r[0].endswith("/Generate"))
    good = pb.GenerateRequest(prompt="hi", max_new_tokens=2).SerializeToString()
    assert len(_raw_call(channel, method, descriptor, good, metadata=KEY)) == 2
    as_double = b"\x29" + struct.pack("<d", 0.7)  # field 5, wire type 1 (fixed64)
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, good + as_double, metadata=KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'temperature' (field 5) arrived with another wire type" in info.value.details()
    nested = pb.GenerateRequest(max_new_tokens=2).SerializeToString() + b"\x1a\x05\x0d" + bytes(4)  # ids as fixed32
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, nested, metadata=KEY)
    assert "'prompt_token_ids.ids' (field 1)" in info.value.details()


def test_the_api_key_is_checked_before_the_request_is_parsed(grpc_server):
    _, _, channel = grpc_server
    method, descriptor = next(r for r in _rpcs() if r[0].endswith("/Generate"))
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, descriptor, b"\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_still_describes_the_real_request_types(grpc_server):
    _, _, channel = grpc_server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="speedpipe.v1.GenerateService")
    [reply] = stub.ServerReflectionInfo(iter([request]), timeout=10)
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in reply.file_descriptor_response.file_descriptor_proto]
    [service] = [s for f in files for s in f.service if s.name == "GenerateService"]
    assert {m.name: m.input_type for m in service.method}["Generate"] == ".speedpipe.v1.GenerateRequest"


def _accepted(engine: ServingEngine, **fields) -> bool:
    """Whether `request_params` accepts a GenerateRequest with `fields` (prompt "hi" and 2 new tokens by default)."""
    try:
        request_params(pb.GenerateRequest(**{"prompt": "hi", "max_new_tokens": 2} | fields), engine)
    except InvalidRequestError:
        return False
    return True


def test_model_info_reports_the_limits_validation_enforces(grpc_server, tokenizer):  # noqa: F811
    """There was no RPC a client could learn the served model or the server's limits from."""
    _, engine, channel = grpc_server
    info = pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY, timeout=10)
    lim = info.limits
    assert info.model_id == engine.model_name and not info.HasField("pipeline")  # the engine was told no pipeline
    assert list(info.eos_token_ids) == list(tokenizer.eos_token_ids) and info.eos_token_ids
    assert info.HasField("bos_token_id") == (tokenizer.bos_token_id is not None)
    two = len(tokenizer.encode("hi"))
    for at_limit, past_limit in (
        ({"max_new_tokens": info.max_model_len - two}, {"max_new_tokens": info.max_model_len - two + 1}),
        ({"prompt_token_ids": pb.TokenIds(ids=[info.vocab_size - 1])}, {"prompt_token_ids": pb.TokenIds(ids=[info.vocab_size])}),
        ({"temperature": lim.max_temperature}, {"temperature": lim.max_temperature + 0.01}),
        ({"logprobs": lim.max_logprobs}, {"logprobs": lim.max_logprobs + 1}),
        ({"prompt_logprobs": lim.max_logprobs}, {"prompt_logprobs": lim.max_logprobs + 1}),
        ({"stop": ["x"] * lim.max_stop_strings}, {"stop": ["x"] * (lim.max_stop_strings + 1)}),
        ({"request_id": "r" * lim.max_request_id_chars}, {"request_id": "r" * (lim.max_request_id_chars + 1)}),
        ({"seed": lim.max_seed}, {"seed": lim.max_seed + 1}),
        ({"logit_bias": {info.vocab_size - 1: -100.0}}, {"logit_bias": {info.vocab_size: -100.0}}),
    ):
        assert _accepted(engine, **at_limit) and not _accepted(engine, **past_limit), (at_limit, past_limit)
    with pytest.raises(InvalidRequestError, match=f"at most {lim.max_logit_bias_entries}$"):  # more than the vocabulary
        request_params(pb.GenerateRequest(prompt="hi", max_new_tokens=2, logit_bias=dict.fromkeys(
            range(lim.max_logit_bias_entries + 1), 1.0)), engine)
    assert (lim.max_num_seqs, lim.max_queue) == (engine.max_num_seqs, engine.max_queue)


def test_model_info_reports_the_token_mask_bias_and_structured_output_limits(grpc_server):
    """RequestLimits lacked the caps of stop_token_ids, allowed_token_ids, bad_words (count and length), the
    logit_bias value range and the structured output's size: each at its limit is accepted, one past it refused."""
    _, engine, channel = grpc_server
    info = pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY, timeout=10)
    lim = info.limits
    assert min(lim.max_stop_token_ids, lim.max_allowed_token_ids, lim.max_bad_words, lim.max_bad_word_chars,
               lim.max_structured_output_chars) > 0 and lim.max_logit_bias > 0
    for at_limit, past_limit in (
        ({"stop_token_ids": [1] * lim.max_stop_token_ids}, {"stop_token_ids": [1] * (lim.max_stop_token_ids + 1)}),
        ({"allowed_token_ids": [1] * lim.max_allowed_token_ids},
         {"allowed_token_ids": [1] * (lim.max_allowed_token_ids + 1)}),
        ({"bad_words": ["x"] * lim.max_bad_words}, {"bad_words": ["x"] * (lim.max_bad_words + 1)}),
        ({"bad_words": ["x" * lim.max_bad_word_chars]}, {"bad_words": ["x" * (lim.max_bad_word_chars + 1)]}),
        ({"logit_bias": {1: -lim.max_logit_bias}}, {"logit_bias": {1: -lim.max_logit_bias * 1.01}}),
        ({"structured_output": pb.StructuredOutput(regex="a" * lim.max_structured_output_chars)},
         {"structured_output": pb.StructuredOutput(regex="a" * (lim.max_structured_output_chars + 1))}),
    ):
        assert _accepted(engine, **at_limit) and not _accepted(engine, **past_limit), (at_limit, past_limit)


def test_model_info_needs_the_api_key_and_describes_the_pipeline(tokenizer):  # noqa: F811
    pipeline = ServedPipeline(num_stages=3, dtype="bfloat16", quantization="int8", speculate="speed")
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64, pipeline=pipeline)
    server = GrpcServer(engine, host="127.0.0.1", port=0, api_key="k3y")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            described = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY, timeout=10).pipeline
    finally:
        server.stop()
    assert (described.num_stages, described.dtype, described.quantization, described.speculate) == \
        (pipeline.num_stages, pipeline.dtype, pipeline.quantization, pipeline.speculate)


def test_model_info_names_the_model_as_http_does(tokenizer):  # noqa: F811
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    http, server = HttpServer(engine, host="127.0.0.1", port=0), GrpcServer(engine, host="127.0.0.1", port=0)
    http.start()
    server.start()
    try:
        [card] = httpx.get(f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}/v1/models",
                           timeout=10).json()["data"]
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            info = pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    finally:
        server.stop()
        http.stop()
    assert (info.model_id, info.max_model_len) == (card["id"], card["max_model_len"])


@pytest.mark.parametrize(("quantization", "dtype", "expected"), [
    ("none", "float32", ("float32", "none")),
    ("none", "bfloat16", ("bfloat16", "none")),
    ("int8", "float32", ("bfloat16", "int8")),  # the int kernels compute in bfloat16 whatever --dtype says
    ("auto", "float32", ("float32", "none")),  # a folder not converted from a GGUF: dense
])
def test_served_pipeline_says_what_the_stages_load(tmp_path, quantization, dtype, expected):
    options = RunConfig(num_stages=3, quantization=quantization, dtype=dtype, speculate="speed", predictor="ngram")
    session = SimpleNamespace(options=options, model=SimpleNamespace(model_dir=write_tiny_model(tmp_path)))
    served = served_pipeline(session)
    assert (served.dtype, served.quantization) == expected
    assert (served.num_stages, served.speculate) == (3, "speed")


def _generate_request_before_top_p_had_presence():
    """GenerateRequest as the .proto declared it before (`float top_p = 6`, no presence), in a
    descriptor pool of its own: what clients built from that .proto send."""
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    message = next(m for m in file.message_type if m.name == "GenerateRequest")
    field = next(f for f in message.field if f.name == "top_p")
    synthetic = field.oneof_index  # proto3 `optional` is a one-field oneof
    field.ClearField("proto3_optional")
    field.ClearField("oneof_index")
    del message.oneof_decl[synthetic]
    for f in message.field:
        if f.HasField("oneof_index") and f.oneof_index > synthetic:
            f.oneof_index -= 1
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("speedpipe.v1.GenerateRequest"))


def test_top_p_zero_is_invalid_argument_but_unset_and_old_clients_mean_1(grpc_server, tokenizer):  # noqa: F811
    """gRPC took top_p = 0 as 1 where HTTP answers 400; with presence an explicit 0 is refused,
    while a request without the field (unset, or a 0 from stubs of the old .proto, which proto3
    does not send) still means 1."""
    _, engine, channel = grpc_server
    with pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.GenerateServiceStub(channel).Generate(
            pb.GenerateRequest(prompt="hi", max_new_tokens=2, top_p=0.0), metadata=KEY, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'top_p'" in info.value.details()
    old = _generate_request_before_top_p_had_presence()
    assert not old.DESCRIPTOR.fields_by_name["top_p"].has_presence
    for top_p in (0.0, 0.5):
        wire = old(prompt="hi", max_new_tokens=2, top_p=top_p).SerializeToString()
        _, params = request_params(pb.GenerateRequest.FromString(wire), engine)
        assert params.top_p == (top_p or 1.0)
    _, params = request_params(pb.GenerateRequest(prompt="hi", max_new_tokens=2), engine)
    assert params.top_p == 1.0
