"""The HTTP front end, request validation and the load tester, over a fake coordinator (no model run).

The fake coordinator commits tokens from a thread through the real RequestHandle, so the serving
engine, the SSE encoding, admission limits, /health and the bench client run for real on loopback;
only the pipeline is replaced. The real-model end-to-end checks are in
tests/integration/test_serving.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from launcher.cli import main
from launcher.coordinator import PipelineError, RequestHandle
from launcher.openai_protocol import parse_chat, parse_completion, render_chat
from launcher.server import HttpServer
from launcher.serving_engine import InvalidRequestError, ServingEngine
from pipeline.sampling import SamplingParams
from pipeline.scheduler_types import Commit, FinishReason, SpecCounters
from pipeline.timeline import Timeline
from pipeline.tokenizer import Tokenizer
from proto import speedpipe_pb2 as pb
from tests.tiny_model import write_tiny_model

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
        self.stage_status = [pb.HealthResponse.SERVING] * 2
        self.scheduler = SimpleNamespace(spec=SpecCounters())
        self.timeline = Timeline(2)
        self.aborted: list[str] = []
        self._n = 0

    def submit(self, prompt, params: SamplingParams, *, request_id=None) -> RequestHandle:
        if self.failure is not None:  # as the real one
            raise self.failure
        ids = list(prompt)
        handle = RequestHandle(request_id, self.tokenizer.decode(ids), ids, params,
                               self.tokenizer.detokenizer(prompt_ids=ids))
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        return handle

    def _run(self, h: RequestHandle) -> None:
        for i in range(h.params.max_new_tokens):
            time.sleep(self.step_s)
            if h.finish_reason is not None:
                return
            last = i == h.params.max_new_tokens - 1
            if h._emit(Commit(0, (h.prompt_ids[i % len(h.prompt_ids)],), FinishReason.LENGTH if last else None), ()):
                return

    def abort(self, handle: RequestHandle) -> None:
        self.aborted.append(handle.request_id)
        handle._finish("aborted")

    def health(self):
        return [pb.HealthResponse(status=s) for s in self.stage_status]

    def stage_stats(self):
        return [pb.StageStats(wall_ns=10**9, busy_ns=4 * 10**8, kv_slots_in_use=0) for _ in range(2)]


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
    deadline = time.monotonic() + 5
    while (len(coord.aborted) < 3 or engine.num_outstanding) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(coord.aborted) == 3 and engine.num_outstanding == 0
    assert 'speedpipe:request_rejected_total{model_name="tiny",reason="queue_full"} 1.0' in httpx.get(url + "/metrics").text


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "3"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 2}, "top_p"),
    ({"seed": -3}, "seed"), ({"stop": 5}, "stop"), ({"model": "other"}, "model"), ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"n": 2}, "n"), ({"stream": "yes"}, "stream"),
    ({"logprobs": 2}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
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


@pytest.mark.parametrize(("text", "stop", "want"), [
    ("abcXYZdef", ("XYZ",), "abc"), ("abXYqXYZ", ("XYZ",), "abXYq"), ("abXYq", ("XYZ",), "abXYq"),
    ("hello world", ("o w", "ld"), "hell"), ("aXb", ("X",), "a"), ("Xab", ("X",), ""),
])
def test_stop_string_text_is_never_streamed(tokenizer, text, stop, want):
    """The coordinator's RequestHandle holds back text that may start a stop string (tiny byte
    tokenizer: one token per character)."""
    ids = tokenizer.encode(text)
    params = SamplingParams(max_new_tokens=len(ids), stop=stop)
    h = RequestHandle("r", "p", [1], params, tokenizer.detokenizer(prompt_ids=[1]))
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if h._emit(Commit(0, (t,), FinishReason.LENGTH if last else None), stop):
            break
    chunks = list(h)
    assert "".join(c.text for c in chunks) == want == h.result(1).text
    assert h.finish_reason == ("stop" if want != text else "length")


def test_stats_log_line(tokenizer):
    from launcher.metrics import StatsLogger

    coord = FakeCoordinator(tokenizer)
    engine = ServingEngine(coord, model_name="tiny", max_num_seqs=2, max_queue=4, max_model_len=64)
    logger = StatsLogger(coord, engine.metrics, engine, interval_s=1.0)
    _, snap = logger.line({})
    engine.metrics.add_generation_tokens(50)
    coord.scheduler.spec.verified_drafts, coord.scheduler.spec.accepted_tokens = 10, 4
    engine._outstanding = 3  # 2 running + 1 waiting
    walls = iter([(3 * 10**9, 10**9), (3 * 10**9, 2 * 10**9)])  # idle 1/2 and 0 of the 2 s interval
    coord.stage_stats = lambda: [pb.StageStats(wall_ns=w, busy_ns=b) for w, b in walls]
    snap["stages"] = [(10**9, 0), (10**9, 0)]
    snap["t"] -= 2.0
    text, _ = logger.line(snap)
    assert "generation 25" in text and "running 2, waiting 1" in text
    assert "draft acceptance 40%" in text and "bubble fraction 25%" in text


def test_client_gone_before_a_non_streamed_answer_aborts_it(served):
    coord, engine, url = served
    coord.step_s = 0.05
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 60}, timeout=0.5)
    deadline = time.monotonic() + 5
    while (not coord.aborted or engine.num_outstanding) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(coord.aborted) == 1 and engine.num_outstanding == 0
