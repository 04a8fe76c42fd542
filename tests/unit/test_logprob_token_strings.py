"""Logprob token strings as current vLLM writes them (launcher/serving/formats/token_strings.py, openai_logprobs.py).

Two tokenizers: the tiny model's byte-level BPE (one token per byte, so every non-ASCII character spans 2-4
tokens that alone decode to U+FFFD) and a tiny SentencePiece-style one built here with the `tokenizers` library
(BPE with byte fallback, Metaspace pre-tokenizer, ByteFallback + Metaspace decoder; its vocabulary has both
"▁true" and "true"). The reference is vLLM's own algorithm ported in tests/vllm_token_strings.py and run on
transformers' tokenizer of the same files; over HTTP (a scripted coordinator: real serving engine, SSE, request
handles) completions streamed and not, echo, chat and prompt_logprobs must all give the reference's strings.
What breaks when these fail: "▁true" and "true" both read "true" and collide as keys of completions'
`top_logprobs` (fewer alternatives than asked); a token that completes an emoji or CJK character reads U+FFFD,
or its strings change with where a stream's chunks were cut (context not carried per choice), or alternatives
are read in each other's context instead of the chosen token's.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from launcher.coordinator.coordinator import RequestHandle
from launcher.serving.formats.token_strings import TokenStrings
from launcher.serving.http_server import HttpServer
from launcher.serving.openai_logprobs import LogprobFormatter
from launcher.serving.openai_protocol import parse_chat
from launcher.serving.serving_engine import ServingEngine
from pipeline.engine.records import Commit, FinishReason
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.logprobs import TokenLogprob
from tests import vllm_token_strings as vllm
from tests.tiny_model import write_tiny_model
from tests.unit.test_serving_http import TEMPLATE, FakeCoordinator

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

TEXT = "héllo 😀 true 世界 ▁true"  # 2-, 4- and 3-byte characters, spaced and bare words
PIECES = ["▁", "▁▁", "t", "r", "u", "e", "tr", "ue", "true", "▁true", "▁▁true", "h", "l", "o", "ll", "▁h"]
MERGES = [("t", "r"), ("u", "e"), ("tr", "ue"), ("▁", "true"), ("▁", "▁"), ("▁▁", "true"), ("l", "l")]


def _metaspace_folder(path, pre: str):
    """A SentencePiece-style tokenizer folder: BPE with byte fallback, a Metaspace pre-tokenizer (alone, or in
    a Sequence after a Punctuation split), a ByteFallback + Metaspace decoder, EOS "</s>", the chat TEMPLATE."""
    names = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    tok = tokenizers.Tokenizer(models.BPE(vocab={n: i for i, n in enumerate(names)}, merges=MERGES,
                                          byte_fallback=True, unk_token="<unk>"))
    meta = pre_tokenizers.Metaspace()
    tok.pre_tokenizer = meta if pre == "metaspace" else pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), meta])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.add_special_tokens([tokenizers.AddedToken("</s>", special=True)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module", params=["byte-level", "metaspace", "metaspace-in-sequence"])
def folder(request, tmp_path_factory):
    """A tokenizer folder of each kind (the tiny model's, or a Metaspace one)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param != "byte-level":
        return _metaspace_folder(path, request.param.removesuffix("-in-sequence"))
    write_tiny_model(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def pair(folder):
    """(speedpipe's Tokenizer, transformers' tokenizer) of the same files."""
    return Tokenizer(folder), vllm.hf_tokenizer(folder)


def test_leading_space_marker_is_the_metaspace_replacement_as_vllm_reads_it(pair):
    tok, hf = pair
    assert tok.leading_space_marker == vllm.leading_space_marker(hf)
    assert (tok.leading_space_marker is None) == ("ByteLevel" in tok.to_json())


def test_each_token_alone_is_vllms_convert_ids_list_to_tokens(pair):
    """Every id of the vocabulary: decoded alone, with a Metaspace piece's stripped leading spaces put back."""
    tok, hf = pair
    ids = list(range(tok.vocab_size))
    want = vllm.convert_ids_list_to_tokens(hf, ids)
    strings = TokenStrings(tok)
    assert [strings.alone(i) for i in ids] == want
    if tok.leading_space_marker is not None:  # not vacuous: spaces restored, a bare "▁" is one space
        assert strings.alone(tok.token_id("▁true")) == " true" and strings.alone(tok.token_id("▁▁true")) == "  true"
        assert strings.alone(tok.token_id("▁")) == " " and tok.decode([tok.token_id("▁")]) == ""


def test_spaced_and_bare_pieces_no_longer_collide_in_completions_top_logprobs(pair):
    """Completions' top_logprobs is a map keyed by token string: with "▁true" and "true" both among the
    alternatives, decoding alone gave one key for both (the collision of vLLM issue #44319); now k + 1 keys."""
    tok, hf = pair
    if tok.leading_space_marker is None:
        pytest.skip("byte-level BPE keeps the space in the token's own text")
    alternatives = [tok.token_id(p) for p in ("▁true", "true", "▁▁true", "▁", "t")]
    assert len({hf.decode([i]) for i in alternatives}) < len(alternatives)  # the collision decode alone makes
    entry = TokenLogprob(alternatives[0], -0.5, tuple((i, -1.0 - j) for j, i in enumerate(alternatives)))
    top = LogprobFormatter(tok).completion([alternatives[0]], [entry], num_top=len(alternatives))["top_logprobs"][0]
    assert list(top) == vllm.verify_tokens(hf, alternatives, [])
    assert len(top) == len(alternatives)


def test_partial_characters_read_in_the_sequences_context_as_vllm(pair):
    """At every position of TEXT's tokens, the chosen token and every vocabulary id as an alternative read as
    vLLM's `_verify_tokens` reads them after the tokens before the position (never after each other)."""
    tok, hf = pair
    ids = tok.encode(TEXT, add_special_tokens=False)
    strings = TokenStrings(tok)
    everything = list(range(tok.vocab_size))
    for j, t in enumerate(ids):
        want = vllm.verify_tokens(hf, [t, *everything], ids[:j])
        assert [strings.text(i, ids[:j]) for i in [t, *everything]] == want, j
    chosen = [strings.text(t, ids[:j]) for j, t in enumerate(ids)]
    assert "".join(chosen) in (tok.decode(ids), " " + tok.decode(ids))  # Metaspace: the first space kept too
    assert "😀" in chosen and "世" in chosen and "é" in chosen  # the completing token reads the whole character
    assert chosen.count("") >= 3 + 2 + 2 + 1  # the tokens before it in the character read ""


def _reference_completion(hf, ids: list[int], tops: list[tuple], before: list[int], k: int) -> dict:
    """The completions logprobs object of tokens `ids` (alternatives `tops`, the logprob -1.0 each) after the
    sequence's tokens `before`, from the vLLM port."""
    tokens, maps = [], []
    for j, (t, top) in enumerate(zip(ids, tops, strict=True)):
        context = [*before, *ids[:j]]
        by_id = list(dict([(t, -1.0), *top]).items())[:k + 1]
        names = vllm.verify_tokens(hf, [t, *(i for i, _ in by_id)], context)
        tokens.append(names[0])
        maps.append(dict(zip(names[1:], (lp for _, lp in by_id), strict=True)))
    offsets = [sum(len(s) for s in tokens[:j]) for j in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [-1.0] * len(ids), "top_logprobs": maps, "text_offset": offsets}


def _alternatives(tok: Tokenizer, token: int, i: int) -> tuple[tuple[int, float], ...]:
    """Alternatives of output position i: bytes and pieces around the chosen token (a byte-level tokenizer's
    lone high bytes, a Metaspace one's "▁true" and "true"), chosen-dependent so neighbours differ."""
    ids = [token, (token + 1) % tok.vocab_size, 0xA9 + i % 8, tok.token_id("▁true") or 0xE4,
           tok.token_id("true") or 0x96]
    return tuple((t, -1.5 - j) for j, t in enumerate(dict.fromkeys(ids)))


class ScriptedCoordinator(FakeCoordinator):
    """FakeCoordinator (the prompt's tokens committed back) in commits of 1, 2, 3, .. tokens, each with
    `_alternatives`, and the prompt's logprobs on the first commit when asked."""

    def _run(self, h: RequestHandle) -> None:
        i, size = 0, 1
        while i < h.params.max_new_tokens:
            time.sleep(self.step_s)
            tokens = [h.prompt_ids[j % len(h.prompt_ids)] for j in range(i, min(i + size, h.params.max_new_tokens))]
            entries = tuple(TokenLogprob(t, -1.0, _alternatives(self.tokenizer, t, i + j)[:h.params.logprobs])
                            for j, t in enumerate(tokens))
            prompt = None
            if h.params.prompt_logprobs is not None and i == 0:
                prompt = (None, *(TokenLogprob(t, -1.0, _alternatives(self.tokenizer, t, j + 1)[:h.params.prompt_logprobs])
                                  for j, t in enumerate(h.prompt_ids[1:])))
            i += len(tokens)
            done = FinishReason.LENGTH if i == h.params.max_new_tokens else None
            if h.emit(Commit(0, tuple(tokens), done, entries if h.params.logprobs is not None else None, prompt)):
                return
            size = size % 3 + 1


@pytest.fixture(scope="module")
def served(pair):
    tok, hf = pair
    engine = ServingEngine(ScriptedCoordinator(tok), model_name="tiny", max_num_seqs=4, max_queue=4,
                           max_model_len=256)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    yield tok, hf, f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}"
    http.stop()


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_completions_logprobs_streamed_equal_non_streamed_and_vllms(served):
    """A token-id prompt (TEXT's) echoed back in commits of 1-3 tokens: each chunk's tokens read in the choice's
    context carried across chunks, so the streamed objects joined equal the non-streamed one and the reference."""
    tok, hf, url = served
    ids = tok.encode(TEXT, add_special_tokens=False)
    k = 4
    body = {"prompt": ids, "max_tokens": len(ids), "logprobs": k, "n": 2}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]
    want = _reference_completion(hf, ids, [_alternatives(tok, t, i)[:k] for i, t in enumerate(ids)], ids, k)
    assert [c["logprobs"] for c in whole] == [want, want]
    events = _events(url, "/v1/completions", body)
    for index in range(2):
        parts = [c["choices"][0]["logprobs"] for c in events if c["choices"] and c["choices"][0]["index"] == index
                 and c["choices"][0]["logprobs"]]
        assert len(parts) > 1
        assert {key: [v for p in parts for v in p[key]] for key in want} == want
    assert any("😀" in m for m in want["top_logprobs"]) and "😀" in want["tokens"]  # not vacuous


def test_echo_reads_the_prompt_then_the_output_as_one_sequence(served):
    tok, hf, url = served
    text = "true 😀é"
    ids = tok.encode(text, add_special_tokens=False)
    answer = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4, "logprobs": 2, "echo": True},
                        timeout=60).json()["choices"][0]["logprobs"]
    prompt_tops = [_alternatives(tok, t, j + 1) for j, t in enumerate(ids[1:])]
    want = _reference_completion(hf, ids[1:], [top[:2] for top in prompt_tops], ids[:1], 2)
    out = _reference_completion(hf, ids[:4], [_alternatives(tok, t, i)[:2] for i, t in enumerate(ids[:4])], ids, 2)
    assert answer["tokens"] == [hf.decode([ids[0]]), *want["tokens"], *out["tokens"]]
    assert answer["top_logprobs"] == [None, *want["top_logprobs"], *out["top_logprobs"]]


def test_chat_logprobs_streamed_equal_non_streamed_and_vllms(served):
    """Chat over the templated prompt (the scripted coordinator commits it back): `token`, `bytes` and each
    `top_logprobs[].token` are the reference's after the prompt's last tokens and the output so far."""
    tok, hf, url = served
    messages = [{"role": "user", "content": TEXT}]
    prompt = parse_chat({"messages": messages}, tokenizer=tok, model_name="tiny", max_model_len=256).prompt_ids
    body = {"messages": messages, "logprobs": True, "top_logprobs": 3, "max_tokens": len(prompt)}
    content = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    streamed = [e for c in _events(url, "/v1/chat/completions", body) if c["choices"]
                for e in (c["choices"][0].get("logprobs") or {"content": []})["content"]]
    assert streamed == content and len(content) == len(prompt)
    for i, (t, e) in enumerate(zip(prompt, content, strict=True)):
        alternatives = [t, *(a for a, _ in _alternatives(tok, t, i)[:3])]
        names = vllm.verify_tokens(hf, alternatives, [*prompt, *prompt[:i]])
        assert [e["token"], *(a["token"] for a in e["top_logprobs"])] == names, i
        assert e["bytes"] == list(names[0].encode())
    assert "😀" in [e["token"] for e in content]


def test_prompt_logprobs_decoded_token_reads_the_prompt_before_it(served):
    tok, hf, url = served
    ids = tok.encode(TEXT, add_special_tokens=False)
    got = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3},
                     timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None
    for j, entry in enumerate(got[1:], start=1):
        alternatives = [ids[j], *(i for i, _ in _alternatives(tok, ids[j], j)[:3])]
        names = vllm.verify_tokens(hf, alternatives, ids[:j])
        assert [(int(i), e["decoded_token"]) for i, e in entry.items()] == list(dict(zip(alternatives, names, strict=True)).items())
