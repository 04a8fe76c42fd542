"""Tool-call parsing of generated text (launcher/serving/formats/tool_parsers.py), whole and streamed.

What breaks when these fail: a hermes `<tool_call>` block is not a call, or text around it is lost or
leaks into the call; a `<tool_call>` tag split across stream chunks is streamed as content (or content
that only looked like a tag start is lost); malformed JSON disappears instead of staying content; a
"required" array item with braces or escaped quotes in a string is cut wrongly; streamed arguments do
not concatenate to the non-streamed ones; finish_reason is not vLLM's ("tool_calls" for auto /
required, "stop" for a named call). No server, no model: the parsers on strings.
"""

from __future__ import annotations

import json

import pytest

from launcher.serving.formats.tool_parsers import ToolOutput, tool_outputs
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
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    return choice["message"]["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in calls], \
        choice["finish_reason"]


def streamed(request: ToolRequest, chunks: list[str], reason: str = "stop") -> tuple[str | None, list, str]:
    """The same, from stream deltas: a call's name and id only in its first delta, arguments concatenated."""
    output, content, calls, names, finish = ToolOutput(request), "", {}, {}, None
    for i, text in enumerate(chunks):
        choice = {"delta": {"content": text}, "finish_reason": reason if i == len(chunks) - 1 else None}
        output.rewrite_delta(choice)
        content += choice["delta"]["content"] or ""
        for tc in choice["delta"].get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in names and tc["function"]["name"], tc
                names[tc["index"]] = tc["function"]["name"]
            else:
                assert tc["index"] in names and "name" not in tc["function"], tc
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
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}\n</tool_call>",  # malformed: stays content
     "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}\n</tool_call>", []),
    ("<tool_call>\n[1, 2]\n</tool_call>", "<tool_call>\n[1, 2]\n</tool_call>", []),  # JSON, not a call
    ("pre " + call("add", {"a": 1}) + " <tool_call>{oops}</tool_call>",
     "pre <tool_call>{oops}</tool_call>", [("add", '{"a": 1}')]),
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}", None, [("add", '{"a": 2}')]),  # unclosed last
    ("<tool_call>\n{\"name\": \"add\", \"argu", "<tool_call>\n{\"name\": \"add\", \"argu", []),  # cut by max_tokens
    ("a < b and <tool_ca", "a < b and <tool_ca", []),  # a partial tag at the end is text after all
    ("x <tool_call> y", "x <tool_call> y", []),
    ("<tool_call>{\"name\": \"add\", \"arguments\": {\"s\": \"é ✓\"}}</tool_call>", None, [("add", '{"s": "é ✓"}')]),
    ("<tool_call>{\"name\": \"add\"}</tool_call>", None, [("add", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_whole_and_streamed_at_every_chunk_size(text, content, calls):
    reason = "tool_calls" if calls else "stop"
    assert whole(AUTO, text) == (content, calls, reason)
    for size in (1, 2, 3, 7, 11, len(text)):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert streamed(AUTO, chunks) == (content, calls, reason), size


def test_a_partial_tag_is_held_back_until_it_is_known_and_text_streams_before_it():
    output = ToolOutput(AUTO)
    deltas, sent = [], []
    for i, text in enumerate(["Hi <", "tool_", "call>\n{\"name\": \"add\", ", "\"arguments\": {}}\n</tool_call>"]):
        choice = {"delta": {"content": text}, "finish_reason": "stop" if i == 3 else None, "logprobs": None}
        sent.append(output.rewrite_delta(choice))
        deltas.append(choice["delta"])
    assert [d["content"] for d in deltas] == ["Hi ", "", "", None]
    assert sent == [True, False, False, True]  # a chunk whose text is held back is not sent
    assert deltas[3]["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"}
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
