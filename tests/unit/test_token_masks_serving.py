"""vLLM's token masks at the front ends: HTTP (completions, chat, streaming) and gRPC (GenerateRequest
fields 18..21, GenerateResponse.stop_token_id), over the echoing fake coordinator of
tests/unit/test_serving_http.py.

What breaks when these fail: min_tokens / stop_token_ids / allowed_token_ids / bad_words are silently
ignored again (the bodies' fields never reach SamplingParams), a bad value is not a 400 naming the field /
INVALID_ARGUMENT naming the proto field, an id outside the vocabulary is accepted, or a choice ended by a
stop token id does not carry the id as `stop_reason` (HTTP, a number as vLLM's) / `stop_token_id` (gRPC),
or shows the stop token's text.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from launcher.coordinator.request_handle import RequestHandle, TextOptions, encode_prompt
from launcher.serving.grpc_generate import GrpcServer, request_params
from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import parse_chat, parse_completion
from launcher.serving.serving_engine import InvalidRequestError, ServingEngine
from pipeline.engine.records import Commit, FinishReason
from pipeline.speculation.sampling import SamplingParams
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.unit.test_grpc_error_details import _details
from tests.unit.test_serving_http import FakeCoordinator, _streamed_chunks, tokenizer  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(60)
USER = [{"role": "user", "content": "Hi"}]
MASKS = {"min_tokens": 2, "stop_token_ids": [33, 10], "allowed_token_ids": [104, 105, 33], "bad_words": ["zz", "q"]}


class StopTokenCoordinator(FakeCoordinator):
    """FakeCoordinator (echoes the prompt's tokens) that checks a request's token masks as the real one does
    (`encode_prompt`) and ends a request as the scheduler does at one of its stop_token_ids: the id
    committed with FinishReason.STOP."""

    def submit(self, prompt, params: SamplingParams, *, request_id=None, text=TextOptions()) -> RequestHandle:
        _, _, params = encode_prompt(self.tokenizer, list(prompt), params, max_model_len=64)  # as Coordinator.submit
        return super().submit(prompt, params, request_id=request_id, text=text)

    def _run(self, h) -> None:
        for i in range(h.params.max_new_tokens):
            token = h.prompt_ids[i % len(h.prompt_ids)]
            stop = token in h.params.stop_token_ids and i >= h.params.min_tokens
            last = stop or i == h.params.max_new_tokens - 1
            reason = (FinishReason.STOP if stop else FinishReason.LENGTH) if last else None
            if h.emit(Commit(0, (token,), reason)) or last:
                return


@pytest.fixture()
def served(tokenizer):  # noqa: F811
    yield from serve_http_and_grpc(StopTokenCoordinator(tokenizer, step_s=0.0))


def serve_http_and_grpc(coordinator):
    """(the HTTP base URL, a gRPC channel) of both front ends on `coordinator`, a fixture's generator."""
    engine = ServingEngine(coordinator, model_name="tiny", max_num_seqs=2, max_queue=2, max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    grpc_server = GrpcServer(engine, host="127.0.0.1", port=0)
    grpc_server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    yield f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}", channel
    channel.close()
    grpc_server.stop()
    http.stop()


def test_the_fields_reach_the_sampling_params_of_both_routes_and_null_is_unset(tokenizer):  # noqa: F811
    for parsed in (parse_completion({"prompt": "Hi", **MASKS}, tokenizer=tokenizer, model_name="tiny"),
                   parse_chat({"messages": USER, **MASKS}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)):
        p = parsed.params
        assert (p.min_tokens, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (2, (33, 10), (33, 104, 105),
                                                                                       ("zz", "q"))
    nulls = {name: None for name in MASKS}
    p = parse_completion({"prompt": "Hi", **nulls}, tokenizer=tokenizer, model_name="tiny").params
    assert (p.min_tokens, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (0, (), None, ())


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"min_tokens": 17}, "min_tokens", "'min_tokens' must be an integer in [0, max_tokens = 16], got 17"),
    ({"min_tokens": -1}, "min_tokens", "got -1"), ({"min_tokens": "2"}, "min_tokens", "got '2'"),
    ({"stop_token_ids": 5}, "stop_token_ids", "'stop_token_ids' must be a list of token ids, got int"),
    ({"stop_token_ids": [256]}, "stop_token_ids", "'stop_token_ids' token id 256 is outside the vocabulary [0, 256)"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "'allowed_token_ids' must not be empty"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids", "got -3"),
    ({"allowed_token_ids": [1, 999]}, "allowed_token_ids", "token id 999 is outside the vocabulary"),
    ({"bad_words": [""]}, "bad_words", "'bad_words' must hold non-blank strings"),
    ({"bad_words": "zz"}, "bad_words", "must be a list of strings, got str"),
])
def test_bad_values_are_400_naming_the_field(served, body, param, message):
    url, _ = served
    for route, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = httpx.post(url + route, json={**base, "max_tokens": 16, **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_id_is_the_stop_reason_and_its_text_is_not_shown(served, tokenizer, chat, stream):  # noqa: F811
    """The echo of "ab!cd" with stop_token_ids ["!"]: tokens a, b, ! (in token_ids), text "ab"; with
    min_tokens 4 the "!" (the third token) is not a stop yet: the echo runs on to the budget."""
    url, _ = served
    bang = tokenizer.encode("!", add_special_tokens=False)[0]
    route, base = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab!cd"}]}) if chat else \
        ("/v1/completions", {"prompt": "ab!cd"})
    body = {**base, "max_tokens": 40, "stop_token_ids": [bang], "return_token_ids": True, "stream": stream}
    if stream:
        choices = [c for e in _streamed_chunks(url, route, body) for c in e["choices"]]
        text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
        ids = [t for c in choices for t in c.get("token_ids") or []]
        last = choices[-1]
        assert all(c["stop_reason"] is None for c in choices[:-1])
    else:
        last = httpx.post(url + route, json=body, timeout=10).json()["choices"][0]
        text, ids = (last["message"]["content"] if chat else last["text"]), last["token_ids"]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", bang)
    assert ids[-1] == bang and bang not in ids[:-1] and text == tokenizer.decode(ids[:-1])
    if not chat:
        assert text == "ab"
        r = httpx.post(url + route, json={**body, "stream": False, "min_tokens": 4}, timeout=10).json()["choices"][0]
        assert (r["finish_reason"], r["stop_reason"]) == ("stop", bang) and r["text"] == "ab!cdab"


def test_grpc_fields_reach_the_sampling_params_and_bad_values_name_the_proto_field(served, tokenizer):  # noqa: F811
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    req = pb.GenerateRequest(prompt="Hi", max_new_tokens=8, min_tokens=2, stop_token_ids=[33, 10],
                             allowed_token_ids=[105, 104, 33], bad_words=["zz"])
    _, p = request_params(req, engine)
    assert (p.min_tokens, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (2, (33, 10), (33, 104, 105), ("zz",))
    _, p = request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=8), engine)
    assert (p.min_tokens, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (0, (), None, ())
    for fields, field in ((dict(min_tokens=9), "min_tokens"), (dict(stop_token_ids=[256]), "stop_token_ids"),
                          (dict(allowed_token_ids=[300]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words")):
        with pytest.raises(InvalidRequestError) as info:
            request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=8, **fields), engine)
        assert info.value.param == field and str(info.value).startswith(f"'{field}'"), str(info.value)
    _, channel = served
    stub = pb_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=4, min_tokens=5), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'min_tokens'" in err.value.details()
    bang = tokenizer.encode("!", add_special_tokens=False)[0]
    replies = list(stub.Generate(pb.GenerateRequest(prompt="ab!cd", max_new_tokens=20, stop_token_ids=[bang]),
                                 timeout=10))
    last = replies[-1]
    assert (last.finish_reason, last.stop_token_id, last.stop_reason) == (pb.GenerateResponse.STOP, bang, "")
    assert last.HasField("stop_token_id") and not any(r.HasField("stop_token_id") for r in replies[:-1])
    assert "".join(r.text for r in replies) == "ab" and [t for r in replies for t in r.token_ids][-1] == bang
    replies = list(stub.Generate(pb.GenerateRequest(prompt="abc", max_new_tokens=2), timeout=10))
    assert not replies[-1].HasField("stop_token_id")


def test_allowed_ids_that_the_other_masks_all_ban_are_refused_before_the_request_runs(served, tokenizer):  # noqa: F811
    """Every allowed id a one-token bad word, or (min_tokens > 0) an EOS or stop token id: the first token could
    only fail the request (a 500 after it ran), so it is a 400 naming allowed_token_ids / INVALID_ARGUMENT
    with a BadRequest on that field. A long bad word (more tokens than characters) is accepted."""
    url, channel = served
    q, bang = (tokenizer.encode(c, add_special_tokens=False)[0] for c in ("q", "!"))
    eos = tokenizer.eos_token_ids[0]
    refused = [{"allowed_token_ids": [q], "bad_words": ["q"]},
               {"allowed_token_ids": [eos, bang], "stop_token_ids": [bang], "min_tokens": 1},
               {"allowed_token_ids": [eos, q], "bad_words": ["q"], "min_tokens": 1}]
    accepted = [{"allowed_token_ids": [eos, bang], "stop_token_ids": [bang]},  # no min_tokens: EOS and "!" may come
                {"allowed_token_ids": [q, bang], "bad_words": ["q!"], "min_tokens": 1},  # "q" may come, "!" after it not
                {"bad_words": ["\u00e9" * 200]}]  # 200 characters, 400 byte tokens
    for route, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        for body in refused:
            r = httpx.post(url + route, json={**base, "max_tokens": 4, **body}, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", (body, r.text)
            assert r.json()["error"]["message"].startswith("'allowed_token_ids' leave no token to generate"), r.text
        for body in accepted:
            r = httpx.post(url + route, json={**base, "max_tokens": 4, **body}, timeout=10)
            assert r.status_code == 200, (body, r.text)
    stub = pb_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=4, allowed_token_ids=[q], bad_words=["q"]),
                           timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in _details(err.value)["BadRequest"].field_violations] == ["allowed_token_ids"]
