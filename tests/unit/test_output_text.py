"""vLLM's output-text settings (launcher/coordinator/request_handle.py `TextOptions`, pipeline/model/tokenizer.py),
`truncate_prompt_tokens` and the refused vLLM fields (launcher/serving/formats/vllm_fields.py), over HTTP, gRPC
and the `launch` flags.

What breaks when these fail: special tokens' text is always skipped (skip_special_tokens false ignored), or the
EOS that ended a request is shown without include_stop_str_in_output (vLLM leaves it out); stop strings do not
see special tokens' text when it is shown; include_stop_str_in_output drops the stop string, keeps text after
it, or misses a stop string that started in text already streamed; spaces_between_special_tokens false still
puts the decoder's space between two added tokens (WordPiece); truncate_prompt_tokens keeps the wrong tokens,
usage counts the untruncated prompt, or a bad value is accepted; guided_json and friends are silently ignored
(unconstrained output) instead of a 400 naming them. References: the `tokenizers` library's own decode, and
Python's string operations on the full text.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from launcher.coordinator.request_handle import RequestHandle, TextOptions
from launcher.serving.grpc_generate import request_params, text_options
from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import parse_chat, parse_completion
from launcher.serving.serving_engine import InvalidRequestError, ServingEngine
from pipeline.engine.records import Commit, FinishReason
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from proto import speedpipe_pb2 as pb
from tests.tiny_model import TINY_EOS_ID, write_tiny_model
from tests.unit.test_serving_http import TEMPLATE, FakeCoordinator

pytestmark = pytest.mark.timeout(120)
SPECIALS = ("<sp>", "<|x|>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The tiny byte tokenizer with two more special tokens (ids 256, 257) and a chat template."""
    import json

    folder = write_tiny_model(tmp_path_factory.mktemp("special"), vocab_size=264)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return Tokenizer(folder)


def run(tokenizer: Tokenizer, ids: list[int], text: TextOptions, *, stop=(), reason=FinishReason.LENGTH,
        at_once: bool = False) -> tuple[RequestHandle, list[str]]:
    """A RequestHandle fed `ids` one commit per token (or all in one commit); (handle, streamed deltas)."""
    params = SamplingParams(max_new_tokens=len(ids), stop=stop)
    h = RequestHandle("r", "p", [1], params, text.detokenizer(tokenizer, [1]), text)
    commits = [tuple(ids)] if at_once else [(t,) for t in ids]
    for i, c in enumerate(commits):
        if h.emit(Commit(0, c, reason if i == len(commits) - 1 else None)):
            break
    return h, [c.text for c in h]


SHOWN = TextOptions(skip_special_tokens=False)


@pytest.mark.parametrize("at_once", [False, True])
def test_special_tokens_are_shown_with_skip_special_tokens_false_but_not_the_ending_eos(tokenizer, at_once):
    ids = tokenizer.encode("a<sp>b<|x|>c", add_special_tokens=False) + [TINY_EOS_ID]
    assert 256 in ids and 257 in ids
    h, deltas = run(tokenizer, ids, SHOWN, reason=FinishReason.EOS, at_once=at_once)
    assert "".join(deltas) == h.result(1).text == tokenizer._tok.decode(ids[:-1], skip_special_tokens=False)
    assert h.token_ids == ids  # the EOS is still one of the request's tokens
    h, _ = run(tokenizer, ids, TextOptions(), reason=FinishReason.EOS, at_once=at_once)
    assert h.text == tokenizer._tok.decode(ids, skip_special_tokens=True) == "abc"
    # include_stop_str_in_output: the EOS's own text too (vLLM); under ignore_eos (no EOS finish) it is shown anyway
    h, _ = run(tokenizer, ids, TextOptions(skip_special_tokens=False, include_stop_str_in_output=True),
               reason=FinishReason.EOS, at_once=at_once)
    assert h.text == tokenizer._tok.decode(ids, skip_special_tokens=False)
    h, _ = run(tokenizer, ids, SHOWN, at_once=at_once)
    assert h.text == tokenizer._tok.decode(ids, skip_special_tokens=False)


def test_stop_strings_match_the_text_as_shown(tokenizer):
    ids = tokenizer.encode("ab<sp>cd", add_special_tokens=False)
    h, _ = run(tokenizer, ids, SHOWN, stop=("<sp>",))
    assert (h.text, h.stop_reason, h.token_ids) == ("ab", "<sp>", ids[:3])
    h, _ = run(tokenizer, ids, TextOptions(), stop=("<sp>",))
    assert (h.text, h.stop_reason, h.finish_reason) == ("abcd", None, "length")


CASES = [("abcXYZdef", ("XYZ",)), ("abXYqXYZ", ("XYZ",)), ("abXYq", ("XYZ",)), ("hello world", ("ld", "o w")),
         ("aXb", ("X",)), ("Xab", ("X",)), ("abcd", ("bcd", "bc")), ("xabcd", ("abcd", "bc")),
         ("aaXYZ", ("aXYZ",)), ("abcdef", ("cdef", "de"))]


@pytest.mark.parametrize(("text", "stop"), CASES)
@pytest.mark.parametrize("at_once", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it(tokenizer, text, stop, at_once):
    """The reference: the first stop string to be complete, found by str.find on the full text."""
    ends = [(text.find(s) + len(s), n) for n, s in enumerate(stop) if s in text]
    want = text[:min(ends)[0]] if ends else text
    ids = tokenizer.encode(text, add_special_tokens=False)
    h, deltas = run(tokenizer, ids, TextOptions(include_stop_str_in_output=True), stop=stop, at_once=at_once)
    assert "".join(deltas) == h.text == want
    assert h.stop_reason == (stop[min(ends)[1]] if ends else None)
    assert h.finish_reason == ("stop" if ends else "length")
    excluded, _ = run(tokenizer, ids, TextOptions(), stop=stop, at_once=at_once)
    assert excluded.text == (want[:len(want) - len(h.stop_reason)] if ends else text)


def _wordpiece(folder) -> Tokenizer:
    """A WordPiece tokenizer (BERT's decoder joins tokens with spaces) with two special tokens."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "[CLS]": 3, "[SEP]": 4}
    tok = tokenizers.Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("[CLS]", "[SEP]")])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(tokenizer, tmp_path):
    wp = _wordpiece(tmp_path / "wp")
    ids = [1, 3, 4, 2, 4]  # a [CLS] [SEP] b [SEP]
    full = wp._tok.decode([1, *ids], skip_special_tokens=False)  # run()'s prompt is [1], its left context
    spaced = full[len(wp._tok.decode([1])):]
    assert spaced == " a [CLS] [SEP] b [SEP]"  # the library's own decode puts the spaces
    assert run(wp, ids, SHOWN)[0].text == spaced
    bare = run(wp, ids, TextOptions(skip_special_tokens=False, spaces_between_special_tokens=False))[0].text
    assert bare == spaced.replace("[CLS] [SEP]", "[CLS][SEP]")  # vLLM: the second of two added tokens is bare
    # byte-level BPE puts no space between special tokens: both settings are the library's decode
    ids = tokenizer.encode("a<sp><|x|><sp>b", add_special_tokens=False)
    for spaces in (True, False):
        text = TextOptions(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert run(tokenizer, ids, text)[0].text == tokenizer._tok.decode(ids, skip_special_tokens=False)


# -- HTTP ---------------------------------------------------------------------------------------------


def test_the_text_fields_reach_the_parsed_request_and_bad_values_are_400(tokenizer):
    body = {"prompt": "hi", "skip_special_tokens": False, "include_stop_str_in_output": True,
            "spaces_between_special_tokens": False}
    parsed = parse_completion(body, tokenizer=tokenizer, model_name="tiny")
    assert parsed.text == TextOptions(skip_special_tokens=False, include_stop_str_in_output=True,
                                      spaces_between_special_tokens=False)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "skip_special_tokens": None},
                      tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    assert chat.text == TextOptions()
    for name in ("skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"):
        with pytest.raises(InvalidRequestError) as info:
            parse_completion({"prompt": "hi", name: "false"}, tokenizer=tokenizer, model_name="tiny")
        assert info.value.param == name


@pytest.mark.parametrize("field", ["guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "guided_decoding_backend", "guided_whitespace_pattern"])
@pytest.mark.parametrize("chat", [False, True])
def test_removed_guided_fields_are_400_naming_them_and_their_replacement(tokenizer, field, chat):
    body = {field: {"type": "object"}, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    parse = parse_chat if chat else parse_completion
    with pytest.raises(InvalidRequestError, match="structured_outputs") as info:
        parse(body, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    assert info.value.param == field


@pytest.mark.parametrize(("field", "value"), [("use_beam_search", True), ("detokenize", False),
                                              ("logits_processors", ["x"])])
def test_unimplemented_vllm_fields_are_400_unless_they_ask_for_nothing(tokenizer, field, value):
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": "hi", field: value}, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == field and field in str(info.value)
    idle = {"use_beam_search": False, "detokenize": True, "logits_processors": [],
            }[field]
    parse_completion({"prompt": "hi", field: idle}, tokenizer=tokenizer, model_name="tiny")


@pytest.mark.parametrize(("value", "stream", "why"), [(-2, False, "non-negative integer or -1"),
                                                     (-1, False, "whole vocabulary"), (21, False, "maximum of 20"),
                                                     ("3", False, "integer"), (True, False, "integer"),
                                                     (1.0, False, "integer"), (1, True, "stream")])
def test_prompt_logprobs_that_cannot_be_served_are_400_naming_the_field(tokenizer, value, stream, why):
    """vLLM's protocol refuses < -1 and k > 0 on a stream; its engine refuses more than --max-logprobs (20 by
    default; -1 = the whole vocabulary). Both endpoints; 0..20 (0 on a stream) are taken."""
    for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(InvalidRequestError, match=why) as info:
            parse({**body, "prompt_logprobs": value, "stream": stream}, tokenizer=tokenizer, model_name="tiny",
                  max_model_len=64)
        assert info.value.param == "prompt_logprobs"
        for ok, streamed in ((0, True), (0, False), (20, False)):
            parsed = parse({**body, "prompt_logprobs": ok, "stream": streamed}, tokenizer=tokenizer, model_name="tiny",
                           max_model_len=64)
            assert parsed.params.prompt_logprobs == ok


DOCS_TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def test_chat_documents_reach_the_template_as_hugging_face_passes_them(tokenizer, tmp_path):
    """vLLM's chat `documents` are the template's `documents` variable (HF's apply_chat_template(documents=...));
    chat_template_kwargs' own "documents" wins, as vLLM merges them. Reference: transformers' rendering."""
    import json

    folder = shutil.copytree(tokenizer.model_dir, tmp_path / "docs")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": DOCS_TEMPLATE}))
    tok = Tokenizer(folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=DOCS_TEMPLATE)
    messages, docs = [{"role": "user", "content": "q?"}], [{"title": "A", "text": "alpha"}, {"title": "B", "text": "b"}]
    for body, want_docs in (({"documents": docs}, docs),
                            ({"documents": docs, "chat_template_kwargs": {"documents": docs[:1]}}, docs[:1])):
        got = parse_chat({"messages": messages, **body}, tokenizer=tok, model_name="tiny", max_model_len=256)
        want = hf.apply_chat_template(messages, documents=want_docs, tokenize=False, add_generation_prompt=True)
        assert got.prompt_ids == tok.encode(want, add_special_tokens=False)
    for bad in ("x", [1], [{"text": 2}]):
        with pytest.raises(InvalidRequestError) as info:
            parse_chat({"messages": messages, "documents": bad}, tokenizer=tok, model_name="tiny", max_model_len=256)
        assert info.value.param == "documents"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    ids = tokenizer.encode("abcdefgh")
    for k, want in ((3, ids[-3:]), (-1, ids), (100, ids)):
        body = {"prompt": "abcdefgh", "truncate_prompt_tokens": k}
        assert parse_completion(body, tokenizer=tokenizer, model_name="tiny", max_model_len=100).prompt_ids == want
    assert parse_completion({"prompt": ids, "truncate_prompt_tokens": 2}, tokenizer=tokenizer,
                            model_name="tiny").prompt_ids == ids[-2:]
    messages = [{"role": "user", "content": "hello there"}]
    full = parse_chat({"messages": messages}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    cut = parse_chat({"messages": messages, "truncate_prompt_tokens": 5}, tokenizer=tokenizer, model_name="tiny",
                     max_model_len=64)
    assert cut.prompt_ids == full.prompt_ids[-5:] and cut.params.max_new_tokens == 64 - 5
    # -1 = what max_tokens leaves of max_model_len (vLLM's renderers/params.py: max_model_len - max_tokens, the
    # completions default 16 included), so that the truncated request fits; reference: Hugging Face's truncation
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.model_dir / "tokenizer.json"), truncation_side="left")
    for budget, extra in ((16, {}), (10, {"max_tokens": 10})):
        long = parse_completion({"prompt": "x" * 80, "truncate_prompt_tokens": -1, **extra}, tokenizer=tokenizer,
                                model_name="tiny", max_model_len=64)
        assert long.prompt_ids == hf("x" * 80, truncation=True, max_length=64 - budget).input_ids
    for extra in ({"max_tokens": 10}, {"max_completion_tokens": 10, "max_tokens": 3}):
        chat = parse_chat({"messages": [{"role": "user", "content": "x" * 80}], "truncate_prompt_tokens": -1, **extra},
                          tokenizer=tokenizer, model_name="tiny", max_model_len=64)
        assert chat.prompt_ids == full_ids(tokenizer, "x" * 80)[-(64 - 10):] and chat.params.max_new_tokens == 10


def full_ids(tokenizer: Tokenizer, content: str) -> list[int]:
    """The untruncated chat prompt of one user message."""
    messages = [{"role": "user", "content": content}]
    return parse_chat({"messages": messages}, tokenizer=tokenizer, model_name="tiny", max_model_len=4096).prompt_ids


def test_truncating_a_text_prompt_keeps_the_bos_the_tokenizer_adds(tokenizer, tmp_path):
    """vLLM tokenises a truncated text prompt with Hugging Face's truncation=True, max_length=k (truncation side
    left), which keeps the post-processor's BOS (and EOS) inside the k; token-id prompts are cut as given.
    Reference: transformers' PreTrainedTokenizerFast on the same tokenizer.json."""
    folder = shutil.copytree(tokenizer.model_dir, tmp_path / "bos")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for single in ("<sp> $A", "<sp> $A <|x|>"):
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<sp>", 256), ("<|x|>", 257)])
        tok.save(str(folder / "tokenizer.json"))
        bos = Tokenizer(folder)
        hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), truncation_side="left")
        for k in (3, 5, 8, 50):
            body = {"prompt": "abcdefgh", "truncate_prompt_tokens": k}
            got = parse_completion(body, tokenizer=bos, model_name="tiny", max_model_len=64).prompt_ids
            assert got == hf("abcdefgh", truncation=True, max_length=k).input_ids, (single, k)
            assert parse_completion({**body, "add_special_tokens": False}, tokenizer=bos, model_name="tiny",
                                    max_model_len=64).prompt_ids == hf("abcdefgh", add_special_tokens=False)[
                                        "input_ids"][-k:]
            ids = hf("abcdefgh").input_ids
            assert parse_completion({**body, "prompt": ids}, tokenizer=bos, model_name="tiny",
                                    max_model_len=64).prompt_ids == ids[-k:]
        engine = ServingEngine(FakeCoordinator(bos), model_name="tiny", max_num_seqs=1, max_queue=1, max_model_len=64)
        req = pb.GenerateRequest(prompt="abcdefgh", max_new_tokens=60, truncate_prompt_tokens=-1)
        assert request_params(req, engine)[0] == hf("abcdefgh", truncation=True, max_length=4).input_ids


@pytest.mark.parametrize("value", [0, -2, 65, "3", True, 2.5])
def test_bad_truncate_prompt_tokens_is_400(tokenizer, value):
    for parse in (parse_completion, parse_chat):
        with pytest.raises(InvalidRequestError) as info:
            parse({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": value},
                  tokenizer=tokenizer, model_name="tiny", max_model_len=64)
        assert info.value.param == "truncate_prompt_tokens", info.value


def test_truncate_prompt_tokens_above_max_model_len_is_refused_as_vllm_over_http_and_grpc(tokenizer):
    """vLLM refuses truncate_prompt_tokens > max_model_len ("truncate_prompt_tokens value (X) is greater than
    max_model_len (Y). Please, select a smaller truncation size."); max_model_len itself is accepted. HTTP: 400
    naming the field; gRPC: INVALID_ARGUMENT naming it (`request_params` raises InvalidRequestError)."""
    want = "'truncate_prompt_tokens' value (65) is greater than max_model_len (64). Please, select a smaller truncation size."
    for parse in (parse_completion, parse_chat):
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert parse({**body, "truncate_prompt_tokens": 64}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
        with pytest.raises(InvalidRequestError) as info:
            parse({**body, "truncate_prompt_tokens": 65}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
        assert (str(info.value), info.value.param) == (want, "truncate_prompt_tokens")
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=1, max_queue=1, max_model_len=64)
    for prompt in ({"prompt": "hi"}, {"prompt_token_ids": pb.TokenIds(ids=[104, 105])}):
        assert request_params(pb.GenerateRequest(**prompt, max_new_tokens=4, truncate_prompt_tokens=64), engine)
        with pytest.raises(InvalidRequestError) as info:
            request_params(pb.GenerateRequest(**prompt, max_new_tokens=4, truncate_prompt_tokens=65), engine)
        assert (str(info.value), info.value.param) == (want, "truncate_prompt_tokens")


def test_add_special_tokens_is_the_post_processors_bos(tokenizer, tmp_path):
    """Completions default true, chat false (the template spells its own BOS), as vLLM; the reference is the
    tokenizers library's encode with and without its post-processor."""
    folder = shutil.copytree(tokenizer.model_dir, tmp_path / "bos")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<sp> $A", special_tokens=[("<sp>", 256)])
    tok.save(str(folder / "tokenizer.json"))
    bos = Tokenizer(folder)
    for flag in (None, True, False):
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                **({} if flag is None else {"add_special_tokens": flag})}
        completion = parse_completion(body, tokenizer=bos, model_name="tiny")
        assert completion.prompt_ids == tok.encode("hi", add_special_tokens=flag is not False).ids
        chat = parse_chat(body, tokenizer=bos, model_name="tiny", max_model_len=64)
        text = bos.decode(chat.prompt_ids, skip_special_tokens=False).removeprefix("<sp>")
        assert chat.prompt_ids == tok.encode(text, add_special_tokens=flag is True).ids
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": "hi", "add_special_tokens": 1}, tokenizer=bos, model_name="tiny")
    assert info.value.param == "add_special_tokens"


@pytest.fixture()
def served(tokenizer):
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    yield engine, f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}"
    http.stop()


def _completion_text(url: str, body: dict) -> str:
    """The whole text of a completion's one choice, streamed or not."""
    if not body.get("stream"):
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_echo_shows_a_text_prompt_as_sent_and_token_ids_with_their_special_tokens(served, tokenizer, stream, skip):
    """vLLM's echo ignores skip_special_tokens (it applies to the output): a text prompt is echoed as the client
    sent it, a token-id prompt as Hugging Face's decode of the ids (special tokens shown). Before: both were
    decoded with special tokens skipped. References: the client's string, transformers' decode; the fake
    coordinator echoes the prompt's tokens as output, whose text is the tokenizers library's decode."""
    prompt = "ab<sp>cd<|x|>"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.model_dir / "tokenizer.json"))
    output = tokenizer._tok.decode(ids, skip_special_tokens=skip)
    body = {"max_tokens": len(ids), "echo": True, "skip_special_tokens": skip, "stream": stream}
    assert _completion_text(served[1], {**body, "prompt": prompt}) == prompt + output
    assert _completion_text(served[1], {**body, "prompt": ids}) == hf.decode(ids) + output
    assert "<sp>" in hf.decode(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_over_http_special_tokens_show_and_usage_counts_the_truncated_prompt(served, tokenizer, stream):
    """The fake coordinator echoes the prompt's tokens; the reference text is the library's decode of them."""
    prompt = "ab<sp>cd<|x|>"
    ids = tokenizer.encode(prompt, add_special_tokens=False)[-5:]
    body = {"prompt": prompt, "max_tokens": 5, "skip_special_tokens": False, "truncate_prompt_tokens": 5,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if not stream:
        answer = httpx.post(served[1] + "/v1/completions", json=body, timeout=30).json()
        text, usage = answer["choices"][0]["text"], answer["usage"]
    else:
        import json
        with httpx.stream("POST", served[1] + "/v1/completions", json=body, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    assert text == tokenizer._tok.decode(ids, skip_special_tokens=False)
    assert usage["prompt_tokens"] == 5
    plain = httpx.post(served[1] + "/v1/completions", json={**body, "skip_special_tokens": True, "stream": False,
                                                             "stream_options": None}, timeout=30).json()
    assert plain["choices"][0]["text"] == tokenizer._tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_logprobs_token_text_is_each_tokens_own_text_whatever_skip_special_tokens(served, tokenizer, skip):
    """vLLM's logprobs tokens are the token's own text (its detokenizer's setting does not apply to them)."""
    prompt = "a<sp>b"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    body = {"prompt": prompt, "max_tokens": len(ids), "logprobs": 0, "skip_special_tokens": skip}
    answer = httpx.post(served[1] + "/v1/completions", json=body, timeout=30).json()
    assert answer["choices"][0]["logprobs"]["tokens"] == [tokenizer._tok.decode([t], skip_special_tokens=False)
                                                          for t in ids]
    assert answer["choices"][0]["text"] == tokenizer._tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_spells_logprobs_tokens_as_vllm(served, tokenizer, stream):
    """vLLM's return_tokens_as_token_ids: every logprobs token (chosen and top, completions and chat) is
    "token_id:<id>" (vllm/entrypoints/openai serving code's format), chat `bytes` its UTF-8 bytes and completions'
    text_offset advances by its length, as vLLM's; the text itself is unchanged."""
    ids = tokenizer.encode("a<sp>é", add_special_tokens=False)
    as_ids = [f"token_id:{t}" for t in ids]
    common = {"max_tokens": len(ids), "return_tokens_as_token_ids": True, "stream": stream}
    bodies = {"/v1/completions": {"prompt": ids, "logprobs": 1, **common},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                       "top_logprobs": 1, **common}}
    for path, body in bodies.items():
        with httpx.stream("POST", served[1] + path, json=body, timeout=30) as r:
            text = r.read().decode()
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")] if stream else [
            json.loads(text)]
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
        if path == "/v1/completions":
            tokens = [t for lp in logprobs for t in lp["tokens"]]
            assert all(set(top) <= {f"token_id:{i}" for i in range(tokenizer.vocab_size)}
                       for lp in logprobs for top in lp["top_logprobs"])
            offsets = [o for lp in logprobs for o in lp["text_offset"]]
            assert offsets == [sum(map(len, as_ids[:k])) for k in range(len(ids))]
        else:
            tokens = [e["token"] for lp in logprobs for e in lp["content"]]
            assert all(e["bytes"] == list(e["token"].encode()) for lp in logprobs for e in lp["content"])
            assert all(t["token"].startswith("token_id:") for lp in logprobs for e in lp["content"]
                       for t in e["top_logprobs"])
        if path == "/v1/completions":
            assert tokens == as_ids  # the fake coordinator generates the prompt's tokens
        assert len(tokens) == len(ids) and all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens


def test_a_guided_field_over_http_is_400_naming_it(served):
    r = httpx.post(served[1] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "guided_json": {"type": "object"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"


# -- gRPC and the CLI ----------------------------------------------------------------------------------


def test_grpc_fields(tokenizer):
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    assert text_options(pb.GenerateRequest()) == TextOptions()
    req = pb.GenerateRequest(prompt="abcdefgh", max_new_tokens=3, skip_special_tokens=False,
                             spaces_between_special_tokens=False, include_stop_str_in_output=True,
                             truncate_prompt_tokens=3)
    assert text_options(req) == TextOptions(skip_special_tokens=False, spaces_between_special_tokens=False,
                                            include_stop_str_in_output=True)
    assert request_params(req, engine)[0] == tokenizer.encode("abcdefgh")[-3:]
    for bad in (0, -5, 65):
        with pytest.raises(InvalidRequestError) as info:
            request_params(pb.GenerateRequest(prompt="abc", max_new_tokens=3, truncate_prompt_tokens=bad), engine)
        assert info.value.param == "truncate_prompt_tokens"


def test_launch_flags_give_the_text_options(capsys):
    from launcher.cli.main import build_parser, main, text_options

    args = build_parser().parse_args(["launch", "--no-skip-special-tokens", "--include-stop-str-in-output"])
    assert text_options(args) == TextOptions(skip_special_tokens=False, include_stop_str_in_output=True)
    assert text_options(build_parser().parse_args(["launch"])) == TextOptions()
    assert main(["launch", "--serve", "--no-skip-special-tokens"]) == 2  # a server takes it per request
    assert "--no-skip-special-tokens cannot be used with --serve" in capsys.readouterr().err


def test_text_options_refuse_non_booleans():
    with pytest.raises(ValueError, match="skip_special_tokens"):
        TextOptions(skip_special_tokens=0)
