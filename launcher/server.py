"""OpenAI-compatible HTTP front end (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health` (200, or 503 with the
reason while the pipeline or any stage is unhealthy) and `GET /metrics` (Prometheus text).
Errors: bad input (also: not UTF-8 JSON, a lone surrogate, deep nesting) → 400, wrong or missing
`Authorization: Bearer KEY` on /v1/* with --api-key → 401, unknown route → 404, a body over
--max-request-bytes → 413, full queue → 429, failed, fenced or draining server → 503, each with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}`; the server keeps serving. A
stream that fails mid-way ends with an error event and `data: [DONE]`.
Body decoding, validation and tokenisation run in a worker thread, so /health and the running
streams are served while a large body is handled.
A client that disconnects (or stops reading a stream) has its request aborted at once, which
frees its KV slot on every stage.
Must not: validate fields itself (launcher/openai_protocol.py) or touch the coordinator directly
(launcher/serving_engine.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from launcher import openai_protocol as proto
from launcher.coordinator import PipelineError
from launcher.serving_engine import (
    InvalidRequestError,
    QueueFullError,
    RequestStream,
    ServingEngine,
    UnavailableError,
)
from workers.control_auth import secret_matches

log = logging.getLogger("speedpipe.serve")
DISCONNECT_POLL_S = 0.2
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class _BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than {limit} bytes (--max-request-bytes)")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body; raises _BodyTooLarge as soon as it is known to exceed `limit` bytes."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _in_thread(fn, *args) -> Any:
    """fn(*args) in a worker thread. If the request is cancelled meanwhile, a RequestStream the call
    still returns is cancelled when it arrives (no orphaned generation)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def cancel_stream(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                t.result()[1].cancel()

        task.add_done_callback(cancel_stream)
        raise


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(proto.error_body(message, param, type_=type_, code=status), status_code=status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that cancels its request however the response ends: finished,
    client gone, or cancelled before the body iterator even started."""

    def __init__(self, content, *, stream: RequestStream, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._request_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._request_stream.cancel()


def _refused(request: Request, api_key: str | None) -> JSONResponse | None:
    """None if `request` may use /v1/* (no --api-key, or `Authorization: Bearer KEY`); else a 401."""
    if api_key is None or secret_matches(request.headers.get("authorization"), f"Bearer {api_key}"):
        return None
    return JSONResponse(proto.error_body("missing or incorrect API key (send `Authorization: Bearer KEY`)",
                                         None, code="invalid_api_key"), status_code=401)


def _admit(engine: ServingEngine, raw: bytes, chat: bool) -> tuple[proto.ParsedRequest, RequestStream]:
    """Decode, validate, tokenise and submit one request body (in a worker thread).
    Raises InvalidRequestError, ValueError, QueueFullError, UnavailableError or PipelineError."""
    body = proto.decode_body(raw)
    tokenizer, model = engine.tokenizer, engine.model_name
    if chat:
        parsed = proto.parse_chat(body, tokenizer=tokenizer, model_name=model, max_model_len=engine.max_model_len)
    else:
        parsed = proto.parse_completion(body, tokenizer=tokenizer, model_name=model)
    engine.check_prompt(parsed.prompt_ids, parsed.params.max_new_tokens, prompt_field=parsed.prompt_field)
    return parsed, engine.start(parsed.prompt_ids, parsed.params, request_id=proto.new_id("chatcmpl" if chat else "cmpl"))


def build_app(engine: ServingEngine, *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI application serving `engine`; /v1/* need `Authorization: Bearer api_key` if set."""
    app = FastAPI(title="speedpipe", docs_url=None, redoc_url=None, openapi_url=None)
    model = engine.model_name

    def refused(request: Request) -> JSONResponse | None:
        return _refused(request, api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        ok, why = await asyncio.to_thread(engine.healthy)
        return Response(status_code=200) if ok else _error(503, why, type_="service_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(engine.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "speedpipe",
                                            "max_model_len": engine.max_model_len}]})


    async def generate(request: Request, *, chat: bool) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        try:
            parsed, stream = await _in_thread(_admit, engine, await _read_body(request, max_request_bytes), chat)
        except _BodyTooLarge as exc:
            return _error(413, str(exc), None)
        except InvalidRequestError as exc:
            return _error(400, str(exc), exc.param)
        except ValueError as exc:  # SamplingParams / coordinator checks not caught above
            return _error(400, str(exc), None)
        except QueueFullError as exc:
            return _error(429, str(exc), None, type_="rate_limit_error")
        except UnavailableError as exc:
            return _error(503, str(exc), None, type_="service_unavailable")
        except PipelineError as exc:
            return _error(503, f"pipeline failed: {exc}", None, type_="service_unavailable")
        if parsed.stream:
            return _AbortingStreamingResponse(_stream(stream, parsed, chat=chat), stream=stream,
                                              media_type="text/event-stream")
        return await _collect(request, stream, parsed, chat=chat)

    async def _collect(request: Request, stream: RequestStream, parsed: proto.ParsedRequest, *, chat: bool) -> Response:
        done = asyncio.Event()

        async def watch() -> None:  # a client gone before the answer is ready aborts the request
            while not done.is_set():
                if await request.is_disconnected():
                    stream.cancel()
                    return
                await asyncio.sleep(DISCONNECT_POLL_S)

        watcher = asyncio.create_task(watch())
        text, ids, reason = [], [], None
        try:
            async for chunk in stream:
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                reason = chunk.finish_reason or reason
        except UnavailableError as exc:
            return _error(503, str(exc), None, type_="service_unavailable")
        except PipelineError as exc:
            return _error(503, f"pipeline failed: {exc}", None, type_="service_unavailable")
        finally:
            done.set()
            watcher.cancel()
            stream.cancel()
        return JSONResponse(proto.completion_body(
            request_id=stream.request_id, model=model, text="".join(text),
            token_ids=ids if parsed.return_token_ids else None, finish_reason=reason, final=stream.final,
            chunk=False, chat=chat))

    async def _stream(stream: RequestStream, parsed: proto.ParsedRequest, *, chat: bool):
        rid = stream.request_id
        try:
            if chat:
                yield _sse(proto.completion_body(request_id=rid, model=model, text="", token_ids=None,
                                                 finish_reason=None, final=None, chunk=True, chat=True, role=True))
            async for chunk in stream:
                if not chunk.text and not chunk.token_ids and chunk.finish_reason is None:
                    continue
                yield _sse(proto.completion_body(
                    request_id=rid, model=model, text=chunk.text,
                    token_ids=list(chunk.token_ids) if parsed.return_token_ids else None,
                    finish_reason=chunk.finish_reason, final=None, chunk=True, chat=chat))
            if parsed.include_usage and stream.final is not None:
                yield _sse(proto.usage_chunk(request_id=rid, model=model, final=stream.final, chat=chat))
            yield "data: [DONE]\n\n"
        except (PipelineError, UnavailableError) as exc:  # the stream ends with an error event, then [DONE]
            message = str(exc) if isinstance(exc, UnavailableError) else f"pipeline failed: {exc}"
            yield _sse(proto.error_body(message, None, type_="service_unavailable", code=503))
            yield "data: [DONE]\n\n"
        finally:  # also on client disconnect (the generator is cancelled / closed)
            stream.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


class HttpServer:
    """uvicorn serving `build_app(engine)` in a background thread (tests, and `serve` with gRPC).

    `start()` returns once the socket listens; raises RuntimeError if it could not bind.
    """

    def __init__(self, engine: ServingEngine, *, host: str, port: int, log_level: str = "warning",
                 api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        import uvicorn

        app = build_app(engine, api_key=api_key, max_request_bytes=max_request_bytes)
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                     access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self.server.run, name="http-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start on {self.config.host}:{self.config.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
