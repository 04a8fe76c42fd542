"""The mistral tool-call parser (launcher/serving/formats/mistral_tool_parser.py), whole and streamed.

What breaks when these fail: a Mistral call (`[TOOL_CALLS]` then a JSON array of {"name", "arguments"}, or
v11+'s `[TOOL_CALLS]name[ARGS]{...}`) is not found, or text that is no call is lost instead of staying
content; content before the tag is lost; a call's arguments are not the JSON the model wrote; a client
accumulating a stream (at any chunking) gets other calls or content than a non-streamed request; call ids
are not Mistral's 9 letters and digits (tests/unit/test_tool_calling_parsers.py's `whole` checks them).
No server, no model: the parser on strings. Expected calls come from the Python objects the texts are
written from (json.dumps). `parallel_tool_calls: false` runs these cases in test_tool_calling_llama_parsers.py.
"""

from __future__ import annotations

import json
import re

import pytest

from launcher.serving.formats.mistral_tool_parser import mistral_call_id
from launcher.serving.formats.tools import ToolRequest
from tests.unit.test_tool_calling_parsers import TOOLS, assert_every_chunking_is_the_whole

MISTRAL_REQUEST = ToolRequest(tools=TOOLS, choice="auto", parser="mistral")
T = "[TOOL_CALLS]"
ARGS = {"city": "Paris", "s": "]}{,\"\\ [ARGS] é ✓", "n": [1, -2.5, {"m": None, "t": True}]}
ARGS_TEXT = json.dumps(ARGS, ensure_ascii=False)


def item(name, args=None, key="arguments") -> str:
    return json.dumps({"name": name, **({} if args is None else {key: args})}, ensure_ascii=False)


def want(name, args) -> tuple[str, str]:
    return name, json.dumps(args, ensure_ascii=False)


CUT = T + "[" + item("add", ARGS)
MISTRAL = [  # (generated text, content, calls)
    ("Just text, no tools.", "Just text, no tools.", []),
    (T + json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}]), None,
     [want("get_weather", {"city": "Paris"})]),
    (T + " [" + item("add", ARGS) + ",\n " + item("get_weather", {"city": "Oslo"}) + "]", None,
     [want("add", ARGS), want("get_weather", {"city": "Oslo"})]),
    ("Sure. " + T + "[" + item("add", {"a": 1}) + "]", "Sure. ", [want("add", {"a": 1})]),
    (T + "[" + item("add", {"a": 1}, key="parameters") + "]", None, [want("add", {"a": 1})]),
    (T + "[" + item("add") + "]", None, [("add", "{}")]),  # no arguments written
    (T + "[" + item("add", {"a": 1}) + "] trailing", None, [want("add", {"a": 1})]),  # after `]`: dropped
    (T + "[" + item("add", {"a": 1}) + ", oops]", None, [want("add", {"a": 1})]),
    (T + "[" + item("add", {"a": 1}) + ', {"a": 2}]', None, [want("add", {"a": 1})]),  # a later item, no name
    (CUT[:CUT.index('"n": [') + 6], None, [("add", ARGS_TEXT[:ARGS_TEXT.index('"n": [') + 6])]),  # budget
    (T + "[]", T + "[]", []),
    (T + '[{"a": 1}]', T + '[{"a": 1}]', []),
    (T + "[" + item("", {"a": 1}) + "]", T + "[" + item("", {"a": 1}) + "]", []),  # an empty name: no call
    ("Text " + T + " not a call", "Text " + T + " not a call", []),
    (T, T, []),
    (T + "\n", T + "\n", []),
    ("[TOOL_CALL", "[TOOL_CALL", []),
    ("a [TOOL_CALLZ] b", "a [TOOL_CALLZ] b", []),
    # v11+: a call per tag, the name before [ARGS], the arguments object after it
    (T + "get_weather[ARGS]" + json.dumps({"city": "Paris"}), None, [want("get_weather", {"city": "Paris"})]),
    (T + "add[ARGS]" + ARGS_TEXT + T + "get_weather[ARGS]" + json.dumps({"city": "Oslo"}), None,
     [want("add", ARGS), want("get_weather", {"city": "Oslo"})]),
    ("Hi " + T + "add[ARGS]{}", "Hi ", [("add", "{}")]),
    (T + "add[ARGS]" + json.dumps({"a": 1}) + " bye", None, [want("add", {"a": 1})]),  # after the call: dropped
    (T + "add[ARGS] \n" + json.dumps({"a": 1}), None, [want("add", {"a": 1})]),  # whitespace before the object
    (T + "add[ARGS]12", None, [("add", "{}")]),  # no arguments object
    (T + "add[ARGS]" + ARGS_TEXT[:20], None, [("add", ARGS_TEXT[:20])]),  # cut by the budget: as streamed
    (T + "add" + json.dumps({"a": 1}), T + "add" + json.dumps({"a": 1}), []),  # no [ARGS]: content
    (T + "add[AR", T + "add[AR", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL)
def test_mistral_stream_at_every_chunking_accumulates_to_the_whole_result(text, content, calls):
    assert_every_chunking_is_the_whole(MISTRAL_REQUEST, text, content, calls)


def test_mistral_call_ids_are_nine_letters_and_digits():
    ids = {mistral_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
