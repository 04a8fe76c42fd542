"""Tool calls out of a chat choice's generated text, streamed or whole (launcher/serving/formats/tools.py).

Owns the parsers of the named and "required" modes and of "auto" with the hermes parser, and the JSON
reading they share (`JsonScanner`, `HermesBlock`, which launcher/serving/formats/llama_tool_parsers.py's
llama3_json parser reuses); launcher/serving/formats/tool_output.py picks a parser and writes its
`CallDelta`s in OpenAI's shape (the name in the first delta of a call, then argument fragments).
  named    the whole output is the arguments object (streamed as it is generated);
  required the output is a JSON array of {"name", "parameters"}: a call per item, starting once its
           name is written, its arguments the `parameters` value as generated (streamed as well);
  hermes   ("auto" with --tool-call-parser hermes; Qwen2.5 / Hermes templates): text outside
           `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks is content (a possible partial
           `<tool_call>` is held back; whitespace right after a call is dropped). A block's JSON is read as
           generated, its top-level shape checked ({, "key": value, ..., }); a block is a call once its
           top-level "name" string is complete (vLLM's hermes sends the name then too): the first delta (name,
           arguments "" or those read with it) goes out, then the text of the first top-level "arguments" (or
           "parameters") value as generated, so a call's arguments are that text, not re-serialized (arguments
           written before the name wait for it, then go out at once). A sent call cannot be taken back: when
           its block ends (`</tool_call>`, or the end of the output as in vLLM) its arguments are what was
           streamed, `{}` if none was written; text after a break of the top-level shape (`} oops`) is dropped;
           the arguments' inside is not validated (a value that is not an object, `"arguments": 12`, is its
           JSON text "12", as vLLM's json.dumps of it). A block that ends before a name was read (not an object,
           no name, a name not a string or empty, a break before it) stays content, tags included; a name that
           is not one of the request's tools is still a call (vLLM's hermes does not check it either). The
           first `</tool_call>` ends a block, even inside a JSON string (as vLLM's).
Each parser: `feed(text)` -> (content, [CallDelta]) for the text generated since its last call, `finish()`
-> the same for what it held back. A non-streamed choice is parsed by feeding its whole text to the same
parser, so the streamed arguments concatenate to exactly the non-streamed ones.
Must not: do I/O, or import launcher/serving.
"""

from __future__ import annotations

import dataclasses
import json
import re

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')  # a required item's start


class JsonScanner:
    """Where JSON text stands, one character at a time: its nesting depth and whether inside a string
    (RFC 8259's strings and brackets; the text is not validated). Shared by the required, hermes and llama3_json
    parsers."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False

    def step(self, char: str) -> None:
        if self.in_string:
            self.escape, self.in_string = (not self.escape and char == "\\"), self.escape or char != '"'
        elif char == '"':
            self.in_string = True
        elif char in "[{":
            self.depth += 1
        elif char in "]}":
            self.depth -= 1


@dataclasses.dataclass(frozen=True)
class CallDelta:
    """A piece of tool call `index` of a choice: its name (first piece only) and an arguments fragment."""

    index: int
    name: str | None
    arguments: str


class NamedParser:
    """tool_choice names a function: every generated character is its arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if not text and self.started:
            return "", []
        first, self.started = not self.started, True
        return "", [CallDelta(0, self.name if first else None, text)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("") if not self.started else ("", [])


class RequiredParser:
    """tool_choice "required": a JSON array of {"name", "parameters"} items (the grammar writes "name" first).

    A call starts once an item's `{"name": "...", "parameters": ` is written; its arguments are the
    `parameters` value as generated, streamed up to the last character inside it. An item in another
    shape becomes a call when complete (its parameters as `json.dumps` writes them); text that is no
    item, or an item cut before its arguments began, is returned as content.
    """

    def __init__(self) -> None:
        self.text, self.pos, self.start, self.scan, self.broken = "", 0, 0, JsonScanner(), False
        self.calls = 0
        self.args_start = self.args_end = self.sent = -1  # the current item's arguments: text[args_start:args_end]

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        deltas: list[CallDelta] = []
        while self.pos < len(self.text) and not self.broken:
            self._step(self.text[self.pos], deltas)
            self.pos += 1
        self._send(deltas)
        return "", deltas

    def _step(self, char: str, deltas: list[CallDelta]) -> None:
        """Advance the scan by one character, adding the deltas of a call it starts or completes."""
        before = self.scan.depth
        self.scan.step(char)
        if self.scan.depth > before:
            if before == 2 and self.args_start < 0:
                self._start_call(deltas)
            self.start = self.pos if before == 1 else self.start
        elif self.scan.depth < before == 2:
            return self._item(deltas)
        if self.args_start >= 0 and max(before, self.scan.depth) >= 3:  # within the arguments value
            self.args_end = self.pos + 1

    def _start_call(self, deltas: list[CallDelta]) -> None:
        """A call when the current item reads `{"name": "<name>", "parameters": ` before this `{`."""
        head = _CALL_HEAD.fullmatch(self.text, self.start, self.pos)
        if head is not None:
            self.args_start = self.args_end = self.sent = self.pos
            deltas.append(CallDelta(self.calls, json.loads(head.group(1)), ""))

    def _send(self, deltas: list[CallDelta]) -> None:
        if self.args_start >= 0 and self.args_end > self.sent:
            deltas.append(CallDelta(self.calls, None, self.text[self.sent:self.args_end]))
            self.sent = self.args_end

    def _item(self, deltas: list[CallDelta]) -> None:
        """A complete item: the rest of its call's arguments, or its call in another shape (always one
        under the grammar; else the rest stays content)."""
        if self.args_start >= 0:
            self._send(deltas)
        else:
            try:
                item = json.loads(self.text[self.start:self.pos + 1])
                deltas.append(CallDelta(self.calls, item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
            except (ValueError, TypeError, KeyError):
                self.broken = True
                return
        self.calls, self.start, self.args_start = self.calls + 1, self.pos + 1, -1

    def finish(self) -> tuple[str, list[CallDelta]]:
        """A call cut by the token budget keeps its truncated arguments (as a named call's); text that is
        not part of a call is returned as content."""
        if self.args_start >= 0 or not (self.scan.depth >= 2 or self.broken):
            return "", []
        return self.text[self.start:].strip().lstrip(",").strip(), []


_NEXT = {("{", "{"): "key", ("key", '"'): "in key", ("key", "}"): "end", (":", ":"): "value start",
         (",}", ","): "key", (",}", "}"): "end"}  # a block's top-level tokens: (expected, char) -> next expected


class HermesBlock:
    """One `<tool_call>` block's text as generated: its top-level members read through a JsonScanner, the
    name once its string is complete, and the text of the first "arguments" (or "parameters") value.
    `expect` is the next top-level token; "" once the block broke the object's shape (nothing read after)."""

    def __init__(self) -> None:
        self.text, self.scan, self.expect = "", JsonScanner(), "{"
        self.start, self.key, self.name = 0, "", None  # start: of the current key or value
        self.args_start = self.args_end = self.sent = -1  # the arguments: text[args_start:args_end]

    def feed(self, text: str) -> str:
        """Read on; return the arguments text not yet returned, once the name is known."""
        first, self.text = len(self.text), self.text + text
        for pos in range(first, len(self.text)):
            if self.expect:
                self._step(pos)
        if self.name is None or self.args_end <= max(self.sent, self.args_start):
            return ""
        fragment, self.sent = self.text[max(self.sent, self.args_start):self.args_end], self.args_end
        return fragment

    def read(self, text: str, index: int) -> list[CallDelta]:
        """Read on; the deltas of call `index` this text gives: its first (the name, no arguments) once the
        name is read, then the arguments text not yet sent. Shared by the hermes and llama3_json parsers."""
        named = self.name is not None
        fragment = self.feed(text)
        deltas = [CallDelta(index, self.name, "")] if not named and self.name is not None else []
        return deltas + [CallDelta(index, None, fragment)] if fragment else deltas

    def closing(self, index: int) -> list[CallDelta]:
        """The last delta of a named block's call `index`: `{}` when no arguments were written."""
        return [CallDelta(index, None, "{}")] if self.args_end <= self.args_start else []

    def _step(self, pos: int) -> None:
        char, before, was_string = self.text[pos], self.scan.depth, self.scan.in_string
        self.scan.step(char)
        if self.expect == "value":  # a container's, a string's or a scalar's character, or the first after it
            if max(before, self.scan.depth) >= 2 or self.scan.in_string or not (char.isspace() or char in ",}"):
                return self._value(pos, was_string)
            self.expect = ",}"
        if self.expect == "in key":
            if not self.scan.in_string:
                self.key, self.expect = _string(self.text[self.start:pos + 1]), ":"
            return None
        if char.isspace():
            return None
        if self.expect == "value start":
            self.start, self.expect = pos, "value"
            return self._value(pos, was_string)
        self.start, self.expect = pos, _NEXT.get((self.expect, char), "")
        return None

    def _value(self, pos: int, was_string: bool) -> None:
        """A character of the current member's value: the name once its string closes, or the arguments."""
        if self.key == "name" and self.name is None:
            if self.text[self.start] != '"':
                self.expect = ""  # a name that is not a string: never a call
            elif was_string and not self.scan.in_string:
                self.name = _string(self.text[self.start:pos + 1]) or None  # "": no call (vLLM never sends it)
                self.expect = self.expect if self.name is not None else ""
        elif self.key in ("arguments", "parameters") and self.args_start in (-1, self.start):
            self.args_start, self.args_end = self.start, pos + 1


class HermesParser:
    """tool_choice "auto" with the hermes parser (module docstring)."""

    def __init__(self) -> None:
        self.pending, self.block, self.calls, self.after_call = "", None, 0, False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.pending += text
        content, deltas = [], []
        while True:
            if self.block is not None:
                end = self.pending.find(TOOL_CALL_END)
                read = self.pending[:end] if end >= 0 else self.pending[:len(self.pending) - _partial(
                    self.pending, TOOL_CALL_END)]
                self._read(read, deltas)
                self.pending = self.pending[len(read):]
                if end < 0:
                    return "".join(content), deltas
                self._close(TOOL_CALL_END, content, deltas)
                self.pending = self.pending[len(TOOL_CALL_END):]
                continue
            start = self.pending.find(TOOL_CALL_START)
            held = self.pending if start >= 0 else self.pending[:len(self.pending) - _partial(self.pending)]
            content.append(self._text(held[:start] if start >= 0 else held))
            if start < 0:
                self.pending = self.pending[len(held):]
                return "".join(content), deltas
            self.pending, self.block = self.pending[start + len(TOOL_CALL_START):], HermesBlock()

    def _text(self, text: str) -> str:
        """Content outside blocks; whitespace right after a call is dropped."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def _read(self, text: str, deltas: list[CallDelta]) -> None:
        """The block's text: the call's first delta once its name is known, then its arguments as generated."""
        assert self.block is not None
        deltas += self.block.read(text, self.calls)

    def _close(self, end: str, content: list[str], deltas: list[CallDelta]) -> None:
        """The block's call ends (`{}` when no arguments were written), or its text is content if it had no name."""
        block, self.block = self.block, None
        assert block is not None
        if block.name is None:
            content.append(self._text(TOOL_CALL_START + block.text + end))
            return
        deltas += block.closing(self.calls)
        self.calls, self.after_call = self.calls + 1, True

    def finish(self) -> tuple[str, list[CallDelta]]:
        content, deltas = [], []
        if self.block is not None:  # an unclosed last block (vLLM's hermes reads it too); a held `</tool_` is its text
            self._read(self.pending, deltas)
            self._close("", content, deltas)
        else:
            content.append(self._text(self.pending))
        self.pending = ""
        return "".join(content), deltas


def _string(token: str) -> str | None:
    """A JSON string token's value, or None when it is not one."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _partial(text: str, tag: str = TOOL_CALL_START) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
