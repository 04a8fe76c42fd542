"""OpenAI's `response_format` and vLLM's `structured_outputs`: a request's structured output constraint.

Owns turning those two fields of a decoded HTTP body into a `GrammarSpec` (pipeline/speculation/grammar.py),
or None for plain text. Accepted (OpenAI API reference, "Structured outputs"; vLLM docs, "Structured Outputs"):
  response_format: {"type": "text"} | {"type": "json_object"} |
                   {"type": "json_schema", "json_schema": {"name": str (required), "schema": {...}, "strict": bool}} |
                   {"type": "structural_tag", "structures": [{"begin": str, "schema": {...}, "end": str}],
                    "triggers": [str]} (vLLM's)
  structured_outputs: exactly one of {"json": schema object or its JSON text}, {"regex": str},
                      {"choice": [str, ...]}, {"json_object": true}, {"grammar": Lark or GBNF text},
                      {"structural_tag": {"structures": [...], "triggers": [...]} or its JSON text}
`strict` is accepted either way: every schema is enforced. Both fields in one request, either with
`ignore_eos: true`, an unknown type or key, or a schema / regex / grammar / structural tag llguidance
refuses raises the caller's `error` class (HTTP and gRPC pass their InvalidRequestError) naming the field
by its dotted path: 400 /
INVALID_ARGUMENT. gRPC: `grammar_from_proto` (GenerateRequest.structured_output: json_object, json_schema,
regex, choice, grammar, structural_tag as JSON text). Must not: do I/O, or import launcher/serving (it sits
below it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pipeline.speculation.echo import shown
from pipeline.speculation.grammar import GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for json_schema and function names (API reference)


class FormatError(ValueError):
    """A structured output field is invalid; `param` names it (its dotted path). The front ends pass their
    own error class (launcher/serving/serving_engine.py's InvalidRequestError: HTTP 400, gRPC
    INVALID_ARGUMENT) as `error`, which this package, below launcher/serving, cannot import."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


ErrorClass = Callable[[str, str], ValueError]  # (message, param) -> the exception to raise


def grammar_from_body(body: dict, *, error: ErrorClass = FormatError) -> GrammarSpec | None:
    """The constraint of an OpenAI / vLLM request body, or None (text). Raises `error(message, param)`."""
    try:
        return _from_body(body)
    except FormatError as exc:
        raise error(str(exc), exc.param) from None


def _from_body(body: dict) -> GrammarSpec | None:
    fmt, structured = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and structured is not None:
        raise FormatError("set 'response_format' or 'structured_outputs', not both", "structured_outputs")
    field = "response_format" if structured is None else "structured_outputs"
    spec = _structured_outputs(structured) if structured is not None else None if fmt is None else _response_format(fmt)
    if spec is not None and body.get("ignore_eos") is True:  # SamplingParams refuses it too, naming response_format
        raise FormatError(f"'{field}' cannot be combined with 'ignore_eos' (a structured output ends with EOS)", field)
    return None if spec is None else spec.asked_by(field)


def _spec(field: str, **kwargs: Any) -> GrammarSpec:
    """GrammarSpec(**kwargs), its refusal an InvalidRequestError naming `field`."""
    try:
        return GrammarSpec(**kwargs)
    except ValueError as exc:
        raise FormatError(f"'{field}': {exc}", field) from None


def object_field(value: Any, field: str) -> dict:
    """`value` when a JSON object, else FormatError naming `field`."""
    if not isinstance(value, dict):
        raise FormatError(f"'{field}' must be an object, got {shown(value)}", field)
    return value


def check_name(name: Any, field: str) -> str:
    """`name` when it follows OPENAI_NAME, else FormatError naming `field`."""
    if not (isinstance(name, str) and OPENAI_NAME.fullmatch(name)):
        raise FormatError(f"'{field}' must be 1 to 64 letters, digits, '_' or '-', got {shown(name)}", field)
    return name


def _response_format(fmt: Any) -> GrammarSpec | None:
    kind = object_field(fmt, "response_format").get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise FormatError(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                                  f"got {shown(kind)}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", kind="json_object")
    if kind == "structural_tag":
        return _struct_tag("response_format", {k: v for k, v in fmt.items() if k != "type"})
    field = "response_format.json_schema"
    wrapper = object_field(fmt.get("json_schema"), field)
    name, strict = wrapper.get("name"), wrapper.get("strict")
    if name is None:  # required by OpenAI's API reference and vLLM's JsonSchemaResponseFormat
        raise FormatError(f"'{field}.name' is required (1 to 64 letters, digits, '_' or '-')", f"{field}.name")
    check_name(name, f"{field}.name")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(f"'{field}.strict' must be true or false, got {shown(strict)}", f"{field}.strict")
    schema = object_field(wrapper.get("schema"), f"{field}.schema")
    return _spec(f"{field}.schema", kind="json_schema", text=json.dumps(schema))


def _structured_outputs(value: Any) -> GrammarSpec:
    given = [k for k, v in object_field(value, "structured_outputs").items() if v is not None and v is not False]
    unknown = [k for k in given if k not in STRUCTURED_OUTPUT_KEYS]
    if unknown or len(given) != 1:
        what = f"unsupported key {shown(unknown[0])}" if unknown else f"{len(given)} of them"
        raise FormatError(f"'structured_outputs' must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)} "
                                  f"({what})", "structured_outputs")
    key = given[0]
    field, item = f"structured_outputs.{key}", value[key]
    if key == "json_object":
        if item is not True:
            raise FormatError(f"'{field}' must be true, got {shown(item)}", field)
        return _spec(field, kind="json_object")
    if key == "json":
        if not isinstance(item, (dict, str)):
            raise FormatError(f"'{field}' must be a JSON schema object or its JSON text, got {shown(item)}", field)
        return _spec(field, kind="json_schema", text=item if isinstance(item, str) else json.dumps(item))
    if key in ("regex", "grammar"):
        if not isinstance(item, str) or not item:
            raise FormatError(f"'{field}' must be a non-empty string, got {shown(item)}", field)
        return _spec(field, kind=key, text=item)
    if key == "structural_tag":
        return _struct_tag(field, object_field(_loads(item, field) if isinstance(item, str) else item, field))
    try:
        return GrammarSpec.choice(item)
    except ValueError as exc:
        raise FormatError(f"'{field}': {exc}, got {shown(item)}", field) from None


def _loads(text: str, field: str) -> Any:
    """The JSON value of `text`, else FormatError naming `field`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's recursion limit
        raise FormatError(f"'{field}': not JSON ({exc})", field) from None


def _struct_tag(field: str, value: dict) -> GrammarSpec:
    """The structural tag spec of {"structures": [...], "triggers": [...]} (no other key), refusals naming `field`."""
    unknown = sorted(set(value) - {"structures", "triggers"})
    if unknown:
        raise FormatError(f"'{field}' has an unsupported key {shown(unknown[0])} (structures, triggers)", field)
    return _spec(field, kind="structural_tag", text=json.dumps(value))


def grammar_from_proto(req: Any, *, error: ErrorClass = FormatError) -> GrammarSpec | None:
    """The constraint of a gRPC GenerateRequest's `structured_output` (proto/speedpipe.proto), or None.
    Raises `error(message, param)` naming the field as the proto does (structured_output.regex, ...)."""
    try:
        spec = _from_proto(req)
    except FormatError as exc:
        raise error(str(exc), exc.param) from None
    return None if spec is None else spec.asked_by("structured_output")


def _from_proto(req: Any) -> GrammarSpec | None:
    if not req.HasField("structured_output"):
        return None
    so = req.structured_output
    kind = so.WhichOneof("kind")
    field = f"structured_output.{kind}" if kind else "structured_output"
    if kind is None or (kind == "json_object" and not so.json_object):
        raise FormatError(f"'{field}' must set one of json_object (true), json_schema, regex, choice, grammar, "
                          "structural_tag", field)
    if kind == "choice":
        try:
            return GrammarSpec.choice(list(so.choice.choices))
        except ValueError as exc:
            raise FormatError(f"'{field}': {exc}", field) from None
    text = {"json_object": "", "json_schema": so.json_schema, "regex": so.regex, "grammar": so.grammar,
            "structural_tag": so.structural_tag}[kind]
    if kind != "json_object" and not text:
        raise FormatError(f"'{field}' is empty", field)
    if kind == "structural_tag":
        return _struct_tag(field, object_field(_loads(text, field), field))
    return _spec(field, kind=kind, text=text)
