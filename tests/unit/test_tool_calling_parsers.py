"""Tool-call parsing of generated text (launcher/serving/formats/tool_parsers.py), whole and streamed.

What breaks when these fail: a hermes `<tool_call>` block is not a call, or text around it is lost or
leaks into the call; a hermes call's name does not come first or its arguments do not stream as generated,
or a client accumulating the stream (at any chunking) gets other calls or content than a non-streamed
request; a `<tool_call>` tag split across stream chunks is streamed as content (or content
that only looked like a tag start is lost); malformed JSON disappears instead of staying content; a
"required" array item with braces or escaped quotes in a string is cut wrongly; streamed arguments do
not concatenate to the non-streamed ones; finish_reason is not vLLM's ("tool_calls" for auto /
required, "stop" for a named call). No server, no model: the parsers on strings.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from launcher.serving.formats.tool_output import ToolOutput, tool_outputs
from launcher.serving.formats.tools import ToolRequest

TOOLS = ({"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "add"}})
AUTO = ToolRequest(tools=TOOLS, choice="auto", parser="hermes")
REQUIRED = ToolRequest(tools=TOOLS, choice="required")
NAMED = ToolRequest(tools=TOOLS, choice="named", name="add")


def call(name: str, arguments: dict, *, pad: str = "\n") -> str:
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': arguments})}{pad}</tool_call>"


def whole(request: ToolRequest, text: str, reason: str = "stop") -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a non-streamed choice."""
    choice = {"message": {"role": "assistant", "content": text}, "finish_reason": reason}
    ToolOutput(request).rewrite_message(choice)
    calls = choice["message"]["tool_calls"]
    ids = r"[A-Za-z0-9]{9}" if request.parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"  # vLLM's shapes
    assert all(re.fullmatch(ids, c["id"]) and c["type"] == "function" for c in calls), calls
    return choice["message"]["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in calls], \
        choice["finish_reason"]


def streamed(request: ToolRequest, chunks: list[str], reason: str = "stop") -> tuple[str | None, list, str]:
    """The same, from stream deltas: a call's name and id only in its first delta, arguments concatenated.
    Calls come in order (index 0, 1, ...), a call's later deltas carry a non-empty fragment of the latest one."""
    output, content, calls, names, finish = ToolOutput(request), "", {}, {}, None
    for i, text in enumerate(chunks):
        choice = {"delta": {"content": text}, "finish_reason": reason if i == len(chunks) - 1 else None}
        output.rewrite_delta(choice)
        content += choice["delta"]["content"] or ""
        for tc in choice["delta"].get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(names) and tc["function"]["name"] and tc["type"] == "function", tc
                names[tc["index"]] = tc["function"]["name"]
            else:
                assert tc["index"] == len(names) - 1 and "name" not in tc["function"], tc
                assert tc["function"]["arguments"], tc  # no empty fragments
            calls[tc["index"]] = calls.get(tc["index"], "") + tc["function"]["arguments"]
        finish = choice["finish_reason"]
    return content or None, [(names[i], calls[i]) for i in sorted(calls)], finish


HERMES = [  # (generated text, content, calls)
    ("Just text, no tools.", "Just text, no tools.", []),
    (call("get_weather", {"city": "Paris"}), None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + call("get_weather", {"city": "Paris"}), "Let me look.\n",
     [("get_weather", '{"city": "Paris"}')]),
    (call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 1, "b": [2, {"c": "}"}]}),
     None, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": [2, {"c": "}"}]}')]),
    (call("add", {"a": 1}) + "\n\nDone.", "Done.", [("add", '{"a": 1}')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', None, [("add", '{"a": 1}')]),  # unclosed
    ('<tool_call>{"name": "add", "arguments": {"a": 1}} oops</tool_call>x', "x", [("add", '{"a": 1}')]),  # dropped
    ('<tool_call>{"name": "add", "arguments": {"a": [1, ', None, [("add", '{"a": [1, ')]),  # cut: as streamed
    ('<tool_call>{"name": "add", "arguments": {"a" 1}}</tool_call>', None, [("add", '{"a" 1}')]),  # not validated
    ('<tool_call>{"name": "add", "arguments": {"s": "</tool_call>"}}</tool_call>', '"}}</tool_call>',
     [("add", '{"s": "')]),  # the first end tag ends a block, as vLLM's
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ('<tool_call>{oops, "name": "add"}</tool_call>', '<tool_call>{oops, "name": "add"}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": [1, "}"], "name": "x"}, "name": "add"}</tool_call>', None,
     [("add", '{"a": [1, "}"], "name": "x"}')]),  # arguments first: held until the name
    ('<tool_call>{"name":"a\\u0064d","arguments":{"s":"\\u00e9\\n", "t":[ 1 ,2 ]} }</tool_call>', None,
     [("add", '{"s":"\\u00e9\\n", "t":[ 1 ,2 ]}')]),  # the arguments' text as generated
    ('<tool_call>{"name": "add", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>', None,
     [("add", '{"a": 1}')]),  # the first arguments member
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", '"{\\"a\\": 1}"')]),
    ('<tool_call>{"name": "add", "arguments": 12 }</tool_call>', None, [("add", "12")]),
    ("A <tool_call>" + json.dumps({"name": "add", "arguments": {}}) + "</tool_call> B\n" + call("get_weather", {})
     + " C", "A B\nC", [("add", "{}"), ("get_weather", "{}")]),
    ("<tool_call>\n[1, 2]\n</tool_call>", "<tool_call>\n[1, 2]\n</tool_call>", []),  # JSON, not a call
    ("pre " + call("add", {"a": 1}) + " <tool_call>{oops}</tool_call>",
     "pre <tool_call>{oops}</tool_call>", [("add", '{"a": 1}')]),
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}", None, [("add", '{"a": 2}')]),  # unclosed last
    ('<tool_call>\n{"name": "add", "argu', None, [("add", "{}")]),  # cut by max_tokens after the name was sent
    ('<tool_call>\n{"name": "ad', '<tool_call>\n{"name": "ad', []),  # ... before: content
    ("a < b and <tool_ca", "a < b and <tool_ca", []),  # a partial tag at the end is text after all
    ("x <tool_call> y", "x <tool_call> y", []),
    ("<tool_call>{\"name\": \"add\", \"arguments\": {\"s\": \"é ✓\"}}</tool_call>", None, [("add", '{"s": "é ✓"}')]),
    ("<tool_call>{\"name\": \"add\"}</tool_call>", None, [("add", "{}")]),
    ('<tool_call>{"name": "", "arguments": {"a": 1}}</tool_call>',  # an empty name: no call, as vLLM's stream
     '<tool_call>{"name": "", "arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"name": "not_a_tool", "arguments": {}}</tool_call>', None, [("not_a_tool", "{}")]),  # as vLLM
]


def chunkings(text: str):
    """Every fixed chunk size, every cut into two, and 30 random cuts into up to 9 (some chunks empty)."""
    for size in range(1, len(text) + 1):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, 8)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_every_chunking_is_the_whole(request, text, content, calls) -> None:
    """`text` parsed whole gives `content`, `calls` and finish reason tool_calls (stop without calls), and
    streamed at every chunking (`chunkings`) it accumulates to the same (the parsers' streaming contract)."""
    reason = "tool_calls" if calls else "stop"
    assert whole(request, text) == (content, calls, reason)
    for chunks in chunkings(text):
        assert streamed(request, chunks) == (content, calls, reason), chunks


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_stream_at_every_chunking_accumulates_to_the_whole_result(text, content, calls):
    assert_every_chunking_is_the_whole(AUTO, text, content, calls)


def test_hermes_name_comes_first_then_arguments_stream_as_generated():
    text = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 12, "b": [true, "x"]}}\n</tool_call>'
    output, deltas = ToolOutput(AUTO), []
    for i in range(0, len(text), 4):
        choice = {"delta": {"content": text[i:i + 4]}, "finish_reason": "stop" if i + 4 >= len(text) else None}
        output.rewrite_delta(choice)
        deltas += [(text[:i + 4], tc) for tc in choice["delta"].get("tool_calls", [])]
    seen, first = deltas[0]
    assert first["function"] == {"name": "add", "arguments": ""} and first["index"] == 0 and "id" in first
    assert seen.endswith('"name": "add", "') and 'arg' not in seen  # sent once the name is complete
    fragments = [tc["function"]["arguments"] for _, tc in deltas[1:]]
    assert len(fragments) >= 5 and "".join(fragments) == '{"a": 12, "b": [true, "x"]}'
    assert all(not seen.endswith("</tool_call>") for seen, _ in deltas[:-1])  # before the block closed


def test_a_partial_tag_is_held_back_until_it_is_known_and_text_streams_before_it():
    output = ToolOutput(AUTO)
    deltas, sent = [], []
    for i, text in enumerate(["Hi <", "tool_", "call>\n{\"name\": \"add\", ", "\"arguments\": {}}\n</tool_call>"]):
        choice = {"delta": {"content": text}, "finish_reason": "stop" if i == 3 else None, "logprobs": None}
        sent.append(output.rewrite_delta(choice))
        deltas.append(choice["delta"])
    assert [d["content"] for d in deltas] == ["Hi ", "", None, None]
    assert sent == [True, False, True, True]  # a chunk whose text is held back is not sent
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert deltas[3]["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]
    output = ToolOutput(AUTO)
    choice = {"delta": {"content": "1 <tool"}, "finish_reason": None}
    output.rewrite_delta(choice)
    assert choice["delta"]["content"] == "1 "
    choice = {"delta": {"content": "box> 2"}, "finish_reason": None}
    output.rewrite_delta(choice)
    assert choice["delta"]["content"] == "<toolbox> 2"


REQUIRED_CASES = [  # (text, finish reason given, content, calls, finish reason returned)
    ('[{"name": "add", "parameters": {"a": 1}}]', "stop", None, [("add", '{"a": 1}')], "tool_calls"),
    ('[{"name": "get_weather", "parameters": {"city": "x\\"}{[\\\\"}}, {"name": "add", "parameters": {}}]', "stop", None,
     [("get_weather", '{"city": "x\\"}{[\\\\"}'), ("add", "{}")], "tool_calls"),
    ('[ {"name" : "add","parameters":{"s": "ü"}} ]', "stop", None, [("add", '{"s": "ü"}')], "tool_calls"),
    ('[{"parameters": {"a": 2}, "name": "add"}]', "stop", None, [("add", '{"a": 2}')], "tool_calls"),  # other order
    ('[{"name": "add", "parameters": {"s": "ü"}}, {"name": "add", "param', "length", '{"name": "add", "param',
     [("add", '{"s": "ü"}')], "length"),  # the budget ran out before the second call's arguments
    ('[{"name": "add", "parameters": {"a": 1, "b": [{"c"', "length", None, [("add", '{"a": 1, "b": [{"c"')],
     "length"),  # ... inside them: truncated arguments, as a named call's
]


@pytest.mark.parametrize(("text", "given", "content", "calls", "reason"), REQUIRED_CASES)
def test_required_calls_whole_and_streamed(text, given, content, calls, reason):
    assert whole(REQUIRED, text, given) == (content, calls, reason)
    for size in (1, 4, len(text)):
        assert streamed(REQUIRED, [text[i:i + size] for i in range(0, len(text), size)], given) == \
            (content, calls, reason)


def test_required_arguments_stream_as_they_are_generated():
    output, text = ToolOutput(REQUIRED), '[{"name": "add", "parameters": {"a": 12, "b": true}}]'
    fragments = []
    for i in range(0, len(text), 5):
        choice = {"delta": {"content": text[i:i + 5]}, "finish_reason": "stop" if i + 5 >= len(text) else None}
        output.rewrite_delta(choice)
        fragments += [(tc.get("id") is not None, tc["function"]) for tc in choice["delta"].get("tool_calls", [])]
    assert fragments[0][0] and fragments[0][1]["name"] == "add", fragments  # id and name in the first delta
    assert len(fragments) > 4 and all(not first for first, _ in fragments[1:])
    assert "".join(f["arguments"] for _, f in fragments) == '{"a": 12, "b": true}'


def test_required_output_that_is_not_calls_stays_content():
    assert whole(REQUIRED, '[{"x": 1}]') == ('{"x": 1}]', [], "stop")


def test_named_output_is_the_arguments_and_keeps_stop():
    text = '{"a": 1, "b": "}"}'
    assert whole(NAMED, text) == (None, [("add", text)], "stop")
    assert streamed(NAMED, [text[:3], "", text[3:]]) == (None, [("add", text)], "stop")
    assert whole(NAMED, '{"a": ', "length") == (None, [("add", '{"a": ')], "length")


def test_no_parser_for_plain_text_choices():
    assert tool_outputs(None, 2) is None
    assert tool_outputs(ToolRequest(tools=TOOLS, choice="none"), 2) is None
    outputs = tool_outputs(AUTO, 3)
    assert len(outputs) == 3 and len({id(o.parser) for o in outputs}) == 3  # one parser state per choice
