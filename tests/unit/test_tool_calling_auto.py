"""tool_choice "auto" with each --tool-call-parser through a real HTTP server, read back with the `openai`
client (launcher/serving/formats/tool_output.py, llama_tool_parsers.py, tool_parsers.py).

What breaks when these fail: a server started with --tool-call-parser llama3_json or pythonic does not find
its model's calls, or a stream accumulates to other calls or content than the non-streamed answer;
`parallel_tool_calls: false` keeps more than the first call over the wire; an unknown parser name starts a
server instead of exiting 2 with one error line. The "model" is the echoing fake coordinator of
tests/unit/test_serving_http.py under a chat template that renders only the last message, so the user's text
is exactly what the model writes; the expected calls come from the Python objects those texts are written from.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from launcher.serving.http_server import HttpServer
from launcher.serving.serve import ServeOptions
from launcher.serving.serving_engine import ServingEngine
from pipeline.model.tokenizer import Tokenizer
from tests.tiny_model import write_tiny_model
from tests.unit.test_serving_http import FakeCoordinator
from tests.unit.test_tool_calling import TOOLS, streamed

pytestmark = pytest.mark.timeout(120)
END = "<END>"  # the template's end of the prompt; the request stops there, so the output is the last message
WEATHER, ADD = {"city": "Oslo", "days": 2}, {"a": 1, "b": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("auto") / "model", seed=3)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{{ messages[-1]['content'] }}" + END
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    engine = ServingEngine(FakeCoordinator(Tokenizer(folder), step_s=0.0), model_name="tiny", max_num_seqs=8,
                           max_queue=8, max_model_len=4096)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    yield engine, f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}"
    http.stop()


def ask(server, parser: str, text: str, monkeypatch, **extra):
    """(non-streamed (content, calls, finish_reason), the streamed one) of "auto" with `parser`."""
    monkeypatch.setattr(server[0], "tool_parser", parser)
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = {"model": "tiny", "messages": [{"role": "user", "content": text}], "tools": TOOLS, "max_tokens": 2000,
          "stop": [END], **extra}
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    ids = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"  # vLLM's shapes
    assert all(re.fullmatch(ids, c.id) and c.type == "function" for c in choice.message.tool_calls or [])
    return (choice.message.content, calls, choice.finish_reason), streamed(client, **kw)[0]


def test_llama3_json_calls_over_the_wire(server, monkeypatch):
    text = ('<|python_tag|>' + json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; "
            + json.dumps({"name": "add", "arguments": ADD}))
    whole, stream = ask(server, "llama3_json", text, monkeypatch)
    assert whole == (None, [("get_weather", json.dumps(WEATHER)), ("add", json.dumps(ADD))], "tool_calls")
    assert stream == whole
    whole, stream = ask(server, "llama3_json", "Plain answer {not a call}", monkeypatch)
    assert whole == ("Plain answer {not a call}", [], "stop") and stream == whole


def test_pythonic_calls_over_the_wire(server, monkeypatch):
    text = f"[get_weather(city={WEATHER['city']!r}, days={WEATHER['days']!r}), add(a={ADD['a']!r}, b={ADD['b']!r})]"
    whole, stream = ask(server, "pythonic", text, monkeypatch)
    assert whole == (None, [("get_weather", json.dumps(WEATHER)), ("add", json.dumps(ADD))], "tool_calls")
    assert stream == whole
    whole, stream = ask(server, "pythonic", "[add(a=__import__('os'))]", monkeypatch)
    assert whole == ("[add(a=__import__('os'))]", [], "stop") and stream == whole


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_parallel_tool_calls_false_keeps_the_first_call_over_the_wire(server, monkeypatch, parser):
    text = {"hermes": "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>'
                              for n, a in (("get_weather", WEATHER), ("add", ADD))),
            "llama3_json": json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; "
            + json.dumps({"name": "add", "parameters": ADD}),
            "pythonic": "[get_weather(city='Oslo', days=2), add(a=1, b=True)]"}[parser]
    whole, stream = ask(server, parser, text, monkeypatch)
    assert len(whole[1]) == 2 and stream == whole
    whole, stream = ask(server, parser, text, monkeypatch, parallel_tool_calls=False)
    assert whole == (None, [("get_weather", json.dumps(WEATHER))], "tool_calls") and stream == whole


@pytest.mark.parametrize("name", ["mistral_v11", "llama3", "HERMES"])
def test_an_unknown_parser_exits_2_with_one_line(capsys, name):
    from launcher.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", name])
    error, usage = capsys.readouterr().err.strip().split("\n")  # the CLI's one error line and its usage hint
    assert info.value.code == 2 and "--tool-call-parser" in error and name in error and "pythonic" in error, error
    assert usage.startswith("usage: speedpipe serve")
    with pytest.raises(ValueError, match="llama3_json") as refused:
        ServeOptions(enable_auto_tool_choice=True, tool_call_parser=name)
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def special_server(tmp_path_factory):
    """The echoing server over a tokenizer whose tool-call tags are special tokens (Qwen's `<tool_call>`,
    Mistral's `[TOOL_CALLS]`, Llama 3.1's `<|python_tag|>`), which a plain decode leaves out."""
    import tokenizers

    folder = write_tiny_model(tmp_path_factory.mktemp("special") / "model", seed=3, vocab_size=264)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|eot|>")])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages[-1]['content'] }}" + END}))
    tokenizer = Tokenizer(folder)
    engine = ServingEngine(FakeCoordinator(tokenizer, step_s=0.0), model_name="tiny", max_num_seqs=8,
                           max_queue=8, max_model_len=4096)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    yield engine, f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}", tokenizer
    http.stop()


CALLS = [("get_weather", WEATHER), ("add", ADD)]
TAGGED = {"hermes": "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in CALLS),
          "mistral": "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]),
          "llama3_json": "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)}


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json"])
def test_calls_are_found_when_the_tags_are_special_tokens(special_server, monkeypatch, parser):
    """hermes and mistral read the text with special tokens kept (vLLM's adjust_request), so the server
    needs no start-up refusal; llama3_json reads it either way (a skipped `<|python_tag|>` leaves the `{`);
    special tokens that are not tags (`<|eot|>`) stay in the content, as in vLLM."""
    engine, url, tokenizer = special_server
    text = TAGGED[parser]
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text  # the tag is special
    whole, stream = ask(special_server[:2], parser, text, monkeypatch)
    assert whole == (None, [(n, json.dumps(a)) for n, a in CALLS], "tool_calls") and stream == whole
    if parser != "llama3_json":
        whole, stream = ask(special_server[:2], parser, "Plain<|eot|> answer", monkeypatch)
        assert whole == ("Plain<|eot|> answer", [], "stop") and stream == whole
        whole, _ = ask(special_server[:2], parser, "Plain<|eot|> answer", monkeypatch, tool_choice="none")
        assert whole == ("Plain answer", [], "stop")  # no tools in play: special tokens skipped as asked


def test_mistral_calls_over_the_wire(server, monkeypatch):
    """Both formats, with Mistral's 9-character ids (`ask` checks them)."""
    v11 = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in CALLS)
    for text in (TAGGED["mistral"], v11):
        whole, stream = ask(server, "mistral", text, monkeypatch)
        assert whole == (None, [(n, json.dumps(a)) for n, a in CALLS], "tool_calls") and stream == whole


@pytest.mark.parametrize(("alias", "parser"), [("llama4_json", "llama3_json"), ("llama4_pythonic", "pythonic")])
def test_vllm_aliases_name_the_same_parsers(server, monkeypatch, alias, parser):
    text = {"llama3_json": TAGGED["llama3_json"], "pythonic": "[get_weather(city='Oslo', days=2), add(a=1, b=True)]"}
    assert ask(server, alias, text[parser], monkeypatch) == ask(server, parser, text[parser], monkeypatch)
    assert ServeOptions(enable_auto_tool_choice=True, tool_call_parser=alias).tool_call_parser == alias
