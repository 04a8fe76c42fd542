"""One chat choice's tool calls in OpenAI's shape, whole or streamed (launcher/serving/formats/tools.py).

Owns picking a choice's parser (named, required, or "auto"'s --tool-call-parser: hermes of
launcher/serving/formats/tool_parsers.py, llama3_json or pythonic of llama_tool_parsers.py (vLLM's aliases
llama4_json and llama4_pythonic name the same parsers), mistral of mistral_tool_parser.py), the call
ids, `parallel_tool_calls: false` under "auto", the finish reason, and which parsers read the text with
special tokens kept (`keeps_special_tokens`: vLLM's `adjust_request` of its hermes and mistral parsers, whose
tags are special tokens in some tokenizers: Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`). `ToolOutput` rewrites a choice's response message or stream delta (the dicts
of launcher/serving/openai_protocol.py's `completion_body`) into OpenAI's shape: `content` (null when
empty) and `tool_calls` = [{"id": "chatcmpl-tool-<hex>" (mistral: 9 letters and digits), "type": "function", "function": {"name",
"arguments": JSON text}}]; in a stream, deltas `tool_calls: [{"index", "id", "type", "function": {"name",
"arguments"}}]`, the id and name in the first delta of a call, then argument fragments.
finish_reason "stop" becomes "tool_calls" when "auto" produced a call or "required" did (vLLM's rule; a
named call keeps "stop"). With `parallel_tool_calls: false`, "auto" keeps the first call and drops the
later ones, neither calls nor content, whole and streamed alike (vLLM's rule since its PR #26233;
generation is not stopped at the first call); "required" is held to one call by its grammar instead.
Must not: do I/O, or import launcher/serving.
"""

from __future__ import annotations

import uuid
from typing import Any

from launcher.serving.formats.llama_tool_parsers import Llama3JsonParser, PythonicParser
from launcher.serving.formats.mistral_tool_parser import MistralParser, mistral_call_id
from launcher.serving.formats.tool_parsers import HermesParser, NamedParser, RequiredParser
from launcher.serving.formats.tools import ToolRequest

AUTO_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "llama4_json": Llama3JsonParser,
                "pythonic": PythonicParser, "llama4_pythonic": PythonicParser, "mistral": MistralParser}
_KEEP_SPECIAL_TOKENS = ("hermes", "mistral")  # parsers whose tags may be special tokens (vLLM's adjust_request)


def tool_call_id(parser: str | None = None) -> str:
    """A new call id, `chatcmpl-tool-<32 hex>` (vLLM's shape; random, uuid4), or for the mistral parser
    9 letters and digits (`mistral_call_id`)."""
    return mistral_call_id() if parser == "mistral" else f"chatcmpl-tool-{uuid.uuid4().hex}"


def keeps_special_tokens(request: ToolRequest) -> bool:
    """Whether the request's text is decoded with special tokens kept: "auto" with the hermes or mistral
    parser, as vLLM's `adjust_request` of those parsers sets skip_special_tokens false whenever tools are
    given and tool_choice is not "none" (named and "required" output is a JSON document here, constrained by
    its grammar, in which no special token can appear). llama3_json reads its output with or without Llama
    3.1's special `<|python_tag|>` (a skipped one leaves the `{` it also starts at); pythonic has no tags."""
    return request.choice == "auto" and request.parser in _KEEP_SPECIAL_TOKENS


def _parser(request: ToolRequest):
    if request.choice == "named":
        return NamedParser(request.name)
    if request.choice == "required":
        return RequiredParser()
    return AUTO_PARSERS[request.parser or "hermes"]()


class ToolOutput:
    """One choice's tool-call parsing state; rewrites its message (whole) or its stream deltas."""

    def __init__(self, request: ToolRequest) -> None:
        assert request.choice != "none", "tool_choice none: plain text, no parser"
        self.request = request
        self.parser = _parser(request)
        self.max_calls = 1 if request.choice == "auto" and not request.parallel else None
        self.ids: list[str] = []
        self.num_calls = 0

    def _reason(self, reason: str | None) -> str | None:
        """vLLM's finish reason: "tool_calls" once auto made a call, or required did and stopped."""
        if reason is None or not self.num_calls or self.request.choice == "named":
            return reason
        return "tool_calls" if self.request.choice == "auto" or reason == "stop" else reason

    def _feed(self, text: str, last: bool) -> tuple[str, list[dict]]:
        content, deltas = self.parser.feed(text)
        if last:
            more, rest = self.parser.finish()
            content, deltas = content + more, deltas + rest
        calls = []
        for d in deltas:
            if self.max_calls is not None and d.index >= self.max_calls:
                continue  # parallel_tool_calls false: a later call is dropped
            if d.name is not None:
                self.ids.append(tool_call_id(self.request.parser))
                self.num_calls += 1
                calls.append({"index": d.index, "id": self.ids[d.index], "type": "function",
                              "function": {"name": d.name, "arguments": d.arguments}})
            elif calls and calls[-1]["index"] == d.index:
                calls[-1]["function"]["arguments"] += d.arguments
            else:
                calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        return content, calls

    def rewrite_message(self, choice: dict[str, Any]) -> None:
        """A whole (non-streamed) choice: its message's content split into content and tool_calls."""
        message = choice["message"]
        content, calls = self._feed(message["content"], last=True)
        message["content"] = content or None
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        choice["finish_reason"] = self._reason(choice["finish_reason"])

    def rewrite_delta(self, choice: dict[str, Any]) -> bool:
        """A stream chunk's choice: its delta's content parsed on from the chunks before it. False when
        the chunk has nothing left to say (its text held back, no logprobs, token ids or finish reason)."""
        delta = choice["delta"]
        content, calls = self._feed(delta.get("content") or "", last=choice["finish_reason"] is not None)
        delta["content"] = content if content or not calls else None
        if calls:
            delta["tool_calls"] = calls
        choice["finish_reason"] = self._reason(choice["finish_reason"])
        return bool(content or calls or choice["finish_reason"] or choice.get("logprobs") or "token_ids" in choice)


def tool_outputs(request: ToolRequest | None, n: int) -> list[ToolOutput] | None:
    """One ToolOutput per choice, or None when the request's output is plain text (no tools, or "none")."""
    if request is None or request.choice == "none":
        return None
    return [ToolOutput(request) for _ in range(n)]
