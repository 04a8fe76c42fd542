"""vLLM's `prompt_logprobs` over HTTP against transformers, on 1 stage and on 2 stages with speculation on.

One server (real stage processes, gloo on loopback) on the tiny random model (float32) per layout: 1 stage (no
speculation: SPEED needs 2) and 2 stages with `speed` (n-gram drafts), so prompt logprobs must not depend on the
stage split or on speculation. Every check compares with a reference computed here from transformers' logits of the prompt:
each prompt token's logprob, its rank (vLLM v1's: how many vocabulary entries are at least as likely) and the k
most likely alternatives with ranks 1..k, as vLLM's JSON writes them (per choice on /v1/completions, at the top
level on /v1/chat/completions, null for the first token), for text and token-id prompts, n = 2, with and without
`echo` + `logprobs` (which must agree with them), gRPC's GenerateRequest.prompt_logprobs, and the refusal of k > 0
on a stream.
What breaks when these fail: a rank off by one or of the wrong row, prompt rows lost or shifted, alternatives
that are not the top k, a layout or speculation mode that changes the prompt's numbers.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import torch

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.openai_protocol import render_chat
from launcher.serving.serve import ServeOptions, ServingStack
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests import vllm_token_strings as vllm
from tests.distributed.test_openai_features_tiny import write_chat_model

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PROMPT = "The cat sat on the mat, and the dog sat on the log."
CHAT = [{"role": "user", "content": "Say something about cats."}]
TOL = 1e-4
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("tiny-prompt-logprobs"))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[(1, "none"), (2, "speed")], ids=lambda p: f"{p[0]}-stage-{p[1]}")
def server(request, tiny_dir):
    num_stages, speculate = request.param
    options = PipelineOptions(num_stages=num_stages, model=str(tiny_dir), progress=False, max_num_seqs=4,
                              max_model_len=128, stage_timeout_s=60, speculate=speculate, predictor="ngram",
                              min_acceptance=0.0)
    with PipelineSession(options, resolve(options)) as session:
        with ServingStack(session, ServeOptions(host="127.0.0.1", port=0, grpc_port=0, stats_interval_s=0)) as stack:
            yield stack


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.http_port}/v1/{route}", json=body, timeout=120)


def _reference(tok, hf_model, ids: list[int], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs of `ids` from transformers' logits: per token after the first, the token (its rank:
    entries with a logprob >= its own, counted with a margin of TOL both ways) then the k most likely tokens
    (ranks 1..k, lower id first on ties), each {"logprob", "rank": (lowest, highest), "decoded_token"} (vLLM's
    strings, tests/vllm_token_strings.py, after the prompt tokens before it)."""
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out: list[dict | None] = [None]
    for j in range(1, len(ids)):
        row, t = logp[j - 1], ids[j]
        rank = (int((row > row[t] + TOL).sum()) + 1, int((row >= row[t] - TOL).sum()))
        values, top = torch.sort(row, descending=True, stable=True)
        entries = {t: (float(row[t]), rank)}
        entries.update({int(i): (float(v), (r + 1, r + 1)) for r, (i, v) in enumerate(zip(top[:k], values[:k], strict=True))})
        names = vllm.token_strings(tok.model_dir, list(entries), ids[:j])  # vLLM's, after the prompt before j
        out.append({str(i): {"logprob": v, "rank": r, "decoded_token": name}
                    for (i, (v, r)), name in zip(entries.items(), names, strict=True)})
    return out


def _assert_matches(got: list, want: list) -> int:
    """`got` (the server's prompt_logprobs) equals `want` (`_reference`); returns at how many positions the margin
    left the prompt token's own rank exact (so a caller can check that the rank comparison was not vacuous)."""
    assert len(got) == len(want) and got[0] is None
    exact = 0
    for j, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert list(g) == list(w), f"position {j}: token ids or their order"
        for key, entry in w.items():
            lo, hi = entry["rank"]
            assert g[key]["logprob"] == pytest.approx(entry["logprob"], abs=TOL), (j, key)
            assert lo <= g[key]["rank"] <= hi, (j, key, g[key]["rank"], entry["rank"])
            assert g[key]["decoded_token"] == entry["decoded_token"]
        lo, hi = next(iter(w.values()))["rank"]  # the prompt token's
        exact += lo == hi
    return exact


def test_completions_prompt_logprobs_match_transformers_for_every_choice(server, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    want = _reference(tok, hf_model, ids, 3)
    r = _post(server, "completions", {"prompt": PROMPT, "prompt_logprobs": 3, "n": 2, **GREEDY,
                                      "return_tokens_as_token_ids": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert _assert_matches(choice["prompt_logprobs"], want) >= len(ids) // 2, "near ties left the ranks inexact"
        assert choice["logprobs"]["tokens"][0].startswith("token_id:")  # decoded_token stays text (vLLM)
    ranks = [e[str(t)]["rank"] for e, t in zip(choices[0]["prompt_logprobs"][1:], ids[1:], strict=True)]
    assert max(ranks) > 3, "some prompt token should rank beyond the top 3 (else the rank check is weak)"


def test_token_id_prompt_with_echo_and_logprobs_agrees_with_prompt_logprobs(server, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    for extra, k in (({}, 2), ({"prompt_logprobs": 0}, 0), ({"prompt_logprobs": 5}, 5)):
        r = _post(server, "completions", {"prompt": ids, "echo": True, "logprobs": 2, **extra, **GREEDY})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        _assert_matches(choice["prompt_logprobs"], _reference(tok, hf_model, ids, k))
        echo = choice["logprobs"]
        for j in range(1, len(ids)):
            entries = choice["prompt_logprobs"][j]
            assert echo["token_logprobs"][j] == pytest.approx(entries[str(ids[j])]["logprob"], abs=1e-6)
            shown = {e["decoded_token"]: e["logprob"] for e in list(entries.values())[:3]}  # vLLM: logprobs + 1
            assert echo["top_logprobs"][j] == pytest.approx(shown, abs=1e-6)
    plain = _post(server, "completions", {"prompt": ids, **GREEDY}).json()["choices"][0]
    assert "prompt_logprobs" not in plain


def test_prompt_logprobs_without_echo_leave_the_choices_logprobs_to_the_generated_tokens(server):
    """Without `echo`, `logprobs` covers the generated tokens only, streamed or not, whatever `prompt_logprobs` asks
    (vLLM's prompt_logprobs is a field of its own): they were prepended the prompt's tokens, as if echoed."""
    base = {"prompt": PROMPT, "logprobs": 2, **GREEDY}
    plain = _post(server, "completions", base).json()["choices"][0]["logprobs"]
    assert len(plain["tokens"]) == GREEDY["max_tokens"]
    for k in (0, 3):
        choice = _post(server, "completions", {**base, "prompt_logprobs": k}).json()["choices"][0]
        assert choice["logprobs"] == plain and len(choice["prompt_logprobs"]) == len(server.engine.tokenizer.encode(PROMPT))
    r = _post(server, "completions", {**base, "prompt_logprobs": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    tokens = [t for c in chunks for choice in c["choices"] if choice.get("logprobs") for t in choice["logprobs"]["tokens"]]
    assert tokens == plain["tokens"]


def test_chat_prompt_logprobs_are_the_templated_prompts_at_the_top_level(server, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(render_chat(CHAT, tokenizer=tok), add_special_tokens=False)
    r = _post(server, "chat/completions", {"messages": CHAT, "prompt_logprobs": 2, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "prompt_logprobs" not in body["choices"][0]
    assert _assert_matches(body["prompt_logprobs"], _reference(tok, hf_model, ids, 2)) >= len(ids) // 2


def test_grpc_prompt_logprobs_match_transformers_on_the_first_chunk(server, hf_model):
    """GenerateRequest.prompt_logprobs (gRPC had no way to ask): the first chunk's prompt_logprobs hold every prompt
    token after the first, with its rank and k alternatives (ranks 1..k by place), as HTTP's entries; no other chunk
    has any, and a request without the field gets none."""
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    want = _reference(tok, hf_model, ids, 3)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        replies = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=3,
                                                        ignore_eos=True, prompt_logprobs=3), timeout=120))
        plain = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=2,
                                                      ignore_eos=True, logprobs=2), timeout=120))
    assert not any(r.prompt_logprobs for r in replies[1:]) and not any(r.prompt_logprobs for r in plain)
    assert not any(e.HasField("rank") for r in plain for e in r.logprobs)
    got = [None] + [{str(e.token_id): {"logprob": e.logprob, "rank": e.rank}, **{str(t.token_id): {
        "logprob": t.logprob, "rank": j + 1} for j, t in enumerate(e.top)}} for e in replies[0].prompt_logprobs]
    for g, w in zip(got[1:], want[1:], strict=True):  # gRPC sends ids only: the strings are the reference's
        for key in g:
            g[key]["decoded_token"] = w[key]["decoded_token"] if key in w else None
    assert [e.token_id for e in replies[0].prompt_logprobs] == ids[1:]
    assert _assert_matches(got, want) >= len(ids) // 2


def test_a_stream_takes_prompt_logprobs_0_only(server):
    r = _post(server, "completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = _post(server, "chat/completions", {"messages": CHAT, "prompt_logprobs": 0, "stream": True, **GREEDY})
    assert r.status_code == 200 and "prompt_logprobs" not in r.text and r.text.endswith("data: [DONE]\n\n")
