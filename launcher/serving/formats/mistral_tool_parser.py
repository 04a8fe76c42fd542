"""Tool calls of Mistral models under tool_choice "auto": --tool-call-parser mistral.

Owns `MistralParser`, with the `feed(text)` / `finish()` contract of launcher/serving/formats/tool_parsers.py
(content and `CallDelta`s; the same parser reads a whole message, so a stream accumulates to it at every
chunking), and Mistral's call ids. Behaviour follows vLLM's mistral parser
(vllm/entrypoints/openai/tool_parsers/mistral_tool_parser.py); where its streamed and non-streamed answers
differ, one rule is chosen and named here. Text before the first `[TOOL_CALLS]` is content (a possible
partial tag is held back). After it, whitespace, then either
  pre-v11 (Mistral 7B Instruct v0.3; vLLM's reader for a tokenizer without `[ARGS]`): a JSON array of
           `{"name": ..., "arguments": {...}}` objects, `,`-separated. Each object is read as hermes reads a
           block (`HermesBlock`): a call once its "name" string is complete, then the text of its first
           "arguments" (or "parameters") value as generated (vLLM re-serializes it with json.dumps); or
  v11+ (Mistral Small 3.2, Magistral, Devstral): `name[ARGS]{...}`, a call per `[TOOL_CALLS]`: the name
           (letters, digits, `_`, `-`) is sent once `[ARGS]` follows it, then the JSON object after it as
           generated.
A `[TOOL_CALLS]` followed by neither, or whose first call ends or breaks before its name, makes the text
from the tag on content (vLLM's non-streamed answer makes the text content too). A sent call cannot be taken
back: a break after its name ends it (`{}` if no arguments were written), and after a call, text that is not
another call (`, {` ... in the array; `[TOOL_CALLS]` again in v11+) is dropped (the array's `]` ends the
calls). The tag is a special token in Mistral's tokenizers: launcher/serving/formats/tool_output.py decodes
with skip_special_tokens false for this parser (vLLM's `adjust_request`).
Must not: do I/O, or import launcher/serving.
"""

from __future__ import annotations

import secrets
import string

from launcher.serving.formats.tool_parsers import CallDelta, HermesBlock, JsonScanner

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A new call id: 9 random letters and digits, the only shape Mistral's chat format accepts (vLLM's
    `MistralToolCall.generate_random_id`, after mistral-common's validator)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (0 if none)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class MistralParser:
    """tool_choice "auto" with the mistral parser (module docstring)."""

    def __init__(self) -> None:
        self.text, self.pos, self.phase = "", 0, "content"  # rest (content), drop: the end states
        self.tag_at, self.start, self.calls, self.args_sent = -1, 0, 0, False
        self.block, self.scan = HermesBlock(), JsonScanner()
        self._steps = {"content": self._content, "tag": self._tag, "items": self._items, "object": self._object,
                       "sep": self._sep, "name": self._name, "args": self._args, "after": self._after}

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self.pos < len(self.text) and self.phase in self._steps:
            if not self._steps[self.phase](content, deltas):
                break  # a possible partial tag: wait for more
        if self.phase in ("rest", "drop"):
            content.append(self.text[self.pos:] if self.phase == "rest" else "")
            self.pos = len(self.text)
        return "".join(content), deltas

    def _fail(self) -> bool:
        """The calls break: before the first, the text from the tag on is content; after one, it is dropped."""
        self.phase, self.pos = ("rest", self.tag_at) if not self.calls else ("drop", self.pos)
        return True

    def _content(self, content: list[str], deltas: list[CallDelta]) -> bool:
        at = self.text.find(TOOL_CALLS, self.pos)
        if at < 0:
            end = len(self.text) - _held(self.text[self.pos:], TOOL_CALLS)
            content.append(self.text[self.pos:end])
            self.pos = end
            return False
        content.append(self.text[self.pos:at])
        self.tag_at, self.pos, self.phase = at, at + len(TOOL_CALLS), "tag"
        return True

    def _tag(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Right after a `[TOOL_CALLS]`: the array (pre-v11) or a name (v11+)."""
        char = self.text[self.pos]
        if char.isspace():
            self.pos += 1
        elif char == "[" and not self.calls:
            self.pos, self.phase = self.pos + 1, "items"
        elif char in _NAME_CHARS:
            self.start, self.phase = self.pos, "name"
        else:
            return self._fail()
        return True

    def _items(self, content: list[str], deltas: list[CallDelta]) -> bool:
        char = self.text[self.pos]
        if char.isspace():
            self.pos += 1
            return True
        if char != "{":
            return self._fail()
        self.block, self.scan, self.phase = HermesBlock(), JsonScanner(), "object"
        return True

    def _object(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """An item's text up to its closing brace, read by the block; the call ends with the item."""
        end = self.pos
        while end < len(self.text) and (end == self.pos or self.scan.depth > 0):
            self.scan.step(self.text[end])
            end += 1
        deltas += self.block.read(self.text[self.pos:end], self.calls)
        self.pos = end
        if self.block.expect and self.scan.depth > 0:
            return True  # the item goes on
        if self.block.name is None:
            return self._fail()
        deltas += self.block.closing(self.calls)
        self.calls, self.phase = self.calls + 1, "sep" if self.block.expect == "end" else "drop"
        return True

    def _sep(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Between items: `,` and the next one, or `]`, which ends the calls; anything else is dropped."""
        char = self.text[self.pos]
        self.pos += 1
        self.phase = "sep" if char.isspace() else "items" if char == "," else "drop"
        return True

    def _name(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """A v11+ name, sent once `[ARGS]` follows it."""
        while self.pos < len(self.text) and self.text[self.pos] in _NAME_CHARS:
            self.pos += 1
        rest = self.text[self.pos:self.pos + len(ARGS)]
        if rest == ARGS:
            deltas.append(CallDelta(self.calls, self.text[self.start:self.pos], ""))
            self.pos, self.phase, self.scan, self.args_sent = self.pos + len(ARGS), "args", JsonScanner(), False
            return True
        return False if ARGS.startswith(rest) else self._fail()

    def _args(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """A v11+ call's arguments: a JSON object (whitespace before it skipped), streamed as generated until
        it closes."""
        if not self.args_sent and self.text[self.pos].isspace():
            self.pos += 1
            return True
        if not self.args_sent and self.text[self.pos] != "{":
            return self._close(deltas, "drop")
        end = self.pos
        while end < len(self.text) and (end == self.pos or self.scan.depth > 0):
            self.scan.step(self.text[end])
            end += 1
        deltas.append(CallDelta(self.calls, None, self.text[self.pos:end]))
        self.pos, self.args_sent = end, True
        return self._close(deltas, "after") if self.scan.depth <= 0 else True

    def _close(self, deltas: list[CallDelta], phase: str) -> bool:
        """The current v11+ call ends (`{}` if no arguments were written)."""
        if not self.args_sent:
            deltas.append(CallDelta(self.calls, None, "{}"))
        self.calls, self.phase = self.calls + 1, phase
        return True

    def _after(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """After a v11+ call: whitespace, then another `[TOOL_CALLS]` or the end; anything else is dropped."""
        if self.text[self.pos].isspace():
            self.pos += 1
            return True
        rest = self.text[self.pos:self.pos + len(TOOL_CALLS)]
        if rest == TOOL_CALLS:
            self.pos, self.phase = self.pos + len(TOOL_CALLS), "tag"
            return True
        if TOOL_CALLS.startswith(rest):
            return False
        self.phase = "drop"
        return True

    def finish(self) -> tuple[str, list[CallDelta]]:
        """At the end: a held partial tag is content; a named item or v11+ call cut by the token budget keeps
        its call; a `[TOOL_CALLS]` with no call after it is content."""
        deltas: list[CallDelta] = []
        if self.phase == "object" and self.block.name is not None:
            deltas += self.block.closing(self.calls)
            self.calls, self.phase = self.calls + 1, "drop"
        elif self.phase == "args":
            self._close(deltas, "drop")
        elif self.phase in ("tag", "items", "object", "name"):
            self._fail()
        content = self.text[self.pos:] if self.phase in ("content", "rest") else ""
        self.phase, self.pos = "drop", len(self.text)
        return content, deltas
