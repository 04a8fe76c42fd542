"""Coordinator: rank 0 of the pipeline; the single authority on committed tokens.

Owns the control-plane clients of every stage (load, health, stats, shutdown), the data-plane
link to stage 0 and from the last stage, the engine thread that drives the pure `Scheduler`,
detokenisation, stop strings and streaming to request handles.
Must not: run model layers, or spawn processes (launcher/local_backend.py places the workers).

Threads: the caller's (submit, results), the engine thread (the only one that touches the
scheduler and sends on the data plane), and the receiver thread (blocking receives from the last
stage). They meet in one event queue, so nothing polls.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import torch

from pipeline.items import Item, ItemKind
from pipeline.predictors import ExitGuess, Predictor, make_predictor
from pipeline.sampling import SamplingParams
from pipeline.scheduler import Scheduler
from pipeline.scheduler_types import Commit, SchedulerConfig
from pipeline.timeline import Timeline
from pipeline.tokenizer import IncrementalDetokenizer, Tokenizer
from pipeline.wire import Message, MessageKind
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.channel import Channel, ChannelError, DataPlaneGroup, SendQueue, rank_name
from workers.control_auth import TlsFiles, control_channel, with_secret
from workers.convert import StageLoadSpec, spec_to_proto

log = logging.getLogger("speedpipe.coordinator")


def _in_daemon_thread(fn, *args, **kwargs) -> concurrent.futures.Future:
    """Run fn(*args, **kwargs) in a daemon thread; its outcome lands in the returned Future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=run, name=getattr(fn, "__name__", "start-up"), daemon=True).start()
    return fut


class PipelineError(RuntimeError):
    """The pipeline failed (a stage died, timed out or refused to load); every request fails."""


@dataclasses.dataclass
class RequestOutput:
    """Final state of one request."""

    request_id: str
    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    e2e_s: float


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """Newly committed tokens of one request and their text; `finish_reason` set on the last chunk."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None


class RequestHandle:
    """A submitted request: iterate it for StreamChunks, or call `result()`."""

    def __init__(self, request_id: str, prompt: str, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer) -> None:
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.detok = detok
        self.token_ids: list[int] = []
        self.text = ""
        self._held = ""  # decoded text not streamed yet: it may be the start of a stop string
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._chunks: queue.Queue[StreamChunk | BaseException] = queue.Queue()
        self._done = threading.Event()

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            chunk = self._chunks.get()
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
            if chunk.finish_reason is not None:
                return

    def result(self, timeout_s: float | None = None) -> RequestOutput:
        """Block until finished. Raises PipelineError if the pipeline failed, TimeoutError on timeout."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout_s} s")
        if self.error is not None:
            raise self.error
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, list(self.token_ids), self.text,
                             self.finish_reason or "", (self.first_token_at or self.finished_at) - self.submitted_at,
                             self.finished_at - self.submitted_at)

    # engine-thread side
    def _emit(self, commit: Commit, stop: Sequence[str]) -> bool:
        """Record committed tokens; returns True if a stop string ended the request."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.extend(commit.token_ids)
        delta = self.detok.add_many(commit.token_ids)
        if commit.finish_reason is not None:
            delta += self.detok.flush()
        # Text that could be the start of a stop string is held back until it is known not to be
        # one (as vLLM does), so no chunk ever streams part of a stop string.
        pending, hit = self._held + delta, False
        if stop:
            cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                pending, hit = pending[:cut], True
        keep = max((len(s) for s in stop), default=1) - 1
        if hit or commit.finish_reason is not None or keep == 0:
            delta, self._held = pending, ""
        else:
            delta, self._held = pending[:max(0, len(pending) - keep)], pending[max(0, len(pending) - keep):]
        self.text += delta
        reason = "stop" if hit else (commit.finish_reason.value if commit.finish_reason else None)
        self._chunks.put(StreamChunk(commit.token_ids, delta, reason))
        if reason is not None:
            self._finish(reason)
        return hit

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()
        if error is not None:
            self._chunks.put(error)
        elif reason == "aborted":  # wake a streaming reader: nothing more will come
            self._chunks.put(StreamChunk((), "", reason))
        self._done.set()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """How the coordinator reaches and drives the stages."""

    num_stages: int
    max_num_seqs: int = 8
    max_model_len: int = 2048
    stage_timeout_s: float = 120.0
    dist_master_addr: str = "127.0.0.1"
    dist_master_port: int = 29500
    device: str = "cpu"
    speculate: bool = False
    predictor: str = "ngram"
    exit_stage: int = 0  # stage whose exit layer feeds the predictor; -1 = none (context-only predictors)
    max_inflight: int = 0  # per sequence; 0 = num_stages
    min_acceptance: float = 0.0  # adaptive drafting threshold (pipeline/draft_gate.py); 0 = every draft
    record_timeline: bool = True  # per-item stage timings (pipeline/timeline.py)
    firp_k: int = 0  # FIRP drafts per chain; 0 = FIRP off
    firp_min_prob: float = 0.0  # FIRP drafts carried only while their probability is at least this

    @property
    def keepalive_s(self) -> float:
        """Idle interval after which a KEEPALIVE goes round the ring ([Note: deadlines])."""
        return self.stage_timeout_s / 4


class Coordinator:
    """Loads the stages, joins the data plane as rank 0 and serves requests until `shutdown`."""

    def __init__(self, config: CoordinatorConfig, tokenizer: Tokenizer, stage_addresses: Sequence[str], *,
                 predictor: Predictor | None = None, control_secret: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        """predictor: overrides the one named by config.predictor (tests use adversarial ones).
        control_secret: sent with every control call (the stages' session secret, workers/control_auth.py);
        tls: the control plane's TLS files (None: plain TCP)."""
        if len(stage_addresses) != config.num_stages:
            raise ValueError(f"{len(stage_addresses)} stage addresses for {config.num_stages} stages")
        self.config = config
        self.tokenizer = tokenizer
        self.channels = [control_channel(a, tls=tls) for a in stage_addresses]
        self.stubs = [pb_grpc.StageServiceStub(with_secret(c, control_secret)) for c in self.channels]
        self.scheduler = Scheduler(SchedulerConfig(
            num_stages=config.num_stages, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            eos_token_ids=tuple(tokenizer.eos_token_ids), speculate=config.speculate,
            max_inflight=config.max_inflight, min_acceptance=config.min_acceptance, firp_k=config.firp_k,
            firp_min_prob=config.firp_min_prob),
            (predictor or make_predictor(config.predictor)) if config.speculate else None)
        self.timeline = Timeline(config.num_stages)
        # Per-micro-batch stage timings: stages time a FORWARD only when its meta asks ("timing").
        # Switch off to measure the recording overhead (tests/benchmarks/timeline_overhead.py).
        self.record_timeline = config.record_timeline
        self.commit_events: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1_000_000)
        self.data: Channel | None = None
        self.sends: SendQueue | None = None
        self.events: queue.Queue[tuple[str, object]] = queue.Queue()
        self.handles: dict[int, RequestHandle] = {}
        self.sent: list[list[Item]] = []  # micro-batches in flight, oldest first (the ring is FIFO)
        self.failure: PipelineError | None = None
        self._ids = itertools.count()
        self._engine: threading.Thread | None = None
        self._receivers: list[threading.Thread] = []
        self._stopping = False

    # -- start-up ---------------------------------------------------------------------------------
    def start(self, specs: Sequence[StageLoadSpec], *, timeout_s: float = 600.0) -> list[pb.LoadStageResponse]:
        """Load every stage and join the process group as rank 0; start the engine.

        Raises PipelineError naming the stage whose Load failed, or on timeout.
        """
        for i, channel in enumerate(self.channels):
            try:
                grpc.channel_ready_future(channel).result(timeout=30)
            except grpc.FutureTimeoutError:
                raise PipelineError(f"stage {i} control plane is not reachable") from None
        # Daemon threads, not a ThreadPoolExecutor: after a failed start a join may stay blocked in
        # the rendezvous, and the interpreter must still be able to exit.
        loads = {_in_daemon_thread(stub.Load, spec_to_proto(spec), timeout=timeout_s): i
                 for i, (stub, spec) in enumerate(zip(self.stubs, specs, strict=True))}
        joined = _in_daemon_thread(self._join_process_group)
        # The first failure wins: a stage whose weights are bad fails its Load at once, while the
        # others would only time out later waiting for it to join the data plane.
        done, pending = concurrent.futures.wait([*loads, joined], timeout=timeout_s,
                                                return_when=concurrent.futures.FIRST_EXCEPTION)
        if pending and not any(f.exception() for f in done):
            raise PipelineError(f"stages did not load and join the data plane within {timeout_s:g} s")
        failed = sorted((loads.get(f, len(specs)), f) for f in done if f.exception() is not None)
        if failed:
            index, fut = failed[0]
            exc = fut.exception()
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            who = f"stage {index}" if index < len(specs) else "coordinator"
            raise PipelineError(f"{who} failed to load: {detail}")
        responses = [f.result() for f in sorted(loads, key=loads.get)]
        self._warm_up()
        sources = {self.config.num_stages}
        if self.config.speculate and self.config.exit_stage >= 0:
            sources.add(self.config.exit_stage + 1)
        self._receivers = [threading.Thread(target=self._receive_loop, args=(rank,), name=f"receiver-{rank}",
                                            daemon=True) for rank in sorted(sources)]
        self._engine = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        for t in self._receivers:
            t.start()
        self._engine.start()
        return responses

    def _join_process_group(self) -> None:
        cfg = self.config
        group = DataPlaneGroup(master_addr=cfg.dist_master_addr, master_port=cfg.dist_master_port, rank=0,
                               world_size=cfg.num_stages + 1, timeout_s=cfg.stage_timeout_s, device="cpu")
        self.data = Channel(group, timeout_s=cfg.stage_timeout_s, label="[coordinator] ",
                            max_payload_bytes=(1 << 20) * max(64, cfg.max_num_seqs))
        self.sends = SendQueue(self.data)  # the engine never blocks on stage 0 (see [Note: background sends])

    def _warm_up(self) -> None:
        """Create every neighbour link in one fixed order: one KEEPALIVE round the ring."""
        self.data.send(Message(MessageKind.KEEPALIVE), 1)
        msg = self.data.recv(self.config.num_stages)
        if msg.kind != MessageKind.KEEPALIVE:
            raise PipelineError(f"warm-up: expected KEEPALIVE back from the last stage, got {msg.kind.name}")

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams, *, request_id: str | None = None) -> RequestHandle:
        """Queue a request (text or token ids). Raises ValueError for bad input, PipelineError if failed."""
        if self.failure is not None:
            raise self.failure
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            text = self.tokenizer.decode(ids)
        for t in ids:
            if not 0 <= t < self.tokenizer.vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.tokenizer.vocab_size})")
        need = len(ids) + params.max_new_tokens
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        if need > self.config.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({params.max_new_tokens}) = {need} "
                             f"exceeds --max-model-len {self.config.max_model_len}")
        seq_id = next(self._ids)
        handle = RequestHandle(request_id or f"req-{seq_id}", text, ids, params,
                               self.tokenizer.detokenizer(prompt_ids=ids))
        self.events.put(("submit", (seq_id, handle)))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request; its KV slot is freed on every stage."""
        self.events.put(("abort", handle))

    # -- engine -----------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        try:
            while not self._stopping:
                self._pump()
                try:
                    kind, payload = self.events.get(timeout=self.config.keepalive_s)
                except queue.Empty:
                    if not self.sent:
                        self.sends.send(Message(MessageKind.KEEPALIVE), 1)
                    continue
                self._handle_event(kind, payload)
        except Exception as exc:  # noqa: BLE001 - every failure fails every request, named
            self._fail(exc if isinstance(exc, PipelineError) else PipelineError(str(exc)))

    def _handle_event(self, kind: str, payload) -> None:
        if kind == "result":
            self._on_result(payload)
        elif kind == "exit":
            self._on_exit(payload)
        elif kind == "submit":
            seq_id, handle = payload
            self.handles[seq_id] = handle
            self.scheduler.add(seq_id, handle.prompt_ids, handle.params)
        elif kind == "abort":
            seq_id = next((i for i, h in self.handles.items() if h is payload), None)
            if seq_id is not None:
                seq = self.scheduler.seqs.get(seq_id)
                admitted = seq is not None and seq.slot >= 0
                self.scheduler.abort(seq_id)
                payload._finish("aborted")
                if not admitted:  # never held a slot: nothing to release, forget it now
                    self.handles.pop(seq_id)
                    if seq is not None:
                        self.scheduler.pop(seq_id)
        elif kind == "error":
            raise payload
        elif kind == "stop":
            self._stopping = True

    def _pump(self) -> None:
        """Send slot releases, then as many micro-batches as the scheduler allows."""
        releases = self.scheduler.take_releases()
        if releases:
            seq_ids, slots = zip(*releases, strict=True)
            self.sends.send(Message(MessageKind.RELEASE, meta={"seq_ids": list(seq_ids), "slots": list(slots)}), 1)
            for seq_id in seq_ids:
                self.handles.pop(seq_id, None)
                self.scheduler.pop(seq_id)
        while (batch := self.scheduler.next_batch(time.perf_counter_ns())) is not None:
            tokens = torch.tensor([t for it in batch for t in it.token_ids], dtype=torch.int64)
            meta = {"timing": []} if self.record_timeline else {}
            self.sends.send(Message(MessageKind.FORWARD, [it.without_tokens() for it in batch], {"x": tokens}, meta), 1)
            self.sent.append(batch)

    def _on_exit(self, msg: Message) -> None:
        tokens, probs = msg.tensors.get("exit_tokens"), msg.tensors.get("exit_probs")
        guesses = [None if tokens is None or int(tokens[i]) < 0 else ExitGuess(int(tokens[i]), float(probs[i]))
                   for i in range(len(msg.items))]
        timing = msg.meta.get("timing")
        self.scheduler.on_exit(msg.items, guesses, timing[-1][2] if timing else time.perf_counter_ns())

    def _on_result(self, msg: Message) -> None:
        sent = self.sent.pop(0)
        commits = self.scheduler.on_result(sent, msg.items, msg.tensors["token_ids"], msg.tensors.get("logits"),
                                           time.perf_counter_ns(), firp_tokens=msg.tensors.get("firp_tokens"),
                                           firp_probs=msg.tensors.get("firp_probs"))
        now_ns = time.perf_counter_ns()
        self.commit_events.extend((now_ns, c.seq_id, t) for c in commits for t in c.token_ids)
        ready = [self.scheduler.draft_ready_ns.pop((it.seq_id, it.start, it.epoch), 0) for it in sent
                 if it.kind == ItemKind.DRAFT]
        if self.record_timeline:
            committed_seqs = {c.seq_id for c in commits}
            returned = {(it.seq_id, it.start, it.epoch) for it in msg.items}
            committed = [it.seq_id in committed_seqs and (it.seq_id, it.start, it.epoch) in returned for it in sent]
            drafts_only = bool(ready) and len(ready) == len(sent)
            self.timeline.record(msg.meta.get("timing", []), sent, sum(committed) / len(sent) if sent else 0.0,
                                 max(ready) if drafts_only else None, committed=committed)
        for commit in commits:
            handle = self.handles.get(commit.seq_id)
            if handle is None:
                continue
            if handle._emit(commit, handle.params.stop):
                self.scheduler.finish_on_stop_string(commit.seq_id)

    def _receive_loop(self, rank: int) -> None:
        """Blocking receives from `rank` (the last stage, or the exit stage's DRAFT events)."""
        is_last = rank == self.config.num_stages
        while True:
            try:
                msg = self.data.recv(rank)
            except ChannelError as exc:
                if not self._stopping:
                    self.events.put(("error", PipelineError(str(exc))))
                return
            if msg.kind == MessageKind.RESULT and is_last:
                self.events.put(("result", msg))
            elif msg.kind == MessageKind.DRAFT:
                self.events.put(("exit", msg))
            elif msg.kind == MessageKind.SHUTDOWN:  # from the last stage, and from the exit stage
                return
            elif msg.kind not in (MessageKind.KEEPALIVE, MessageKind.RELEASE) or not is_last:
                self.events.put(("error", PipelineError(f"unexpected {msg.kind.name} from {rank_name(rank)}")))
                return

    # -- failure and shutdown ---------------------------------------------------------------------
    def fail(self, error: PipelineError) -> None:
        """Called from any thread (e.g. the process monitor): fail every request and stop."""
        self.events.put(("error", error))

    def _fail(self, error: PipelineError) -> None:
        from launcher.stage_heartbeat import blame_hung_stages

        error = PipelineError(blame_hung_stages(str(error), self.stubs))  # a timeout may name a victim
        log.error("pipeline failed: %s", error)
        self.failure = error
        self._stopping = True
        for handle in list(self.handles.values()):
            handle._finish("error", error)
        while True:  # requests submitted but not yet seen by the engine
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                payload[1]._finish("error", error)

    def stage_stats(self) -> list[pb.StageStats]:
        """GetStats of every stage, in stage order."""
        return [stub.GetStats(pb.GetStatsRequest(), timeout=10) for stub in self.stubs]

    def reset_stats(self) -> None:
        """Zero every stage's counters and the coordinator's speculation / useful-time totals.
        Call while idle (the engine thread owns these counters while requests run)."""
        self.timeline.reset()
        self.commit_events.clear()
        self.scheduler.spec = type(self.scheduler.spec)()
        for stub in self.stubs:
            stub.Reset(pb.ResetRequest(reset_stats=True), timeout=10)

    def health(self) -> list[pb.HealthResponse]:
        return [stub.Health(pb.HealthRequest(), timeout=5) for stub in self.stubs]

    def shutdown(self, reason: str = "launcher exiting") -> None:
        """Stop the engine, drain the data plane with an in-band SHUTDOWN, stop every stage."""
        if self._engine is not None and self._engine.is_alive():
            self.events.put(("stop", None))
            self._engine.join(timeout=10)
        if self.failure is None and self.data is not None:
            try:
                self.sends.send(Message(MessageKind.SHUTDOWN), 1)
                self.sends.flush()
                for receiver in self._receivers:  # each ends on its source's SHUTDOWN
                    receiver.join(timeout=self.config.stage_timeout_s)
            except ChannelError as exc:
                log.warning("data plane shutdown failed: %s", exc)
        for stub in self.stubs:
            try:
                stub.Shutdown(pb.ShutdownRequest(reason=reason), timeout=5)
            except grpc.RpcError:
                pass
        for ch in self.channels:
            ch.close()
