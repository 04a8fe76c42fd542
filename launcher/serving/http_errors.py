"""HTTP error responses of the OpenAI-compatible server, and the request body's bytes.

Owns the OpenAI-style error body of every refused or failed request (`error_response`), the status of
each failure (400 bad input, 401 wrong key, 404 a model this server does not serve (vLLM's NotFoundError,
launcher/serving/formats/model_field.py), 408 a body still arriving after BODY_READ_TIMEOUT_S, 413 body
over --max-request-bytes, 429 full queue, 400 too for a request whose own masks left no token mid-way, 500 a request that failed
alone while the server stays up, 503
failed, fenced or draining server), reading a body within its limits, and decoding it as JSON (`decode_body`: 400 for bytes that are not UTF-8
JSON, deep nesting or a lone surrogate). Must not: route requests (launcher/serving/http_server.py
does) or read the body's fields (launcher/serving/openai_protocol.py does).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.request_handle import NoTokenLeftError, RequestError
from launcher.serving import openai_protocol
from launcher.serving.formats.model_field import NOT_FOUND_TYPE, ModelNotFoundError
from launcher.serving.serving_engine import InvalidRequestError, QueueFullError, UnavailableError
from pipeline.speculation.echo import clipped
from workers.rpc.control_auth import secret_matches

MAX_JSON_DEPTH = 32  # deepest nesting of arrays / objects a request body may have


BODY_READ_TIMEOUT_S = 60.0  # longest a request body may take to arrive, from its first read (408 after)


class BodyError(Exception):
    """A request body the server will not read to the end; `status` is the HTTP status it answers."""

    status = 400


class BodyTooLarge(BodyError):
    """A request body over --max-request-bytes (413)."""

    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than {limit} bytes (--max-request-bytes)")


class BodyTimeout(BodyError):
    """A request body still arriving after BODY_READ_TIMEOUT_S (408): a client that trickles its body
    (slowloris) would otherwise hold a connection and a request slot for as long as it likes."""

    status = 408

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body did not arrive within {timeout_s:g} s")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body. Raises BodyTooLarge as soon as it is known to exceed `limit` bytes, and
    BodyTimeout when the whole body has not arrived `timeout_s` seconds (default BODY_READ_TIMEOUT_S)
    after the read began."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)
    timeout_s = BODY_READ_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(_read_all(request, limit), timeout_s)
    except asyncio.TimeoutError:  # builtins.TimeoutError from 3.11 on; asyncio's own before
        raise BodyTimeout(timeout_s) from None


async def _read_all(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body. Raises InvalidRequestError (param "body") for bytes that are
    not UTF-8 JSON, nesting deeper than MAX_JSON_DEPTH, or a string that is not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON allows but no tokenizer can encode)."""
    try:
        value = json.loads(raw)
    except RecursionError:  # the C parser recurses per level: ~1000 levels of [ or {
        raise InvalidRequestError(f"request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
                                  "body") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if "int_max_str_digits" in str(exc):  # Python's limit on int("..."): its message names a server setting
            raise InvalidRequestError(f"request body holds an integer of more than {sys.get_int_max_str_digits()} "
                                      "digits", "body") from None
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", "body") from None
    _check_value(value)
    return value


def _check_value(value: Any) -> None:
    """Raise InvalidRequestError if `value` nests deeper than MAX_JSON_DEPTH or any string (key or
    value) in it is not encodable as UTF-8. Iterative: never recurses."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise InvalidRequestError(f"request body nests arrays/objects deeper than {MAX_JSON_DEPTH} "
                                          f"levels", "body")
            children = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack.extend((c, depth + 1) for c in children)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = clipped(v[exc.start:exc.end].encode("utf-8", "backslashreplace").decode())
                raise InvalidRequestError(f"request body has a string that is not valid Unicode (lone surrogate "
                                          f"{bad})", "body") from None


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""
    return JSONResponse(openai_protocol.error_body(message, param, type_=type_, code=status), status_code=status)


def refused(request: Request, api_key: str | None) -> JSONResponse | None:
    """None if `request` may use /v1/* (no --api-key, or `Authorization: Bearer KEY`, the scheme in
    any case as RFC 9110 §11.1 says); else a 401."""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if api_key is None or (scheme.lower() == "bearer" and secret_matches(token.strip(), api_key)):
        return None
    return JSONResponse(openai_protocol.error_body("missing or incorrect API key (send `Authorization: Bearer KEY`)",
                                         None, code="invalid_api_key"), status_code=401)


def failure(exc: PipelineError | UnavailableError) -> tuple[int, str, str]:
    """(status, message, error type) of a failure after admission: 400 for a request whose own masks left no
    token (NoTokenLeftError, bad input: its `param` names the field; [Note: no token left] in
    pipeline/speculation/verify.py); 500 for a request that failed alone while the server stays up
    (RequestError: its logits were not finite); 503 for a fenced or draining server, or a failed pipeline."""
    if isinstance(exc, NoTokenLeftError):
        return 400, str(exc), "invalid_request_error"
    if isinstance(exc, RequestError):
        return 500, str(exc), "internal_server_error"
    return 503, str(exc) if isinstance(exc, UnavailableError) else f"pipeline failed: {exc}", "service_unavailable"


def unavailable(exc: PipelineError | UnavailableError) -> JSONResponse:
    """The response for `failure(exc)`."""
    code, message, type_ = failure(exc)
    return error_response(code, message, getattr(exc, "param", None), type_=type_)


def admission_error(exc: Exception) -> JSONResponse:
    """The response for an exception raised while admitting a request (see the module docstring)."""
    if isinstance(exc, BodyError):
        return error_response(exc.status, str(exc), None)
    if isinstance(exc, ModelNotFoundError):
        return error_response(exc.status, str(exc), exc.param, type_=NOT_FOUND_TYPE)
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return error_response(429, str(exc), None, type_="rate_limit_error")
    if isinstance(exc, (UnavailableError, PipelineError)):
        return unavailable(exc)
    return error_response(400, str(exc), None)  # ValueError: the coordinator's checks not caught above
