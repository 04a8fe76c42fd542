"""vLLM's tokenizer endpoints: the bodies of `POST /tokenize` and `POST /detokenize`.

Clients that count tokens before they send a request (to keep prompt + `max_tokens` within
`max_model_len`), or check how a chat renders under the model's template, call these on vLLM's
OpenAI-compatible server; the shapes are vLLM's (`TokenizeCompletionRequest`,
`TokenizeChatRequest`, `DetokenizeRequest` and their responses):

- `/tokenize` with `{"prompt": "...", "add_special_tokens": true}`, or with `{"messages": [...]}`
  and the chat options of /v1/chat/completions (`add_generation_prompt`, `continue_final_message`,
  `chat_template_kwargs`, and `tools`, which the template sees; `tool_choice` is not read, as vLLM); either may ask for `"return_token_strs": true`. The answer is
  `{"count", "max_model_len", "tokens", "token_strs"}`, and `tokens` are exactly the prompt ids
  the generation endpoint would run for the same prompt or messages (so `count` is its
  `usage.prompt_tokens`). `add_special_tokens` (default true for a prompt, false for messages,
  whose template spells its own BOS, as vLLM) adds the BOS token of a model whose
  tokenizer_config says `add_bos_token`.
- `/detokenize` with `{"tokens": [ids]}` answers `{"prompt": text}`, special tokens kept (as
  Hugging Face's `decode` and vLLM do).

Every bad field raises InvalidRequestError naming it (HTTP 400); another model's name ModelNotFoundError
(HTTP 404, vLLM's answer: launcher/serving/formats/model_field.py), checked before any other field
(vLLM's pydantic models check JSON types before its `_check_model`; here the model comes first for those too).
Must not: do I/O or know about the coordinator (launcher/serving/http_server.py serves these).
"""

from __future__ import annotations

from typing import Any

from launcher.serving.formats.chat_messages import chat_options
from launcher.serving.formats.model_field import check_model
from launcher.serving.formats.tools import tools_from_body
from launcher.serving.openai_protocol import bool_field, render_chat
from launcher.serving.serving_engine import InvalidRequestError
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.echo import shown

MAX_DETOKENIZE_TOKENS = 1 << 20  # longest id list /detokenize takes (far beyond any context)


def _object(body: Any, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", None)
    check_model(body, model_name, error=InvalidRequestError)
    return body


def tokenize_body(body: Any, *, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> dict[str, Any]:
    """The `/tokenize` answer for a decoded JSON `body` (a prompt or chat messages, see the module
    docstring): {"count": int, "max_model_len": int, "tokens": [count] ids, "token_strs": [count]
    vocabulary strings or None}. Raises InvalidRequestError naming the bad field."""
    body = _object(body, model_name)
    chat = "messages" in body
    if chat and "prompt" in body:
        raise InvalidRequestError("give either 'prompt' or 'messages', not both", "prompt")
    add_special = bool_field(body, "add_special_tokens", not chat)
    if chat:
        tools = tools_from_body({"tools": body.get("tools"), "tool_choice": "none"}, parser=None,
                                error=InvalidRequestError)  # the template sees them, as in a chat request
        text = render_chat(body.get("messages"), tokenizer=tokenizer, tools=tools and tools.tools,
                           **chat_options(body, error=InvalidRequestError))
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequestError("'prompt' must be a string (or send 'messages')", "prompt")
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    strs = tokenizer.token_strings(ids) if bool_field(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(body: Any, *, tokenizer: Tokenizer, model_name: str) -> dict[str, str]:
    """The `/detokenize` answer for a decoded JSON `body` {"tokens": [ids]}: {"prompt": text}.
    Raises InvalidRequestError ('tokens') for a missing list, a non-integer, or an id outside the
    vocabulary."""
    body = _object(body, model_name)
    ids = body.get("tokens")
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_TOKENS:
        raise InvalidRequestError(f"'tokens' must be a list of at most {MAX_DETOKENIZE_TOKENS} token ids", "tokens")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < tokenizer.vocab_size:
            raise InvalidRequestError(f"'tokens[{i}]' = {shown(t)} is not a token id of this model "
                                      f"(0..{tokenizer.vocab_size - 1})", "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
