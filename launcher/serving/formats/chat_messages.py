"""A chat request's `messages` and template options as the model's chat template sees them.

Owns the template options (`chat_options`) and checking each message and reducing it to what templates read (Hugging Face `apply_chat_template`'s
message dicts): `role`, `content` (a string: text parts joined; an assistant's null content, a turn that
only called tools, becomes ""), an assistant's `tool_calls` (each `{"id", "type": "function",
"function": {"name", "arguments"}}`, the arguments' JSON text parsed into an object as vLLM passes them,
since templates such as Qwen2.5's write `arguments | tojson`), and a tool result's `tool_call_id` and
`name`. Refusals raise the caller's `error` class naming the field (`messages[2].tool_calls[0].function.name`).
Must not: do I/O, render templates, or import launcher/serving (it sits below it).
"""

from __future__ import annotations

import json
from typing import Any

from launcher.serving.formats.response_format import ErrorClass
from pipeline.speculation.echo import shown


def chat_options(body: dict, *, error: ErrorClass) -> dict[str, Any]:
    """The template options of a chat body: add_generation_prompt (default true),
    continue_final_message (default false; not both) and chat_template_kwargs (an object), with vLLM's
    `documents` (a list of objects of strings; the template's `documents` variable, as Hugging Face's
    `apply_chat_template(documents=...)`; chat_template_kwargs' own "documents" wins, as in vLLM)."""
    options = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise error(f"'{name}' must be true or false, got {shown(value)}", name)
        options[name] = default if value is None else value
    if body.get("add_generation_prompt") is True and options["continue_final_message"]:
        raise error("'continue_final_message' and 'add_generation_prompt' cannot both be true", "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise error("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(kwargs or ())
    if reserved:
        raise error(f"'chat_template_kwargs' may not set {sorted(reserved)}", "chat_template_kwargs")
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
            raise error("'documents' must be a list of objects whose values are strings", "documents")
        kwargs = {"documents": documents, **(kwargs or {})}
    options["template_kwargs"] = kwargs
    return options


def clean_messages(messages: Any, *, error: ErrorClass) -> list[dict[str, Any]]:
    """[{role, content, tool_calls?, tool_call_id?, name?}] of a request's messages. Raises `error(message, param)`."""
    if not isinstance(messages, list) or not messages:
        raise error("'messages' must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, f"messages[{i}]", error) for i, m in enumerate(messages)]


def _message(m: Any, field: str, error: ErrorClass) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise error(f"'{field}' must be an object with a string 'role'", f"{field}.role")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise error(f"'{field}.content' parts must all be of type 'text'", f"{field}.content")
        content = "".join(p["text"] for p in content)
    if content is None and m["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise error(f"'{field}.content' must be a string", f"{field}.content")
    clean: dict[str, Any] = {"role": m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls is not None and m["role"] == "assistant":
        if not isinstance(calls, list):
            raise error(f"'{field}.tool_calls' must be a list of tool calls", f"{field}.tool_calls")
        if calls:
            clean["tool_calls"] = [_tool_call(c, f"{field}.tool_calls[{j}]", error) for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = m.get(key)
        if value is not None and m["role"] == "tool":
            if not isinstance(value, str):
                raise error(f"'{field}.{key}' must be a string", f"{field}.{key}")
            clean[key] = value
    if m["role"] == "tool" and "tool_call_id" not in clean:
        raise error(f"'{field}.tool_call_id' is required in a message of role 'tool'", f"{field}.tool_call_id")
    return clean


def _tool_call(call: Any, field: str, error: ErrorClass) -> dict[str, Any]:
    """An assistant's tool call, its arguments as an object when they are an object's JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise error(f"'{field}' must be an object with a 'function' object", f"{field}.function")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise error(f"'{field}.function.name' must be a non-empty string", f"{field}.function.name")
    if not isinstance(arguments, (str, dict)):
        raise error(f"'{field}.function.arguments' must be a string of JSON", f"{field}.function.arguments")
    if isinstance(arguments, str) and not arguments.strip():  # no arguments: {} (vLLM's rule)
        arguments = {}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    clean = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        clean["id"] = call["id"]
    return clean
