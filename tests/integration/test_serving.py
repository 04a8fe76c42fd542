"""`speedpipe serve` on the real default model, driven by the official `openai` client over loopback.

One 2-stage server (HTTP + gRPC on free ports) for the module. Checks: completions and chat,
streaming and not; 16 concurrent streaming greedy requests give exactly the tokens `launch` gives
for the same prompts (the offline reference runs through `run_launch`, launch's code path, on the
same pipeline); the chat prompt equals transformers' `apply_chat_template`; a client that closes
its stream mid-generation frees the KV slot on every stage and a later request is unaffected; bad
input → 400 naming the field (server keeps serving); a full queue → 429; gRPC Generate streams the
same tokens and answers INVALID_ARGUMENT; /metrics carries the vLLM-style names.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import pytest

from launcher.cli.launch import run_launch
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.serve import ServeOptions, ServingStack
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.registry import DEFAULT_MODEL
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.conftest import wait_for

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NUM_TOKENS = 6
MAX_NUM_SEQS = 8
MAX_QUEUE = 8
MAX_MODEL_LEN = 256
WORDS = ("river", "castle", "robot", "garden", "winter", "music", "ocean", "market")
PROMPTS = tuple(f"A short story about a {w}{' and a ' + WORDS[(i + 3) % 8] if i >= 8 else ''}:"
                for i, w in enumerate(WORDS * 2))
CHAT = [{"role": "user", "content": "Name three colors."}]
SEEDED = SamplingParams(max_new_tokens=NUM_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def server(smollm2_conversion, smollm2_cache):
    """(stack, offline token ids per prompt from run_launch) for a 2-stage pipeline."""
    options = PipelineOptions(num_stages=2, model=DEFAULT_MODEL, cache_dir=str(smollm2_cache), progress=False,
                              max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, stage_timeout_s=60)
    with PipelineSession(options, resolve(options)) as session:
        params = [SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True)] * len(PROMPTS)
        offline = {o["prompt"]: o["token_ids"] for o in run_launch(session, PROMPTS, params)["outputs"]}
        sampled = run_launch(session, [PROMPTS[5]], [SEEDED])["outputs"][0]["token_ids"]
        offline[("seeded", PROMPTS[5])] = sampled
        serve = ServeOptions(host="127.0.0.1", port=0, grpc_port=0, max_queue=MAX_QUEUE, stats_interval_s=0)
        with ServingStack(session, serve) as stack:
            yield stack, offline


@pytest.fixture(scope="module")
def client(server):
    stack, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def base_url(stack) -> str:
    return f"http://127.0.0.1:{stack.http_port}"


def kv_slots(stack) -> list[int]:
    return [st.kv_slots_in_use for st in stack.session.coordinator.stage_stats()]


def pipeline_idle(stack) -> bool:
    """True once nothing can take a KV slot any more: no request outstanding, the engine has no
    micro-batch in flight and no sequence left to release, and every stage's slots are free.

    [Note: a free slot read too early] Reading only the stages' slot counts races with in-flight
    work: an aborted request's FORWARD may still sit in stage 0's queue (0 slots read), run a moment
    later (1 slot) and only then meet the RELEASE queued behind it. The engine's counts are read
    first: with none in flight, every FORWARD sent has run on every stage, so a 0 read after them
    stays 0."""
    coordinator = stack.session.coordinator
    return (coordinator.sync(5.0) and not stack.engine.num_outstanding and not coordinator.engine.num_inflight
            and not coordinator.engine.num_sequences and not any(kv_slots(stack)))


def wait_slots_free(stack, timeout_s: float = 10.0) -> list[int]:
    """The stages' KV slots in use once the pipeline is idle ([Note: a free slot read too early]), or
    as they are when `timeout_s` ran out."""
    wait_for(lambda: pipeline_idle(stack), timeout_s=timeout_s)
    return kv_slots(stack)


def wait_outstanding_zero(stack, timeout_s: float = 10.0) -> int:
    wait_for(lambda: not stack.engine.num_outstanding, timeout_s=timeout_s)
    return stack.engine.num_outstanding


def test_completion_not_streamed(server, client):
    stack, offline = server
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=NUM_TOKENS, **GREEDY)
    assert r.choices[0].token_ids == offline[PROMPTS[0]]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == NUM_TOKENS
    assert r.usage.prompt_tokens == len(stack.engine.tokenizer.encode(PROMPTS[0]))
    assert r.choices[0].text == stack.engine.tokenizer.decode(offline[PROMPTS[0]])


def test_16_concurrent_streams_match_offline_launch(server, client):
    _, offline = server

    def stream(prompt: str) -> tuple[list[int], str, object]:
        ids, text, usage = [], [], None
        for chunk in client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=NUM_TOKENS,
                                               stream=True, stream_options={"include_usage": True}, **GREEDY):
            for c in chunk.choices:
                ids += c.token_ids
                text.append(c.text)
            usage = chunk.usage or usage
        return ids, "".join(text), usage

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(stream, PROMPTS))
    for prompt, (ids, _, usage) in zip(PROMPTS, results, strict=True):
        assert ids == offline[prompt], prompt
        assert usage.completion_tokens == NUM_TOKENS


def test_seeded_sampling_and_stop_strings(server, client):
    stack, offline = server
    for _ in range(2):  # the same seed gives the same tokens as launch, every time
        r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[5], max_tokens=NUM_TOKENS,
                                      temperature=SEEDED.temperature, top_p=SEEDED.top_p, seed=SEEDED.seed,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].token_ids == offline[("seeded", PROMPTS[5])]
    tok = stack.engine.tokenizer
    full = tok.decode(offline[PROMPTS[4]])
    stop = tok.decode(offline[PROMPTS[4]][3:5])
    assert stop.strip(), "pick tokens with visible text"
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[4], max_tokens=NUM_TOKENS, stop=[stop],
                                  **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.find(stop)]


def test_chat_template_matches_transformers(server):
    transformers = pytest.importorskip("transformers")
    from launcher.serving.openai_protocol import render_chat

    stack, _ = server
    tok = transformers.AutoTokenizer.from_pretrained(stack.session.model.model_dir)
    messages = [{"role": "system", "content": "Be brief."}, *CHAT]
    for m in (CHAT, messages):
        want = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        assert render_chat(m, tokenizer=stack.engine.tokenizer) == want
        want = tok.apply_chat_template(m, add_generation_prompt=False, tokenize=False)
        assert render_chat(m, tokenizer=stack.engine.tokenizer, add_generation_prompt=False) == want
    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    want = tok.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert render_chat(prefill, tokenizer=stack.engine.tokenizer, continue_final_message=True) == want
    assert want.endswith("The answer is")


def test_chat_streamed_and_not(server, client):
    stack, _ = server
    full = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=NUM_TOKENS, **GREEDY)
    parts, ids, roles = [], [], []
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=NUM_TOKENS,
                                                stream=True, **GREEDY):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            roles.append(c.delta.role)
            ids += getattr(c, "token_ids", None) or []
    assert full.choices[0].message.role == "assistant"
    assert roles[0] == "assistant"
    assert "".join(parts) == full.choices[0].message.content
    assert ids == full.choices[0].token_ids
    assert len(ids) == NUM_TOKENS
    # the chat prompt is the rendered template: the same tokens as a completion of that text
    from launcher.serving.openai_protocol import render_chat

    prompt = render_chat(CHAT, tokenizer=stack.engine.tokenizer)
    plain = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=NUM_TOKENS, **GREEDY)
    assert plain.choices[0].token_ids == ids
    assert full.usage.prompt_tokens == plain.usage.prompt_tokens


def test_cancel_mid_stream_frees_slot_and_later_request_is_unaffected(server, client):
    stack, offline = server
    assert wait_slots_free(stack) == [0, 0]
    long = MAX_MODEL_LEN - 32
    stream = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=long, stream=True,
                                       **GREEDY)
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].token_ids) if chunk.choices else 0
        if got >= 2:
            break
    assert kv_slots(stack) == [1, 1]  # it holds a slot on every stage while it runs
    stream.close()  # the client goes away mid-stream
    # freed because the request was aborted (the counter below says "abort", not "length"), well
    # before its ~220 tokens could have run out: no timing assertion (the machine may be loaded)
    assert wait_slots_free(stack) == [0, 0]
    assert wait_outstanding_zero(stack) == 0
    metrics = httpx.get(base_url(stack) + "/metrics").text
    assert 'speedpipe:request_success_total{finished_reason="abort",model_name="smollm2-135m"} 1.0' in metrics
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=NUM_TOKENS, **GREEDY)
    assert r.choices[0].token_ids == offline[PROMPTS[2]]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"model": 5}, "model"),  # a model that is not a string (another model's name is vLLM's 404: below)
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_bad_input_is_400_naming_the_field(server, client, kwargs, param):
    args = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert param.split("_")[0] in str(info.value.message)
    assert httpx.get(base_url(server[0]) + "/health").status_code == 200  # still serving


def test_a_model_this_server_does_not_serve_is_vllms_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    assert info.value.status_code == 404 and info.value.param == "model"
    assert info.value.body["message"] == "The model `no-such-model` does not exist."
    assert httpx.get(base_url(server[0]) + "/health").status_code == 200  # still serving


def test_malformed_json_and_bad_chat_are_400(server, client):
    stack, _ = server
    r = httpx.post(base_url(stack) + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": 3}])
    assert info.value.param == "messages[0].content"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2-135m", messages=[])
    assert info.value.param == "messages"
    ok = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1, temperature=0)
    assert ok.usage.completion_tokens == 1


def test_full_queue_is_429(server, client):
    stack, _ = server
    assert wait_slots_free(stack) == [0, 0]
    body = {"model": "smollm2-135m", "prompt": "Count: 1, 2, 3,", "max_tokens": 64, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
        held = []
        try:
            for _ in range(MAX_NUM_SEQS + MAX_QUEUE):  # each returns once the server accepted it
                held.append(http.send(http.build_request("POST", base_url(stack) + "/v1/completions", json=body),
                                      stream=True))
            assert all(r.status_code == 200 for r in held)
            assert stack.engine.num_waiting == MAX_QUEUE
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1)
            assert info.value.status_code == 429
            channel = grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}")
            with pytest.raises(grpc.RpcError) as rpc:
                list(pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=1)))
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            channel.close()
        finally:
            for r in held:
                r.close()
    # a queued request notices its closed stream only once it streams its first token, so the 8 that
    # were waiting run briefly before their abort: a generous bound, still a leak check
    assert wait_for(lambda: pipeline_idle(stack), timeout_s=60.0), \
        f"requests or KV slots left after the streams closed: {stack.engine.num_outstanding}, {kv_slots(stack)}"
    assert kv_slots(stack) == [0, 0] and stack.engine.num_outstanding == 0
    r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


def test_grpc_generate_streams_the_same_tokens(server):
    stack, offline = server
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING
        chunks = list(stub.Generate(pb.GenerateRequest(prompt=PROMPTS[3], max_new_tokens=NUM_TOKENS, ignore_eos=True)))
        assert [t for c in chunks for t in c.token_ids] == offline[PROMPTS[3]]
        assert chunks[-1].finish_reason == pb.GenerateResponse.LENGTH
        assert chunks[-1].usage.completion_tokens == NUM_TOKENS
        for req, field in ((pb.GenerateRequest(prompt="Hi", max_new_tokens=0), "max_new_tokens"),
                           (pb.GenerateRequest(prompt="Hi", max_new_tokens=2, top_p=1.5), "top_p"),
                           (pb.GenerateRequest(max_new_tokens=2), "prompt")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details()


def test_grpc_cancel_frees_the_slot(server):
    stack, _ = server
    assert wait_slots_free(stack) == [0, 0]
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        call = pb_grpc.GenerateServiceStub(channel).Generate(
            pb.GenerateRequest(prompt=PROMPTS[6], max_new_tokens=MAX_MODEL_LEN - 32, ignore_eos=True))
        assert next(call).token_ids and next(call).token_ids
        assert kv_slots(stack) == [1, 1]
        call.cancel()
        assert wait_slots_free(stack, timeout_s=5) == [0, 0]
    assert wait_outstanding_zero(stack) == 0


def test_models_health_and_metrics(server):
    stack, _ = server
    url = base_url(stack)
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    assert httpx.get(url + "/health").status_code == 200
    text = httpx.get(url + "/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "generation_tokens_total", "prompt_tokens_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "squashed_items_total", "request_rejected_total"):
        assert f"speedpipe:{name}" in text, name
    for kind in ("busy", "useful", "wasted", "idle"):
        assert f'speedpipe:stage_{kind}_seconds_total{{stage="1"}}' in text
    generated = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("speedpipe:generation_tokens_total"))
    assert generated >= NUM_TOKENS * len(PROMPTS)


def test_logprobs_echo_and_penalties_match_transformers_on_the_default_model(server, client):
    """Greedy float32 logprobs (with echo) and a frequency penalty against transformers' own logits
    (the full checks per option run on the tiny model: tests/distributed/test_openai_features_tiny.py)."""
    transformers = pytest.importorskip("transformers")
    import torch

    stack, _ = server
    hf = transformers.AutoModelForCausalLM.from_pretrained(stack.session.model.model_dir, dtype=torch.float32).eval()
    ids = stack.engine.tokenizer.encode(PROMPTS[1])
    out, want = [], []
    for _ in range(NUM_TOKENS):  # greedy with frequency_penalty 1.0: logits[t] -= count of t in the output
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0].float()
        if not out:
            prompt_logp = torch.log_softmax(logits[:-1], dim=-1)
        penalised = logits[-1] - torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[-1])
        out.append(int(torch.argmax(penalised)))
        want.append(float(torch.log_softmax(logits[-1], dim=-1)[out[-1]]))
    r = client.completions.create(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=NUM_TOKENS, temperature=0,
                                  logprobs=2, echo=True, frequency_penalty=1.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.token_ids == out and choice.text.startswith(PROMPTS[1])
    n = len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:n] == pytest.approx(
        [float(prompt_logp[j - 1][ids[j]]) for j in range(1, n)], abs=1e-4)
    assert choice.logprobs.token_logprobs[n:] == pytest.approx(want, abs=1e-4)
