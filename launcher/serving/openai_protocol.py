"""OpenAI API request validation, chat-template rendering and response bodies.

Owns turning a decoded JSON body of `POST /v1/completions` or `/v1/chat/completions` into prompt
token ids and `SamplingParams` (every bad field → `InvalidRequestError` naming it, which the HTTP
layer answers with 400 and an OpenAI-style error body; another model's name → 404, formats/model_field.py), rendering chat messages with the model's
own Jinja chat template (sandboxed, as Hugging Face does), and building the JSON objects of
responses and stream chunks. Field semantics follow the OpenAI API reference; extensions as vLLM's: `ignore_eos`,
`return_token_ids` (adds `token_ids` to each choice / chunk), `repetition_penalty`. `logit_bias` (an object of
token ids as strings -> bias in [-100, 100]; ids checked against the vocabulary), `logprobs` (completions: an
integer 0..20; chat: true/false with `top_logprobs` 0..20), `echo` (completions), `n` (1..MAX_N independent
choices; with a `seed`, choice i uses seed + i) and the presence / frequency / repetition penalties map onto
`SamplingParams` (pipeline/speculation/sampling.py); vLLM's `min_tokens`, `stop_token_ids`, `allowed_token_ids`
and `bad_words` onto its token masks (pipeline/speculation/masks/token_masks.py; a stop token id is the choice's
`stop_reason`); `response_format` and vLLM's `structured_outputs` onto its grammar (formats/response_format.py);
chat `tools` / `tool_choice` into `ParsedRequest.tools` and, named or "required", a grammar (formats/tools.py);
vLLM's output-text fields into `ParsedRequest.text`, `truncate_prompt_tokens`, `add_special_tokens` and the vLLM
fields refused rather than ignored (formats/vllm_fields.py).
Must not: do I/O or know about the coordinator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from launcher.coordinator.request_handle import TextOptions
from launcher.serving.formats import vllm_fields
from launcher.serving.formats.chat_messages import chat_options, clean_messages
from launcher.serving.formats.model_field import check_model
from launcher.serving.formats.response_format import grammar_from_body
from launcher.serving.formats.tool_output import keeps_special_tokens
from launcher.serving.formats.tools import ToolRequest, tools_from_body
from launcher.serving.prometheus import FINISH_REASONS
from launcher.serving.serving_engine import MAX_TEMPERATURE, FinalInfo, InvalidRequestError
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.echo import clipped, shown
from pipeline.speculation.sampling import MAX_LOGPROBS, SamplingParamError, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4
API_SEED_LIMIT = 2**63  # seeds in [0, 2**63): vLLM's API takes a signed 64-bit seed (torch.long)
# Fields this server does not implement: refused (400 naming the field) unless absent or set to a
# value that asks for nothing (n = 1; anything falsy for the others: 0, false, null, [], {}).
# Other unknown fields (user, metadata, ...) are ignored, as OpenAI's servers do.
UNSUPPORTED = ("best_of", "suffix", "functions", "chat_template")
MAX_N = 16  # most choices one request may ask for (each is a sequence in its own KV slot)
TEMPLATE_TEXT_CHARS = 300  # most of a chat template's own refusal shown (it may quote the messages)


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request: prompt ids, sampling parameters and response options."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_field: str
    n: int = 1
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    echo: str | None = None  # completions' echo: the text shown before the output (vllm_fields.echo_text)
    budget_field: str = "max_tokens"  # the request's name of its token budget (or max_completion_tokens)
    tools: ToolRequest | None = None  # chat `tools` / `tool_choice` (launcher/serving/formats/tools.py)
    text: TextOptions = TextOptions()  # skip_special_tokens, ... (launcher/serving/formats/vllm_fields.py)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens are "token_id:<id>" (openai_logprobs.py)

    def choice_params(self) -> list[SamplingParams]:
        """Each of the n choices' sampling parameters: seed + i for choice i when a seed is given (reproducible)."""
        if self.params.seed is None:
            return [self.params] * self.n
        return [dataclasses.replace(self.params, seed=(self.params.seed + i) % API_SEED_LIMIT) for i in range(self.n)]


def _number(body: dict, name: str, default: float, *, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidRequestError(f"'{name}' must be a number, got {shown(value)}", name)
    if value < lo or (lo_open and value == lo) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequestError(f"'{name}' must be in {interval}, got {shown(value)}", name)
    return float(value)


def _int(body: dict, name: str, default: int | None, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer, got {shown(value)}", name)
    if value < lo or (hi is not None and value >= hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise InvalidRequestError(f"'{name}' must be {limit}, got {shown(value)}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return tuple(stops)


def bool_field(body: dict, name: str, default: bool, *, parent: str | None = None) -> bool:
    """The true/false field `name` of `body` (null or absent: `default`), as OpenAI and vLLM take it: any
    other JSON value (1, "yes", {}) raises InvalidRequestError naming the field, as `parent.name` for a
    field of the object `parent` (stream_options.include_usage)."""
    value = body.get(name)
    field = name if parent is None else f"{parent}.{name}"
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"'{field}' must be true or false, got {shown(value)}", field)
    return default if value is None else value


def _common(body: dict, *, max_tokens_default: int) -> dict[str, Any]:
    """Validate the fields both endpoints share (`model` is checked before: parse_*); returns keyword arguments of
    SamplingParams + options."""
    for name in UNSUPPORTED:
        value = body.get(name)
        if (value not in (None, 1, body.get("n"))) if name == "best_of" else bool(value):
            raise InvalidRequestError(f"'{name}' = {shown(value)} is not supported by this server", name)
    vllm_fields.refuse_unsupported(body, error=InvalidRequestError)
    # max_completion_tokens (the newer name) wins unless it is null, as in vLLM
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, field, max_tokens_default, lo=1)
    flags = {name: bool_field(body, name, False)
             for name in ("stream", "ignore_eos", "return_token_ids", "echo", "return_tokens_as_token_ids")}
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequestError("'stream_options' must be an object", "stream_options")
    if stream_options is not None and not flags["stream"]:
        raise InvalidRequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    return {
        **flags,
        "budget_field": field,
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, lo=0.0, hi=MAX_TEMPERATURE),
        "top_p": _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        "top_k": _int(body, "top_k", 0, lo=-1),
        "min_p": _number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        "seed": _int(body, "seed", None, lo=0, hi=API_SEED_LIMIT),
        "stop": _stop(body),
        **_usage_options(stream_options or {}),
        "text": vllm_fields.text_options(body, error=InvalidRequestError),
        "prompt_logprobs": vllm_fields.prompt_logprobs(body, stream=flags["stream"], error=InvalidRequestError),
        "n": _int(body, "n", 1, lo=1, hi=MAX_N + 1),
        "presence_penalty": _number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, lo=0.0, hi=2.0, lo_open=True),
        "logit_bias": {} if body.get("logit_bias") is None else body["logit_bias"],  # {"50256": -100}; 0, "", [] are 400
        "grammar": grammar_from_body(body, error=InvalidRequestError),  # response_format / structured_outputs
        **{name: body[name] for name in ("min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words")
           if body.get(name) is not None},  # vLLM's token masks (speculation/masks/token_masks.py checks them); null: unset
    }


def _usage_options(stream_options: dict) -> dict[str, bool]:
    """include_usage and continuous_usage (every chunk carries the usage so far: vLLM's
    stream_options.continuous_usage_stats, which it honours only with include_usage), both booleans."""
    include = bool_field(stream_options, "include_usage", False, parent="stream_options")
    every = bool_field(stream_options, "continuous_usage_stats", False, parent="stream_options")
    return {"include_usage": include, "continuous_usage": include and every}


def _completion_logprobs(body: dict, kw: dict[str, Any]) -> None:
    """Completions: `logprobs` (null or 0..MAX_LOGPROBS) and `echo` (prompt logprobs: vLLM's prompt_logprobs k, else logprobs')."""
    lp = {"logprobs": None if body.get("logprobs") is False else body.get("logprobs")}  # false: none, as null
    kw["logprobs"] = _int(lp, "logprobs", None, lo=0, hi=MAX_LOGPROBS + 1)
    if kw["echo"] and kw["logprobs"] is not None and kw["prompt_logprobs"] is None:
        kw["prompt_logprobs"] = kw["logprobs"]


def _chat_logprobs(body: dict, kw: dict[str, Any]) -> None:
    """Chat: `logprobs` (true/false) and `top_logprobs` (0..MAX_LOGPROBS, only with logprobs)."""
    if kw.pop("echo"):
        raise InvalidRequestError("'echo' is only supported on /v1/completions", "echo")
    want = bool_field(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS + 1)
    if top is not None and not want:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kw["logprobs"] = (top or 0) if want else None


def _finish(kw: dict[str, Any], prompt_ids: list[int], prompt_field: str, vocab_size: int) -> ParsedRequest:
    """The ParsedRequest of validated fields `kw` (SamplingParams' and the options'; logit_bias ids
    are checked against `vocab_size`). A setting that SamplingParams refuses although the checks above
    let it through is an InvalidRequestError naming the request's own field (`api_field`), not a bare
    ValueError (HTTP's `param: null`)."""
    options = {k: kw.pop(k) for k in ("stream", "include_usage", "continuous_usage", "return_token_ids", "n",
                                      "echo", "budget_field", "text", "return_tokens_as_token_ids") if k in kw}
    try:
        params = SamplingParams(**kw)
        params.check_vocab(vocab_size)
    except SamplingParamError as exc:
        raise InvalidRequestError.of_setting(exc, api_field(exc.param, options["budget_field"])) from None
    return ParsedRequest(prompt_ids, params, prompt_field=prompt_field, **options)


def api_field(param: str, budget_field: str) -> str:
    """The request field of SamplingParams' field `param`: max_new_tokens is the request's budget field
    (`budget_field`: max_tokens, or max_completion_tokens when the request used it), the others have the API's names."""
    return {"max_new_tokens": budget_field}.get(param, param)


def parse_completion(body: Any, *, tokenizer: Tokenizer, model_name: str, max_model_len: int | None = None) -> ParsedRequest:
    """A /v1/completions body. prompt: a string, a list of one string, or a list of token ids; a
    string certainly longer than `max_model_len` tokens is refused before it is tokenised.
    Raises InvalidRequestError naming the field, ModelNotFoundError for another model (formats/model_field.py)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", None)
    check_model(body, model_name, error=InvalidRequestError)  # 404 for another model, before any field's value (vLLM)
    kw = _common(body, max_tokens_default=DEFAULT_COMPLETION_MAX_TOKENS)
    if body.get("tools"):
        raise InvalidRequestError("'tools' is only supported on /v1/chat/completions", "tools")
    _completion_logprobs(body, kw)
    keep = vllm_fields.truncation_limit(body.get("truncate_prompt_tokens"), max_model_len or 2**31,
                                        max_tokens=kw["max_new_tokens"], error=InvalidRequestError)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("'prompt' is empty", "prompt")
        _check_fits(tokenizer, prompt, None if keep else max_model_len, "prompt")
        ids = vllm_fields.encode_truncated(tokenizer, prompt, keep, bool_field(body, "add_special_tokens", True))
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = vllm_fields.truncated(prompt, keep)
    elif prompt is None:
        raise InvalidRequestError("'prompt' is required", "prompt")
    else:
        raise InvalidRequestError("'prompt' must be a string or a list of token ids (one prompt per request)",
                                  "prompt")
    kw["echo"] = vllm_fields.echo_text(tokenizer, prompt, ids) if kw["echo"] else None
    return _finish(kw, ids, "prompt", tokenizer.vocab_size)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        text = clipped(str(message), TEMPLATE_TEXT_CHARS)
        raise InvalidRequestError(f"chat template refused the messages: {text}", "messages")

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_chat(messages: Any, *, tokenizer: Tokenizer, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: Sequence[dict] | None = None) -> str:
    """The prompt text of `messages` under the model's chat template, as Hugging Face's
    `apply_chat_template`: ending with the assistant's generation prompt (`add_generation_prompt`),
    or cut right after the last message's content so the model continues it
    (`continue_final_message`). template_kwargs: extra variables of the template (vLLM's
    `chat_template_kwargs`, e.g. {"enable_thinking": false}; they override `tools`, the request's tools,
    the template's `tools` variable as in HF and vLLM). Raises InvalidRequestError
    ('messages', or the field) for malformed messages, a model without a chat template, or a template
    that fails on this request (Qwen2.5's on `chat_template_kwargs` {"tools": 5})."""
    clean = clean_messages(messages, error=InvalidRequestError)
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
    specials = {name: tokenizer.decode([i], skip_special_tokens=False) for name, i in (  # a token it lacks: undefined,
        ("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)) if i is not None}  # as in HF
    template = _compiled_template(tokenizer.chat_template)  # a model's broken template stays a server error
    try:
        text = template.render(
            **({"tools": list(tools)} if tools else {}), **(template_kwargs or {}), messages=clean,
            add_generation_prompt=add_generation_prompt and not continue_final_message, **specials)
    except (TemplateError, TypeError, AttributeError, LookupError) as exc:  # raise_exception's error passes
        raise InvalidRequestError(f"the chat template cannot render this request ({type(exc).__name__}: "
                                  f"{clipped(str(exc), TEMPLATE_TEXT_CHARS)})",
                                  "chat_template_kwargs" if template_kwargs else "messages") from None
    if continue_final_message:
        final = clean[-1]["content"].strip()
        if not final or final not in text:
            raise InvalidRequestError("'continue_final_message' needs a last message with content the chat template "
                                      "keeps", "continue_final_message")
        text = text[:text.rindex(final) + len(final)]
    return text


def parse_chat(body: Any, *, tokenizer: Tokenizer, model_name: str, max_model_len: int,
               tool_parser: str | None = None) -> ParsedRequest:
    """A /v1/chat/completions body; max_tokens defaults to what fits in max_model_len. tool_parser: the
    server's tool-call parser for tool_choice "auto" (--tool-call-parser), or None.
    Raises InvalidRequestError naming the field, ModelNotFoundError for another model (formats/model_field.py)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", None)
    check_model(body, model_name, error=InvalidRequestError)
    tools = tools_from_body(body, parser=tool_parser, error=InvalidRequestError)
    text = render_chat(body.get("messages"), tokenizer=tokenizer, tools=tools and tools.tools,
                       **chat_options(body, error=InvalidRequestError))
    keep = vllm_fields.truncation_limit(body.get("truncate_prompt_tokens"), max_model_len,
                                        max_tokens=vllm_fields.asked_budget(body), error=InvalidRequestError)
    _check_fits(tokenizer, text, None if keep else max_model_len, "messages")
    special = bool_field(body, "add_special_tokens", False)  # false: the template spells its own BOS (HF, vLLM)
    ids = vllm_fields.encode_truncated(tokenizer, text, keep, special)
    kw = _common(body, max_tokens_default=max(1, max_model_len - len(ids)))
    _chat_logprobs(body, kw)
    if tools is not None and keeps_special_tokens(tools):  # the parser's adjust_request (formats/tool_output.py)
        kw["text"] = dataclasses.replace(kw["text"], skip_special_tokens=False)
    if tools is not None and tools.constrains:
        _constrain_to_tools(kw, tools)
    return dataclasses.replace(_finish(kw, ids, "messages", tokenizer.vocab_size), tools=tools)


def _constrain_to_tools(kw: dict[str, Any], tools: ToolRequest) -> None:
    """A named or "required" tool_choice: the output is constrained to the call's JSON (vLLM's approach)."""
    if kw["grammar"] is not None:
        raise InvalidRequestError("a named or \"required\" 'tool_choice' constrains the output itself: not together "
                                  "with 'response_format' or 'structured_outputs'", "tool_choice")
    if kw["ignore_eos"]:
        raise InvalidRequestError("'ignore_eos' cannot be combined with a named or \"required\" 'tool_choice'",
                                  "ignore_eos")
    kw["grammar"] = tools.grammar(error=InvalidRequestError)


def _check_fits(tokenizer: Tokenizer, text: str, max_model_len: int | None, field: str) -> None:
    """InvalidRequestError naming `field` when `text` cannot fit `max_model_len` tokens (`Tokenizer.check_fits`)."""
    if max_model_len is not None:
        try:
            tokenizer.check_fits(text, max_model_len, what=f"'{field}'")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), field) from None


# -- responses ---------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(final: FinalInfo) -> dict[str, int]:
    return usage_so_far(final.prompt_tokens, final.completion_tokens)


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object; on a stream chunk with continuous_usage_stats, the tokens of that
    chunk's choice so far (as vLLM counts them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, param: str | None, *, type_: str = "invalid_request_error",
               code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_body(*, request_id: str, model: str, text: str, token_ids: list[int] | None, finish_reason: str | None,
                    final: FinalInfo | None, chunk: bool, chat: bool, role: bool = False, index: int = 0,
                    logprobs: dict[str, Any] | None = None, stop_reason: str | int | None = None) -> dict[str, Any]:
    """A response (chunk=False) or stream chunk (chunk=True) of either endpoint, one choice
    (number `index`; `logprobs` from launcher/serving/openai_logprobs.py or None). `stop_reason`:
    the stop string or stop token id that ended the choice, null otherwise (vLLM's field of that name)."""
    reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
    if chat:
        content = {"role": "assistant", "content": text} if (role or not chunk) else {"content": text}
        choice = {"index": index, ("delta" if chunk else "message"): content, "logprobs": logprobs,
                  "finish_reason": reason, "stop_reason": stop_reason}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stop_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if final is not None and not chunk:
        body["usage"] = usage(final)
    return body


def usage_chunk(*, request_id: str, model: str, final: FinalInfo, chat: bool) -> dict[str, Any]:
    """The last stream chunk when stream_options.include_usage: no choices, only usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(final)}
