"""vLLM's /tokenize and /detokenize, and /version, over the fake coordinator of test_serving_http.

The tokens /tokenize returns must be exactly the prompt ids the generation endpoints run, so each
test compares it with what /v1/completions or /v1/chat/completions report for the same input
(`usage.prompt_tokens`, and `parse_completion` / `parse_chat` themselves) and with transformers'
own tokenizer on the same tokenizer.json.
"""

from __future__ import annotations

import json

import httpx
import pytest
import tokenizers
import tokenizers.processors

from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import parse_chat, parse_completion
from launcher.serving.serving_engine import InvalidRequestError, ServingEngine
from launcher.serving.tokenize_api import detokenize_body, tokenize_body
from pipeline.model.tokenizer import Tokenizer
from tests.tiny_model import TINY_EOS_ID
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401  (module fixture)

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture()
def server(tokenizer):  # noqa: F811
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1,
                           max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0, api_key="sekret")
    http.start()
    port = http.server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekret"}
    http.stop()


def test_tokenize_matches_the_prompt_ids_generation_runs(tokenizer):  # noqa: F811
    answer = tokenize_body({"prompt": "Hello, wörld"}, tokenizer=tokenizer, model_name="tiny", max_model_len=64)
    parsed = parse_completion({"prompt": "Hello, wörld"}, tokenizer=tokenizer, model_name="tiny")
    assert answer["tokens"] == parsed.prompt_ids and answer["count"] == len(parsed.prompt_ids) == 13
    assert answer["max_model_len"] == 64 and answer["token_strs"] is None
    chat = tokenize_body({"messages": MESSAGES, "return_token_strs": True}, tokenizer=tokenizer, model_name="tiny",
                         max_model_len=64)
    assert chat["tokens"] == parse_chat({"messages": MESSAGES}, tokenizer=tokenizer, model_name="tiny",
                                        max_model_len=64).prompt_ids
    assert "".join(chat["token_strs"]).endswith("<assistant>")  # one byte a token: the strings spell the text
    bare = tokenize_body({"messages": MESSAGES, "add_generation_prompt": False}, tokenizer=tokenizer,
                         model_name="tiny", max_model_len=64)
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and chat["count"] == bare["count"] + len("<assistant>")


def test_token_strings_and_detokenize_agree_with_transformers(tokenizer):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.model_dir / "tokenizer.json"))
    text = "Hello wörld\n\tend"
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tokenizer.token_strings(ids) == reference.convert_ids_to_tokens(ids)
    with_eos = [*ids, TINY_EOS_ID]
    answer = detokenize_body({"tokens": with_eos}, tokenizer=tokenizer, model_name="tiny")
    assert answer == {"prompt": reference.decode(with_eos)}  # special tokens kept, as HF's default
    assert answer["prompt"] != tokenizer.decode(with_eos)  # which generation output skips


@pytest.fixture()
def bos_tokenizer(tmp_path, tokenizer) -> Tokenizer:  # noqa: F811
    """The tiny tokenizer adding BOS (its tokenizer.json's post-processor, which decides, and add_bos_token,
    as Llama 2's folders) and a chat template that spells the BOS (as Llama's)."""
    folder = tmp_path / "bos"
    folder.mkdir()
    for f in tokenizer.model_dir.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token="\u0101", chat_template="{{ bos_token }}" + cfg["chat_template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="\u0101 $A", pair="\u0101 $A $B:1", special_tokens=[("\u0101", tok.token_to_id("\u0101"))])
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_add_special_tokens_adds_the_bos_of_a_model_that_wants_one(bos_tokenizer):
    with_bos = tokenize_body({"prompt": "ab"}, tokenizer=bos_tokenizer, model_name="tiny", max_model_len=64)
    without = tokenize_body({"prompt": "ab", "add_special_tokens": False}, tokenizer=bos_tokenizer,
                            model_name="tiny", max_model_len=64)
    assert with_bos["tokens"] == [bos_tokenizer.bos_token_id, *without["tokens"]] and without["tokens"] == [97, 98]
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(bos_tokenizer.model_dir))
    assert with_bos["tokens"] == reference("ab").input_ids


def test_a_chat_template_that_spells_the_bos_gets_it_once(bos_tokenizer):
    """As Hugging Face's apply_chat_template (and vLLM): the rendered text is tokenised without
    adding special tokens, so a template that writes `{{ bos_token }}` does not get a second BOS."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(bos_tokenizer.model_dir))
    expected = list(reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    parsed = parse_chat({"messages": MESSAGES}, tokenizer=bos_tokenizer, model_name="tiny", max_model_len=64)
    assert parsed.prompt_ids == expected and expected.count(bos_tokenizer.bos_token_id) == 1
    answer = tokenize_body({"messages": MESSAGES}, tokenizer=bos_tokenizer, model_name="tiny", max_model_len=64)
    assert answer["tokens"] == expected


@pytest.mark.parametrize(("fn", "body", "param"), [
    (tokenize_body, [], None), (tokenize_body, {"prompt": 5}, "prompt"), (tokenize_body, {}, "prompt"),
    (tokenize_body, {"prompt": "a", "model": 5}, "model"),
    (tokenize_body, {"prompt": "a", "messages": MESSAGES}, "prompt"),
    (tokenize_body, {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    (tokenize_body, {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    (tokenize_body, {"messages": []}, "messages"),
    (tokenize_body, {"messages": MESSAGES, "chat_template_kwargs": 3}, "chat_template_kwargs"),
    (detokenize_body, {}, "tokens"), (detokenize_body, {"tokens": "abc"}, "tokens"),
    (detokenize_body, {"tokens": [1, -1]}, "tokens"), (detokenize_body, {"tokens": [256]}, "tokens"),
    (detokenize_body, {"tokens": [True]}, "tokens"), (detokenize_body, {"tokens": [1.0]}, "tokens"),
])
def test_bad_fields_are_named(tokenizer, fn, body, param):  # noqa: F811
    kwargs = {"max_model_len": 64} if fn is tokenize_body else {}
    with pytest.raises(InvalidRequestError) as info:
        fn(body, tokenizer=tokenizer, model_name="tiny", **kwargs)
    assert info.value.param == param


def test_http_routes(server):
    url, auth = server
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello"}, headers=auth)
    assert r.status_code == 200 and r.json()["count"] == 5
    done = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, headers=auth)
    assert done.json()["usage"]["prompt_tokens"] == r.json()["count"]
    back = httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]}, headers=auth)
    assert back.status_code == 200 and back.json() == {"prompt": "Hello"}
    assert httpx.post(url + "/tokenize", json={"prompt": "Hello"}).status_code == 401  # the API key applies
    bad = httpx.post(url + "/detokenize", json={"tokens": [999]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", content=b"{", headers=auth).status_code == 400
    version = httpx.get(url + "/version")  # unauthenticated, like /health
    assert version.status_code == 200 and version.json()["version"]


def test_self_distilled_chat_prompts_get_one_bos_as_serving_sends(bos_tokenizer):
    from launcher.cli.training.distill_data import chat_prompt

    served = parse_chat({"messages": [{"role": "user", "content": "Hi there"}]}, tokenizer=bos_tokenizer,
                        model_name="tiny", max_model_len=64).prompt_ids
    assert bos_tokenizer.encode(chat_prompt(bos_tokenizer, "Hi there")) == served
