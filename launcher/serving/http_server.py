"""OpenAI-compatible HTTP front end (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models` (and `/v1/models/{id}`), vLLM's
`POST /tokenize` and `POST /detokenize` (launcher/serving/tokenize_api.py; behind --api-key
like /v1/*), `GET /health` (200, or 503 with the reason while the pipeline or any stage is
unhealthy, also while a failed stage restarts), `GET /ready` (200 while new requests are admitted,
restarts included; 503 while draining or fenced: readiness for load balancers), `GET /version` and
`GET /metrics` (Prometheus text).
Errors: bad input (also: not UTF-8 JSON, a lone surrogate, deep nesting; masks that leave no token mid-way,
the stream's error event with code 400 once streaming) → 400, wrong or missing
`Authorization: Bearer KEY` on /v1/* with --api-key → 401, unknown route → 404, a model this server does not
serve (in a body's `model` or GET /v1/models/{id}) → 404 as vLLM's (launcher/serving/formats/model_field.py), a body over
--max-request-bytes → 413, full queue → 429, a request whose logits were not finite → 500 (that
request alone), failed, fenced or draining server → 503, each with an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` (launcher/serving/http_errors.py); the server keeps
serving. A stream that fails mid-way ends with an error event and `data: [DONE]`.
Body decoding, validation and tokenisation run in a worker thread, so /health and the running
streams are served while a large body is handled.
A client that disconnects (or stops reading a stream) has its request aborted at once, which
frees its KV slot on every stage.
Must not: validate fields itself (launcher/serving/openai_protocol.py) or touch the coordinator directly
(launcher/serving/serving_engine.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from launcher.backends.ports import format_address, listen_socket
from launcher.coordinator.coordinator import PipelineError
from launcher.serving import openai_protocol, tokenize_api
from launcher.serving.choice_streams import ChoiceStreams, merged
from launcher.serving.formats.model_field import ModelNotFoundError, check_model_name
from launcher.serving.formats.tool_output import tool_outputs
from launcher.serving.http_errors import (
    BodyError,
    admission_error,
    decode_body,
    error_response,
    failure,
    read_body,
    refused,
    unavailable,
)
from launcher.serving.openai_logprobs import LogprobFormatter
from launcher.serving.serving_engine import (
    InvalidRequestError,
    QueueFullError,
    RequestStream,
    ServingEngine,
    UnavailableError,
)

log = logging.getLogger("speedpipe.serve")
DISCONNECT_POLL_S = 0.2
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


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


def _admit(engine: ServingEngine, raw: bytes, chat: bool) -> tuple[openai_protocol.ParsedRequest, ChoiceStreams]:
    """Decode, validate, tokenise and submit one request body (in a worker thread): n choices are n
    independent sequences, seeds derived per choice (`ParsedRequest.choice_params`).
    Raises InvalidRequestError, ValueError, QueueFullError, UnavailableError or PipelineError."""
    body = decode_body(raw)
    tokenizer, model = engine.tokenizer, engine.model_name
    if chat:
        parsed = openai_protocol.parse_chat(body, tokenizer=tokenizer, model_name=model,
                                            max_model_len=engine.max_model_len, tool_parser=engine.tool_parser)
    else:
        parsed = openai_protocol.parse_completion(body, tokenizer=tokenizer, model_name=model,
                                                  max_model_len=engine.max_model_len)
    engine.check_prompt(parsed.prompt_ids, parsed.params.max_new_tokens, prompt_field=parsed.prompt_field,
                        budget_field=parsed.budget_field)
    if parsed.n > engine.max_num_seqs + engine.max_queue:
        raise InvalidRequestError(f"'n' = {parsed.n} choices exceed the {engine.max_num_seqs + engine.max_queue} "
                                  f"requests this server holds at once (--max-num-seqs + --max-queue)", "n")
    streams = ChoiceStreams(openai_protocol.new_id("chatcmpl" if chat else "cmpl"))
    try:
        for i, params in enumerate(parsed.choice_params()):
            rid = streams.request_id if parsed.n == 1 else f"{streams.request_id}-{i}"
            streams.append(engine.start(parsed.prompt_ids, params, request_id=rid, text=parsed.text))
    except BaseException:
        streams.cancel()
        raise
    return parsed, streams


async def _collect(request: Request, stream: ChoiceStreams, parsed: openai_protocol.ParsedRequest, *,
                   engine: ServingEngine, formatter: LogprobFormatter, chat: bool) -> Response:
    """The whole answer of a non-streaming request (every choice); a client gone before it is ready aborts it."""
    model = engine.model_name
    done = asyncio.Event()

    async def watch() -> None:  # a client gone before the answer is ready aborts the request
        while not done.is_set():
            if await request.is_disconnected():
                stream.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.create_task(watch())
    choices, tools, prompt_logprobs = [], tool_outputs(parsed.tools, len(stream)), None
    try:
        for index, choice in enumerate(stream):
            text, ids, reason, entries, prompt_entries = [parsed.echo or ""], [], None, [], None
            stop_reason = None
            async for chunk in choice:
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                entries.extend(chunk.logprobs or ())
                prompt_entries = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else prompt_entries
                reason, stop_reason = chunk.finish_reason or reason, stop_reason if chunk.stop_reason is None else chunk.stop_reason
            choices.append(openai_protocol.completion_body(
                request_id=stream.request_id, model=model, text="".join(text),
                token_ids=ids if parsed.return_token_ids else None, finish_reason=reason, final=None,
                chunk=False, chat=chat, index=index, stop_reason=stop_reason,
                logprobs=formatter.choice(parsed, chat).of_chunk(ids, entries, prompt_entries))["choices"][0])
            if (prompt_logprobs := formatter.vllm_prompt(parsed, prompt_entries)) is not None and not chat:
                choices[-1]["prompt_logprobs"] = prompt_logprobs  # vLLM's: per choice (completions), top level (chat)
            if tools is not None:  # content and tool_calls (launcher/serving/formats/tool_output.py)
                tools[index].rewrite_message(choices[-1])
    except (UnavailableError, PipelineError) as exc:
        return unavailable(exc)
    finally:
        done.set()
        watcher.cancel()
        stream.cancel()
    body = openai_protocol.completion_body(request_id=stream.request_id, model=model, text="", token_ids=None,
                                 finish_reason=None, final=stream.final,
                                 chunk=False, chat=chat)
    body["choices"] = choices
    return JSONResponse({**body, "prompt_logprobs": prompt_logprobs} if chat and prompt_logprobs else body)


async def _stream(stream: ChoiceStreams, parsed: openai_protocol.ParsedRequest, *, engine: ServingEngine,
                  formatter: LogprobFormatter, chat: bool):
    """Server-sent events of a streaming request (choices interleaved as they come), ending in
    `data: [DONE]`, after an error event if the pipeline fails mid-way."""
    model = engine.model_name
    rid = stream.request_id
    logprobs_of = [formatter.choice(parsed, chat) for _ in stream]  # per choice: its context, its text offset
    generated = [0] * len(stream)  # tokens of each choice so far (continuous_usage_stats)
    started: set[int] = set()
    tools = tool_outputs(parsed.tools, len(stream))  # per choice: tool calls parsed out of its deltas

    def dressed(index: int, body: dict, *, role: bool = False) -> str:
        """The event of a chunk: vLLM's continuous usage (the choice's tokens so far); tool calls parsed
        out of a content delta ("" for a chunk whose text the tool-call parser holds back)."""
        if parsed.continuous_usage:
            body["usage"] = openai_protocol.usage_so_far(len(parsed.prompt_ids), generated[index])
        if tools is not None and not role and not tools[index].rewrite_delta(body["choices"][0]):
            return ""
        return _sse(body)

    try:
        if chat:
            for index in range(len(stream)):
                yield dressed(index, openai_protocol.completion_body(
                    request_id=rid, model=model, text="", token_ids=None, finish_reason=None, final=None,
                    chunk=True, chat=True, role=True, index=index), role=True)
        async for index, chunk in merged(stream):
            if not chunk.text and not chunk.token_ids and chunk.finish_reason is None:
                continue
            text = chunk.text if index in started else (parsed.echo or "") + chunk.text
            started.add(index)
            ids = list(chunk.token_ids)
            generated[index] += len(ids)
            logprobs = logprobs_of[index].of_chunk(ids, list(chunk.logprobs or ()), chunk.prompt_logprobs)
            event = dressed(index, openai_protocol.completion_body(
                request_id=rid, model=model, text=text, token_ids=ids if parsed.return_token_ids else None,
                finish_reason=chunk.finish_reason, final=None, chunk=True, chat=chat, index=index,
                logprobs=logprobs, stop_reason=chunk.stop_reason))
            if event:
                yield event
        final = stream.final
        if parsed.include_usage and final is not None:
            yield _sse(openai_protocol.usage_chunk(request_id=rid, model=model, final=final, chat=chat))
        yield "data: [DONE]\n\n"
    except (PipelineError, UnavailableError) as exc:  # the stream ends with an error event, then [DONE]
        code, message, type_ = failure(exc)
        yield _sse(openai_protocol.error_body(message, getattr(exc, "param", None), type_=type_, code=code))
        yield "data: [DONE]\n\n"
    finally:  # also on client disconnect (the generator is cancelled / closed)
        stream.cancel()


def _add_ops_routes(app: FastAPI, engine: ServingEngine) -> None:
    """Unauthenticated routes: /health, /ready, /version, /metrics, and the error body of unknown routes."""
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        ok, why = await asyncio.to_thread(engine.healthy)
        return Response(status_code=200) if ok else error_response(503, why, type_="service_unavailable")

    @app.get("/ready")
    async def ready() -> Response:  # a load balancer's readiness: 200 also while a stage restarts
        ok, why = await asyncio.to_thread(engine.ready)
        return Response(status_code=200) if ok else error_response(503, why, type_="service_unavailable")

    @app.get("/version")
    async def version() -> Response:
        try:
            return JSONResponse({"version": metadata.version("speedpipe")})
        except metadata.PackageNotFoundError:  # run from a source tree that was never installed
            return JSONResponse({"version": "unknown"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(engine.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_openai_routes(app: FastAPI, engine: ServingEngine, *, api_key: str | None, max_request_bytes: int) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions, behind `Authorization: Bearer api_key` if set."""
    formatter = LogprobFormatter(engine.tokenizer)

    async def generate(request: Request, *, chat: bool) -> Response:
        if (denied := refused(request, api_key)) is not None:
            return denied
        try:
            parsed, stream = await _in_thread(_admit, engine, await read_body(request, max_request_bytes), chat)
        except ClientDisconnect:  # gone before its body arrived: nothing was admitted, nobody to answer
            log.debug("client disconnected while sending its request body")
            return Response(status_code=400)
        except (BodyError, ValueError, QueueFullError, UnavailableError, PipelineError) as exc:
            return admission_error(exc)  # InvalidRequestError is a ValueError
        if parsed.stream:
            return _AbortingStreamingResponse(_stream(stream, parsed, engine=engine, formatter=formatter, chat=chat),
                                              stream=stream, media_type="text/event-stream")
        return await _collect(request, stream, parsed, engine=engine, formatter=formatter, chat=chat)

    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "speedpipe",
            "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (denied := refused(request, api_key)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        if (denied := refused(request, api_key)) is not None:
            return denied
        try:
            check_model_name(model_id, engine.model_name)  # the body's `model` check: one 404 for every route
        except ModelNotFoundError as exc:
            return admission_error(exc)
        return JSONResponse(card)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)


def _add_tokenizer_routes(app: FastAPI, engine: ServingEngine, *, api_key: str | None, max_request_bytes: int) -> None:
    """vLLM's /tokenize and /detokenize (launcher/serving/tokenize_api.py), behind the API key like /v1/*."""
    async def tokenizer_call(request: Request, answer) -> Response:  # /tokenize, /detokenize
        if (denied := refused(request, api_key)) is not None:
            return denied
        try:
            raw = await read_body(request, max_request_bytes)
            return JSONResponse(await asyncio.to_thread(lambda: answer(decode_body(raw))))
        except ClientDisconnect:
            return Response(status_code=400)
        except (BodyError, ValueError) as exc:  # InvalidRequestError is a ValueError
            return admission_error(exc)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenizer_call(request, lambda body: tokenize_api.tokenize_body(
            body, tokenizer=engine.tokenizer, model_name=engine.model_name, max_model_len=engine.max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenizer_call(request, lambda body: tokenize_api.detokenize_body(
            body, tokenizer=engine.tokenizer, model_name=engine.model_name))


def build_app(engine: ServingEngine, *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI application serving `engine`; /v1/*, /tokenize and /detokenize need
    `Authorization: Bearer api_key` if set."""
    app = FastAPI(title="speedpipe", docs_url=None, redoc_url=None, openapi_url=None)
    _add_ops_routes(app, engine)
    _add_openai_routes(app, engine, api_key=api_key, max_request_bytes=max_request_bytes)
    _add_tokenizer_routes(app, engine, api_key=api_key, max_request_bytes=max_request_bytes)
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
        self._error: BaseException | None = None  # why the server thread ended
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._socket: socket.socket | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._socket])
        except BaseException as exc:  # noqa: BLE001 - reported by start(), not as a thread traceback
            self._error = exc

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind here, not in uvicorn: a port taken is one RuntimeError with the reason ("cannot listen on
        127.0.0.1:8000 (Address already in use)"), not uvicorn's own ERROR line and a SystemExit."""
        host, port = self.config.host, self.config.port
        try:
            self._socket = listen_socket(host, port)
        except OSError as exc:  # socket.gaierror too
            raise RuntimeError(f"cannot listen on {format_address(host, port)} ({exc.strerror})") from None
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                why = f" ({self._error})" if self._error is not None else ""
                raise RuntimeError(f"HTTP server did not start on {format_address(host, port)}{why}")
            time.sleep(0.02)
        where = format_address(host, self._socket.getsockname()[1])  # uvicorn logs it only for a socket it bound
        logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s (Press CTRL+C to quit)", where)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._socket is not None:  # uvicorn closed it when it served; not when it never started
            self._socket.close()
