"""OpenAI tool calling on /v1/chat/completions: a request's `tools`, `tool_choice` and `parallel_tool_calls`.

Owns validating those fields into a `ToolRequest` (OpenAI API reference, "Function calling"; vLLM's
`ChatCompletionRequest`), and the JSON schema that constrains generation when the model must call a tool,
as vLLM builds it: a named tool (`{"type": "function", "function": {"name": ...}}`) -> that tool's
`parameters` schema, the output being its arguments object; "required" -> an array of
`{"name": <the tool's name>, "parameters": <its schema>}` items, one `anyOf` branch per tool, at least one
item (at most one when `parallel_tool_calls` is false). "auto" needs the server's tool-call parser
(`--enable-auto-tool-choice --tool-call-parser NAME`, `TOOL_PARSERS`, formats/tool_output.py);
"none" gives plain text, the template still seeing the tools. Refusals raise the caller's `error`
class naming the field by its dotted path (`tools[1].function.name`).
Must not: do I/O, or import launcher/serving (it sits below it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from launcher.serving.formats.response_format import ErrorClass, FormatError, check_name, object_field
from pipeline.speculation.echo import shown
from pipeline.speculation.grammar import MAX_GRAMMAR_CHARS, GrammarSpec

TOOL_CHOICE_MODES = ("none", "auto", "required")
# --tool-call-parser choices (formats/tool_output.py); llama4_json and llama4_pythonic: vLLM's aliases
TOOL_PARSERS = ("hermes", "llama3_json", "llama4_json", "pythonic", "llama4_pythonic", "mistral")
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
MAX_TOOLS_CHARS = MAX_GRAMMAR_CHARS  # the tools' JSON text, as a constraint's (compile time grows with size)
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
ENABLE_AUTO = f"start the server with --enable-auto-tool-choice --tool-call-parser NAME ({', '.join(TOOL_PARSERS)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolRequest:
    """A request's validated tool fields.

    tools: the tools as the chat template sees them (`{"type": "function", "function": {...}}`; HF
    `apply_chat_template(tools=...)`); choice: none | auto | required | named; name: the named tool;
    parallel: `parallel_tool_calls`; parser: the server's tool-call parser (auto only).
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def constrains(self) -> bool:
        """Whether generation is constrained to a tool call (named, required)."""
        return self.choice in ("named", "required")

    def schema(self) -> dict:
        """The JSON schema of the output (named: the arguments; required: the list of calls)."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
                  for t in self.tools}
        if self.choice == "named":
            return params[self.name]
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            calls["maxItems"] = 1
        return calls

    def grammar(self, *, error: ErrorClass = FormatError) -> GrammarSpec:
        """The constraint of a named / required choice. Raises `error` naming the schema's field."""
        try:
            return GrammarSpec(kind="json_schema", text=json.dumps(self.schema()), field="tool_choice")
        except ValueError as exc:
            field = self._failing_tool()
            raise error(f"'{field}': {exc}", field) from None

    def _failing_tool(self) -> str:
        """The field of the (first) tool whose parameters schema does not compile on its own, else 'tools'."""
        for index, tool in enumerate(self.tools):
            if self.choice == "named" and tool["function"]["name"] != self.name:
                continue
            try:
                GrammarSpec(kind="json_schema", text=json.dumps(tool["function"].get("parameters") or {}))
            except ValueError:
                return f"tools[{index}].function.parameters"
        return "tools"


def tools_from_body(body: dict, *, parser: str | None, error: ErrorClass = FormatError) -> ToolRequest | None:
    """The tool fields of a chat body, or None when it has no tools (and tool_choice is absent or
    "none"). parser: the server's tool-call parser, None unless auto tool choice is enabled.
    Raises `error(message, param)`."""
    try:
        return _from_body(body, parser)
    except FormatError as exc:
        raise error(str(exc), exc.param) from None


def _from_body(body: dict, parser: str | None) -> ToolRequest | None:
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FormatError(f"'parallel_tool_calls' must be true or false, got {shown(parallel)}", "parallel_tool_calls")
    tools = _tools(body.get("tools"))
    names = [t["function"]["name"] for t in tools]
    choice, name = _choice(body.get("tool_choice"), names)
    if not tools:
        if choice != "none":
            raise FormatError(f"'tool_choice' {shown(body.get('tool_choice'))} needs 'tools'", "tool_choice")
        return None
    if choice == "auto" and parser is None:
        raise FormatError(f"'tool_choice' \"auto\" (the default with 'tools') needs a tool-call parser: {ENABLE_AUTO}; "
                          "or send \"tool_choice\": \"required\", \"none\" or a named function", "tool_choice")
    return ToolRequest(tools=tuple(tools), choice=choice, name=name, parallel=parallel is not False,
                       parser=parser if choice == "auto" else None)


def _tools(value: Any) -> list[dict]:
    """The validated `tools` list ([] when absent): each a function tool with a unique name."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise FormatError(f"'tools' must be a list of function tools, got {shown(value)}", "tools")
    if len(value) > MAX_TOOLS:
        raise FormatError(f"'tools' has {len(value)} tools; at most {MAX_TOOLS}", "tools")
    size = len(json.dumps(value))
    if size > MAX_TOOLS_CHARS:
        raise FormatError(f"'tools' is {size} characters of JSON, over the limit of {MAX_TOOLS_CHARS}", "tools")
    tools, seen = [], set()
    for i, tool in enumerate(value):
        tools.append(_tool(tool, f"tools[{i}]"))
        name = tools[-1]["function"]["name"]
        if name in seen:
            raise FormatError(f"'tools[{i}].function.name' {shown(name)} is not unique", f"tools[{i}].function.name")
        seen.add(name)
    return tools


def _tool(tool: Any, field: str) -> dict:
    """One `{"type": "function", "function": {name, description?, parameters?, strict?}}`, checked."""
    if object_field(tool, field).get("type") != "function":
        raise FormatError(f"'{field}.type' must be \"function\", got {shown(tool.get('type'))}", f"{field}.type")
    field = f"{field}.function"
    function = object_field(tool.get("function"), field)
    check_name(function.get("name"), f"{field}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise FormatError(f"'{field}.description' must be a string, got {shown(description)}", f"{field}.description")
    params, strict = function.get("parameters"), function.get("strict")
    if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
        raise FormatError(f"'{field}.parameters' must be a JSON schema of an object, got {shown(params)}",
                          f"{field}.parameters")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(f"'{field}.strict' must be true or false, got {shown(strict)}", f"{field}.strict")
    kept = {k: function[k] for k in _FUNCTION_KEYS if function.get(k) is not None}
    return {"type": "function", "function": kept}


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    """(mode, named tool) of `tool_choice`; absent: "auto" with tools, else "none" (OpenAI's defaults)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise FormatError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function, "
                              f"got {shown(value)}", "tool_choice")
        return value, None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise FormatError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {shown(value)}",
                          "tool_choice")
    name = value["function"].get("name")
    if name not in names:
        raise FormatError(f"'tool_choice.function.name' {shown(name)} is not one of the request's tools",
                          "tool_choice.function.name")
    return "named", name
