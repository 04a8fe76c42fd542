"""The `model` a request names: this server's model, or a 404 as vLLM answers it.

Owns `check_model` (the request body's `model` field, read by /v1/completions, /v1/chat/completions,
/tokenize and /detokenize) and `check_model_name` (the same rule for a bare name: GET /v1/models/{id}
asks it too, so every route answers an unknown model alike), and `ModelNotFoundError`, which the HTTP
layer (launcher/serving/http_errors.py `admission_error`) answers with 404.

The rule and the answer are vLLM's (vllm/entrypoints/openai/engine/serving.py `OpenAIServing._check_model`
and `_is_model_supported`): an absent, null or empty `model` means the served model; any other name that
is not the served one is HTTP 404 with `{"error": {"message": "The model `NAME` does not exist.",
"type": "NotFoundError", "param": "model", "code": 404}}`, which the openai Python client raises as
`openai.NotFoundError`. A `model` that is not a string is bad input (vLLM's pydantic request models:
400), raised as the caller's `error` class. The name is echoed as vLLM echoes it, raw (quotes, backslashes
and non-ASCII characters as sent; " at 0x<hex>>" written ">", as vLLM's create_error_response passes
every message through vllm/entrypoints/utils.py `sanitize_message`), with two exceptions that keep an error
message one short line: a line-breaking character is written as Python escapes it ("\\n", "\\u2028"), and
the name is cut to its first SHOWN_CHARS characters (pipeline/speculation/echo.py `clipped`). gRPC's
GenerateRequest names no model, so gRPC has nothing to check.
Must not: do I/O, or import launcher/serving (this package sits below it).
"""

from __future__ import annotations

import re
from typing import Any

from launcher.serving.formats.response_format import ErrorClass
from pipeline.speculation.echo import clipped, shown

NOT_FOUND_TYPE = "NotFoundError"  # vLLM's error type of an unknown model (its create_error_response err_type)
_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")  # vLLM's sanitize_message: no object address in an error message


class ModelNotFoundError(ValueError):
    """A request names a model this server does not serve: HTTP 404, `param` "model" (vLLM's)."""

    status = 404
    param = "model"

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{clipped(_one_line(_ADDRESS.sub('>', name)))}` does not exist.")


def _one_line(name: str) -> str:
    """`name` with each character that breaks a line (str.splitlines': \\n, \\r, \\x85, \\u2028, ...) escaped as
    repr escapes it; every other character as it is."""
    return "".join(repr(c)[1:-1] if len(f"a{c}b".splitlines()) > 1 else c for c in name)


def check_model_name(name: str, served: str) -> None:
    """Raise ModelNotFoundError unless `name` is `served`, the server's model name."""
    if name != served:
        raise ModelNotFoundError(name)


def check_model(body: dict, served: str, *, error: ErrorClass) -> None:
    """Check a decoded request body's `model` (absent, null, "" or `served` pass). Raises
    ModelNotFoundError (404) for another name, `error(message, "model")` for a value that is not a string."""
    model: Any = body.get("model")
    if model is None or model == "":  # vLLM's `_is_model_supported`: no name means the served model
        return
    if not isinstance(model, str):
        raise error(f"'model' must be a string, got {shown(model)}", "model")
    check_model_name(model, served)
