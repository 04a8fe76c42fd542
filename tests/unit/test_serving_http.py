"""The HTTP front end, request validation and the load tester, over a fake coordinator (no model run).

The fake coordinator commits tokens from a thread through the real RequestHandle, so the serving
engine, the SSE encoding, admission limits, /health and the bench client run for real on loopback;
only the pipeline is replaced. The real-model end-to-end checks are in
tests/integration/test_serving.py.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pytest

from launcher.cli.main import main
from launcher.coordinator.coordinator import PipelineError, RequestHandle
from launcher.coordinator.request_handle import TextOptions
from launcher.serving import http_errors, openai_protocol
from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import parse_chat, parse_completion, render_chat
from launcher.serving.serving_engine import InvalidRequestError, ServingEngine
from pipeline.engine.records import Commit, FinishReason, SpecCounters
from pipeline.measure.timeline import Timeline
from pipeline.model.tokenizer import Tokenizer
from pipeline.run_config import RunConfig
from pipeline.speculation.echo import shown
from pipeline.speculation.logprobs import TokenLogprob
from pipeline.speculation.sampling import SamplingParamError, SamplingParams
from proto import speedpipe_pb2 as pb
from tests.conftest import wait_for
from tests.tiny_model import write_tiny_model
from workers.rpc.status_details import error_reason

pytestmark = pytest.mark.timeout(60)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return Tokenizer(path)


class FakeCoordinator:
    """Commits the prompt's bytes back, one token per `step_s`, through real RequestHandles."""

    def __init__(self, tokenizer: Tokenizer, *, step_s: float = 0.002) -> None:
        self.tokenizer, self.step_s = tokenizer, step_s
        self.failure: PipelineError | None = None
        self.recovering: str | None = None  # a stage fail-over in progress (launcher/coordinator/stage_failover.py)
        self.failover = None  # no fail-over: a silent stage refuses admissions
        self.stage_status = [pb.HealthResponse.SERVING] * 2
        self.spec = SpecCounters()
        self.timeline = Timeline(2)
        self.aborted: list[str] = []
        self.error_at: int | None = None  # this output position's logits are not finite (FinishReason.ERROR)
        self.num_restarts = 0
        self._n = 0

    def submit(self, prompt, params: SamplingParams, *, request_id=None, text=TextOptions()) -> RequestHandle:
        if self.failure is not None:  # as the real one
            raise self.failure
        ids = list(prompt)
        handle = RequestHandle(request_id, self.tokenizer.decode(ids), ids, params, text.detokenizer(self.tokenizer, ids),
                               text)
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        return handle

    def _run(self, h: RequestHandle) -> None:
        for i in range(h.params.max_new_tokens):
            time.sleep(self.step_s)
            if h.finish_reason is not None:
                return
            if i == self.error_at:  # as the scheduler: no tokens, the sequence ends ([Note: non-finite logits])
                h.emit(Commit(0, (), FinishReason.ERROR))
                return
            last = i == h.params.max_new_tokens - 1
            token = h.prompt_ids[i % len(h.prompt_ids)]
            if h.emit(Commit(0, (token,), FinishReason.LENGTH if last else None, *_fake_logprobs(h.params, token, i, h))):
                return

    def abort(self, handle: RequestHandle) -> None:
        self.aborted.append(handle.request_id)
        handle.finish("aborted")

    def health(self):
        return [pb.HealthResponse(status=s) for s in self.stage_status]

    def stage_stats(self, timeout_s: float = 10.0):
        return [pb.StageStats(wall_ns=10**9, busy_ns=4 * 10**8, kv_slots_in_use=0) for _ in range(2)]


def _fake_logprobs(params: SamplingParams, token: int, i: int, h: RequestHandle) -> tuple:
    """(logprobs, prompt_logprobs) of output position i as the real coordinator reports them: one
    entry per token when the request asks, the prompt's (None for its first token) on the first commit."""
    if params.logprobs is None:
        return None, None
    def entry(t: int) -> TokenLogprob:
        return TokenLogprob(t, -1.0, tuple((t, -1.0) for _ in range(params.logprobs)))
    prompt = None
    if params.prompt_logprobs is not None and i == 0:
        prompt = (None, *(entry(t) for t in h.prompt_ids[1:]))
    return (entry(token),), prompt


@pytest.fixture()
def served(tokenizer):
    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    port = http.server.servers[0].sockets[0].getsockname()[1]
    yield coord, engine, f"http://127.0.0.1:{port}"
    http.stop()


def test_health_is_503_while_a_stage_is_unhealthy(served):
    coord, _, url = served
    assert httpx.get(url + "/health").status_code == 200
    coord.stage_status[1] = pb.HealthResponse.UNHEALTHY
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and "stage 1" in r.json()["error"]["message"]
    coord.stage_status[1] = pb.HealthResponse.SERVING
    coord.failure = PipelineError("stage 0 (pid 1) exited unexpectedly with code -9")
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and "exited unexpectedly" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503


def test_ready_stays_200_while_a_stage_restarts_and_is_503_once_requests_are_refused(served):
    """/ready is what a load balancer (Kubernetes readiness) asks: a stage restart is a pause that
    new requests wait behind, so the server must stay in the Service; /health is 503 meanwhile, and
    a readiness probe on it (or on gRPC health) turned every restart into refused connections."""
    from types import SimpleNamespace

    coord, engine, url = served
    assert httpx.get(url + "/ready").status_code == 200
    coord.failover = SimpleNamespace()  # a fail-over restarts failed stages
    coord.recovering = "restarting after a stage failure: stage 1 exited"
    assert httpx.get(url + "/health").status_code == 503
    assert httpx.get(url + "/ready").status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200  # admitted while recovering, as /ready said
    coord.recovering = None
    engine.fence("draining: SIGTERM", draining=True)
    r = httpx.get(url + "/ready")
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 503


def test_ready_is_503_after_a_failure_for_good(served):
    coord, _, url = served
    coord.failure = PipelineError("stage restarts exhausted")
    r = httpx.get(url + "/ready")
    assert r.status_code == 503 and "exhausted" in r.json()["error"]["message"]


def test_streamed_text_and_usage(served):
    _, engine, url = served
    body = {"prompt": "Hello", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "HelloHe"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert engine.num_outstanding == 0



def _streamed_chunks(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + route, json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(served, chat):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries the prompt's
    tokens and its choice's completion tokens so far; the last chunk the total of every choice. Before:
    silently ignored (usage only on the last chunk)."""
    _, _, url = served
    route, extra = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}) if chat
                    else ("/v1/completions", {"prompt": "Hello"}))
    body = {**extra, "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _streamed_chunks(url, route, body)
    *choices, last = chunks
    prompt = last["usage"]["prompt_tokens"]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": prompt, "completion_tokens": 6,
                                                       "total_tokens": prompt + 6}
    seen = {0: 0, 1: 0}
    for c in choices:
        [choice] = c["choices"]
        seen[choice["index"]] += bool(choice.get("text") or choice.get("delta", {}).get("content"))
        assert c["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen[choice["index"]],
                              "total_tokens": prompt + seen[choice["index"]]}, c
    assert seen == {0: 3, 1: 3}
    # Without include_usage nothing changes (as vLLM): no usage anywhere.
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in c for c in _streamed_chunks(url, route, body))


@pytest.mark.parametrize("value", [1, "true", {}])
def test_continuous_usage_stats_must_be_a_boolean(served, tokenizer, value):
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": value}}
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(body, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == "stream_options.continuous_usage_stats"
    r = httpx.post(served[2] + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"'stream_options.continuous_usage_stats' must be true or false, got {value!r}")
    body["stream_options"]["continuous_usage_stats"] = None
    assert parse_completion(body, tokenizer=tokenizer, model_name="tiny").continuous_usage is False

def test_queue_bound_is_429_and_abort_on_disconnect(served):
    coord, engine, url = served
    coord.step_s = 0.05
    body = {"prompt": "Hi", "max_tokens": 60, "stream": True}
    with httpx.Client(timeout=10) as http:
        held = [http.send(http.build_request("POST", url + "/v1/completions", json=body), stream=True)
                for _ in range(3)]  # max_num_seqs 2 + max_queue 1
        assert [r.status_code for r in held] == [200] * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        for r in held:
            r.close()
    wait_for(lambda: len(coord.aborted) >= 3 and not engine.num_outstanding, timeout_s=5)
    assert len(coord.aborted) == 3 and engine.num_outstanding == 0
    metrics = httpx.get(url + "/metrics").text
    assert 'speedpipe:request_rejected_total{model_name="tiny",reason="queue_full"} 1.0' in metrics
    assert 'speedpipe:request_success_total{finished_reason="abort",model_name="tiny"} 3.0' in metrics  # vLLM's label


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "3"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 2}, "top_p"),
    ({"seed": -3}, "seed"), ({"stop": 5}, "stop"), ({"model": 5}, "model"), ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"n": 0}, "n"), ({"stream": "yes"}, "stream"),
    ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"echo": 1}, "echo"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.1}, "repetition_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"min_p": "0.1"}, "min_p"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"), ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"logit_bias": {"256": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
])
def test_parse_completion_names_the_bad_field(tokenizer, body, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": "Hi", **body}, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == param
    assert param in str(info.value)


def test_parse_completion_and_chat(tokenizer):
    p = parse_completion({"prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                          "stop": "x", "model": "tiny"}, tokenizer=tokenizer, model_name="tiny")
    assert p.prompt_ids == tokenizer.encode("Hi")
    assert p.params == SamplingParams(max_new_tokens=3, temperature=0.5, top_p=0.9, seed=7, stop=("x",))
    assert parse_completion({"prompt": [5, 6]}, tokenizer=tokenizer, model_name="tiny").params.max_new_tokens == 16
    harmless = {"n": 1, "logprobs": False, "echo": False, "presence_penalty": 0, "logit_bias": {}, "user": "u"}
    assert parse_completion({"prompt": "Hi", **harmless}, tokenizer=tokenizer, model_name="tiny").prompt_ids
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert render_chat(messages, tokenizer=tokenizer) == "<user>Hi\n<assistant>"
    chat = parse_chat({"messages": messages}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    assert chat.params.max_new_tokens == 64 - len(chat.prompt_ids)
    chat = parse_chat({"messages": messages, "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 5},
                      tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    assert chat.params.logprobs == 3 and [p.seed for p in chat.choice_params()] == [5, 6]
    p = parse_completion({"prompt": "Hi", "logprobs": 2, "echo": True, "repetition_penalty": 1.2},
                         tokenizer=tokenizer, model_name="tiny")
    assert (p.params.logprobs, p.params.prompt_logprobs, p.echo, p.params.repetition_penalty) == (2, 2, "Hi", 1.2)
    for body, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"logprobs": 3}, "logprobs"), ({"echo": True}, "echo")):
        with pytest.raises(InvalidRequestError) as info:
            parse_chat({"messages": messages, **body}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
        assert info.value.param == param


def test_null_means_the_default_and_vllm_sampling_fields_are_read(tokenizer):
    """OpenAI allows null for optional fields: max_completion_tokens null falls back to max_tokens
    (vLLM's rule), stream / echo null are false; top_k and min_p reach SamplingParams."""
    p = parse_completion({"prompt": "Hi", "max_completion_tokens": None, "max_tokens": 5, "stream": None,
                          "echo": None, "top_k": 40, "min_p": 0.05}, tokenizer=tokenizer, model_name="tiny")
    assert (p.params.max_new_tokens, p.stream, p.echo, p.params.top_k, p.params.min_p) == (5, False, None, 40, 0.05)
    p = parse_completion({"prompt": "Hi", "max_completion_tokens": 3, "max_tokens": 5, "stream": True,
                          "stream_options": {"include_usage": True}}, tokenizer=tokenizer, model_name="tiny")
    assert (p.params.max_new_tokens, p.stream, p.include_usage) == (3, True, True)


def test_chat_template_options(tokenizer):
    """add_generation_prompt, continue_final_message and chat_template_kwargs, as Hugging Face's
    apply_chat_template (tests/integration/test_serving.py compares with transformers)."""
    def chat(messages, **body):
        return parse_chat({"messages": messages, **body}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)

    user = [{"role": "user", "content": "Hi"}]
    assert render_chat(user, tokenizer=tokenizer, add_generation_prompt=False) == "<user>Hi\n"
    assert chat(user, add_generation_prompt=False).prompt_ids == tokenizer.encode("<user>Hi\n")
    prefill = [*user, {"role": "assistant", "content": "Sure"}]
    assert chat(prefill, continue_final_message=True).prompt_ids == tokenizer.encode("<user>Hi\n<assistant>Sure")
    tool_turn = [*user, {"role": "assistant", "content": None, "tool_calls": []}, *user]
    assert chat(tool_turn).prompt_ids == tokenizer.encode("<user>Hi\n<assistant>\n<user>Hi\n<assistant>")
    assert chat(user, chat_template_kwargs={"enable_thinking": False}).prompt_ids == chat(user).prompt_ids
    for body, param in (({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        with pytest.raises(InvalidRequestError) as info:
            chat(prefill, **body)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        chat([{"role": "user", "content": None}])
    assert info.value.param == "messages[0].content"


def test_logit_bias_reaches_the_sampling_params_of_both_routes(tokenizer):
    """OpenAI's logit_bias (token ids as strings) was refused as unsupported; it is now SamplingParams'."""
    bias = {"logit_bias": {"50": -100, "7": 2.5}}
    p = parse_completion({"prompt": "Hi", **bias}, tokenizer=tokenizer, model_name="tiny")
    assert p.params.logit_bias == ((7, 2.5), (50, -100.0))
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], **bias}, tokenizer=tokenizer,
                      model_name="tiny", max_model_len=64)
    assert chat.params.logit_bias == ((7, 2.5), (50, -100.0))
    assert parse_completion({"prompt": "Hi", "logit_bias": None}, tokenizer=tokenizer, model_name="tiny").params.logit_bias == ()


@pytest.mark.parametrize("bias", [0, False, "", []])
def test_a_logit_bias_that_is_not_an_object_is_refused_even_when_falsy(tokenizer, bias):
    """`"logit_bias": 0` (or false, "", []) was taken as no bias; OpenAI's field is an object: 400."""
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": "Hi", "logit_bias": bias}, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == "logit_bias" and "must be an object" in str(info.value)


@pytest.mark.parametrize(("route", "bias", "message"), [
    ("/v1/completions", {"256": 1}, "'logit_bias' token id 256 is outside the vocabulary [0, 256)"),
    ("/v1/chat/completions", {"a": 1}, "'logit_bias' keys must be token ids (integers >= 0), got 'a'"),
    ("/v1/completions", {"3": -101}, "'logit_bias' of token 3 must be a number in [-100, 100], got -101"),
])
def test_a_bad_logit_bias_is_400_naming_the_field(served, route, bias, message):
    _, _, url = served
    body = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(url + route, json={**body, "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                                          "param": "logit_bias", "code": 400}, r.text
    assert httpx.post(url + route, json={**body, "max_tokens": 2, "logit_bias": {"3": -100}}).status_code == 200


def test_too_long_prompt_names_prompt_or_max_tokens(served):
    _, _, url = served
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 64, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 10, "max_tokens": 60})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_cli_rejects_bad_serve_and_bench_flags_before_spawning(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse choices
        main(["serve", "--backend", "nope"])
    assert exit_info.value.code == 2
    assert main(["launch", "--serve", "--grpc-port", "-5"]) == 2  # launch --serve is serve
    assert "--grpc-port" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1]), "--grpc-port", "-1"]) == 2
        assert "cannot listen" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "--base-url" in capsys.readouterr().err  # bench serve's own checks: tests/unit/test_bench_serve.py


@pytest.mark.parametrize(("text", "stop", "want", "matched"), [
    ("abcXYZdef", ("XYZ",), "abc", "XYZ"), ("abXYqXYZ", ("XYZ",), "abXYq", "XYZ"), ("abXYq", ("XYZ",), "abXYq", None),
    ("hello world", ("ld", "o w"), "hell", "o w"), ("aXb", ("X",), "a", "X"), ("Xab", ("X",), "", "X"),
    ("abcd", ("bcd", "bc"), "a", "bc"),  # the first to be complete ends it
    ("xabcd", ("abcd", "bc"), "xa", "bc"),
])
def test_stop_string_text_is_never_streamed(tokenizer, text, stop, want, matched):
    """The coordinator's RequestHandle holds back text that may start a stop string (tiny byte
    tokenizer: one token per character), and names the stop string that ended it (vLLM's
    `stop_reason`; None after length)."""
    ids = tokenizer.encode(text)
    params = SamplingParams(max_new_tokens=len(ids), stop=stop)
    h = RequestHandle("r", "p", [1], params, tokenizer.detokenizer(prompt_ids=[1]))
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if h.emit(Commit(0, (t,), FinishReason.LENGTH if last else None)):
            break
    chunks = list(h)
    assert "".join(c.text for c in chunks) == want == h.result(1).text
    assert h.finish_reason == ("stop" if want != text else "length")
    assert h.stop_reason == chunks[-1].stop_reason == matched
    assert all(c.stop_reason is None for c in chunks[:-1])
    # all the tokens in one commit (a speculative result): the same text and stop string
    at_once = RequestHandle("r", "p", [1], params, tokenizer.detokenizer(prompt_ids=[1]))
    at_once.emit(Commit(0, tuple(ids), FinishReason.LENGTH))
    assert (at_once.result(1).text, at_once.stop_reason) == (want, matched)


def test_tokens_committed_with_a_non_finite_row_stream_before_the_error(tokenizer):
    """A speculative result can accept drafts and then meet a non-finite row: the accepted tokens are
    what plain decoding streamed before failing there, so they stream first and the error names the
    position after them."""
    from launcher.coordinator.request_handle import RequestError

    ids = tokenizer.encode("ab")
    h = RequestHandle("r", "p", [1], SamplingParams(max_new_tokens=8), tokenizer.detokenizer(prompt_ids=[1]))
    assert h.emit(Commit(0, tuple(ids), FinishReason.ERROR)) is False
    chunks = iter(h)
    assert next(chunks).token_ids == tuple(ids)
    with pytest.raises(RequestError, match=f"at output token {len(ids)}:"):
        next(chunks)
    assert h.finish_reason == "error" and h.token_ids == ids


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_choices_name_the_stop_string_that_ended_them(served, stream, chat):
    """`stop_reason` (vLLM's field): the matched stop string on the last choice or chunk, null on the
    others and when the length limit ended the choice."""
    _, _, url = served
    body = {"max_tokens": 25, "stream": stream, "n": 2}
    if chat:
        body |= {"messages": [{"role": "user", "content": "say: hello world"}], "stop": ["zz", "o w"]}
    else:
        body |= {"prompt": "hello world", "stop": ["zz", "o w"]}
    r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=10)
    assert r.status_code == 200
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"]]
        last = [c for c in choices if c["finish_reason"] is not None]
        assert all(c["stop_reason"] is None for c in choices if c["finish_reason"] is None)
    else:
        last = r.json()["choices"]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", "o w")] * 2
    r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stop": ["zz"]}, timeout=10)
    assert [(c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]] == [("length", None)]


def test_stats_log_line(tokenizer, monkeypatch):
    from launcher.serving import prometheus
    from launcher.serving.prometheus import StatsLogger

    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=4, max_model_len=64)
    logger = StatsLogger(coord, engine.metrics, engine, interval_s=1.0)
    _, snap = logger.line({})
    engine.metrics.add_generation_tokens(50)
    coord.spec.verified_drafts, coord.spec.accepted_tokens = 10, 4
    engine._outstanding = 3  # 2 running + 1 waiting
    walls = iter([(3 * 10**9, 10**9), (3 * 10**9, 2 * 10**9)])  # idle 1/2 and 0 of the 2 s interval
    coord.stage_stats = lambda: [pb.StageStats(wall_ns=w, busy_ns=b) for w, b in walls]
    snap["stages"] = [(10**9, 0), (10**9, 0)]
    clock = iter([snap["t"] + 2.0])  # the interval exactly 2 s, however long this test took to get here
    monkeypatch.setattr(prometheus.time, "perf_counter", lambda: next(clock))
    text, _ = logger.line(snap)
    assert "generation 25" in text and "running 2, waiting 1" in text
    assert "draft acceptance 40%" in text and "bubble fraction 25%" in text


def test_client_gone_before_a_non_streamed_answer_aborts_it(served):
    coord, engine, url = served
    coord.step_s = 0.05
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 60}, timeout=0.5)
    wait_for(lambda: coord.aborted and not engine.num_outstanding, timeout_s=5)
    assert len(coord.aborted) == 1 and engine.num_outstanding == 0


# -- request hardening, API key, fence (issue 16) ----------------------------------------------------
@pytest.fixture()
def guarded(tokenizer):
    """A server with --api-key and a small --max-request-bytes."""
    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=2, max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0, api_key="k3y", max_request_bytes=4096)
    http.start()
    port = http.server.servers[0].sockets[0].getsockname()[1]
    yield coord, engine, f"http://127.0.0.1:{port}"
    http.stop()


AUTH = {"Authorization": "Bearer k3y"}


def test_a_body_over_max_request_bytes_is_413(guarded):
    _, engine, url = guarded
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 5000}, headers=AUTH)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while streaming the body in
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH).status_code == 200
    assert engine.num_outstanding == 0


@pytest.mark.parametrize(("raw", "fragment"), [
    (b'{"prompt": "hi \\ud800", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "' + b"[" * 10 + b'", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}", "deeper than"),
    (b"[" * 100_000, "deeper than"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_ill_formed_bodies_are_400_with_an_openai_error(served, raw, fragment):
    _, _, url = served
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error" and error["param"] == "body"
    assert httpx.get(url + "/health").status_code == 200


def test_api_key_is_required_on_v1_routes_only(guarded):
    _, _, url = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": "bearer k3y"}).status_code == 200  # RFC 9110
    assert httpx.get(url + "/v1/models/tiny", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200


def test_one_model_card_by_id(served):
    """GET /v1/models/{id} (the openai client's models.retrieve); an unknown id is 404."""
    _, _, url = served
    card = httpx.get(url + "/v1/models/tiny").json()
    assert card == httpx.get(url + "/v1/models").json()["data"][0] and card["id"] == "tiny"
    r = httpx.get(url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_requests_complete_while_a_large_body_is_uploaded_and_parsed(served):
    coord, _, url = served
    release = threading.Event()
    outcome = {}

    def slow_body():  # a client uploading a large body slowly: the event loop must not wait for it
        yield b'{"prompt": "'
        release.wait(30)
        yield b"y" * 3_000_000 + b'", "max_tokens": 1}'

    def upload() -> None:
        outcome["big"] = httpx.post(url + "/v1/completions", content=slow_body(), timeout=60,
                                    headers={"Content-Type": "application/json"})

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        release.set()  # the body is complete: decoded in a worker thread, refused from its size untokenised
    finally:
        release.set()
        uploader.join(60)
    assert outcome["big"].status_code == 400 and "cannot fit max_model_len" in outcome["big"].json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_fenced_engine_refuses_at_once_and_fail_all_ends_streams_with_an_error_event(served):
    coord, engine, url = served
    coord.step_s = 0.05
    from launcher.serving.serving_engine import UnavailableError

    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 60, "stream": True},
                      timeout=10) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert "stage_busy_seconds" in httpx.get(url + "/metrics").text
        engine.fence("pipeline failed: stage 1 missed its heartbeats")
        assert engine.fail_all(UnavailableError("pipeline failed: stage 1 missed its heartbeats")) == 1
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and "stage 1" in json.loads(rest[-2])["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "heartbeats" in r.json()["error"]["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "heartbeats" in health.json()["error"]["message"]
    assert engine.wait_idle(5) and engine.num_outstanding == 0
    metrics = httpx.get(url + "/metrics")  # no per-stage scrape of a fenced pipeline: it could hang
    assert metrics.status_code == 200 and "stage_busy_seconds" not in metrics.text
    assert "generation_tokens_total" in metrics.text


def _gauge(text: str, name: str) -> float:
    return float(re.search(rf'^speedpipe:{name}{{model_name="tiny"}} (\S+)$', text, re.M).group(1))


def test_metrics_show_restarts_the_budget_left_a_recovery_and_a_fence(served):
    """An operator's alert needs to see a fail-over coming before the server fences: restarts so far,
    restarts left in the window, a recovery in progress, and whether requests are admitted."""
    from launcher.coordinator.stage_restarts import RestartBudget, RestartLedger

    coord, engine, url = served
    text = httpx.get(url + "/metrics").text
    assert _gauge(text, "stage_restarts_total") == 0 and "stage_restarts_left" not in text  # no fail-over
    assert _gauge(text, "stage_recovering") == 0 and _gauge(text, "accepting_requests") == 1
    ledger = RestartLedger(RestartBudget(max_restarts=3, window_s=600))
    ledger.record(time.monotonic())
    coord.failover, coord.num_restarts = SimpleNamespace(budget=ledger), 1
    coord.recovering = "restarting after a stage failure: stage 1 exited"
    text = httpx.get(url + "/metrics").text
    assert _gauge(text, "stage_restarts_total") == 1 and _gauge(text, "stage_restarts_left") == 2
    assert _gauge(text, "stage_recovering") == 1
    coord.recovering = None
    engine.fence("pipeline failed: stage restarts exhausted")
    assert _gauge(httpx.get(url + "/metrics").text, "accepting_requests") == 0


def test_same_port_for_http_and_grpc_is_exit_2_before_any_stage_starts(capsys, monkeypatch):
    import launcher.serving.serve

    def spawned(*args, **kwargs):
        raise AssertionError("a pipeline session was started")

    monkeypatch.setattr(launcher.serving.serve, "PipelineSession", spawned)
    port = str(free_tcp_port())
    assert main(["serve", "--port", port, "--grpc-port", port]) == 2
    err = capsys.readouterr().err
    assert "--grpc-port" in err and "Traceback" not in err
    for flag, value in (("--max-request-bytes", "10"), ("--shutdown-grace-s", "-1"),
                        ("--stage-heartbeat-timeout-s", "0"), ("--tls-cert", __file__), ("--tls-key", __file__)):
        assert main(["serve", flag, value]) == 2
        assert flag in capsys.readouterr().err
    assert main(["serve", "--tls-cert", __file__, "--tls-key", __file__]) == 2  # not PEM
    assert "not a PEM certificate" in capsys.readouterr().err


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_buffers_are_windows(tokenizer):
    from launcher.serving.serve import window_serving_buffers
    from pipeline.engine.engine import Engine
    from pipeline.engine.records import SchedulerConfig
    from pipeline.measure.timeline import StageTiming
    from pipeline.speculation.items import Item, ItemKind

    engine = Engine(SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=64))
    window_serving_buffers(SimpleNamespace(engine=engine), 100)
    item = Item(seq_id=0, slot=0, start=0, num_tokens=1, kind=ItemKind.DRAFT)
    for i in range(1, 5000):
        engine.commit_log.append((i, 0, 1))
        engine.timeline.record([StageTiming(0, 10 * i, 10 * i + 5), StageTiming(1, 10 * i + 5, 10 * i + 9)], [item],
                               1.0, draft_ready_ns=10 * i - 1)
    assert len(engine.commit_log) == 100 and len(engine.timeline.slices) == 100
    assert 0 < len(engine.timeline.draft_gaps_ns) <= 100
    assert engine.timeline.num_batches == 4999  # totals stay exact


def test_grpc_generate_needs_the_api_key_health_does_not_and_non_finite_logits_are_internal(tokenizer):
    import grpc

    from launcher.serving.grpc_generate import GrpcServer
    from proto import speedpipe_pb2_grpc as pb_grpc

    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    server = GrpcServer(engine, host="127.0.0.1", port=0, api_key="k3y")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            request = pb.GenerateRequest(prompt="Hi", max_new_tokens=3)
            for metadata, reason in ((None, "CREDENTIALS_MISSING"), ([("authorization", "Bearer wrong")],
                                                                    "CREDENTIALS_INVALID")):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(request, metadata=metadata, timeout=10))
                assert (info.value.code(), error_reason(info.value)) == (grpc.StatusCode.UNAUTHENTICATED, reason)
            replies = list(stub.Generate(request, metadata=[("authorization", "Bearer k3y")], timeout=10))
            assert sum(len(r.token_ids) for r in replies) == 3
            assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
            coord.error_at = 1  # [Note: non-finite logits]: that request alone fails, INTERNAL
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, metadata=[("authorization", "Bearer k3y")], timeout=10))
            assert info.value.code() == grpc.StatusCode.INTERNAL and "not finite" in info.value.details()
            assert error_reason(info.value) == "REQUEST_FAILED"
            assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
            coord.error_at = None
            engine.fence("draining: the server is shutting down")
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, metadata=[("authorization", "Bearer k3y")], timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
    finally:
        server.stop()


def test_n_choices_are_independent_requests_merged_in_one_response(served):
    coord, engine, url = served
    r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "n": 3, "seed": 9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and all(c["text"] == "abca" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 2
    r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "n": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert engine.num_outstanding == 0


def test_a_client_gone_mid_body_is_not_an_application_error(served, caplog):
    """A client that closes its connection before its body arrives is logged at debug level, not
    as an ASGI exception with a traceback (a flood of them would bury the real errors)."""
    _, _, url = served
    host, port = url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    assert httpx.get(url + "/health").status_code == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_grpc_request_params_check_the_http_ranges(tokenizer):
    """gRPC refuses what HTTP refuses (temperature above 2), and reads top_k / min_p."""
    from launcher.serving.grpc_generate import request_params

    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    for bad, param in (({"temperature": 5.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                       ({"top_k": -3}, "top_k"), ({"min_p": 1.5}, "min_p")):
        with pytest.raises(InvalidRequestError) as info:
            request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, **bad), engine)
        assert info.value.param == param, info.value
    _, params = request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, temperature=2.0, top_k=5,
                                                  min_p=0.25), engine)
    assert (params.temperature, params.top_k, params.min_p) == (2.0, 5, 0.25)


def test_a_request_with_non_finite_logits_fails_alone_with_500_and_the_server_stays_up(served):
    """[Note: non-finite logits] in pipeline/engine/records.py: that request gets a 500 (an error event
    mid-stream) naming the cause; /health stays 200 and the next request is served."""
    coord, engine, url = served
    coord.error_at = 3
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=10)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "internal_server_error" and error["code"] == 500
    assert "not finite (NaN or inf) at output token 3" in error["message"] and "--dtype" in error["message"]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    last = json.loads(events[-2])["error"]
    assert last["code"] == 500 and "not finite" in last["message"], events
    assert httpx.get(url + "/health").status_code == 200
    coord.error_at = None
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert engine.wait_idle(5) and engine.num_outstanding == 0


def test_a_prompt_too_big_to_fit_is_refused_before_it_is_tokenised(served, tokenizer, monkeypatch):
    """A body under --max-request-bytes whose prompt cannot fit max_model_len tokens, even at the
    longest token of the vocabulary, is a 400 found from its size: the server never tokenises it (a
    flood of such prompts once starved the heartbeat thread and got a healthy stage restarted)."""
    _, engine, url = served
    big = "hello " * (engine.max_model_len * tokenizer.max_token_bytes)  # 6x the bytes that could fit
    encoded = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or [1])
    for path, body, field in (("/v1/completions", {"prompt": big, "max_tokens": 2}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}],
                                                        "max_tokens": 2}, "messages")):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "bytes: it cannot fit max_model_len 64 tokens" in error["message"], error
    assert not any(n >= len(big) for n in encoded), "the oversized prompt was tokenised"
    with pytest.raises(ValueError, match="prompt is .* bytes: it cannot fit"):
        tokenizer.check_fits(big, engine.max_model_len)
    tokenizer.check_fits("hello " * 10, engine.max_model_len)  # small text: no error


def test_a_template_error_quoting_a_huge_value_is_cut(tokenizer, monkeypatch):
    """A template's own error (jinja's UndefinedError quotes the missing key: here a 20,000-character
    role looked up in a role map) is cut as raise_exception's is; it was echoed whole."""
    monkeypatch.setattr(tokenizer, "chat_template", "{% set p = {'user': 'U: '} %}"
                        "{% for m in messages %}{{ p[m['role']] + m['content'] }}{% endfor %}")
    with pytest.raises(InvalidRequestError) as info:
        render_chat([{"role": "r" * 20_000, "content": "Hi"}], tokenizer=tokenizer)
    message = str(info.value)
    assert message.startswith("the chat template cannot render this request (UndefinedError: 'dict object' "
                              "has no attribute 'rrr") and message.endswith("… (20033 characters))"), message
    assert len(message) < 400 and info.value.param == "messages"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_uvicorn_still_logs_where_it_serves(tokenizer, host):
    """uvicorn logs "Uvicorn running on ..." only for a socket it binds itself; HttpServer binds its own,
    so it logs that line (at uvicorn's info level) as uvicorn did. It was gone."""
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    http = HttpServer(engine, host=host, port=0, log_level="info")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("uvicorn.error").addHandler(handler)  # after uvicorn.Config configured its loggers
    try:
        http.start()
        port = http.server.servers[0].sockets[0].getsockname()[1]
        where = f"[{host}]" if ":" in host else host
        assert f"Uvicorn running on http://{where}:{port} (Press CTRL+C to quit)" in lines, lines
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        http.stop()

def test_a_taken_ipv6_port_is_named_with_brackets(tokenizer):
    """A taken port on an IPv6 --host was named ':::8000' / '::1:8000'; now '[::1]:8000', as clients
    write it (the HTTP server, the gRPC server and serve's check before start-up)."""
    from launcher.serving.grpc_generate import GrpcServer
    from launcher.serving.serve import ServeOptions

    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=re.escape(f"cannot listen on [::1]:{port} (Address already in use)")):
            HttpServer(engine, host="::1", port=port).start()
        with pytest.raises(RuntimeError, match=re.escape(f"cannot listen for gRPC on [::1]:{port} (")):
            GrpcServer(engine, host="::1", port=port)
        with pytest.raises(ValueError, match=re.escape(f"--port {port}: cannot listen on [::1]:{port} (")):
            ServeOptions(host="::1", port=port, grpc_port=-1).check_ports()

def test_a_second_grpc_server_cannot_share_the_port(tokenizer):
    """grpc turns SO_REUSEPORT on by default: two servers started at once both listened on one
    --grpc-port and split its calls between them. The second must fail to bind."""
    from launcher.serving.grpc_generate import GrpcServer

    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    first = GrpcServer(engine, host="127.0.0.1", port=0)
    first.start()
    try:
        with pytest.raises(RuntimeError, match=f"cannot listen for gRPC on 127.0.0.1:{first.port}"):
            GrpcServer(engine, host="127.0.0.1", port=first.port)
    finally:
        first.stop()


def test_a_scrape_skips_the_per_stage_counters_while_a_stage_is_silent(served, monkeypatch):
    """A hung stage made every /metrics scrape wait 10 s on its GetStats (and hold a worker thread
    that /health needs): with the heartbeat saying a stage is silent, a scrape does not ask."""
    coord, engine, url = served
    asked = []
    monkeypatch.setattr(coord, "stage_stats", lambda timeout_s=10.0: asked.append(timeout_s) or [])
    httpx.get(url + "/metrics", timeout=10)
    assert asked == [2.0]  # healthy (no heartbeat here): asked, with the scrape's short deadline
    silent = type("Silent", (), {"healthy": lambda self: (False, "stage 1 has not answered its heartbeat")})()
    monkeypatch.setattr(engine, "heartbeat", silent)
    metrics = httpx.get(url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "generation_tokens_total" in metrics.text and asked == [2.0]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ["a", ""]}, "stop", "must not be empty"),
    ({"seed": 2**63}, "seed", "[0, 2**63)"),
    ({"request_id": "r" * 257}, "request_id", "at most 256"),
])
def test_grpc_refuses_what_http_refuses(tokenizer, fields, param, message):
    """gRPC accepted 10 stop strings, empty ones and seeds from 2**63, which HTTP refuses, and
    megabyte request ids (logged and echoed in every response)."""
    from launcher.serving.grpc_generate import request_params

    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, **fields), engine)
    assert info.value.param == param
    assert request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, stop=["a"] * 4, seed=2**63 - 1,
                                             request_id="r" * 256), engine)[1].seed == 2**63 - 1


@pytest.mark.parametrize("taken", ["--port", "--grpc-port"])
def test_a_port_taken_while_the_model_loaded_is_one_value_error_naming_the_flag(tokenizer, taken, tmp_path, capfd):
    """The ports are checked before the stages start; one taken after that (while a model loads for
    minutes) used to end `serve` with a traceback and exit 1: now a ValueError naming the flag (exit 2).
    Its one line says why (before: uvicorn's SystemExit lost "Address already in use"), and nothing else
    reaches stderr (before: uvicorn's "ERROR: [Errno 98] ..." or grpc's "E... add_port.cc ..." line too);
    no listening socket of the front ends is left."""
    import types

    import psutil

    from launcher.serving.serve import ServeOptions, ServingStack

    coord = FakeCoordinator(tokenizer)
    coord.stubs, coord.recovery_listeners = [], []
    coord.engine = types.SimpleNamespace(window_buffers=lambda n: None)
    session = types.SimpleNamespace(coordinator=coord, options=RunConfig(max_num_seqs=2, max_model_len=64),
                                    model=types.SimpleNamespace(model_dir=tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"port": port, "grpc_port": -1} if taken == "--port" else {"port": 0, "grpc_port": port}
        options = ServeOptions(model_name="tiny", stats_interval_s=0, **ports)
        before = {c.laddr for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN}
        with pytest.raises(ValueError) as info:
            with ServingStack(session, options):
                pass
        after = {c.laddr for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN}
    what = "listen" if taken == "--port" else "listen for gRPC"
    assert str(info.value) == (f"{taken} {port}: cannot {what} on 127.0.0.1:{port} (Address already in use): it "
                               "was free at start-up, so something took it while the model loaded")
    assert capfd.readouterr().err == ""
    assert after == before


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_an_integer_too_big_for_a_float_is_400_naming_the_field(served, field):
    """10**400 is a valid JSON integer that no float holds: once an OverflowError, a 500 (found by
    tests/unit/test_http_fuzz.py)."""
    _, _, url = served
    raw = b'{"prompt": "Hi", "max_tokens": 2, "%s": 1%s}' % (field.encode(), b"0" * 400)
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "must be in" in r.json()["error"]["message"]


def test_an_integer_past_pythons_digit_limit_is_400_without_naming_a_server_setting(served):
    """int("1" * 5000) is refused by Python (sys.get_int_max_str_digits(), 4300): once answered with its
    message, "...use sys.set_int_max_str_digits() to increase the limit", a server setting."""
    _, _, url = served
    raw = b'{"prompt": "Hi", "max_tokens": 1%s}' % (b"0" * 5000)
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body" and error["message"] == "request body holds an integer of more than 4300 digits"


def _vllm_not_found(name: str) -> str:
    """vLLM's 404 message for `name`: `_check_model`'s f-string through `create_error_response`'s sanitize_message
    (vllm/entrypoints/openai/engine/serving.py, vllm/entrypoints/utils.py)."""
    return re.sub(r" at 0x[0-9a-f]+>", ">", f"The model `{name}` does not exist.")


def _not_found_answers(url: str, name: str) -> list[httpx.Response]:
    """An unknown model `name` asked of every route that reads one (GET /v1/models/{id} but for a name with a line
    feed, a path Starlette's router matches no route for: its plain 404)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": name}
    answers = [httpx.post(url + "/v1/completions", json={"prompt": "Hi", "model": name}),
               httpx.post(url + "/v1/chat/completions", json=chat),
               httpx.post(url + "/tokenize", json={"prompt": "Hi", "model": name}),
               httpx.post(url + "/detokenize", json={"tokens": [1], "model": name})]
    if "\n" not in name:
        answers.append(httpx.get(url + "/v1/models/" + quote(name, safe="")))
    return answers


def test_an_unknown_model_name_is_echoed_raw_as_vllm(served):
    """vLLM echoes the name as sent; it was echoed as repr escapes it (the quote and the backslash doubled, a
    zero-width space spelled out): the message differed from vLLM's for such a name. An object address in it
    (" at 0x7f3a>") is dropped as vLLM's sanitize_message drops it from every error message (it was kept)."""
    _, _, url = served
    for name in ("it's \"ü\" 模型 \\ \u200b", "other", "<obj at 0x7f3a> at 0xbeef>!"):
        for r in _not_found_answers(url, name):
            assert r.status_code == 404 and r.json()["error"]["message"] == _vllm_not_found(name), r.request.url


def test_an_unknown_model_name_with_a_line_break_stays_one_line(served):
    """The one exception to vLLM's raw echo: a line-breaking character is escaped as repr escapes it, so the error
    message stays one line (found by tests/unit/test_http_fuzz.py)."""
    _, _, url = served
    for name, shown_as in (("two\nlines", "two\\nlines"), ("a\rb", "a\\rb"), ("é\u2028'", "é\\u2028'")):
        for r in _not_found_answers(url, name):
            assert r.status_code == 404 and r.json()["error"]["message"] == _vllm_not_found(shown_as), r.request.url


def test_shown_cuts_a_long_value_and_keeps_a_short_one_as_repr():
    assert [shown(v) for v in ("hot", 3, -1.5, None, [1, "a"], {"type": "json_object"})] == [
        "'hot'", "3", "-1.5", "None", "[1, 'a']", "{'type': 'json_object'}"]
    assert shown("x" * 20_000) == "'" + "x" * 79 + "… (20000 characters)"
    assert shown(list(range(5000))) == repr(list(range(5000)))[:80] + "… (5000 items)"
    assert shown(10**500) == "1" + "0" * 79 + "… (501 characters)"


LONG = "x" * 20_000


@pytest.mark.parametrize(("route", "body", "param", "start"), [
    ("/v1/completions", {"temperature": LONG}, "temperature", "'temperature' must be a number, got 'xxx"),
    ("/v1/completions", {"max_tokens": [7] * 5000}, "max_tokens", "'max_tokens' must be an integer, got [7, 7"),
    ("/v1/completions", {"max_tokens": -(10**1000)}, "max_tokens", "'max_tokens' must be >= 1, got -1000"),
    ("/v1/completions", {"top_p": 10**1000}, "top_p", "'top_p' must be in (0, 1], got 1000"),
    ("/v1/completions", {"stream": LONG}, "stream", "'stream' must be true or false, got 'xxx"),
    ("/v1/completions", {"functions": [{"type": "function"}] * 3000}, "functions", "'functions' = [{'type'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": LONG}, "tools",
     "'tools' must be a list of function tools, got 'xxx"),
    ("/v1/completions", {"response_format": {"type": LONG}}, "response_format.type",
     "'response_format.type' must be one of text, json_object, json_schema, structural_tag, got 'xxx"),
    ("/v1/completions", {"prompt": [10**1000]}, "prompt", "'prompt' token id 1000"),
    ("/v1/completions", {"prompt": "\ud800" * 5000}, "body", "request body has a string that is not valid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": LONG}, "logprobs",
     "'logprobs' must be true or false, got 'xxx"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": LONG}, "add_special_tokens", "'add_special_tokens' must"),
    ("/detokenize", {"tokens": [LONG]}, "tokens", "'tokens[0]' = 'xxx"),
])
def test_an_error_echoing_a_huge_value_shows_its_start_and_size(served, route, body, param, start):
    """A message that echoes the client's value was as long as the value (20,000 characters and more);
    it now shows the value's first SHOWN_CHARS characters, "…" and its size."""
    _, _, url = served
    body = {"prompt": "Hi", **body} if route == "/v1/completions" else body
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    r = httpx.post(url + route, content=raw, headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(start) and "… (" in error["message"] and len(error["message"]) < 250, error


def test_a_huge_unknown_model_id_is_cut_in_the_404(served):
    _, _, url = served
    for r in (httpx.get(url + "/v1/models/" + "m" * 5000),
              httpx.post(url + "/v1/completions", json={"prompt": "Hi", "model": "m" * 5000})):
        message = r.json()["error"]["message"]
        assert r.status_code == 404 and message == "The model `" + "m" * 80 + "… (5000 characters)` does not exist."


@pytest.mark.parametrize("value", [1, 0, "true", "", {}, [], [True]])
def test_include_usage_must_be_a_boolean(served, tokenizer, value):
    """OpenAI and vLLM take stream_options.include_usage as a boolean only; any JSON value was read as
    truthy or falsy. null is the default (false)."""
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": value}}
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(body, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == "stream_options.include_usage"
    _, _, url = served
    for route, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "Hi"}]})):
        r = httpx.post(url + route, json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"'stream_options.include_usage' must be true or false, got {value!r}",
            "type": "invalid_request_error", "param": "stream_options.include_usage", "code": 400}
    body["stream_options"]["include_usage"] = None
    assert parse_completion(body, tokenizer=tokenizer, model_name="tiny").include_usage is False


def test_a_setting_sampling_params_refuses_names_the_request_field(served, monkeypatch):
    """A SamplingParamError (a setting the API's checks let through: here logprobs up to 30 allowed by
    a raised API limit) was a bare ValueError, answered with `param: null`; it now names the field."""
    _, _, url = served
    monkeypatch.setattr(openai_protocol, "MAX_LOGPROBS", 30)  # SamplingParams still allows 20
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 25})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert r.json()["error"]["message"] == "'logprobs' must be None or an integer in [0, 20], got 25"


@pytest.mark.parametrize(("route", "body", "refused", "field"), [
    ("/v1/completions", {"max_tokens": 5}, "max_new_tokens", "max_tokens"),
    ("/v1/completions", {}, "max_new_tokens", "max_tokens"),  # the default budget
    ("/v1/chat/completions", {"max_completion_tokens": 5}, "max_new_tokens", "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 5}, "max_new_tokens", "max_tokens"),
    ("/v1/completions", {"prompt_logprobs": 2}, "prompt_logprobs", "prompt_logprobs"),  # vLLM's own field
    ("/v1/chat/completions", {"top_p": 0.5}, "top_p", "top_p"),
])
def test_sampling_params_names_map_to_the_request_fields(served, monkeypatch, route, body, refused, field):
    def refuse(**kw):
        raise SamplingParamError(refused, f"{refused} must be refused in this test, got {kw.get(refused)}")

    monkeypatch.setattr(openai_protocol, "SamplingParams", refuse)
    _, _, url = served
    body = {**body, "messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {**body, "prompt": "Hi"}
    error = httpx.post(url + route, json=body).json()["error"]
    assert error["param"] == field and error["message"].startswith(f"'{field}' must be refused in this test"), error


def test_a_too_long_budget_names_max_completion_tokens_when_the_request_used_it(served):
    """check_prompt's error named 'max_tokens' (its default) also for a chat request that set
    max_completion_tokens."""
    _, _, url = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_completion_tokens": 1000})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_completion_tokens", error
    assert "'max_completion_tokens' (1000)" in error["message"]


def test_a_body_still_arriving_after_the_read_timeout_is_408_and_frees_the_connection(guarded, monkeypatch):
    """A client that sends its headers and then trickles (or stops sending) its body gets 408 once
    BODY_READ_TIMEOUT_S has passed, instead of holding the connection and a request slot for ever."""
    monkeypatch.setattr(http_errors, "BODY_READ_TIMEOUT_S", 0.5)
    _, engine, url = guarded
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(4096)  # the socket's 10 s timeout fails the test if no answer comes
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert "did not arrive within 0.5 s" in json.loads(body)["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH).status_code == 200
    assert engine.num_outstanding == 0
