"""Coordinator: rank 0 of the pipeline; the single authority on committed tokens. Thin I/O.

Owns the control-plane clients of every stage (load, health, stats, shutdown), the data-plane link to
stage 0 and from the last stage, the engine thread that feeds the pure `pipeline.engine.engine.Engine`
real events and carries out its output (sends, releases), and the request handles (detokenisation,
stop strings, streaming: launcher/coordinator/request_handle.py). Must not: decide what runs or what
commits (the engine does), run model layers, or spawn processes (launcher/backends/local.py places them).

Threads: the caller's (submit, results), the engine thread (the only one that touches the engine
and sends), the receivers (launcher/coordinator/stage_receivers.py). They meet in one event queue (a C-level
SimpleQueue, as it is on every token's ring return): no polling. Commits no stop string can end are
streamed after the step's sends ([Note: streaming after the send] in request_handle.py).
With a `StageFailover` set, a stage failure is recovered in place by the engine thread ([Note: fail-over]
in launcher/coordinator/stage_failover.py); events of an older data-plane group (`generation`) are dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import grpc

from launcher.coordinator.request_handle import (
    PipelineError,
    RequestHandle,
    RequestOutput,
    StreamChunk,
    TextOptions,
    encode_prompt,
)
from launcher.coordinator.stage_control import load_and_join, shutdown_stages, wait_reachable
from launcher.coordinator.stage_failover import StageFailover, StageRecovery
from launcher.coordinator.stage_link import StageLink
from launcher.coordinator.stage_receivers import ReceiverError, await_death_report, start_receivers
from pipeline.engine.engine import Engine
from pipeline.engine.events import Abort, Submit
from pipeline.engine.records import Commit, SchedulerConfig, SpecCounters
from pipeline.engine.wire import rank_of_stage
from pipeline.measure.timeline import Timeline
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.grammar import GrammarVocab
from pipeline.speculation.predictors import Predictor, make_predictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.speculation.tree import TreeCounters
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.channel import ChannelError
from workers.load_spec_codec import StageLoadSpec
from workers.rpc.control_auth import TlsFiles, control_channel, with_secret

__all__ = ["Coordinator", "CoordinatorConfig", "PipelineError", "RequestHandle", "RequestOutput", "StreamChunk"]

log = logging.getLogger("speedpipe.coordinator")
DEATH_REPORT_WAIT_S = 3.0  # how long a data-plane failure waits for the report of the stage that died
ENGINE_STOP_S = 10.0  # shutdown() joins the engine thread for up to this (in deploy/'s termination grace)


class DataPlaneFailure(PipelineError):
    """A receive from a stage failed (its peer closed, timed out or sent garbage): the symptom,
    whose cause may be another stage's death (`Coordinator._fail` waits for that report)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """How the coordinator reaches and drives the stages: the scheduler's view of the run
    (`RunConfig.scheduler_config`, validated there) plus what only the coordinator needs."""

    scheduler: SchedulerConfig
    stage_timeout_s: float = 120.0
    dist_master_addr: str = "127.0.0.1"
    dist_master_port: int = 29500
    predictor: str = "ngram"
    exit_stage: int = 0  # stage whose exit layer feeds the predictor; -1 = none (context-only predictors)
    record_timeline: bool = True  # per-item stage timings (pipeline/measure/timeline.py)

    @property
    def num_stages(self) -> int:
        return self.scheduler.num_stages

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def keepalive_s(self) -> float:
        """Idle interval after which a KEEPALIVE goes round the ring ([Note: deadlines])."""
        return self.stage_timeout_s / 4


class Coordinator(StageRecovery):
    """Loads the stages, joins the data plane as rank 0 and serves requests until `shutdown`."""

    def __init__(self, config: CoordinatorConfig, tokenizer: Tokenizer, stage_addresses: Sequence[str], *,
                 predictor: Predictor | None = None, control_secret: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        """predictor: overrides config.predictor's (tests use adversarial ones); control_secret: sent with every control
        call (the stages' session secret, workers/rpc/control_auth.py); tls: the control plane's TLS files (None: plain TCP)."""
        if len(stage_addresses) != config.num_stages:
            raise ValueError(f"{len(stage_addresses)} stage addresses for {config.num_stages} stages")
        self.config, self.tokenizer = config, tokenizer
        self._control_secret, self._tls = control_secret, tls
        self.channels = [self._control_channel(a) for a in stage_addresses]
        self.stubs = [pb_grpc.StageServiceStub(with_secret(c, control_secret)) for c in self.channels]
        self.record_timeline = config.record_timeline  # stage timings (overhead: tests/benchmarks/timeline_overhead.py)
        self.engine = Engine(config.scheduler, (predictor or make_predictor(config.predictor))
                             if config.scheduler.speculate else None, record_timeline=config.record_timeline,
                             commit_sink=self._emit, grammar_vocab=GrammarVocab.of(tokenizer))
        self.link = self._new_link(config.dist_master_port)
        self.events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self.handles: dict[int, RequestHandle] = {}
        self._after_send: list[tuple[RequestHandle, Commit]] = []  # commits to stream once the step's sends left
        self.failure: PipelineError | None = None
        self._ids, self.num_restarts = itertools.count(), 0
        self._engine_thread: threading.Thread | None = None
        self._receivers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._receivers_stopping = threading.Event()  # this generation's receivers end quietly
        self.generation = 0  # bumped by each fail-over: one data-plane group per generation
        self.failover: StageFailover | None = None  # set by the session to recover from stage failures
        self.recovering: str | None = None  # why a fail-over is in progress (health reports it)
        self._unloaded: set[int] = set()  # restarted stages not loaded yet
        self.recovery_listeners: list = []  # called (phase "start" | "done", reason) on the engine thread

    @property
    def spec(self) -> SpecCounters:
        """Speculation totals since the last `reset_stats`."""
        return self.engine.spec

    @property
    def tree(self) -> TreeCounters:
        """Token-tree totals since the last `reset_stats` (pipeline/speculation/tree.py)."""
        return self.engine.tree

    @property
    def timeline(self) -> Timeline:
        """What each micro-batch cost on each stage, and was worth (the engine's)."""
        return self.engine.timeline

    @property
    def commit_events(self):
        """(time_ns, seq_id, token) of every commit (the engine's commit log)."""
        return self.engine.commit_log

    # -- start-up ---------------------------------------------------------------------------------
    def start(self, specs: Sequence[StageLoadSpec], *, timeout_s: float = 600.0) -> list[pb.LoadStageResponse]:
        """Load every stage and join the process group as rank 0; start the engine thread.
        Raises PipelineError naming the stage whose Load failed, or on timeout."""
        wait_reachable(self.channels)
        responses = load_and_join(self.stubs, specs, self.link.join, timeout_s=timeout_s, abandon=self.link.close)
        self.link.warm_up()
        self._start_receivers()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._engine_thread.start()
        return responses

    def _control_channel(self, address: str) -> grpc.Channel:
        return control_channel(address, tls=self._tls)

    def _new_link(self, port: int) -> StageLink:
        c = self.config
        return StageLink(num_stages=c.num_stages, master_addr=c.dist_master_addr, master_port=port,
                         timeout_s=c.stage_timeout_s, max_num_seqs=c.scheduler.max_num_seqs, record_timeline=c.record_timeline)

    def _start_receivers(self) -> None:
        """This generation's receivers: the last stage's results, the exit stage's guesses."""
        sources, exit_rank = {self.link.last}, -1
        if self.config.scheduler.speculate and self.config.exit_stage >= 0:
            exit_rank = rank_of_stage(self.config.exit_stage)
            sources.add(exit_rank)
        self._receivers_stopping = threading.Event()
        self._receivers = start_receivers(self.link.channel, sorted(sources), last_rank=self.link.last,
                                          events=self.events, stopping=self._receivers_stopping,
                                          generation=self.generation, exit_rank=exit_rank)

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams, *, request_id: str | None = None, text: TextOptions = TextOptions()) -> RequestHandle:
        """Queue a request (text or token ids; `text`: its TextOptions). Raises ValueError, PipelineError."""
        if self.failure is not None:
            raise self.failure
        prompt_text, ids, params = encode_prompt(self.tokenizer, prompt, params, max_model_len=self.config.max_model_len)
        seq_id = next(self._ids)
        handle = RequestHandle(request_id or f"req-{seq_id}", prompt_text, ids, params, text.detokenizer(self.tokenizer, ids), text)
        self.events.put(("submit", (seq_id, handle)))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request; its KV slot is freed on every stage."""
        self.events.put(("abort", handle))

    def sync(self, timeout_s: float) -> bool:
        """Wait until the engine thread handled every event queued before this call (e.g. the
        step that forgets a finished request); False on timeout or after a failure."""
        done = threading.Event()
        self.events.put(("sync", done))
        return done.wait(timeout_s)

    # -- engine thread ----------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._pump()
            except Exception as exc:  # noqa: BLE001 - recovered, or it fails every request, named
                error = exc if isinstance(exc, PipelineError) else PipelineError(str(exc))
                error = error if self._stopping.is_set() else self._recover(error)
                if error is not None:
                    self.recovering = None  # a failed recovery is over too (health: UNHEALTHY, not restarting)
                    self._fail(error)
                    return

    def _pump(self) -> None:
        """Apply queued events to the engine and send its output until stopped; raises on failure."""
        while not self._stopping.is_set():
            try:
                kind, payload = self.events.get(timeout=self.config.keepalive_s)
            except queue.Empty:
                if not self.engine.num_inflight:
                    self.link.keepalive()
                continue
            try:  # then stream: commits made before a failure still reach their requests
                out = self.engine.step(self._to_engine_events(kind, payload), now_ns=time.perf_counter_ns())
                self.link.send_step(out, feeding=self.engine.num_fed > 0)  # releases, then micro-batches
            finally:
                self._stream_after_send()
            for seq_id in out.forgotten:
                self.handles.pop(seq_id, None)

    # -- fail-over: StageRecovery (launcher/coordinator/stage_failover.py) drives it ----------------------
    def _reconnect(self, i: int, address: str) -> None:
        """Stage `i` restarted at `address`: a new control channel; unloaded until a Load succeeds."""
        self.channels[i].close()
        self.channels[i] = self._control_channel(address)
        self.stubs[i] = pb_grpc.StageServiceStub(with_secret(self.channels[i], self._control_secret))
        self._unloaded.add(i)

    def _to_engine_events(self, kind: str, payload) -> list:
        """One queued event as engine events (none for a stop, or an abort of an unknown request)."""
        if kind == "event":  # from a receiver: RESULT or EXIT_GUESS, stamped on arrival
            generation, event = payload
            return [event] if generation == self.generation else []  # an old ring's: stale
        if kind == "submit":
            seq_id, handle = payload
            self.handles[seq_id] = handle
            return [Submit(seq_id=seq_id, prompt_ids=tuple(handle.prompt_ids), params=handle.params)]
        if kind == "abort":
            seq_id = next((i for i, h in self.handles.items() if h is payload), None)
            payload.finish("aborted")
            return [] if seq_id is None else [Abort(seq_id=seq_id)]
        if kind == "error":
            generation, error = payload
            if generation != self.generation:
                return []  # about a ring that a fail-over has replaced
            if isinstance(error, ReceiverError):
                raise DataPlaneFailure(str(error))
            raise error if isinstance(error, PipelineError) else PipelineError(str(error))
        if kind in ("stop", "sync"):
            (self._stopping if kind == "stop" else payload).set()
            return []
        raise AssertionError(f"unknown coordinator event {kind!r}")

    def _emit(self, commit: Commit) -> bool:
        """The engine's commit sink: stream to the request's handle now if a stop string may end it (True
        if one did), else after the step's sends ([Note: streaming after the send] in request_handle.py)."""
        handle = self.handles.get(commit.seq_id)
        if handle is None or handle.stops_on_text:
            return handle is not None and handle.emit(commit)
        self._after_send.append((handle, commit))
        return False

    def _stream_after_send(self) -> None:
        """Stream the commits `_emit` held back, in the order they were made."""
        held, self._after_send = self._after_send, []
        for handle, commit in held:
            handle.emit(commit)

    # -- failure and shutdown ---------------------------------------------------------------------
    def fail(self, error: PipelineError, *, generation: int | None = None) -> None:
        """Called from any thread (e.g. the process monitor): fail every request and stop, or, with
        a fail-over set and budget left, restart the failed stage and replay ([Note: fail-over]).
        generation: the data-plane generation the report is about (default the current one); one about a
        replaced ring (a death a fail-over already handles) is dropped; one about the current ring also
        gives up a join still waiting ([Note: a death during a join] in stage_failover.py)."""
        link = self.link  # before the generation: a fail-over bumps that first, then replaces the link
        self.events.put(("error", (self.generation if generation is None else generation, error)))
        if generation in (None, self.generation):
            link.abandon_join(str(error))

    def _fail(self, error: PipelineError) -> None:
        """Fail every request with `error`, named by its cause: hung stages first; and when a receive
        failed while some stage's control plane refuses (its process is gone), the backend's report
        of that death, awaited up to DEATH_REPORT_WAIT_S (the neighbours' broken connections often
        arrive first). Then stop."""
        from launcher.coordinator.stage_heartbeat import blame_hung_stages, probe_stages

        hung, unreachable = probe_stages(self.stubs)
        message = blame_hung_stages(str(error), hung)  # a timeout may name a victim
        if unreachable and not hung and isinstance(error, DataPlaneFailure):  # a death broke this receive?
            death = await_death_report(self.events, self.generation, DEATH_REPORT_WAIT_S)
            message = message if death is None else f"{death}; {message}"
        error = PipelineError(message)
        log.error("pipeline failed: %s", error)
        self.failure = error
        self._stopping.set()
        self._receivers_stopping.set()
        for handle in list(self.handles.values()):
            handle.finish("error", error)
        while True:  # requests submitted but not yet seen by the engine
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                payload[1].finish("error", error)

    def stage_stats(self, timeout_s: float = 10.0) -> list[pb.StageStats]:
        """GetStats of every stage, in stage order, asked at once (at most `timeout_s` in all)."""
        calls = [stub.GetStats.future(pb.GetStatsRequest(), timeout=timeout_s) for stub in self.stubs]
        return [call.result() for call in calls]

    def reset_stats(self) -> None:
        """Zero every stage's counters and the engine's totals (call while idle: the engine thread owns them)."""
        self.engine.reset_stats()
        for stub in self.stubs:
            stub.Reset(pb.ResetRequest(reset_stats=True), timeout=10)

    def health(self) -> list[pb.HealthResponse]:
        """Health of every stage, in stage order."""
        return [stub.Health(pb.HealthRequest(), timeout=5) for stub in self.stubs]

    def shutdown(self, reason: str = "launcher exiting") -> None:
        """Stop the engine, drain the data plane with an in-band SHUTDOWN, stop every stage."""
        if self._engine_thread is not None and self._engine_thread.is_alive():
            self.events.put(("stop", None))
            self._engine_thread.join(timeout=ENGINE_STOP_S)
        if self.failure is None and self.link.channel is not None:
            try:
                self.link.shutdown()
                for receiver in self._receivers:  # each ends on its source's SHUTDOWN
                    receiver.join(timeout=self.config.stage_timeout_s)
            except ChannelError as exc:
                log.warning("data plane shutdown failed: %s", exc)
        shutdown_stages(self.stubs, self.channels, reason=reason)
