"""Serving engine: the front ends' (HTTP, gRPC) one door into a running Coordinator.

Owns admission control (a bounded number of outstanding requests: `max_num_seqs` decoding plus
`max_queue` waiting; beyond that `QueueFullError`, which the front ends answer with HTTP 429 /
gRPC RESOURCE_EXHAUSTED), the fence (after a stage failure or while draining, new requests fail at
once with `UnavailableError`, HTTP 503 / gRPC UNAVAILABLE, and `healthy()` names the reason without
asking the stages), ending outstanding requests with an error event (`fail_all`), the request streams that carry committed chunks from the coordinator's
threads to a consumer (asyncio or blocking), cancellation (a client that goes away frees its KV
slot on every stage at once, through `Coordinator.abort`), and the per-request serving metrics.
Must not: parse HTTP or protobuf, render chat templates, or start processes.

[Note: continuous admission]
Requests are handed to the coordinator as they arrive; its scheduler admits a waiting request into
a KV slot as soon as one is free and packs its prefill into the next micro-batch next to the
decodes already running (pipeline/engine/scheduler.py [Note: micro-batching]), so nobody waits for a
"batch" to finish. With speculation on, drafts only take stage slots that real items leave idle
([Note: speculation policy]). The engine bounds only how many requests may wait.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from launcher.coordinator.coordinator import Coordinator, RequestHandle, StreamChunk
from launcher.coordinator.request_handle import TextOptions
from launcher.serving.prometheus import ServingMetrics
from pipeline.run_config import check_prompt_length
from pipeline.speculation.echo import shown
from pipeline.speculation.sampling import SamplingParamError, SamplingParams

log = logging.getLogger("speedpipe.serve")


class QueueFullError(RuntimeError):
    """Too many outstanding requests: `max_num_seqs` running plus `max_queue` waiting."""


class UnavailableError(RuntimeError):
    """The server takes no new requests (draining, or fenced after a stage failure): HTTP 503."""


MAX_TEMPERATURE = 2.0  # OpenAI's upper bound of a request's sampling temperature (HTTP and gRPC)


class InvalidRequestError(ValueError):
    """A request field is invalid; `param` names the field (OpenAI `error.param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def of_setting(cls, exc: SamplingParamError, field: str, message: str | None = None) -> InvalidRequestError:
        """A SamplingParams refusal (`message`, default str(exc)) as the request's `field`: the field is
        `param`, and quoted replaces exc.param at the message's start ("top_p must be in (0, 1], got 0"
        -> "'top_p' must be in (0, 1], got 0"; max_new_tokens -> 'max_tokens' on HTTP)."""
        return cls((message or str(exc)).replace(exc.param, f"'{field}'", 1), field)


@dataclasses.dataclass(frozen=True)
class FinalInfo:
    """What the last chunk of a stream carries: finish reason, token counts and latencies (s)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    e2e_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedPipeline:
    """How the served pipeline runs its model, as clients are told (gRPC GetModelInfo): stages,
    activation dtype name, the weights' effective numeric mode (none | gguf | int8 | int4) and the
    speculation mode (none | speed | firp | speed+firp)."""

    num_stages: int
    dtype: str
    quantization: str
    speculate: str


_EMPTY = object()


class RequestStream:
    """One admitted request: a pump thread moves its chunks from the coordinator into a buffer that
    one consumer reads; `cancel()` aborts.

    The pump starts at once (so the admission slot is returned when the request ends even if no
    consumer ever reads it). Iterate the stream (blocking, for gRPC) or `async for` it (asyncio,
    for HTTP); one consumer only. After the last chunk (finish_reason set) `final` holds usage and
    latencies. The iterators raise PipelineError if the pipeline fails.
    """

    def __init__(self, engine: ServingEngine, handle: RequestHandle) -> None:
        self.engine, self.handle = engine, handle
        self.final: FinalInfo | None = None
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._wakeup: Callable[[], None] | None = None
        self._cancelled = False
        self._failed = False  # fail() delivered an error: the pump delivers nothing more
        self._thread = threading.Thread(target=self._pump, name=f"stream-{handle.request_id}", daemon=True)
        engine._track(self)
        self._thread.start()

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def cancel(self) -> None:
        """Abort the request if it is still running: its KV slot is freed on every stage."""
        if not self._cancelled and self.handle.finish_reason is None:
            self._cancelled = True
            self.engine.coordinator.abort(self.handle)

    def fail(self, error: BaseException) -> None:
        """End the stream now with `error` (the consumer raises it after the chunks it already has)
        and abort the request on the coordinator; later chunks are dropped. Any thread."""
        with self._cond:
            if self._failed or (self._items and self._items[-1] is None):
                return
            self._failed = True
        self._deliver(error, force=True)
        self.cancel()

    # consumer side
    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self._wakeup = lambda: loop.call_soon_threadsafe(ready.set)
        while True:
            with self._cond:
                item = self._items.popleft() if self._items else _EMPTY
            if item is _EMPTY:
                await ready.wait()
                ready.clear()
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # pump thread
    def _deliver(self, item: StreamChunk | BaseException | None, *, force: bool = False) -> None:
        with self._cond:
            if self._failed and not force:
                return
            self._items.append(item)
            self._cond.notify_all()
            wakeup = self._wakeup
        if wakeup is not None:
            try:
                wakeup()
            except RuntimeError:  # the consumer's event loop is closed (server stopping)
                pass

    def _pump(self) -> None:
        h, m = self.handle, self.engine.metrics
        last_t, released = None, False
        try:
            for chunk in h:
                now = time.perf_counter()
                if chunk.token_ids:
                    if last_t is None:
                        m.observe_ttft(now - h.submitted_at)
                    else:  # one gap per chunk, however many tokens: [Note: latency metrics] in pipeline/measure/metrics.py
                        m.observe_itl(now - last_t)
                    last_t = now
                    m.add_generation_tokens(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    e2e = (h.finished_at or now) - h.submitted_at
                    ttft = (h.first_token_at or h.finished_at or now) - h.submitted_at
                    self.final = FinalInfo(chunk.finish_reason, len(h.prompt_ids), len(h.token_ids), ttft, e2e)
                    m.observe_finish(chunk.finish_reason, e2e)
                    # free the admission slot before the client can see the end (and send again)
                    released = self.engine._release(self)
                self._deliver(chunk)
            self._deliver(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            m.observe_finish("error", time.perf_counter() - h.submitted_at)
            released = released or self.engine._release(self)
            self._deliver(exc)
        finally:
            if not released:
                self.engine._release(self)


class ServingEngine:
    """Admission-bounded, thread-safe access to a started Coordinator.

    max_num_seqs: KV slots (requests decoding at once); max_queue: requests allowed to wait for a
    slot beyond those. Counts for `num_running` / `num_waiting` are derived from the outstanding
    requests (the scheduler admits whenever a slot is free). `heartbeat`: when set (serve mode,
    launcher/coordinator/stage_heartbeat.py), `healthy()` answers from its latest beats instead of asking every
    stage, so /health never waits on a hung stage. `pipeline`: how the pipeline runs (None: not told,
    e.g. an engine over a test double).
    """

    def __init__(self, coordinator: Coordinator, *, model_name: str, max_num_seqs: int, max_queue: int,
                 max_model_len: int, pipeline: ServedPipeline | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
        self.coordinator = coordinator
        self.tokenizer = coordinator.tokenizer
        self.model_name, self.max_num_seqs, self.max_queue = model_name, max_num_seqs, max_queue
        self.max_model_len, self.pipeline = max_model_len, pipeline
        self.heartbeat = None  # a StageHeartbeat, set by the serving stack
        self.tool_parser: str | None = None  # tool_choice "auto"'s parser (--tool-call-parser), set by the stack
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._streams: set[RequestStream] = set()
        self._outstanding = 0
        self._fence: str | None = None  # why new requests are refused (draining, stage failure)
        self._draining = False  # the fence is a shutdown's, not a failure's
        self.metrics = ServingMetrics(coordinator, model_name=model_name, engine=self)

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    @property
    def num_running(self) -> int:
        return min(self._outstanding, self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, self._outstanding - self.max_num_seqs)

    @property
    def fenced(self) -> str | None:
        """Why new requests are refused (e.g. "draining: ..."), or None while admitting."""
        return self._fence

    def fence(self, reason: str, *, draining: bool = False) -> None:
        """Refuse every new request from now on with UnavailableError(reason); the first reason stays.
        `draining`: for a shutdown (health NOT_SERVING), not a failure (UNHEALTHY)."""
        with self._lock:
            if self._fence is None:  # _draining first: health_status reads both without the lock
                self._draining = draining
                self._fence = reason
                log.warning("no new requests: %s", reason)

    def fail_all(self, error: BaseException) -> int:
        """End every outstanding request's stream now with `error` (an error event for the client) and
        abort it on the coordinator. Returns how many were ended."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.fail(error)
        return len(streams)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no request is outstanding; True if none is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout=timeout_s)

    def healthy(self) -> tuple[bool, str]:
        """(True, "") when the coordinator and every stage serve; else (False, why)."""
        if self._fence is not None:
            return False, self._fence
        if self.coordinator.failure is not None:
            return False, str(self.coordinator.failure)
        if self.coordinator.recovering is not None:  # a stage fail-over is in progress: requests wait
            return False, self.coordinator.recovering
        if self.heartbeat is not None:
            return self.heartbeat.healthy()
        try:
            responses = self.coordinator.health()
        except Exception as exc:  # noqa: BLE001 - any control-plane failure is "unhealthy"
            return False, f"stage health check failed: {exc}"
        for i, r in enumerate(responses):
            if r.status != r.SERVING:
                return False, f"stage {i} is {r.Status.Name(r.status)}" + (f": {r.message}" if r.message else "")
        return True, ""

    def ready(self) -> tuple[bool, str]:
        """(True, "") while `start` admits new requests, also while a failed stage restarts (they wait
        behind it: a pause); (False, why) while draining, fenced or failed, or while a stage without
        fail-over is silent. What a load balancer's readiness check wants (HTTP /ready), where
        `healthy` also says False during a restart."""
        if self._fence is not None:
            return False, self._fence
        if self.coordinator.failure is not None:
            return False, str(self.coordinator.failure)
        silent = self._silent_stage()
        return silent is None, silent or ""

    def _silent_stage(self) -> str | None:
        """Why new requests are refused for a silent stage (before it is declared hung), or None; never
        while a fail-over will restart it (then requests wait behind the restart: a pause, not an error)."""
        if self.heartbeat is None or self.coordinator.failover is not None:
            return None
        beating, why = self.heartbeat.healthy()
        return None if beating else why

    def health_status(self) -> tuple[str, str]:
        """("serving", ""), ("not_serving", why) while draining or restarting a failed stage (it
        recovers, or exits, by itself), or ("unhealthy", why) once it cannot serve without a restart."""
        ok, why = self.healthy()
        if ok:
            return "serving", ""
        if self._fence is not None:
            temporary = self._draining
        else:
            temporary = self.coordinator.failure is None and self.coordinator.recovering is not None
        return ("not_serving" if temporary else "unhealthy"), why

    def check_prompt(self, prompt_ids: Sequence[int], max_tokens: int, *, prompt_field: str,
                     budget_field: str = "max_tokens") -> None:
        """Raise InvalidRequestError if a token id is outside the vocabulary, or the prompt breaks
        the length rule (`check_prompt_length`); the error names the prompt's field, or
        `budget_field` (HTTP's 'max_tokens', gRPC's 'max_new_tokens') when the prompt alone fits."""
        for t in prompt_ids:
            if not 0 <= t < self.tokenizer.vocab_size:
                raise InvalidRequestError(f"'{prompt_field}' token id {shown(t)} is outside the vocabulary "
                                          f"[0, {self.tokenizer.vocab_size})", prompt_field)
        try:
            check_prompt_length(num_prompt_tokens=len(prompt_ids), max_new_tokens=max_tokens,
                                max_model_len=self.max_model_len, what=f"'{prompt_field}'", budget=f"'{budget_field}'")
        except ValueError as exc:
            field = prompt_field if not prompt_ids or len(prompt_ids) >= self.max_model_len else budget_field
            raise InvalidRequestError(str(exc), field) from None

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str,
              text: TextOptions = TextOptions()) -> RequestStream:
        """Submit a validated request (`text`: how its tokens become text). Raises QueueFullError when
        `max_num_seqs + max_queue` are outstanding, UnavailableError while fenced, PipelineError if the pipeline
        failed, InvalidRequestError (naming the field) for settings the coordinator rejects, ValueError for other
        input it rejects."""
        silent = self._silent_stage()  # outside the lock: the heartbeat's own lock
        with self._lock:
            if self._fence is not None or silent is not None:
                self.metrics.observe_rejected("unavailable")
                raise UnavailableError(self._fence or silent)
            limit = self.max_num_seqs + self.max_queue
            if self._outstanding >= limit:
                self.metrics.observe_rejected("queue_full")
                raise QueueFullError(f"server is at capacity: {self._outstanding} requests outstanding "
                                     f"(--max-num-seqs {self.max_num_seqs} + --max-queue {self.max_queue}); retry later")
            self._outstanding += 1
        try:
            handle = self.coordinator.submit(list(prompt_ids), params, request_id=request_id, text=text)
        except SamplingParamError as exc:  # the coordinator's token mask checks (`tokenized_masks`): the field's error
            self._release()
            raise InvalidRequestError.of_setting(exc, exc.param) from None
        except BaseException:
            self._release()
            raise
        self.metrics.add_prompt_tokens(len(handle.prompt_ids))
        return RequestStream(self, handle)

    def _track(self, stream: RequestStream) -> None:
        """A stream whose pump is about to start: outstanding until `_release(stream)`."""
        with self._lock:
            self._streams.add(stream)

    def _release(self, stream: RequestStream | None = None) -> bool:
        """One outstanding request ended; returns True (for the caller's bookkeeping)."""
        with self._idle:
            self._outstanding -= 1
            self._streams.discard(stream)
            self._idle.notify_all()
        return True


