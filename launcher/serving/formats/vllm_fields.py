"""vLLM's request fields about the prompt and the output text, and the vLLM fields this server refuses.

Owns reading, from a decoded HTTP body (both endpoints), vLLM's SamplingParams fields of the output text into
a `TextOptions` (launcher/coordinator/request_handle.py): `skip_special_tokens` (default true),
`spaces_between_special_tokens` (default true), `include_stop_str_in_output` (default false); vLLM's
`echo_text` (what completions' echo shows); `truncate_prompt_tokens` (keep the last k prompt tokens, BOS kept; -1 = max_model_len - max_tokens, as
vLLM's renderer; 0 is refused, it would leave no prompt; above max_model_len is refused, as vLLM's); and the
refusal of vLLM extension fields that this server does not implement and that would otherwise be ignored
with a different result (unknown fields are ignored, openai_protocol.py's `UNSUPPORTED`):
  guided_json, guided_regex, guided_choice, guided_grammar, guided_decoding_backend, guided_whitespace_pattern:
      vLLM 0.12 removed them (replaced by `structured_outputs`) and now ignores them, so a client that sends
      them gets unconstrained text from vLLM; here a 400 names the field and its replacement rather than
      either ignoring it or keeping an API vLLM dropped.
  use_beam_search (true), detokenize (false), logits_processors, prompt_embeds: not implemented.
It also reads vLLM's `prompt_logprobs` (`prompt_logprobs`: k alternatives per prompt token, as vLLM's protocol
checks it; openai_logprobs.py writes the answer).
(vLLM's chat `documents` are read by formats/chat_messages.py, return_tokens_as_token_ids by
openai_protocol.py.) Each refusal raises the caller's `error` class naming the field. gRPC reads its own
fields (launcher/serving/grpc_generate.py) and shares `truncation_limit`, `truncated` and `encode_truncated`.
Must not: do I/O, or import launcher/serving (it sits below it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from launcher.coordinator.request_handle import TextOptions
from launcher.serving.formats.response_format import ErrorClass, FormatError
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.echo import shown
from pipeline.speculation.sampling import MAX_LOGPROBS

_TEXT_FIELDS = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                "include_stop_str_in_output": False}  # name -> default (vLLM's)
_GUIDED = {"guided_json": "{\"structured_outputs\": {\"json\": ...}} or response_format json_schema",
           "guided_regex": "{\"structured_outputs\": {\"regex\": ...}}",
           "guided_choice": "{\"structured_outputs\": {\"choice\": [...]}}",
           "guided_grammar": "a JSON schema, regex or choice in structured_outputs (no grammars here)",
           "guided_decoding_backend": "structured_outputs (llguidance is this server's only backend)",
           "guided_whitespace_pattern": "structured_outputs (JSON whitespace is the schema's default)"}
# field -> (the value that asks for nothing, why it is refused otherwise)
_REFUSED = {"use_beam_search": (False, "beam search is not implemented"),
            "detokenize": (True, "the text is always detokenised"),
            "logits_processors": (None, "custom logits processors are not supported"),
            "prompt_embeds": (None, "prompts are text or token ids")}


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


def prompt_logprobs(body: dict, *, stream: bool, error: ErrorClass = FormatError) -> int | None:
    """vLLM's `prompt_logprobs` of a body (both endpoints): None (absent or null) or k in [0, MAX_LOGPROBS], the
    alternatives reported with each prompt token's logprob and rank. Raises `error` naming the field, as vLLM's
    protocol (vllm/entrypoints/openai/completion/protocol.py `check_logprobs`) and engine do, for a non-integer,
    a value below -1, -1 (the whole vocabulary: vLLM allows it only when its --max-logprobs is -1) or one above
    MAX_LOGPROBS (vLLM's default --max-logprobs, the cap of `logprobs` too), and for k > 0 with `stream` (vLLM's
    stream chunks have no prompt_logprobs field, so it refuses them; 0 is accepted and reported nowhere)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"'prompt_logprobs' must be an integer, got {shown(value)}", "prompt_logprobs")
    if value < -1:
        raise error(f"'prompt_logprobs' must be a non-negative integer or -1, got {value}", "prompt_logprobs")
    if value == -1 or value > MAX_LOGPROBS:
        asked = "-1 (the whole vocabulary)" if value == -1 else str(value)
        raise error(f"'prompt_logprobs' = {asked} is greater than this server's maximum of {MAX_LOGPROBS}",
                    "prompt_logprobs")
    if stream and value > 0:
        raise error("'prompt_logprobs' is not available with \"stream\": true (only 0, which reports nothing)",
                    "prompt_logprobs")
    return value


def truncation_limit(value: Any, max_model_len: int, *, max_tokens: int = 0, field: str = "truncate_prompt_tokens",
                     error: ErrorClass = FormatError) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps: None (absent: all), k in [1, max_model_len], or
    for -1 what `max_tokens` (the request's output budget; 0 if it set none) leaves of max_model_len (vLLM's
    renderer, vllm/renderers/params.py `TokenizeParams`: -1 maps to max_model_len - max_tokens; max_model_len
    itself if that leaves nothing, for the length check to refuse). Raises `error` naming `field` for a
    non-integer, a value below -1, 0 (no prompt would be left) or one above max_model_len (vLLM refuses those)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"'{field}' must be an integer, got {shown(value)}", field)
    if value < -1 or value == 0:
        raise error(f"'{field}' must be -1 (max_model_len - max_tokens) or in [1, {max_model_len}], got {value}",
                    field)
    if value > max_model_len:  # vLLM's words (vllm/entrypoints/openai/serving_engine.py `_validate_truncation_size`)
        raise error(f"'{field}' value ({value}) is greater than max_model_len ({max_model_len}). Please, select a "
                    "smaller truncation size.", field)
    if value == -1:
        return max_model_len - max_tokens if 0 <= max_tokens < max_model_len else max_model_len
    return value


def echo_text(tokenizer: Tokenizer, prompt: str | Sequence[int], ids: Sequence[int]) -> str:
    """The text completions' `echo` shows before the output, as vLLM: a text prompt as the client sent it, token
    ids (`ids`, after truncate_prompt_tokens) decoded with their special tokens shown, whatever the request's
    skip_special_tokens, which applies to the output only (vllm/entrypoints/openai/serving_engine.py
    `_normalize_prompt_text_to_input`: `input_text = prompt`; `_normalize_prompt_tokens_to_input`:
    `tokenizer.decode(input_ids)`, Hugging Face's default skip_special_tokens=False)."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)


def asked_budget(body: dict) -> int:
    """The output budget a body names (max_completion_tokens, else max_tokens), 0 if none or not a positive
    integer (the caller refuses that later): what truncate_prompt_tokens -1 leaves room for."""
    value = body.get("max_completion_tokens")
    value = body.get("max_tokens") if value is None else value
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def truncated(ids: Sequence[int], limit: int | None, *, added: tuple[int, int] = (0, 0)) -> list[int]:
    """The prompt's token ids cut to `limit` by dropping its first text tokens (vLLM truncates on the left), or
    all of them for None. `added`: how many ids the tokenizer's post-processor put before and after the text
    (`Tokenizer.num_added`; (0, 0) for token ids or text encoded without special tokens): they are kept and
    count toward `limit`, as Hugging Face's `tokenizer(text, truncation=True, max_length=limit)` with the left
    truncation side keeps BOS, which is how vLLM tokenises a truncated text prompt."""
    ids = list(ids)
    if limit is None or len(ids) <= limit:
        return ids
    before, after = added
    body = ids[before:len(ids) - after]
    keep = max(0, limit - before - after)
    return ids[:before] + body[len(body) - keep:] + ids[len(ids) - after:]


def encode_truncated(tokenizer: Tokenizer, text: str, limit: int | None, add_special_tokens: bool) -> list[int]:
    """The ids of a text prompt, cut to `limit` (`truncated`) keeping what the post-processor adds (BOS)."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return truncated(ids, limit, added=tokenizer.num_added if add_special_tokens else (0, 0))
