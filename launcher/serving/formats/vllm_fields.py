"""vLLM's request fields about the prompt and the output text, and the vLLM fields this server refuses.

Owns reading, from a decoded HTTP body (both endpoints), vLLM's SamplingParams fields of the output text into
a `TextOptions` (launcher/coordinator/request_handle.py): `skip_special_tokens` (default true),
`spaces_between_special_tokens` (default true), `include_stop_str_in_output` (default false); vLLM's
`truncate_prompt_tokens` (keep the last k prompt tokens; -1 = max_model_len, as vLLM's renderer since it
normalises a negative value so; 0 is refused, it would leave no prompt; above max_model_len is refused, as
vLLM's); and the refusal of vLLM extension fields that this server does not implement and that would
otherwise be ignored with a different result (unknown fields are ignored, openai_protocol.py's `UNSUPPORTED`):
  guided_json, guided_regex, guided_choice, guided_grammar, guided_decoding_backend, guided_whitespace_pattern:
      vLLM 0.12 removed them (replaced by `structured_outputs`) and now ignores them, so a client that sends
      them gets unconstrained text from vLLM; here a 400 names the field and its replacement rather than
      either ignoring it or keeping an API vLLM dropped.
  prompt_logprobs (vLLM's per-choice prompt logprobs; here: completions' `echo` with `logprobs`),
  use_beam_search (true), detokenize (false), logits_processors, return_tokens_as_token_ids (true),
  prompt_embeds: not implemented; documents (vLLM passes them to the chat template): send them in
  chat_template_kwargs, which this server passes.
Each refusal raises the caller's `error` class naming the field. gRPC reads its own fields
(launcher/serving/grpc_generate.py) and shares `truncation_limit` and `truncated`.
Must not: do I/O, or import launcher/serving (it sits below it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from launcher.coordinator.request_handle import TextOptions
from launcher.serving.formats.response_format import ErrorClass, FormatError
from pipeline.speculation.echo import shown

_TEXT_FIELDS = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                "include_stop_str_in_output": False}  # name -> default (vLLM's)
_GUIDED = {"guided_json": "{\"structured_outputs\": {\"json\": ...}} or response_format json_schema",
           "guided_regex": "{\"structured_outputs\": {\"regex\": ...}}",
           "guided_choice": "{\"structured_outputs\": {\"choice\": [...]}}",
           "guided_grammar": "a JSON schema, regex or choice in structured_outputs (no grammars here)",
           "guided_decoding_backend": "structured_outputs (llguidance is this server's only backend)",
           "guided_whitespace_pattern": "structured_outputs (JSON whitespace is the schema's default)"}
# field -> (the value that asks for nothing, why it is refused otherwise)
_REFUSED = {"prompt_logprobs": (None, "use 'echo': true with 'logprobs' on /v1/completions"),
            "use_beam_search": (False, "beam search is not implemented"),
            "detokenize": (True, "the text is always detokenised"),
            "logits_processors": (None, "custom logits processors are not supported"),
            "return_tokens_as_token_ids": (False, "logprobs' tokens are always their text"),
            "prompt_embeds": (None, "prompts are text or token ids"),
            "documents": (None, "pass them to the chat template as chat_template_kwargs {\"documents\": [...]}")}


def text_options(body: dict, *, error: ErrorClass = FormatError) -> TextOptions:
    """The output-text fields of a request body (null or absent: vLLM's defaults). Raises `error` naming a
    field that is not true / false."""
    values = {}
    for name, default in _TEXT_FIELDS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise error(f"'{name}' must be true or false, got {shown(value)}", name)
        values[name] = default if value is None else value
    return TextOptions(**values)


def refuse_unsupported(body: dict, *, error: ErrorClass = FormatError) -> None:
    """Raise `error` naming the first vLLM field of this module's list that asks for something here
    unimplemented (a guided_* field set at all; the others set to other than their do-nothing value)."""
    for name, replacement in _GUIDED.items():
        if body.get(name) is not None:
            raise error(f"'{name}' was removed in vLLM 0.12 and is not supported; use {replacement}", name)
    for name, (idle, why) in _REFUSED.items():
        value = body.get(name)
        if value is not None and value != idle and not (idle is None and value in ([], {})):
            raise error(f"'{name}' = {shown(value)} is not supported by this server: {why}", name)


def truncation_limit(value: Any, max_model_len: int, *, field: str = "truncate_prompt_tokens",
                     error: ErrorClass = FormatError) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps: None (absent: all), k in [1, max_model_len], or
    max_model_len for -1 (vLLM's renderer). Raises `error` naming `field` for a non-integer, a value below
    -1, 0 (no prompt would be left) or one above max_model_len (vLLM refuses those too)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"'{field}' must be an integer, got {shown(value)}", field)
    if value < -1 or value == 0:
        raise error(f"'{field}' must be -1 (max_model_len) or in [1, {max_model_len}], got {value}", field)
    if value > max_model_len:
        raise error(f"'{field}' = {value} is greater than max_model_len {max_model_len}; select a smaller "
                    "truncation size", field)
    return max_model_len if value == -1 else value


def truncated(ids: Sequence[int], limit: int | None) -> list[int]:
    """The last `limit` of the prompt's token ids (vLLM truncates on the left), or all of them for None."""
    return list(ids) if limit is None else list(ids)[-limit:]
