"""Property-based fuzzing of gRPC GenerateService over a fake coordinator (no model run).

The promise under test: whatever GenerateRequest a client sends (any value of every field, in or out
of its documented range, or bytes that are not a GenerateRequest at all), the RPC ends OK or with a
client's status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), never INTERNAL or UNKNOWN, with a
non-empty one-line message, and never hangs (each call has a deadline, which would show as
DEADLINE_EXCEEDED). Requests go through a real grpc client and server on loopback.

Deterministic and short: the settings FUZZ of tests/unit/test_http_fuzz.py (its docstring says how to
fuzz longer locally).
"""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher.serving.grpc_generate import GrpcServer
from launcher.serving.serving_engine import ServingEngine
from proto import speedpipe_pb2 as pb
from tests.unit.test_http_fuzz import FUZZ, GRAMMARS, STRUCTURAL_TAGS
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401  (module fixture)

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 20.0
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}

UINT32, UINT64, INT32 = (0, 2**32 - 1), (0, 2**64 - 1), (-(2**31), 2**31 - 1)
_float = st.one_of(
    st.floats(width=32),
    st.floats(-3, 3, width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-40, 1.0, 2.0, 2.0000002]),
)
_small = st.integers(0, 12)
# Structured outputs: valid, malformed and unsatisfiable constraints (a schema that is not JSON, `false`,
# a regex that does not compile, an empty choice list, one over the 262,144-character cap).
SCHEMAS = ['{"type": "object"}', "true", "false", "[]", "{", '{"type": "nope"}', '{"enum": []}', "x" * 262_145]
REGEXES = ["[0-9]+", "(", "a{99999999}", "", "\\", "[^\\s\\S]"]
TAG_TEXTS = [t if isinstance(t, str) else json.dumps(t) for t in STRUCTURAL_TAGS]
# Every field of GenerateRequest, in its wire type's full range (optional fields drawn or left unset).
FIELDS = {
    "request_id": st.one_of(st.text(max_size=8), st.text(min_size=250, max_size=300)),
    "max_new_tokens": st.one_of(_small, st.integers(*UINT32)),
    "temperature": _float,
    "top_p": _float,
    "seed": st.one_of(st.integers(*UINT64), st.sampled_from([2**63 - 1, 2**63])),
    "stop": st.lists(st.text(max_size=3), max_size=6),
    "ignore_eos": st.booleans(),
    "presence_penalty": _float,
    "frequency_penalty": _float,
    "repetition_penalty": _float,
    "logprobs": st.one_of(st.integers(0, 22), st.integers(*UINT32)),
    "top_k": st.one_of(st.integers(-2, 300), st.integers(*INT32)),
    "min_p": _float,
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(-2, 300), st.integers(*INT32)), st.one_of(_float, st.floats(-101, 101, width=32)), max_size=3
    ),
    "structured_output": st.one_of(
        st.booleans().map(lambda b: pb.StructuredOutput(json_object=b)),
        st.one_of(st.text(max_size=30), st.sampled_from(SCHEMAS)).map(lambda s: pb.StructuredOutput(json_schema=s)),
        st.one_of(st.text(max_size=12), st.sampled_from(REGEXES)).map(lambda r: pb.StructuredOutput(regex=r)),
        st.lists(st.text(max_size=6), max_size=4).map(lambda c: pb.StructuredOutput(choice=pb.Choices(choices=c))),
        st.one_of(st.text(max_size=30), st.sampled_from(GRAMMARS)).map(lambda g: pb.StructuredOutput(grammar=g)),
        st.one_of(st.text(max_size=30), st.sampled_from(TAG_TEXTS)).map(lambda t: pb.StructuredOutput(structural_tag=t)),
    ),
}
PROMPT = st.one_of(
    st.none(),
    st.text(max_size=40).map(lambda s: {"prompt": s}),
    st.lists(st.one_of(st.integers(0, 300), st.integers(*UINT32)), max_size=6).map(
        lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}
    ),
)

# Hand-made bytes: a wrong wire type (request_id as a varint, max_new_tokens as a string), a
# truncated field, a prompt that is not UTF-8 or is a lone surrogate (with max_new_tokens=1), a good one,
# and `stop` (a string) sent 5000 times as a varint (each was named: a trailer over the client's 16 KiB).
RAW_REQUESTS = [
    b"\x08\x01",
    b"\x22\x03abc",
    b"\x12\xff",
    b"\xff",
    b"\x12\x01\xff\x20\x01",
    b"\x12\x03\xed\xa0\x80\x20\x01",
    b"\x12\x01a\x20\x01",
    b"\x12\x01a\x20\x01" + b"\x40\x01" * 5000,
]
MAX_DETAILS_CHARS = 1000  # a message is one short line


@pytest.fixture(scope="module")
def channel(tokenizer):  # noqa: F811
    """A grpc channel to a real GenerateService on loopback; room for many requests at once."""
    engine = ServingEngine(
        FakeCoordinator(tokenizer, step_s=0.0),
        model_name="tiny",
        max_num_seqs=32,
        max_queue=32,
        max_model_len=64,
    )
    server = GrpcServer(engine, host="127.0.0.1", port=0)
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch
    server.stop()


def _call(channel: grpc.Channel, request: bytes) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    """(status, details, replies) of one Generate call sent as raw bytes."""
    generate = channel.unary_stream(
        "/speedpipe.v1.GenerateService/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    replies = []
    try:
        for reply in generate(request, timeout=DEADLINE_S):
            replies.append(reply)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", replies
    return grpc.StatusCode.OK, "", replies


def _check(code: grpc.StatusCode, details: str, replies: list[pb.GenerateResponse]) -> None:
    assert code in CLIENT_ERRORS | {grpc.StatusCode.OK}, (code, details)
    if code != grpc.StatusCode.OK:
        assert details.strip() and details.splitlines() == [details], details
        assert len(details) <= MAX_DETAILS_CHARS, details[:300]
    else:
        assert replies and replies[-1].finish_reason != pb.GenerateResponse.FINISH_REASON_UNSPECIFIED, (
            replies[-1:]
        )


@FUZZ
@given(fields=st.fixed_dictionaries({}, optional=FIELDS), prompt=PROMPT)
def test_any_generate_request_is_ok_or_a_client_error(channel, fields, prompt):
    request = pb.GenerateRequest(**fields, **(prompt or {}))
    _check(*_call(channel, request.SerializeToString()))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=40), st.sampled_from(RAW_REQUESTS)))
def test_raw_request_bytes_are_ok_or_invalid_argument(channel, raw):
    code, details, replies = _call(channel, raw)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    _check(code, details, replies)


@pytest.mark.parametrize("constraint", [
    *(pb.StructuredOutput(json_schema=s) for s in SCHEMAS),
    *(pb.StructuredOutput(regex=r) for r in REGEXES),
    pb.StructuredOutput(json_object=False),
    pb.StructuredOutput(choice=pb.Choices(choices=[])),
    pb.StructuredOutput(choice=pb.Choices(choices=["", "a"])),
    *(pb.StructuredOutput(grammar=g) for g in GRAMMARS),
    *(pb.StructuredOutput(structural_tag=t) for t in TAG_TEXTS),
], ids=lambda c: str(c)[:24])
def test_every_listed_constraint_is_ok_or_invalid_argument(channel, constraint):
    """Each hand-listed constraint on a valid request (the fuzz above meets each one only by chance)."""
    request = pb.GenerateRequest(prompt="hi", max_new_tokens=2, structured_output=constraint)
    code, details, replies = _call(channel, request.SerializeToString())
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    _check(code, details, replies)
