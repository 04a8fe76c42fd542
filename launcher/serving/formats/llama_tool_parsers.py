"""Tool calls of Llama models under tool_choice "auto": --tool-call-parser llama3_json and pythonic.

Owns two parsers with the `feed(text)` / `finish()` contract of launcher/serving/formats/tool_parsers.py
(content and `CallDelta`s; the same parser reads a whole message, so a stream accumulates to it at every
chunking). Their behaviour follows vLLM's parsers of the same names (vllm/entrypoints/openai/tool_parsers/
llama_tool_parser.py, pythonic_tool_parser.py); where vLLM's streamed and non-streamed answers differ,
one rule is chosen and named below.
  llama3_json (Llama 3.1 / 3.2 / 3.3 and Llama 4 JSON tool calls; vLLM's llama3_json and llama4_json): an
           output that starts, after optional whitespace, with `<|python_tag|>` or `{` is one or more
           `{"name": ..., "arguments"|"parameters": {...}}` objects separated by `;` (as vLLM's streaming
           parser; its non-streamed one also finds objects after other text). Anything else is content.
           Each object is read as hermes reads a block (`HermesBlock`): a call once its "name" string is
           complete (a name that is empty, not a string or missing leaves no call), then the text of its
           first "arguments" / "parameters" value as generated (vLLM re-serializes it with json.dumps; a
           value that is not an object stays its JSON text, as vLLM's json.dumps of it). Until the first
           name is read everything is held back; a first object that ends or breaks before its name makes
           the whole output content. A sent call cannot be taken back: a break of an object's top-level
           shape after its name ends it (`{}` if no arguments were written), and once a call was made,
           text that is not `; {` + another call is dropped, as vLLM's streaming parser drops it.
  pythonic (Llama 3.2 / Llama 4 pythonic, ToolACE; vLLM's pythonic): an output that starts, after optional
           whitespace, with `[` is held back until that list's closing `]` (found as Python's tokenizer finds
           it: strings, triple quotes, escapes and comments skipped; each character read once), then read with
           `ast.parse` (never evaluated): a non-empty list of `name(key=literal, ...)` calls, literals being strings, numbers (a sign allowed; finite), True / False / None, and
           lists and dicts (string keys) of them, becomes the calls, each sent whole in one delta (vLLM's
           streams a call's arguments as they form; here the list is decided whole, so one that turns out
           not to be calls is content, as in vLLM's non-streamed answer), arguments as
           `json.dumps(..., ensure_ascii=False)` writes them. Anything else (positional arguments, which
           vLLM drops; `**kwargs`, expressions, tuples) makes the whole output content; so does a list cut by
           the token budget. Text after the list is dropped (as vLLM's streaming parser drops it).
Must not: do I/O, import launcher/serving, or evaluate generated text.
"""

from __future__ import annotations

import ast
import json
import math

from launcher.serving.formats.tool_parsers import CallDelta, HermesBlock, JsonScanner

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's tag before a JSON (or built-in tool) call


class Llama3JsonParser:
    """tool_choice "auto" with the llama3_json parser (module docstring)."""

    def __init__(self) -> None:
        self.text, self.pos, self.phase = "", 0, "lead"  # lead, object, between, next; content, drop: the rest
        self.block, self.scan, self.calls, self.tagged = HermesBlock(), JsonScanner(), 0, False
        self._steps = {"lead": self._lead, "object": self._object, "between": self._between, "next": self._next}

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        deltas: list[CallDelta] = []
        while self.pos < len(self.text) and self.phase not in ("content", "drop"):
            if not self._steps[self.phase](deltas):
                break  # a possible partial tag: wait for more
        content = self.text[self.pos:] if self.phase == "content" else ""
        self.pos = len(self.text) if self.phase in ("content", "drop") else self.pos
        return content, deltas

    def _lead(self, deltas: list[CallDelta]) -> bool:
        """Before the first object: whitespace and one `<|python_tag|>`; anything else makes it all content."""
        rest = self.text[self.pos:self.pos + len(PYTHON_TAG)]
        if rest[0].isspace():
            self.pos += 1
        elif rest[0] == "{":
            self.phase = "object"
        elif not self.tagged and rest == PYTHON_TAG:
            self.pos, self.tagged = self.pos + len(PYTHON_TAG), True
        elif not self.tagged and PYTHON_TAG.startswith(rest):
            return False
        else:
            self.phase, self.pos = "content", 0
        return True

    def _object(self, deltas: list[CallDelta]) -> bool:
        """An object's text up to its closing brace, read by the block; the call ends with the object."""
        end = self.pos
        while end < len(self.text) and (end == self.pos or self.scan.depth > 0):
            self.scan.step(self.text[end])
            end += 1
        block = self.block
        deltas += block.read(self.text[self.pos:end], self.calls)
        self.pos = end
        if block.expect and self.scan.depth > 0:
            return True  # the object goes on
        self._close(deltas)
        self.phase = "between" if block.expect == "end" and block.name is not None else self.phase
        return True

    def _close(self, deltas: list[CallDelta]) -> None:
        """The current object ends: its call (`{}` if no arguments were written), or content / dropped."""
        block, self.block, self.scan = self.block, HermesBlock(), JsonScanner()
        if block.name is None:
            self.phase, self.pos = ("content", 0) if not self.calls else ("drop", self.pos)
            return
        deltas += block.closing(self.calls)
        self.calls, self.phase = self.calls + 1, "drop"

    def _between(self, deltas: list[CallDelta]) -> bool:
        char = self.text[self.pos]
        self.pos += 1 if char.isspace() or char == ";" else 0
        self.phase = "between" if char.isspace() else "next" if char == ";" else "drop"
        return True

    def _next(self, deltas: list[CallDelta]) -> bool:
        char = self.text[self.pos]
        self.pos += 1 if char.isspace() else 0
        self.phase = "next" if char.isspace() else "object" if char == "{" else "drop"
        return True

    def finish(self) -> tuple[str, list[CallDelta]]:
        """An object cut by the token budget keeps its call if it was named; a held start is content."""
        deltas: list[CallDelta] = []
        if self.phase == "object":
            self._close(deltas)
        content = self.text if self.phase == "lead" else self.text[self.pos:] if self.phase == "content" else ""
        self.phase, self.pos = "drop", len(self.text)
        return content, deltas


class PythonicParser:
    """tool_choice "auto" with the pythonic parser (module docstring)."""

    def __init__(self) -> None:
        self.text, self.pos, self.phase = "", 0, "lead"  # lead, list; content, done
        self.start, self.depth, self.quote = 0, 0, ""  # where the list starts; open brackets; `_scan`'s quote

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        if self.phase == "lead" and self.text.strip():
            self.start = len(self.text) - len(self.text.lstrip())
            self.phase, self.pos = ("list", self.start) if self.text[self.start] == "[" else ("content", 0)
        if self.phase == "list" and self._closed():
            calls = _calls(self.text[self.start:self.pos])
            if calls is not None:
                self.phase = "done"
                return "", [CallDelta(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
            self.phase, self.pos = "content", 0
        if self.phase == "content":
            content, self.pos = self.text[self.pos:], len(self.text)
            return content, []
        return "", []

    def _closed(self) -> bool:
        """Scan on from `self.pos` (`_scan`); True once the list's closing bracket arrived (`self.pos` then just
        past it)."""
        self.pos, self.depth, self.quote = _scan(self.text, self.pos, self.depth, self.quote)
        return self.depth == 0

    def finish(self) -> tuple[str, list[CallDelta]]:
        """A list not closed (cut by the token budget) or a held start is content."""
        content = self.text[self.pos:] if self.phase == "content" else self.text if self.phase != "done" else ""
        self.phase, self.pos = "done", len(self.text)
        return content, []


def _scan(text: str, pos: int, depth: int, quote: str) -> tuple[int, int, str]:
    """Read `text` on from `pos`, `depth` brackets open, inside `quote` ("", the opening quote of a string:
    one or three ' or ", or "#" in a comment) as Python's tokenizer reads it: brackets counted outside strings
    and comments, in a string a backslash escapes the next character (a raw string ends so too), triple
    quotes. Returns (pos, depth, quote) where it stopped: just past the bracket that brings depth to 0, or at
    the end of the text, or before a quote or backslash that the next text decides (`''` may open `'''`).
    Over a stream each character is read once (re-tokenizing the text at each `]` was quadratic)."""
    while pos < len(text):
        char = text[pos]
        if quote == "#":
            quote, pos = ("" if char == "\n" else "#"), pos + 1
        elif quote:
            if char == "\\" and pos + 1 == len(text):
                break
            if char == "\\":
                pos += 2
            elif text.startswith(quote, pos):
                quote, pos = "", pos + len(quote)
            elif len(quote) == 3 and quote.startswith(text[pos:]):
                break  # a closing triple quote may be arriving
            else:
                pos += 1
        elif char in "'\"":
            if text[pos:] in (char, char * 2):
                break  # an empty string or the start of a triple quote
            quote = char * 3 if text.startswith(char * 3, pos) else char
            pos += len(quote)
        else:
            quote = "#" if char == "#" else ""
            depth += (char in "([{") - (char in ")]}")
            pos += 1
            if depth == 0:
                break
    return pos, depth, quote


class _NotLiteral(ValueError):
    pass


def _calls(source: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a Python list of calls with literal keyword arguments, else None."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            if any(keyword.arg is None for keyword in call.keywords):
                return None  # **kwargs
            arguments = {keyword.arg: _literal(keyword.value) for keyword in call.keywords}
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # _NotLiteral is a ValueError
        return None


def _literal(node: ast.expr) -> object:
    """The JSON value of a literal: str, finite int / float (signed), bool, None, list, dict with str keys."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral("a sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral("a float that JSON cannot write")
        return node.value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    raise _NotLiteral(f"not a literal: {type(node).__name__}")
