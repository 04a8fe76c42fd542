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
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls or [])
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


@pytest.mark.parametrize("name", ["mistral", "llama3", "HERMES"])
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


def test_only_hermes_needs_its_tags_in_the_served_text(tmp_path):
    """A special `<|python_tag|>` (Llama 3.1's) is left out of the text, which then starts with the `{`
    llama3_json accepts too, so the server starts; hermes without its tags cannot (test_tool_calling.py)."""
    import tokenizers

    from launcher.serving.formats.tool_output import check_tokenizer
    from launcher.serving.formats.tool_parsers import TOOL_CALL_START

    folder = write_tiny_model(tmp_path / "model", seed=3)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<|python_tag|>", TOOL_CALL_START)])
    tok.save(str(folder / "tokenizer.json"))
    tokenizer = Tokenizer(folder)
    call = json.dumps({"name": "add", "parameters": ADD})
    served = tokenizer.decode(tokenizer.encode("<|python_tag|>" + call, add_special_tokens=False))
    assert served == call  # the tag is skipped
    check_tokenizer("llama3_json", tokenizer)
    check_tokenizer("pythonic", tokenizer)
    with pytest.raises(ValueError, match="--tool-call-parser hermes"):
        check_tokenizer("hermes", tokenizer)
