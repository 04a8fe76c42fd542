"""The OpenAI API features clients use, through the official `openai` client against `speedpipe serve`.

One 2-stage server (real stage processes, gloo on loopback) on the tiny random model (float32) per
speculation mode: `none`, `speed` (n-gram drafts) and `speed+firp` (untrained FIRP maps, so chains
of several rows are verified in one result and both accepted and rejected), every draft sent. Every check compares with
a reference computed here from transformers' logits for the same prompt (greedy decoding, float32,
to 1e-4): `logprobs` / `top_logprobs` on completions and chat, `echo` with prompt logprobs, `n` = 3,
presence / frequency / repetition penalties, `logit_bias` and vLLM's token masks (HTTP and gRPC), gRPC Generate's logprobs and penalties, and gRPC
GetModelInfo's description of the session; all modes must match the same reference, so the
verify pass gives the logprobs plain decoding gives. Bad values answer 400 naming the field.
What breaks when these fail: logprobs of the wrong row or distribution, prompt rows lost, penalties
that differ from vLLM's formula or that ignore accepted drafts, choices that share a sequence.
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
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.masks.token_masks import bad_word_token_ids
from pipeline.speculation.sampling import SamplingParams
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests import vllm_token_strings as vllm
from tests.tiny_model import write_firp_file, write_tiny_model
from tests.unit.test_logprobs_penalties import _reference_penalised
from tests.unit.test_token_masks_paths import reference

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PROMPT = "The cat sat on the mat."
NUM_TOKENS = 8
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "user", "content": "Say something."}]
TOL = 1e-4
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def write_chat_model(path):
    """The tiny model at `path`, with TEMPLATE as its chat template."""
    path = write_tiny_model(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("tiny-openai"))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["none", "speed", "speed+firp"])
def server(request, tiny_dir, tmp_path_factory):
    firp = {}
    if "firp" in request.param:
        path = write_firp_file(tiny_dir, tmp_path_factory.mktemp("firp") / "firp.safetensors", layer=1, k=3)
        firp = dict(firp_file=str(path), layer_split="2,2")
    options = PipelineOptions(num_stages=2, model=str(tiny_dir), progress=False, max_num_seqs=4, max_model_len=128,
                              stage_timeout_s=60, speculate=request.param, predictor="ngram", min_acceptance=0.0,
                              row_cost="none", **firp)  # fixed FIRP chains: every pass verifies one
    with PipelineSession(options, resolve(options)) as session:
        with ServingStack(session, ServeOptions(host="127.0.0.1", port=0, grpc_port=0, stats_interval_s=0)) as stack:
            yield stack


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _logits(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every position."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _greedy_reference(hf_model, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding on transformers' logits (biased, then penalised, as `params` says): tokens and,
    per token, the raw log_softmax of its position."""
    out, logps = [], []
    for _ in range(params.max_new_tokens):
        logits = _logits(hf_model, prompt_ids + out)[-1]
        biased = logits.clone()
        for t, b in params.logit_bias:
            biased[t] += b
        out.append(int(torch.argmax(_reference_penalised(biased, params, prompt_ids, out))))
        logps.append(torch.log_softmax(logits, dim=-1))
    return out, logps


def _names(tok: Tokenizer, ids: list[int], context: list[int]) -> list[str]:
    """vLLM's strings of the alternatives `ids` of one position after the sequence's tokens `context`."""
    return vllm.token_strings(tok.model_dir, ids, context)


def _top(tok: Tokenizer, logp: torch.Tensor, k: int, context: list[int]) -> dict[str, float]:
    values, ids = torch.sort(logp, descending=True, stable=True)
    return dict(zip(_names(tok, ids[:k].tolist(), context), values[:k].tolist(), strict=True))


def _top_with_chosen(tok: Tokenizer, logp: torch.Tensor, token: int, k: int, context: list[int]) -> dict[str, float]:
    """The completions form: the chosen token's logprob, then the k most likely (OpenAI: up to k + 1)."""
    return {_names(tok, [token], context)[0]: float(logp[token]), **_top(tok, logp, k, context)}


def _assert_top(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=TOL)


def test_completion_logprobs_and_top_logprobs_match_transformers(server, client, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    ref, logps = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS))
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, logprobs=3, **GREEDY)
    choice = choice_of(r)
    assert choice.token_ids == ref
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([float(logps[i][t]) for i, t in enumerate(ref)], abs=TOL)
    assert lp.tokens == [_names(tok, [t], [*ids, *ref[:i]])[0] for i, t in enumerate(ref)]
    for i, top in enumerate(lp.top_logprobs):
        _assert_top(top, _top_with_chosen(tok, logps[i], ref[i], 3, [*ids, *ref[:i]]))
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, logprobs=0, **GREEDY)
    for i, top in enumerate(choice_of(r).logprobs.top_logprobs):  # logprobs 0: the chosen token alone
        _assert_top(top, {lp.tokens[i]: lp.token_logprobs[i]})


def choice_of(response, index: int = 0):
    assert len(response.choices) > index
    return response.choices[index]


def test_echo_returns_prompt_logprobs(server, client, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    prompt_logp = torch.log_softmax(_logits(hf_model, ids), dim=-1)
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, logprobs=2, echo=True, **GREEDY)
    lp = choice_of(r).logprobs
    assert choice_of(r).text.startswith(PROMPT)
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([float(prompt_logp[j - 1][ids[j]]) for j in range(1, n)], abs=TOL)
    for j in range(1, n):
        _assert_top(lp.top_logprobs[j], _top_with_chosen(tok, prompt_logp[j - 1], ids[j], 2, ids[:j]))
    assert len(lp.tokens) == n + NUM_TOKENS and lp.text_offset[0] == 0


def test_chat_logprobs_match_transformers(server, client, hf_model):
    tok = server.engine.tokenizer
    ids = tok.encode(render_chat(CHAT, tokenizer=tok))
    ref, logps = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS))
    r = client.chat.completions.create(model=server.engine.model_name, messages=CHAT, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = choice_of(r).logprobs.content
    assert [c.token for c in content] == [_names(tok, [t], [*ids, *ref[:i]])[0] for i, t in enumerate(ref)]
    assert [c.logprob for c in content] == pytest.approx([float(logps[i][t]) for i, t in enumerate(ref)], abs=TOL)
    for i, c in enumerate(content):
        _assert_top({t.token: t.logprob for t in c.top_logprobs}, _top(tok, logps[i], 2, [*ids, *ref[:i]]))


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                       dict(repetition_penalty=1.8)], ids=lambda p: next(iter(p)))
def test_penalties_match_transformers(server, client, hf_model, penalties):
    ids = server.engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=NUM_TOKENS, **penalties)
    ref, _ = _greedy_reference(hf_model, ids, params)
    plain, _ = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS))
    body = {**GREEDY, "extra_body": {**GREEDY["extra_body"], **penalties}} if "repetition_penalty" in penalties \
        else {**GREEDY, **penalties}
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, **body)
    assert choice_of(r).token_ids == ref
    assert ref != plain, "the penalty should change this prompt's greedy output (else the check is vacuous)"


def test_logit_bias_matches_transformers_over_http_and_grpc(server, client, hf_model):
    ids = server.engine.tokenizer.encode(PROMPT)
    plain, _ = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS))
    bias = {plain[0]: -100, (plain[0] + 1) % server.engine.tokenizer.vocab_size: 0.5}
    ref, logps = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS, logit_bias=bias))
    assert ref != plain and plain[0] not in ref, "-100 on the first greedy token must change the output"
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, logprobs=0,
                                  logit_bias={str(t): b for t, b in bias.items()}, **GREEDY)
    assert choice_of(r).token_ids == ref
    raw = [float(logps[i][t]) for i, t in enumerate(ref)]  # the raw model's logprobs, as vLLM's default
    assert choice_of(r).logprobs.token_logprobs == pytest.approx(raw, abs=TOL)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        chunks = list(pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
            prompt=PROMPT, max_new_tokens=NUM_TOKENS, ignore_eos=True, logit_bias=bias)))
    assert [t for c in chunks for t in c.token_ids] == ref


def test_token_masks_match_transformers_over_http_and_grpc(server, client, hf_model):
    """vLLM's min_tokens, stop_token_ids, allowed_token_ids and bad_words (tokenised by the coordinator) on
    the real pipeline: the token-by-token reference of tests/unit/test_token_masks_paths.py on transformers'
    logits, in every speculation mode; a stop token id ends the output, is its stop_reason, shows no text."""
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    n = 3 * NUM_TOKENS
    plain, _ = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=n))
    masks = dict(min_tokens=4, allowed_token_ids=[t for t in range(tok.vocab_size) if t != plain[1]])
    eos = tuple(tok.eos_token_ids)

    def logits_fn(prefix: list[int]) -> torch.Tensor:
        return _logits(hf_model, prefix)[-1]

    def masked(bad_word_ids=()) -> list[int]:
        return reference(ids, SamplingParams(max_new_tokens=n, ignore_eos=True, **masks, bad_word_ids=bad_word_ids),
                         eos=eos, logits_fn=logits_fn)

    unbanned = masked()  # a bad word the output has without it: one printable token
    word = next(t for t in unbanned if tok.decode([t]).strip() and len(tok.encode(tok.decode([t]), add_special_tokens=False)) == 1)
    bad = bad_word_token_ids([tok.decode([word])], lambda w: tok.encode(w, add_special_tokens=False))
    no_stop = masked(bad)
    assert word not in no_stop and no_stop != unbanned, "the bad word changed nothing"
    masks["stop_token_ids"], ref = [], no_stop
    while len(ref) == n and len(masks["stop_token_ids"]) < 8:  # add the token it repeats until one ends it
        masks["stop_token_ids"].append(ref[-1])
        ref = masked(bad)
    assert ref[-1] in masks["stop_token_ids"] and 4 < len(ref) < n, "no stop id ends the output"
    assert ref != plain[:len(ref)] and word not in ref and plain[1] not in ref, "the masks changed nothing"
    r = client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=n, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, **masks,
                                              "bad_words": [tok.decode([word])]})
    assert choice_of(r).token_ids == ref
    assert (choice_of(r).finish_reason, choice_of(r).stop_reason) == ("stop", ref[-1])
    assert choice_of(r).text == tok.decode(ref[:-1])
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        chunks = list(pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
            prompt=PROMPT, max_new_tokens=n, ignore_eos=True, bad_words=[tok.decode([word])], **masks)))
    assert [t for c in chunks for t in c.token_ids] == ref
    assert chunks[-1].stop_token_id == ref[-1] and chunks[-1].finish_reason == pb.GenerateResponse.STOP
    # allowed ids that min_tokens all masks: refused before the request runs (it could only fail: 500)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=n,
                                  extra_body={"allowed_token_ids": list(eos), "min_tokens": 1})
    assert err.value.body["param"] == "allowed_token_ids", err.value.body


def test_n_3_greedy_and_seeded(server, client, hf_model):
    name = server.engine.model_name
    ids = server.engine.tokenizer.encode(PROMPT)
    ref, _ = _greedy_reference(hf_model, ids, SamplingParams(max_new_tokens=NUM_TOKENS))
    r = client.completions.create(model=name, prompt=PROMPT, n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.token_ids == ref for c in r.choices)
    assert r.usage.completion_tokens == 3 * NUM_TOKENS and r.usage.prompt_tokens == len(ids)
    sampled = {**GREEDY, "temperature": 1.0, "seed": 7}
    r = client.completions.create(model=name, prompt=PROMPT, n=3, **sampled)
    singles = [client.completions.create(model=name, prompt=PROMPT, **{**sampled, "seed": 7 + i}) for i in range(3)]
    assert [c.token_ids for c in r.choices] == [choice_of(s).token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in r.choices}) > 1, "choices with derived seeds should differ"


def test_n_3_streamed_has_every_choice(server, client):
    stream = client.completions.create(model=server.engine.model_name, prompt=PROMPT, n=3, stream=True,
                                       logprobs=1, **GREEDY)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    logprobs: dict[int, int] = {0: 0, 1: 0, 2: 0}
    for chunk in stream:
        for c in chunk.choices:
            tokens[c.index].extend(c.token_ids or [])
            logprobs[c.index] += len(c.logprobs.token_logprobs) if c.logprobs else 0
    assert all(len(t) == NUM_TOKENS for t in tokens.values()) and tokens[0] == tokens[1] == tokens[2]
    assert all(n == NUM_TOKENS for n in logprobs.values())


def test_streamed_chat_and_echo_carry_the_same_logprobs(server, client):
    name = server.engine.model_name
    whole = client.chat.completions.create(model=name, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    streamed = []
    for chunk in client.chat.completions.create(model=name, messages=CHAT, logprobs=True, top_logprobs=2,
                                                stream=True, **GREEDY):
        for c in chunk.choices:
            streamed.extend(c.logprobs.content if c.logprobs else [])
    want = choice_of(whole).logprobs.content
    assert [c.token for c in streamed] == [c.token for c in want]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in want], abs=TOL)
    text, token_logprobs = "", []
    for chunk in client.completions.create(model=name, prompt=PROMPT, logprobs=0, echo=True, stream=True, **GREEDY):
        text += chunk.choices[0].text
        token_logprobs.extend(chunk.choices[0].logprobs.token_logprobs)
    whole = client.completions.create(model=name, prompt=PROMPT, logprobs=0, echo=True, **GREEDY)
    assert text == choice_of(whole).text and text.startswith(PROMPT)
    want = choice_of(whole).logprobs.token_logprobs
    assert token_logprobs[0] is None and want[0] is None
    assert token_logprobs[1:] == pytest.approx(want[1:], abs=TOL)


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_values_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_grpc_generate_logprobs_and_penalties_match_transformers(server, hf_model):
    ids = server.engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=NUM_TOKENS, frequency_penalty=1.0)
    ref, logps = _greedy_reference(hf_model, ids, params)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        chunks = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=NUM_TOKENS, ignore_eos=True,
                                                       frequency_penalty=1.0, logprobs=2)))
        entries = [e for c in chunks for e in c.logprobs]
        assert [t for c in chunks for t in c.token_ids] == ref == [e.token_id for e in entries]
        assert [e.logprob for e in entries] == pytest.approx([float(logps[i][t]) for i, t in enumerate(ref)], abs=TOL)
        for i, e in enumerate(entries):
            values, top_ids = torch.sort(logps[i], descending=True, stable=True)
            assert [t.token_id for t in e.top] == top_ids[:2].tolist()
            assert [t.logprob for t in e.top] == pytest.approx(values[:2].tolist(), abs=TOL)
        for req, field in ((pb.GenerateRequest(prompt="Hi", max_new_tokens=2, logprobs=21), "logprobs"),
                           (pb.GenerateRequest(prompt="Hi", max_new_tokens=2, presence_penalty=3), "presence_penalty"),
                           (pb.GenerateRequest(prompt="Hi", max_new_tokens=2, repetition_penalty=0), "repetition_penalty")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


def test_grpc_model_info_describes_the_running_session(server):
    """GetModelInfo against a real session: the pipeline the stages run, the EOS ids the scheduler
    stops at, and the model id and max_model_len that GET /v1/models lists."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        info = pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    options, coordinator = server.session.options, server.session.coordinator
    assert (info.pipeline.num_stages, info.pipeline.speculate) == (options.num_stages, options.speculate)
    assert (info.pipeline.dtype, info.pipeline.quantization) == ("float32", "none")  # the tiny model, float32 dense
    assert list(info.eos_token_ids) == list(coordinator.config.scheduler.eos_token_ids)
    [card] = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/models").json()["data"]
    assert (info.model_id, info.max_model_len) == (card["id"], card["max_model_len"])


def test_speculation_verified_drafts(server, client):
    if server.session.options.speculate == "none":
        pytest.skip("plain decoding")
    client.completions.create(model=server.engine.model_name, prompt="ab ab ab ab ab ab", logprobs=1,
                              frequency_penalty=0.5, **GREEDY)
    spec = server.session.coordinator.spec
    assert spec.verified_drafts > 0 and spec.accepted_tokens > 0 and spec.squashed_items > 0, spec
    if "firp" in server.session.options.speculate:
        assert spec.firp_verified > 0, spec


def test_special_tokens_the_ending_eos_and_truncation_over_http_and_grpc(server, client, hf_model):
    """vLLM's skip_special_tokens false shows EOS tokens generated under ignore_eos, but the EOS that ends a
    request only with include_stop_str_in_output; truncate_prompt_tokens decodes from the last k prompt tokens
    (transformers' greedy continuation of them) and usage counts those k. References: the tokenizers library's
    decode, transformers' logits."""
    tok, model = server.engine.tokenizer, server.engine.model_name
    eos = tok.eos_token_ids[0]
    forced = {str(eos): 100}  # every greedy token is EOS
    shown = {"skip_special_tokens": False, "return_token_ids": True}
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=forced,
                                  extra_body={**shown, "ignore_eos": True})
    assert choice_of(r).token_ids == [eos] * 4
    assert choice_of(r).text == tok._tok.decode([eos] * 4, skip_special_tokens=False) != ""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=forced,
                                  extra_body=shown)
    assert (choice_of(r).token_ids, choice_of(r).text, choice_of(r).finish_reason) == ([eos], "", "stop")
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=forced,
                                  extra_body={**shown, "include_stop_str_in_output": True})
    assert choice_of(r).text == tok._tok.decode([eos], skip_special_tokens=False)
    keep = 4
    ids = tok.encode(PROMPT)
    ref, _ = _greedy_reference(hf_model, ids[-keep:], SamplingParams(max_new_tokens=NUM_TOKENS))
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=NUM_TOKENS,
                                  extra_body={**GREEDY["extra_body"], "truncate_prompt_tokens": keep})
    assert choice_of(r).token_ids == ref and r.usage.prompt_tokens == keep
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        chunks = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, logit_bias={eos: 100},
                                                       skip_special_tokens=False, include_stop_str_in_output=True)))
        assert "".join(c.text for c in chunks) == tok._tok.decode([eos], skip_special_tokens=False)
        chunks = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=NUM_TOKENS, ignore_eos=True,
                                                       truncate_prompt_tokens=keep)))
    assert [t for c in chunks for t in c.token_ids] == ref and chunks[-1].usage.prompt_tokens == keep
