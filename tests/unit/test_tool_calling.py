"""OpenAI tool calling on /v1/chat/completions through a real HTTP server (launcher/serving/formats/tools.py,
tool_parsers.py, chat_messages.py), read back with the `openai` client so OpenAI's own types check the wire.

What breaks when these fail: a bad `tools` / `tool_choice` / `parallel_tool_calls` / tool message is
accepted, or refused with a 500 or a `param` that names no field; a named or "required" call's arguments
do not parse or do not match the tool's schema (the constraint did not reach the model); the response is
not OpenAI's shape (content null, `tool_calls` with `chatcmpl-tool-` ids, vLLM's finish reasons); streamed
tool calls differ from the non-streamed ones, or choices of n > 1 share a parser; "auto" works without the
server's parser or ignores the hermes calls; the chat template never sees the tools, a tool result or an
assistant's tool calls. Constrained requests run the real tiny random model under the real llguidance mask
(`masked_decoding` below), others the echoing fake coordinator of
tests/unit/test_serving_http.py.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
import torch

from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import parse_chat
from launcher.serving.serve import ServeOptions
from launcher.serving.serving_engine import ServingEngine
from pipeline.engine.records import Commit, FinishReason
from pipeline.model.row_layout import Span
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.grammar import GrammarState, GrammarVocab
from pipeline.speculation.sampling import Sampler, SamplingParams
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer, write_tiny_model
from tests.unit.test_serving_http import FakeCoordinator
from tests.unit.test_token_tree_pipeline import _stages

pytestmark = pytest.mark.timeout(120)
# Qwen2.5's shape, shortened: the tools first, an assistant's calls as hermes blocks, a tool result with its id.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "add"}}
CALL_ID = r"chatcmpl-tool-[0-9a-f]{32}|[A-Za-z0-9]{9}"  # vLLM's ids; the second: the mistral parser's


@torch.inference_mode()
def masked_decoding(model, prompt: list[int], params: SamplingParams, vocab: GrammarVocab) -> list[int]:
    """Plain masked decoding (tests/unit/test_grammar_paths.py's reference) with a KV cache: each row
    masked by the grammar at the output so far, then argmax or the seeded draw; stops after EOS."""
    sampler, state, out = Sampler(params), GrammarState(params.grammar, vocab), []
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(prompt) + params.max_new_tokens + 1)
    row = model(torch.tensor(prompt, dtype=torch.int64), [Span(0, 0, len(prompt))], kv)[-1].float()
    while True:
        out.append(sampler.sample(state.masked(row, out), len(out)))
        if out[-1] == TINY_EOS_ID or len(out) == params.max_new_tokens:
            return out
        row = model(torch.tensor(out[-1:]), [Span(0, len(prompt) + len(out) - 1, 1)], kv)[-1].float()


class TinyModelCoordinator(FakeCoordinator):
    """The fake coordinator, but a constrained request (`params.grammar`) gets the tiny model's masked
    decoding of its prompt (greedy or seeded, the real llguidance mask), committed one token at a time.
    Decodings are kept by (prompt, params), so a streamed request repeating a non-streamed one reuses them."""

    def __init__(self, tokenizer: Tokenizer, folder) -> None:
        super().__init__(tokenizer, step_s=0.0)
        (self.model,) = _stages(folder, 1, "none")
        self.vocab = GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
        self.decoded: dict[tuple, list[int]] = {}

    def _run(self, h) -> None:
        if h.params.grammar is None:
            return super()._run(h)
        key = (tuple(h.prompt_ids), repr(h.params))
        if key not in self.decoded:
            self.decoded[key] = masked_decoding(self.model, list(h.prompt_ids), h.params, self.vocab)
        tokens = self.decoded[key]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            reason = (FinishReason.EOS if token == TINY_EOS_ID else FinishReason.LENGTH) if last else None
            if h.finish_reason is not None or h.emit(Commit(0, (token,), reason)):
                return


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tools") / "model", seed=3)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(folder):
    """(engine, base url) of a server with the hermes parser for "auto" (--enable-auto-tool-choice). One torch
    thread: the tiny model's small matmuls ran 25x slower with two threads on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ServingEngine(TinyModelCoordinator(Tokenizer(folder), folder), model_name="tiny", max_num_seqs=8,
                           max_queue=8, max_model_len=4096)
    engine.tool_parser = "hermes"
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    yield engine, f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}"
    http.stop()
    torch.set_num_threads(threads)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=60)


def calls_of(message) -> list[tuple[str, str]]:
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message.tool_calls or [])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client, pieces: list | None = None, **kw) -> dict[int, tuple[str | None, list[tuple[str, str]], str]]:
    """{choice index: (content, [(name, arguments)], finish_reason)} of a stream, deltas accumulated as
    OpenAI's docs do: a call's id and name in its first delta only, then argument fragments
    (each delta's (choice, call index, arguments) appended to `pieces`)."""
    content, calls, finish = {}, {}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            i = choice.index
            content[i] = content.get(i, "") + (choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                got = calls.setdefault(i, {})
                if tc.id is not None:
                    assert tc.index not in got and re.fullmatch(CALL_ID, tc.id) and tc.function.name, tc
                    got[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.function.name is None, tc
                got[tc.index][1] += tc.function.arguments or ""
                if pieces is not None:
                    pieces.append((i, tc.index, tc.function.arguments))
            finish[i] = choice.finish_reason or finish.get(i)
    return {i: (content[i] or None, [tuple(v) for _, v in sorted(calls.get(i, {}).items())], finish[i])
            for i in content}


def test_a_named_call_gets_arguments_that_validate_against_the_tools_schema(client):
    for seed in (None, 1, 2):
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=80, **sampling)
        choice = r.choices[0]
        assert choice.message.content is None and choice.finish_reason == "stop", choice
        [(name, arguments)] = calls_of(choice.message)
        assert name == "add"
        jsonschema.validate(json.loads(arguments), ADD)
        assert streamed(client, model="tiny", messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=80,
                        **sampling) == {0: (None, [(name, arguments)], "stop")}


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_name_a_listed_tool_and_validate_against_its_schema(client, parallel):
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
          "parallel_tool_calls": parallel, "temperature": 1.0}
    for seed in (3, 4, 5, 6):
        choice = client.chat.completions.create(seed=seed, **kw).choices[0]
        calls = calls_of(choice.message)
        assert choice.message.content is None and choice.finish_reason == "tool_calls", choice
        assert 1 <= len(calls) and (parallel or len(calls) == 1), calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert streamed(client, seed=seed, **kw) == {0: (None, calls, "tool_calls")}


HERMES_CALLS = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
                '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>')


def test_auto_finds_hermes_calls_streamed_as_whole_and_per_choice(client):
    """The echoing fake returns the prompt, so the user's text is what the "model" writes: content up to
    the first call (the template's text included), then two calls; n = 2 choices parse independently."""
    kw = {"model": "tiny", "messages": [{"role": "user", "content": HERMES_CALLS}], "tools": TOOLS,
          "max_tokens": 2000, "stop": ["<assistant>"], "n": 2}
    r = client.chat.completions.create(**kw)
    want_calls = [("get_weather", '{"city": "Oslo", "days": 2}'), ("add", '{"a": 1, "b": true}')]
    for choice in r.choices:
        assert calls_of(choice.message) == want_calls and choice.finish_reason == "tool_calls", choice
        assert choice.message.content.startswith("<tools>") and choice.message.content.endswith("<user>Checking. ")
    assert len({c.id for choice in r.choices for c in choice.message.tool_calls}) == 4
    want = (r.choices[0].message.content, want_calls, "tool_calls")
    assert streamed(client, **kw) == {0: want, 1: want}


def test_hermes_arguments_stream_in_fragments_and_odd_blocks_accumulate_to_the_whole_answer(client):
    """A call's arguments arrive in several deltas; arguments before the name, a block broken after its name
    (the call keeps what was streamed, the rest is dropped) and one with no name (content) give a streaming
    client exactly the non-streamed message."""
    text = ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> then '
            '<tool_call>{"name": "add", "arguments": {"a": 1}} oops</tool_call> and <tool_call>{"a": 1}</tool_call>')
    kw = {"model": "tiny", "messages": [{"role": "user", "content": text}], "tools": TOOLS, "max_tokens": 2000,
          "stop": ["<assistant>"]}
    message = client.chat.completions.create(**kw).choices[0].message
    assert calls_of(message) == [("get_weather", '{"city": "Oslo"}'), ("add", '{"a": 1}')]
    assert message.content.endswith('<user>then and <tool_call>{"a": 1}</tool_call>\n')
    pieces = []
    assert streamed(client, pieces, **kw) == {0: (message.content, calls_of(message), "tool_calls")}
    kw["messages"][0]["content"] = HERMES_CALLS
    pieces.clear()
    streamed(client, pieces, **kw)
    firsts = [k for k, (_, index, _) in enumerate(pieces) if index not in {p[1] for p in pieces[:k]}]
    assert firsts == [0, firsts[1]] and pieces[0][2] == pieces[firsts[1]][2] == ""  # the name's delta: no arguments
    assert firsts[1] >= 4 and all(p[2] for k, p in enumerate(pieces) if k not in firsts)  # then fragments


def test_tool_choice_none_is_plain_text_and_the_template_still_sees_the_tools(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": HERMES_CALLS}],
                                       tools=TOOLS, tool_choice="none", max_tokens=2000, stop=["<assistant>"])
    message = r.choices[0].message
    assert not message.tool_calls and r.choices[0].finish_reason == "stop"
    assert message.content.startswith("<tools>" + json.dumps(TOOLS[0], sort_keys=True))
    assert HERMES_CALLS in message.content


def test_auto_without_the_servers_parser_is_400_naming_the_flags(server, client, monkeypatch):
    monkeypatch.setattr(server[0], "tool_parser", None)
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=4, **extra)
        assert info.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in info.value.body["message"]
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_tool_results_and_assistant_tool_calls_reach_the_template(server, client):
    engine, _ = server
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    parsed = parse_chat({"messages": messages, "tools": TOOLS, "tool_choice": "none"}, tokenizer=engine.tokenizer,
                        model_name="tiny", max_model_len=4096)
    prompt = engine.tokenizer.decode(parsed.prompt_ids)
    tools = "".join(json.dumps(t, sort_keys=True) for t in TOOLS)  # Jinja's tojson sorts the keys
    assert prompt == (f"<tools>{tools}</tools>\n<user>Weather in Paris?\n"
                      '<assistant><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
                      "<tool>rain[call_1]\n<assistant>")
    messages[1]["tool_calls"][0]["function"]["arguments"] = ""  # no arguments: an empty object, as vLLM
    parsed = parse_chat({"messages": messages, "tools": TOOLS, "tool_choice": "none"}, tokenizer=engine.tokenizer,
                        model_name="tiny", max_model_len=4096)
    assert '{"name": "get_weather", "arguments": {}}' in engine.tokenizer.decode(parsed.prompt_ids)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
                                       temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), ADD)


def test_tokenize_counts_the_prompt_a_chat_request_with_tools_runs(server):
    """/tokenize's tokens are the chat request's prompt ids: the template sees the tools there too."""
    engine, url = server
    body = {"messages": USER, "tools": TOOLS}
    parsed = parse_chat({**body, "tool_choice": "none"}, tokenizer=engine.tokenizer, model_name="tiny", max_model_len=4096)
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == parsed.prompt_ids
    r = httpx.post(url + "/tokenize", json={**body, "tools": [{"type": "function"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function"


FN = TOOLS[1]["function"]
REFUSED = [  # (body fields, param)
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter", "function": FN}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {**FN, "name": "my tool"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {**FN, "name": "n" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"parameters": ADD}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {**FN, "description": 5}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {**FN, "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {**FN, "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {**FN, "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [TOOLS[1], TOOLS[0], TOOLS[1]]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {**FN, "description": "x" * 300_000}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "ignore_eos": True}, "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "objekt"}}}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "objekt"}}}}}], "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"functions": [FN]}, "functions"),
    ({"messages": [*USER, {"role": "tool", "content": "rain"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "tool", "content": "rain", "tool_call_id": 7}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": {"a": 1}}]}, "messages[1].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages[1].tool_calls[0].function"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refusals_are_400_in_one_line_naming_the_field(server, fields, param):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"] and len(error["message"]) < 500


def test_tools_are_refused_on_completions_and_accepted_empty_or_null_on_chat(server):
    url = server[1]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    for fields in ({"tools": []}, {"tools": None, "tool_choice": "none"}, {"tools": TOOLS, "parallel_tool_calls": False}):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3, **fields}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_serve_flags_need_each_other_and_a_known_parser(capsys):
    from launcher.cli.main import main

    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServeOptions(enable_auto_tool_choice=True)
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral_v11"])
    assert info.value.code == 2
    assert ServeOptions(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"


def test_a_streamed_named_call_sends_arguments_as_they_are_generated(server):
    """The arguments of a named call arrive in fragments (not one piece at the end)."""
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60,
            "temperature": 0, "stream": True}
    fragments, started = [], time.monotonic()
    with httpx.stream("POST", server[1] + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    fragments += [tc["function"]["arguments"] for tc in choice["delta"].get("tool_calls", [])]
    assert len(fragments) > 3 and time.monotonic() - started < 60
    jsonschema.validate(json.loads("".join(fragments)), ADD)


def test_hermes_reads_text_with_special_tokens_kept_for_a_tokenizer_whose_tags_are_special(folder, tmp_path):
    """A special `<tool_call>` would be left out of the text, so the parser would never see a call: as vLLM's
    hermes `adjust_request`, "auto" with hermes decodes with skip_special_tokens false (it replaced a start-up
    refusal of such tokenizers); other tool choices keep the request's own setting.
    Over the wire: tests/unit/test_tool_calling_auto.py."""
    import shutil

    import tokenizers

    special = shutil.copytree(folder, tmp_path / "special")
    tok = tokenizers.Tokenizer.from_file(str(special / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(special / "tokenizer.json"))
    tokenizer = Tokenizer(special)
    assert "<tool_call>" not in tokenizer.decode(tokenizer.encode("<tool_call>", add_special_tokens=False))

    def skips(parser, **body):
        parsed = parse_chat({"messages": USER, "tools": TOOLS, **body}, tokenizer=tokenizer, model_name="tiny",
                            max_model_len=4096, tool_parser=parser)
        return parsed.text.skip_special_tokens

    assert skips("hermes") is False and skips("hermes", skip_special_tokens=True) is False  # vLLM overrides it
    assert skips("hermes", tool_choice="none") is True and skips("hermes", tool_choice="required") is True
    assert skips("hermes", tool_choice="none", skip_special_tokens=False) is False
    assert skips("pythonic") is True and skips("mistral") is False
