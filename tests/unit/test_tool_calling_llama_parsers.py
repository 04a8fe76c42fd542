"""The llama3_json and pythonic tool-call parsers (launcher/serving/formats/llama_tool_parsers.py) and
`parallel_tool_calls: false` under "auto" (launcher/serving/formats/tool_output.py), whole and streamed.

What breaks when these fail: a Llama 3.x JSON call (`<|python_tag|>` or `{`, objects joined by `;`) or a
pythonic list of calls is not found, or text that is no call is lost instead of staying content; a call's
arguments are not the JSON the model wrote (llama3_json: its text; pythonic: `json.dumps` of the Python
literals); a pythonic output is evaluated rather than read as literals (positional arguments, expressions,
`**kwargs` must stay content); a client accumulating a stream (at any chunking) gets other calls or content
than a non-streamed request; an empty name becomes a call; `parallel_tool_calls: false` keeps more than the
first call, or the stream and the whole message disagree on which. No server, no model: the parsers on
strings. Expected calls come from the Python objects the texts are written from (json.dumps, repr).
"""

from __future__ import annotations

import json

import pytest

from launcher.serving.formats.tool_output import AUTO_PARSERS
from launcher.serving.formats.tools import TOOL_PARSERS, ToolRequest
from tests.unit.test_tool_calling_mistral import MISTRAL
from tests.unit.test_tool_calling_parsers import (
    HERMES,
    TOOLS,
    assert_every_chunking_is_the_whole,
    chunkings,
    streamed,
    whole,
)

LLAMA = ToolRequest(tools=TOOLS, choice="auto", parser="llama3_json")
PYTHONIC = ToolRequest(tools=TOOLS, choice="auto", parser="pythonic")
TAG = "<|python_tag|>"
ARGS = {"city": "Paris", "s": "}{;\"\\ é ✓", "n": [1, -2.5, {"m": None, "t": True}]}


def obj(name, args=None, key="parameters") -> str:
    return json.dumps({"name": name, **({} if args is None else {key: args})}, ensure_ascii=False)


def want(name, args) -> tuple[str, str]:
    return name, json.dumps(args, ensure_ascii=False)


FULL, ARGS_TEXT = obj("add", ARGS), json.dumps(ARGS, ensure_ascii=False)
LLAMA3_JSON = [  # (generated text, content, calls)
    ("Just text, no tools.", "Just text, no tools.", []),
    (TAG + obj("get_weather", {"city": "Paris"}), None, [want("get_weather", {"city": "Paris"})]),
    (obj("add", ARGS, "arguments"), None, [want("add", ARGS)]),
    ("\n " + TAG + " " + obj("get_weather", {"city": "Oslo"}) + "; " + obj("add", ARGS) + ";\n" + obj("add", {}),
     None, [want("get_weather", {"city": "Oslo"}), want("add", ARGS), want("add", {})]),
    (obj("add", {"a": 1}) + " trailing text", None, [want("add", {"a": 1})]),  # dropped, as vLLM's stream
    (obj("add", {"a": 1}) + '; {"a": 2}', None, [want("add", {"a": 1})]),  # a later object with no name: dropped
    (obj("add", {"a": 1}) + "; oops", None, [want("add", {"a": 1})]),
    (obj("add"), None, [("add", "{}")]),  # no arguments written
    (obj("add", 12), None, [("add", "12")]),  # arguments not an object: their JSON text, as vLLM's json.dumps
    (obj("add", '{"a": 1}'), None, [("add", json.dumps('{"a": 1}'))]),
    (obj("not_a_tool", {}), None, [("not_a_tool", "{}")]),  # not checked against the tools, as vLLM's
    ('{"name": "add", "parameters": {"a": 1} oops, "x": 2}; ' + obj("add"), None, [want("add", {"a": 1})]),
    (FULL[:FULL.index('"n": [') + 6], None, [("add", ARGS_TEXT[:ARGS_TEXT.index('"n": [') + 6])]),  # cut: as streamed
    ('{"a": 1}', '{"a": 1}', []),  # JSON, no call
    (obj("", {"a": 1}), obj("", {"a": 1}), []),  # an empty name: no call
    ('{"name": 5, "parameters": {}}; ' + obj("add"), '{"name": 5, "parameters": {}}; ' + obj("add"), []),
    (" " + FULL[:10], " " + FULL[:10], []),  # cut before the name: content
    ("Let me call " + obj("add"), "Let me call " + obj("add"), []),  # text first: content (vLLM's stream)
    (TAG + TAG + obj("add"), TAG + TAG + obj("add"), []),
    (TAG + "brave_search.call(query='x')", TAG + "brave_search.call(query='x')", []),  # a built-in tool: content
    ("<|python", "<|python", []),
    ("<|python_tax|>", "<|python_tax|>", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_JSON)
def test_llama3_json_stream_at_every_chunking_accumulates_to_the_whole_result(text, content, calls):
    assert_every_chunking_is_the_whole(LLAMA, text, content, calls)


def test_llama3_json_name_comes_first_then_arguments_stream_as_generated():
    text = TAG + obj("add", ARGS)
    output, deltas = ToolOutputProbe(LLAMA), []
    for i in range(0, len(text), 3):
        deltas += [(text[:i + 3], tc) for tc in output.feed(text[i:i + 3], last=i + 3 >= len(text))]
    seen, first = deltas[0]
    assert first["function"] == {"name": "add", "arguments": ""} and seen.endswith('"add", ')
    fragments = [tc["function"]["arguments"] for _, tc in deltas[1:]]
    assert len(fragments) > 10 and "".join(fragments) == json.dumps(ARGS, ensure_ascii=False)


def call(name, **kwargs) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


NESTED = {"a": [1, -2.5, None, True, False], "b": {"k": "v'\"])", "é": "✓ \n"}, "c": -7, "d": +0.5}
PYTHONIC_CASES = [  # (generated text, content, calls)
    ("Just text.", "Just text.", []),
    (f"[{call('get_weather', city='Paris', days=3)}, {call('add')}]", None,
     [want("get_weather", {"city": "Paris", "days": 3}), want("add", {})]),
    (f"\n [{call('add', **NESTED)}]", None, [want("add", NESTED)]),
    (f"[{call('add', a=1)}]\nDone.", None, [want("add", {"a": 1})]),  # text after the list: dropped
    ("[add(a='])}\\'')]", None, [want("add", {"a": "])}'"})]),  # brackets and a quote inside a string
    ("[add(a='''it's ] ok''', b=\"\"\"say \"hi\" ]\"\"\")]", None,  # triple quotes holding quotes and brackets
     [want("add", {"a": "it's ] ok", "b": 'say "hi" ]'})]),
    ("[add(a=1,  # a comment: ] ' [\n     b=2)]", None, [want("add", {"a": 1, "b": 2})]),  # as Python skips it
    ("[add(a='x' \\\n    'y')]", None, [want("add", {"a": "xy"})]),  # a line continuation, implicit concatenation
    ("[add(a=f'{1}]')]", "[add(a=f'{1}]')]", []),  # an f-string is no literal: content
    ("[add(a=b']')]", "[add(a=b']')]", []),  # bytes: no JSON for them
    ("[add(1)]", "[add(1)]", []),  # positional arguments: content (vLLM drops them)
    ("[add(a=1 + 2)]", "[add(a=1 + 2)]", []),  # an expression: content, never evaluated
    ("[add(a=x)]", "[add(a=x)]", []),
    ("[add(a=(1, 2))]", "[add(a=(1, 2))]", []),
    ("[add(a={1: 2})]", "[add(a={1: 2})]", []),
    ("[add(**{'a': 1})]", "[add(**{'a': 1})]", []),
    ("[os.system(a='x')]", "[os.system(a='x')]", []),
    ("[add(a=1e999)]", "[add(a=1e999)]", []),  # not finite: no JSON for it
    ("[add(), 1]", "[add(), 1]", []),
    ("[]", "[]", []),
    ("[1] is a citation.", "[1] is a citation.", []),
    ("add(a=1)", "add(a=1)", []),  # not a list
    ("Sure: [add(a=1)]", "Sure: [add(a=1)]", []),
    ("[add(a=1), get_weather(city='Pa", "[add(a=1), get_weather(city='Pa", []),  # cut by the budget
    ("[add(a=1)", "[add(a=1)", []),
    (" ", " ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC_CASES)
def test_pythonic_stream_at_every_chunking_accumulates_to_the_whole_result(text, content, calls):
    assert_every_chunking_is_the_whole(PYTHONIC, text, content, calls)


def test_pythonic_calls_go_out_whole_when_the_list_closes():
    text = f"[{call('get_weather', city='Oslo')}, {call('add', a=2)}]"
    output, sent = ToolOutputProbe(PYTHONIC), []
    for i in range(len(text)):
        sent += [(i, tc) for tc in output.feed(text[i], last=i == len(text) - 1)]
    assert [i for i, _ in sent] == [len(text) - 1] * 2  # both at the closing bracket, each in one delta
    assert [tc["function"] for _, tc in sent] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                                  {"name": "add", "arguments": '{"a": 2}'}]


CASES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "pythonic": PYTHONIC_CASES, "mistral": MISTRAL,
         "llama4_json": LLAMA3_JSON, "llama4_pythonic": PYTHONIC_CASES}  # vLLM's aliases: the same cases


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(parser):
    """Later calls are dropped (vLLM's rule), content stays; the parallel answer is the reference."""
    serial = ToolRequest(tools=TOOLS, choice="auto", parser=parser, parallel=False)
    assert any(len(calls) > 1 for _, _, calls in CASES[parser])
    for text, _, _ in CASES[parser]:
        parallel = whole(ToolRequest(tools=TOOLS, choice="auto", parser=parser), text)
        expect = (parallel[0], parallel[1][:1], parallel[2])
        assert whole(serial, text) == expect
        for chunks in chunkings(text):
            assert streamed(serial, chunks) == expect, chunks


def test_every_parser_flag_has_a_parser():
    assert set(AUTO_PARSERS) == set(TOOL_PARSERS)


class ToolOutputProbe:
    """A ToolOutput fed one chunk at a time: the tool_calls deltas each chunk produced."""

    def __init__(self, request: ToolRequest) -> None:
        from launcher.serving.formats.tool_output import ToolOutput

        self.output = ToolOutput(request)

    def feed(self, text: str, *, last: bool) -> list[dict]:
        choice = {"delta": {"content": text}, "finish_reason": "stop" if last else None}
        self.output.rewrite_delta(choice)
        return choice["delta"].get("tool_calls", [])


def _tokenize_list_end(text: str) -> int | None:
    """Reference: where Python's own tokenizer closes the bracket at text[0] (None: not yet, or no Python)."""
    import io
    import tokenize

    lines = io.StringIO(text).readlines()
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))
    depth = 0
    try:
        for token in tokenize.generate_tokens(iter(lines).__next__):
            if token.type == tokenize.ERRORTOKEN:
                return None
            if token.type == tokenize.OP and token.string in ("(", "[", "{", ")", "]", "}"):
                depth += 1 if token.string in "([{" else -1
                if depth == 0:
                    return line_starts[token.end[0] - 1] + token.end[1]
    except (tokenize.TokenError, SyntaxError):
        return None
    return None


LIST_ENDS = [text for text, _, _ in PYTHONIC_CASES if text.lstrip().startswith("[")] + [
    "[add(a='''x ' ]\n'''), add(b=\"\"\"\"\"\")]", "[add(a='', b=\"\")] '", "[add(a=r'\\'', b='\\\\')]",
    "[add(a=1)  # ]\n]", "[add(a='''''')]", "[add(a=\"\"\"\" ]\"\"\")]", "[add(a={'k': [1, (2, 3)]})]"]


@pytest.mark.parametrize("text", LIST_ENDS)
def test_pythonic_list_end_is_where_pythons_tokenizer_closes_it_at_every_chunking(text):
    """The list's end, scanned as chunks arrive, is the offset Python's tokenize gives the whole text, and at
    every prefix either that offset or not yet (a prefix tokenize already closes is closed)."""
    from launcher.serving.formats.llama_tool_parsers import PythonicParser

    text = text.lstrip()
    want = _tokenize_list_end(text)
    for chunks in chunkings(text):
        parser, seen, end = PythonicParser(), "", None
        for chunk in chunks:
            parser.feed(chunk)
            seen += chunk
            if parser.phase in ("done", "content") and end is None:
                end = len(seen)
                assert want is not None and want <= end, (chunks, seen)
                assert _tokenize_list_end(seen) == want, (chunks, seen)  # closed as soon as tokenize closes it
        if want is not None and end is None:
            raise AssertionError(f"never closed at {chunks}")


def test_pythonic_list_end_is_found_in_linear_time(monkeypatch):
    """A call whose argument is a long nested list, streamed in 4-character chunks: each `]` must not read
    the whole text again (re-tokenizing the text at each `]` took 22 s on this machine for these 27,788
    characters). Counted, not timed: the characters the scanner reads over the whole stream stay within
    twice the text's length."""
    from launcher.serving.formats import llama_tool_parsers
    from launcher.serving.formats.llama_tool_parsers import PythonicParser

    scanned, scan = [0], llama_tool_parsers._scan

    def counting_scan(text, pos, *args):
        out = scan(text, pos, *args)
        scanned[0] += len(text) - pos  # what this call could read: the rest of the text
        return out

    monkeypatch.setattr(llama_tool_parsers, "_scan", counting_scan)
    rows = [[i, -i] for i in range(2000)]
    text = f"[{call('add', a=rows)}]"
    parser = PythonicParser()
    deltas = [parser.feed(text[i:i + 4])[1] for i in range(0, len(text), 4)]
    assert [(d.name, json.loads(d.arguments)) for ds in deltas for d in ds] == [("add", {"a": rows})]
    assert scanned[0] <= 2 * len(text), f"{scanned[0]} characters scanned for a text of {len(text)}"
