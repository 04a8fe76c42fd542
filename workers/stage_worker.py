"""Stage worker process: a gRPC control-plane server plus the stage's data-plane loop.

Owns one pipeline stage's lifetime: `Load` has pipeline/engine/stage_assembly.py build the stage (only
this stage's tensors: model, KV cache, exit head, FIRP maps), joins the torch.distributed group
(rank = stage_index + 1) and starts the data-plane loop in a thread; `Health`, `GetStats`, `Reset`,
`Shutdown` answer the coordinator; `Rejoin` (workers/rejoin.py) moves the loaded stage into a fresh
data-plane group after another stage was restarted ([Note: fail-over] in launcher/coordinator/stage_failover.py).
Must not: build models itself, talk to clients or decide what runs.

Run: python -m workers.stage_worker --stage-index I [--host 127.0.0.1] [--port 0]
Prints `SPEEDPIPE_STAGE_READY port=<N>` on stdout once listening; logs go to stderr. Exits when
stdin reaches EOF (its launcher died) or on Shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import torch

from pipeline.engine.stage_assembly import (
    SpecBookkeepingError,
    StageLoadSpec,
    assemble_stage,
    is_user_file_error,
    machine_error,
)
from pipeline.engine.stage_executor import StageExecutor
from pipeline.measure.row_cost import numeric_mode_name, ratio_line
from pipeline.measure.stage_calibration import MAX_CALIBRATION_ROWS, calibrate_stage, time_exit_head
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.channel import Channel, DataPlaneGroup
from workers.heap import freeze_startup_heap
from workers.load_spec_codec import spec_from_proto
from workers.log_config import LOG_LEVEL_ENV, LOG_LEVELS, configure_logging
from workers.parent_death import arm_parent_death_signal
from workers.rejoin import JOIN_TIMEOUT_S, RejoinHandler, join_failure
from workers.rpc.control_auth import (
    CONTROL_GRPC_OPTIONS,
    SECRET_ENV,
    SECRET_METADATA_KEY,
    SecretCheckInterceptor,
    TlsFiles,
    take_secret_from_env,
)
from workers.rpc.request_parse import RequestParseInterceptor
from workers.stage_loop import StageLoop

log = logging.getLogger("speedpipe.worker")

READY_LINE = "SPEEDPIPE_STAGE_READY port={port}"
# Tests only: a file whose text is the seconds every Load made while it exists waits before it loads (a
# restarted stage that loads slowly: [Note: every rank waits for all_joined] in workers/channel.py).
LOAD_DELAY_FILE_ENV = "SPEEDPIPE_TEST_LOAD_DELAY_FILE"


def load_delay_s_for_tests() -> float:
    """Seconds this Load waits first: the number in the file LOAD_DELAY_FILE_ENV names, read now (0 when
    unset or absent). Raises ValueError for a file that holds no number."""
    path = os.environ.get(LOAD_DELAY_FILE_ENV)
    return float(Path(path).read_text()) if path and os.path.exists(path) else 0.0


class StageServicer(RejoinHandler, pb_grpc.StageServiceServicer):
    """gRPC StageService of one worker. Errors in Load map to INVALID_ARGUMENT (a ValueError, a
    missing or unreadable file: the user's input) / FAILED_PRECONDITION (a Load this worker cannot take:
    already in a data-plane group ("already loaded"), meant for another stage, or a SpecBookkeepingError
    such as a stage index outside num_stages; the coordinator's bookkeeping, not the user's input) /
    INTERNAL ("<ExceptionType>: <message>" of any other exception, whose traceback this worker logs
    at DEBUG only; also an OSError of the machine, such as EMFILE or ENOMEM, named by its errno) /
    DEADLINE_EXCEEDED or UNAVAILABLE when the model loaded but its data-plane rendezvous timed out or
    went away (`join_failure` in workers/rejoin.py; the weights stay: a Rejoin may move the stage into
    the next group, or a Load loads them again, as after a Rejoin that failed or still waits: the stage
    left its group). Load's messages do not name the stage: the coordinator, which knows which stage it
    asked, does ("stage 1 failed to load: ...")."""

    def __init__(self, stage_index: int, stop_event: threading.Event, *, rejoin_wait_s: float = 0.0) -> None:
        """rejoin_wait_s: after a data-plane failure, wait this long for a `Rejoin` before exiting
        (0: exit at once, so the launcher notices; > 0 when the launcher restarts stages)."""
        self.stage_index = stage_index
        self.rejoin_wait_s = rejoin_wait_s
        self._rejoined = threading.Event()
        self.stop_event = stop_event
        self.spec: StageLoadSpec | None = None
        self.executor: StageExecutor | None = None
        self.loop: StageLoop | None = None
        self.weights_bytes = 0
        self.failure: str | None = None
        self.join_error: str | None = None  # why the last join failed while the weights stay loaded (Health)
        self._lock = threading.Lock()
        self._init_rejoins()  # [Note: superseded rejoin] in workers/rejoin.py
        self._heap_frozen = False

    # -- lifecycle -------------------------------------------------------------------------------
    def Load(self, request, context):
        with self._lock:
            if self.loop is not None and not self.loop.retired:  # in a group; one whose join failed loads again
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the worker is already loaded")
            # a loop a Rejoin retired (that Rejoin failed or waits) goes, and the data-plane failure it ended with
            self.executor = self.spec = self.join_error = self.loop = self.failure = None
            self._supersede_rejoins()  # one waiting after a failed join must not start a second loop
            try:
                spec = spec_from_proto(request)
            except ValueError as exc:  # a SpecBookkeepingError: the coordinator's bookkeeping, not the user's input
                context.abort(*load_failure(exc))
            if spec.stage_index != self.stage_index:  # the coordinator's bookkeeping, not the user's input
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker was started as stage {self.stage_index}, Load asks for {spec.stage_index}")
            start = time.perf_counter()
            try:
                names = self._load_model(spec)
                calibration = self._calibrate(spec) if spec.calibrate_max_rows else self._time_exit_head(spec)
            except Exception as exc:  # noqa: BLE001 - one line to the coordinator (`load_failure`)
                self.executor = None  # not loaded: a corrected Load may follow
                code, message = load_failure(exc)
                if code == grpc.StatusCode.INTERNAL:  # unexpected, or the machine's: its traceback at DEBUG
                    log.debug("[Stage %d] loading the model failed", self.stage_index, exc_info=True)
                context.abort(code, message)
            self.spec = spec  # loaded: a Rejoin may move it into a group if this join fails
            try:
                group = self._join_data_plane(spec)
            except Exception as exc:  # noqa: BLE001 - torch's rendezvous errors: one line, not UNKNOWN
                code, self.join_error = join_failure(exc, spec, timeout_s=JOIN_TIMEOUT_S)
                context.abort(code, self.join_error)
            self._start_loop(spec, group)
            log.info("[Stage %d] loaded layers %s (%.1f MB) in %.2f s", spec.stage_index, spec.layer_range,
                     self.weights_bytes / 2**20, time.perf_counter() - start)
            return pb.LoadStageResponse(weights_bytes=self.weights_bytes,
                                        num_parameters=sum(p.numel() for p in self.executor.model.parameters()),
                                        load_s=time.perf_counter() - start, tensor_names=names, **calibration)

    def _calibrate(self, spec: StageLoadSpec) -> dict:
        """Time this stage's passes of 1.. rows (pipeline/measure/stage_calibration.py); the
        LoadStageResponse fields that report them. Raises SpecBookkeepingError for calibrate_max_rows
        outside [1, MAX_CALIBRATION_ROWS]."""
        if not 1 <= spec.calibrate_max_rows <= MAX_CALIBRATION_ROWS:  # the coordinator caps it
            raise SpecBookkeepingError(f"calibrate_max_rows must be in [1, {MAX_CALIBRATION_ROWS}] (0: no calibration), "
                             f"got {spec.calibrate_max_rows}")
        start = time.perf_counter()
        mode = numeric_mode_name(dtype=spec.dtype, quantization=spec.quantization, dense_layout=spec.dense_layout)
        table = calibrate_stage(self.executor.model, mode=mode, max_rows=spec.calibrate_max_rows, device=spec.device,
                                num_threads=spec.num_threads)
        head_s = self._time_exit_head(spec).get("exit_head_row_s", 0.0)
        took = time.perf_counter() - start
        log.info("[Stage %d] row costs in %.2f s: %s; exit head %.2f ms a row", spec.stage_index, took,
                 ratio_line(table), head_s * 1e3)
        return {"row_costs": [pb.RowCost(num_rows=n, pass_s=s) for n, s in zip(table.num_rows, table.pass_s, strict=True)],
                "row_cost_mode": mode, "calibrate_s": took, "exit_head_row_s": head_s}

    def _time_exit_head(self, spec: StageLoadSpec) -> dict:
        """{"exit_head_row_s": seconds the exit head takes on one row} where this stage has one, else {}:
        what `launch`'s speed-up estimate takes off a pass that ran it ([Note: plain decode estimate] in
        pipeline/measure/handoffs.py). A few ms at load."""
        head = self.executor.exit_head
        if head is None:
            return {}
        return {"exit_head_row_s": time_exit_head(head, hidden_size=self.executor.model.config.hidden_size,
                                                  dtype=next(iter(head.parameters())).dtype, device=spec.device,
                                                  num_threads=spec.num_threads)}

    def _load_model(self, spec: StageLoadSpec) -> list[str]:
        """Build this stage from its spec (pipeline/engine/stage_assembly.py); returns the tensor names read."""
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        time.sleep(load_delay_s_for_tests())
        stage = assemble_stage(spec)
        self.executor, self.weights_bytes = stage.executor, stage.weights_bytes
        if not self._heap_frozen:  # once, before any data-plane object exists: those must stay collectable
            self._heap_frozen = freeze_startup_heap() > 0  # [Note: the collector on the per-token path]
        return stage.tensor_names

    def _join_data_plane(self, spec: StageLoadSpec, *, connect_timeout_s: float = JOIN_TIMEOUT_S,
                         refused_is_abandoned: bool = False) -> DataPlaneGroup:
        """Join the process group at the spec's rendezvous: blocks until every rank joined, at most
        `connect_timeout_s` (the group's timeout_s bounds its first step). Raises RuntimeError (torch's),
        RendezvousAbandoned once the coordinator gave it up (refused_is_abandoned: a Rejoin's port, held
        before it was sent, refusing connections means that too: [Note: abandoned rendezvous])."""
        return DataPlaneGroup(master_addr=spec.dist_master_addr, master_port=spec.dist_master_port,
                              rank=spec.dist_rank, world_size=spec.dist_world_size,
                              timeout_s=spec.stage_timeout_s, device=spec.device, connect_timeout_s=connect_timeout_s,
                              refused_is_abandoned=refused_is_abandoned)

    def _start_loop(self, spec: StageLoadSpec, group: DataPlaneGroup) -> None:
        """Start the data-plane loop of this stage on `group` (caller holds the lock)."""
        hidden_bytes = self.executor.model.config.hidden_size * 4
        channel = Channel(group, timeout_s=spec.stage_timeout_s, device=spec.device, label=f"[Stage {spec.stage_index}] ",
                          max_payload_bytes=max(hidden_bytes, self.executor.model.config.vocab_size * 4)
                          * spec.max_model_len * spec.max_num_seqs)
        self.loop = StageLoop(executor=self.executor, channel=channel, stage_index=spec.stage_index,
                              num_stages=spec.num_stages)
        self.join_error = None
        self._rejoined = threading.Event()
        threading.Thread(target=self._run_loop, args=(self.loop, self._rejoined), name="data-plane",
                         daemon=True).start()

    def _run_loop(self, loop: StageLoop, rejoined: threading.Event) -> None:
        try:
            loop.run()
        except Exception as exc:  # fatal unless a Rejoin retired this loop or comes in time
            if loop.retired:
                log.info("[Stage %d] old data-plane group ended: %s", self.stage_index, exc)
                return
            self.failure = str(exc)
            log.error("[Stage %d] data plane failed: %s", self.stage_index, exc)
            if self.rejoin_wait_s > 0 and rejoined.wait(self.rejoin_wait_s):
                return  # the coordinator moved this stage into a fresh group
            sys.stderr.flush()
            os._exit(3)  # the launcher tears everything down

    # -- queries ----------------------------------------------------------------------------------
    def Health(self, request, context):
        """SERVING while its data-plane loop runs; NOT_LOADED until a Load has loaded the weights; NOT_SERVING
        while the weights are loaded but the last join (Load's or Rejoin's) failed: the stage is in no group and
        waits for the coordinator's next Rejoin or Load (the message names that failure); UNHEALTHY once its
        data plane failed or stopped."""
        if self.join_error is not None and self.executor is not None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING,
                                     message=f"weights loaded, in no data-plane group: {self.join_error}")
        if self.failure:
            return pb.HealthResponse(status=pb.HealthResponse.UNHEALTHY, message=self.failure)
        if self.loop is None:
            return pb.HealthResponse(status=pb.HealthResponse.NOT_LOADED, message="waiting for Load")
        if self.loop.stopped.is_set():
            return pb.HealthResponse(status=pb.HealthResponse.UNHEALTHY, message="data plane stopped")
        return pb.HealthResponse(status=pb.HealthResponse.SERVING)

    def GetStats(self, request, context):
        ex = self.executor
        if ex is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.stage_index} is not loaded")
        c = ex.counters
        return pb.StageStats(
            wall_ns=time.perf_counter_ns() - c.reset_at_ns, busy_ns=c.busy_ns,
            items_processed=c.items_processed, tokens_processed=c.tokens_processed,
            messages_received=self.loop.messages_received if self.loop else 0,
            rss_bytes=psutil.Process().memory_info().rss, weights_bytes=self.weights_bytes,
            kv_cache_bytes=ex.kv.nbytes, kv_slots_in_use=ex.kv.slots_in_use(),
        )

    def Reset(self, request, context):
        if self.executor is not None:
            if request.reset_stats:
                self.executor.counters.reset()
            if request.clear_kv_cache:
                self.executor.clear()
        return pb.ResetResponse()

    def Shutdown(self, request, context):
        log.info("[Stage %d] shutdown requested: %s", self.stage_index, request.reason or "no reason given")
        self.stop_event.set()
        return pb.ShutdownResponse()


def load_failure(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed Load answers for `exc` (StageServicer's docstring):
    FAILED_PRECONDITION for a SpecBookkeepingError, INVALID_ARGUMENT for another ValueError or a file
    the user named ([Note: the user's files or the machine] in pipeline/engine/stage_assembly.py),
    INTERNAL for the rest (an OSError of the machine named by its errno)."""
    if isinstance(exc, SpecBookkeepingError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError) or (isinstance(exc, OSError) and is_user_file_error(exc)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OSError):
        return grpc.StatusCode.INTERNAL, machine_error(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _exit_on_stdin_eof(stop_event: threading.Event) -> None:
    """The launcher holds our stdin open; EOF means it stopped us or died: stop at once (no orphans).

    Reads the raw file descriptor (os.read), never `sys.stdin.buffer`: a daemon thread blocked in a
    buffered read holds the reader's lock, and interpreter shutdown then aborts with "Fatal Python
    error: _enter_buffered_busy". Closing stdin is also the launcher's normal way to stop a stage
    (LocalStageProcesses.stop, Ctrl-C included), so EOF is logged at INFO, not as a warning.
    """
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    if not stop_event.is_set():
        log.info("stdin closed (the launcher stopped or went away); exiting")
    os._exit(0 if stop_event.is_set() else 1)


def start_server(*, stage_index: int, host: str, port: int = 0, stop_event: threading.Event,
                 control_secret: str | None = None, tls: TlsFiles | None = None,
                 rejoin_wait_s: float = 0.0) -> tuple[grpc.Server, StageServicer, int]:
    """Start one stage's StageService on host:port (0 = a free port) in this process.

    Returns (server, servicer, bound port). The Shutdown RPC sets `stop_event`; the caller then
    calls `stop_server`. Used by `serve` (a process per stage) and by the Ray stage actor (the same
    worker code inside an actor). control_secret: every call must carry it as metadata, else
    UNAUTHENTICATED ([Note: control-plane secret] in workers/rpc/control_auth.py); None = no check.
    tls: serve TLS with these files instead of plain TCP. Raises OSError if the address cannot be bound.
    """
    interceptors = [] if control_secret is None else [SecretCheckInterceptor(
        key=SECRET_METADATA_KEY, expected=control_secret, what="control-plane secret (the launcher's session secret)")]
    interceptors.append(RequestParseInterceptor())  # a coordinator of another version: INVALID_ARGUMENT, not INTERNAL
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="grpc"),
                         interceptors=interceptors, options=list(CONTROL_GRPC_OPTIONS))
    servicer = StageServicer(stage_index, stop_event, rejoin_wait_s=rejoin_wait_s)
    pb_grpc.add_StageServiceServicer_to_server(servicer, server)
    try:
        address = f"{host}:{port}"
        bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(
            address, tls.server_credentials())
    except RuntimeError as exc:  # grpc raises RuntimeError on a bind failure
        raise OSError(f"cannot bind control plane to {host}:{port}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot bind control plane to {host}:{port}")
    server.start()
    return server, servicer, bound


def stop_server(server: grpc.Server, servicer: StageServicer) -> None:
    """After Shutdown: let the data-plane loop finish its in-band SHUTDOWN, then stop the server."""
    if servicer.loop is not None:
        servicer.loop.stopped.wait(timeout=5.0)
    server.stop(grace=1.0).wait(2.0)


def serve(argv: list[str] | None = None) -> int:
    """Entry point of a stage worker process. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m workers.stage_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--stage-index", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="control-plane bind address (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="control-plane port (0 = pick a free one)")
    parser.add_argument("--log-level", help=f"{' | '.join(LOG_LEVELS)} (default: ${LOG_LEVEL_ENV}, else WARNING)")
    parser.add_argument("--no-stdin-watch", action="store_true", help="do not exit on stdin EOF")
    parser.add_argument("--rejoin-wait-s", type=float, default=0.0,
                        help="after a data-plane failure, wait this long for a Rejoin before exiting (default 0)")
    args = parser.parse_args(argv)
    arm_parent_death_signal()  # a SIGKILLed launcher takes its stages with it
    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        print(f"stage worker: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    # Ctrl-C in a terminal reaches the whole process group, and systemd (KillMode=control-group),
    # `timeout` and `kill -- -PGID` send SIGTERM to every process: the launcher owns shutdown (it drains,
    # then closes our stdin; PR_SET_PDEATHSIG covers a killed launcher), so a stage watching its stdin
    # dies of neither signal itself (its in-flight requests would end in an error instead of draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not args.no_stdin_watch:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_event = threading.Event()
    secret = take_secret_from_env()
    if secret is None:
        print(f"stage worker: {SECRET_ENV} is not set: the launcher hands every stage the session secret that "
              f"authenticates the control plane", file=sys.stderr)
        return 2
    try:
        server, servicer, port = start_server(stage_index=args.stage_index, host=args.host, port=args.port,
                                              stop_event=stop_event, control_secret=secret, tls=TlsFiles.from_env(),
                                              rejoin_wait_s=args.rejoin_wait_s)
    except (OSError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if not args.no_stdin_watch:
        threading.Thread(target=_exit_on_stdin_eof, args=(stop_event,), daemon=True).start()
    print(READY_LINE.format(port=port), flush=True)
    stop_event.wait()
    stop_server(server, servicer)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
