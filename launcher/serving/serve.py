"""`speedpipe serve` (and `launch --serve`): a long-running pipeline behind HTTP and gRPC.

Owns the serve flags, checking them (and that the ports are free) before any stage is spawned,
and `ServingStack`, which puts the front ends on a started PipelineSession: the serving engine,
the OpenAI-compatible HTTP server (launcher/serving/http_server.py), the gRPC GenerateService
(launcher/serving/grpc_generate.py) and the periodic stats log line (launcher/serving/prometheus.py).
If a stage dies or misses its heartbeats for --stage-heartbeat-timeout-s, the coordinator restarts
it and replays the running requests (launcher/coordinator/stage_failover.py; they see a pause, /health is 503
"restarting ..." meanwhile), at most --max-stage-restarts times within --restart-window-s. Past
that budget the pipeline has failed: the engine is fenced (new requests: 503 at once), every in-flight request ends with an error event,
the remaining stage processes are stopped, and the front ends stay up answering 503 / UNAVAILABLE
(and /health 503 with the reason) until the server is stopped. SIGTERM drains
(launcher/serving/drain.py). Must not: parse requests or hold generation logic.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from launcher.backends.ports import format_address, listen_socket
from launcher.coordinator.coordinator import Coordinator, PipelineError
from launcher.coordinator.session import PipelineSession, settle_coordinator_process
from launcher.coordinator.stage_restarts import RestartBudget
from launcher.serving.formats.tools import TOOL_PARSERS
from workers.rpc.control_auth import API_KEY_ENV, TlsFiles

if TYPE_CHECKING:
    from launcher.serving.serving_engine import ServedPipeline

log = logging.getLogger("speedpipe.serve")


def add_serve_args(p: argparse.ArgumentParser, *, switch: bool = False) -> None:
    """Server flags; switch=True also adds `--serve` (for `launch`)."""
    g = p.add_argument_group("serving (OpenAI-compatible HTTP and gRPC)")
    if switch:
        g.add_argument("--serve", action="store_true", help="serve over HTTP/gRPC instead of running prompts")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC GenerateService port (default 50051; -1 = off)")
    g.add_argument("--served-model-name", help="model name clients send (default: the --model name)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a KV slot; more are refused with 429 (default 64)")
    g.add_argument("--stats-interval-s", type=float, default=10.0,
                   help="seconds between stats log lines (default 10; 0 = off)")
    g.add_argument("--api-key", help="clients must send `Authorization: Bearer KEY` (HTTP /v1/*) or that "
                   f"metadata (gRPC Generate); default ${API_KEY_ENV} if set, else no key")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest HTTP request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are ended with "
                   "an error event (default 30; a second SIGTERM ends them at once)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer chat requests with tools and tool_choice \"auto\" (the default with tools): the "
                   "model decides, and --tool-call-parser finds its tool calls in its text (vLLM's flag)")
    g.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                   help="the tool-call format of the model's chat template, for --enable-auto-tool-choice: "
                   "hermes = <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Qwen2.5, Hermes); "
                   "llama3_json = "
                   "[<|python_tag|>]{\"name\": ..., \"parameters\": ...}; ... (Llama 3.1-3.3, Llama 4 JSON); pythonic = "
                   "[f(a=1), g()] (Llama 3.2 / Llama 4 pythonic); mistral = [TOOL_CALLS][{\"name\": ..., "
                   "\"arguments\": ...}] or [TOOL_CALLS]name[ARGS]{...} (Mistral); llama4_json and llama4_pythonic: "
                   "vLLM's aliases of llama3_json and pythonic")
    g.add_argument("--tls-cert", metavar="PEM", help="TLS certificate of the stages' control plane (with "
                   "--tls-key; it must name every stage's host): stages serve TLS, the coordinator trusts it")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--stage-heartbeat-timeout-s", type=float, default=5.0,
                   help="a stage that does not answer its heartbeat this long is declared hung: requests fail, "
                   "/health 503 (default 5; a long step is not a hang)")
    f = p.add_argument_group("stage fail-over")
    f.add_argument("--max-stage-restarts", type=int, default=3,
                   help="restart a dead or hung stage and replay the running requests at most this many times "
                   "within --restart-window-s; beyond that every request fails (default 3; 0 = never restart)")
    f.add_argument("--restart-window-s", type=float, default=600.0,
                   help="sliding window of --max-stage-restarts, in seconds (default 600)")


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# In serve mode the coordinator's trace buffers keep only the latest entries: nothing writes a trace
# of a server, and the full-run defaults (1,000,000 commit events, 200,000 slices) would grow its
# memory for hours ([Note: bounded serve buffers]).
SERVE_WINDOW = 1024
TAKEN_SINCE = ": it was free at start-up, so something took it while the model loaded"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Front-end settings. Raises ValueError naming the flag for bad values."""

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # -1 = no gRPC server
    model_name: str | None = None
    max_queue: int = 64
    stats_interval_s: float = 10.0
    http_log_level: str = "warning"
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace_s: float = 30.0
    stage_heartbeat_timeout_s: float = 5.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                             f"{', '.join(TOOL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be in [0, 65535] or -1 (off), got {self.grpc_port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.stats_interval_s < 0:
            raise ValueError(f"--stats-interval-s must be >= 0, got {self.stats_interval_s}")
        if self.port and self.port == self.grpc_port:
            raise ValueError(f"--port and --grpc-port are both {self.port}: the HTTP and gRPC servers need "
                             f"different ports")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable() or " " in self.api_key):
            raise ValueError("--api-key must be a non-empty string of printable characters without spaces")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if not self.stage_heartbeat_timeout_s > 0:
            raise ValueError(f"--stage-heartbeat-timeout-s must be > 0, got {self.stage_heartbeat_timeout_s}")

    def check_ports(self) -> None:
        """Raise ValueError if the host does not resolve or a port is taken (before spawning anything).
        Every port is held while the next is tried, so the same port twice is refused too."""
        ports = [("--port", self.port)] + ([("--grpc-port", self.grpc_port)] if self.grpc_port > 0 else [])
        with contextlib.ExitStack() as held:
            for flag, port in ports:
                try:
                    held.enter_context(listen_socket(self.host, port))
                except socket.gaierror as exc:
                    raise ValueError(f"--host {self.host!r} does not resolve: {exc.strerror}") from None
                except OSError as exc:
                    raise ValueError(f"{flag} {port}: cannot listen on {format_address(self.host, port)} "
                                     f"({exc.strerror})") from None


class ServingStack:
    """Engine + HTTP + gRPC + stats logger + stage heartbeat on a started session; a context manager.

    `http_port` / `grpc_port` are the bound ports (useful with port 0). Raises ValueError naming the
    flag if a server cannot listen (a port taken after `ServeOptions.check_ports`). `on_pipeline_failure()` fences the engine and ends every request.
    """

    def __init__(self, session: PipelineSession, options: ServeOptions) -> None:
        from launcher.coordinator.stage_heartbeat import StageHeartbeat
        from launcher.serving.grpc_generate import GrpcServer
        from launcher.serving.http_server import HttpServer
        from launcher.serving.prometheus import StatsLogger
        from launcher.serving.serving_engine import ServingEngine

        coord, opt = session.coordinator, session.options
        self.session = session
        window_serving_buffers(coord, SERVE_WINDOW)
        self.engine = ServingEngine(coord, model_name=options.model_name or default_model_name(session),
                                    max_num_seqs=opt.max_num_seqs, max_queue=options.max_queue,
                                    max_model_len=opt.max_model_len, pipeline=served_pipeline(session))
        self.http = HttpServer(self.engine, host=options.host, port=options.port, log_level=options.http_log_level,
                               api_key=options.api_key, max_request_bytes=options.max_request_bytes)
        try:  # the ports were free at start-up (`check_ports`); something may have taken one since
            self.grpc = (GrpcServer(self.engine, host=options.host, port=options.grpc_port, api_key=options.api_key)
                         if options.grpc_port >= 0 else None)
        except RuntimeError as exc:
            raise ValueError(f"--grpc-port {options.grpc_port}: {exc}{TAKEN_SINCE}") from None
        self.stats = StatsLogger(coord, self.engine.metrics, self.engine, interval_s=options.stats_interval_s)
        self.heartbeat = StageHeartbeat(coord.stubs, timeout_s=options.stage_heartbeat_timeout_s,
                                        on_hung=self._on_hung)
        self.engine.heartbeat = self.heartbeat
        self.engine.tool_parser = options.tool_call_parser if options.enable_auto_tool_choice else None
        coord.recovery_listeners.append(self._on_recovery)
        self.failure: PipelineError | None = None
        self.host = options.host
        self.options = options

    @property
    def http_port(self) -> int:
        servers = self.http.server.servers
        return servers[0].sockets[0].getsockname()[1] if servers else self.http.config.port

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.port if self.grpc is not None else None

    def __enter__(self) -> ServingStack:
        try:
            if self.grpc is not None:
                self.grpc.start()
            try:
                self.http.start()
            except RuntimeError as exc:  # as for gRPC above: exit 2 with one line, the stages stopped
                raise ValueError(f"--port {self.options.port}: {exc}{TAKEN_SINCE}") from None
            self.stats.start()
            self.heartbeat.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def on_pipeline_failure(self, failure: BaseException) -> None:
        """Fence (new requests 503 at once) and end every in-flight request with an error event naming
        `failure`, without waiting for the coordinator (it may be stuck on a hung stage). Idempotent."""
        if self.failure is None:
            self.failure = failure if isinstance(failure, PipelineError) else PipelineError(str(failure))
        self.heartbeat.stop()
        self.engine.fence(f"pipeline failed: {self.failure}")
        self.engine.fail_all(self.failure)

    def _on_hung(self, stage_index: int, message: str) -> None:
        error = PipelineError(message)
        coord = self.session.coordinator
        if coord.failover is None:
            self.on_pipeline_failure(error)
        coord.fail(error)  # with fail-over: the coordinator kills and restarts the hung stage

    def _on_recovery(self, phase: str, reason: str) -> None:
        """Coordinator fail-over hook (engine thread): no heartbeat verdicts while stages restart;
        a fresh heartbeat on the new stages once the pipeline is back."""
        from launcher.coordinator.stage_heartbeat import StageHeartbeat

        if phase == "start":
            self.heartbeat.stop()
            return
        if self.failure is None:
            self.heartbeat = StageHeartbeat(self.session.coordinator.stubs, on_hung=self._on_hung,
                                            timeout_s=self.options.stage_heartbeat_timeout_s).start()
            self.engine.heartbeat = self.heartbeat

    def close(self) -> None:
        self.heartbeat.stop()
        self.stats.stop()
        self.http.stop()
        if self.grpc is not None:
            self.grpc.stop()


def window_serving_buffers(coord: Coordinator, max_entries: int) -> None:
    """Keep only the latest `max_entries` commit events, timeline slices and draft gaps of `coord`.

    [Note: bounded serve buffers]
    `launch` and `bench` keep every event of a run for its trace and plots; a server runs for days
    and writes no trace, so its buffers are windows. Counters (useful / wasted seconds, speculation
    totals) are plain numbers and stay exact. Called before the server admits requests.
    """
    coord.engine.window_buffers(max_entries)


def served_pipeline(session: PipelineSession) -> ServedPipeline:
    """How `session` runs its model, as GetModelInfo tells clients: the dtype and numeric mode the
    stages load in (`--quantization auto` settled to gguf or none, as the stages settle it)."""
    from launcher.serving.serving_engine import ServedPipeline
    from pipeline.weights.quant_load import activation_dtype, effective_mode

    opt, model_dir = session.options, str(session.model.model_dir)
    dtype = activation_dtype(opt.quantization, model_dir, opt.torch_dtype, opt.device)
    return ServedPipeline(num_stages=opt.num_stages, dtype=str(dtype).removeprefix("torch."),
                          quantization=effective_mode(opt.quantization, model_dir, opt.device), speculate=opt.speculate)


def default_model_name(session: PipelineSession) -> str:
    """The name clients send: the registered name (e.g. smollm2-135m), else the model folder's name."""
    name = session.options.model
    if "/" in name or "\\" in name or name.endswith(".gguf"):
        return session.model.model_dir.name
    return name


def restart_budget(args: argparse.Namespace) -> RestartBudget:
    """--max-stage-restarts / --restart-window-s. Raises ValueError naming the flag."""
    return RestartBudget(max_restarts=args.max_stage_restarts, window_s=args.restart_window_s)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, grpc_port=args.grpc_port, model_name=args.served_model_name,
                        max_queue=args.max_queue, stats_interval_s=args.stats_interval_s,
                        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
                        max_request_bytes=args.max_request_bytes, shutdown_grace_s=args.shutdown_grace_s,
                        stage_heartbeat_timeout_s=args.stage_heartbeat_timeout_s,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser)


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """--tls-cert and --tls-key (both or neither). Raises ValueError naming the flag."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    return None if cert is None else TlsFiles(cert_file=cert, key_file=key)


def _show_stats_lines() -> None:
    if logging.getLogger().level > logging.INFO:  # the stats line is the server's heartbeat: show it
        logging.getLogger("speedpipe.stats").setLevel(logging.INFO)
        if not logging.getLogger("speedpipe.stats").handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("speedpipe.stats").addHandler(handler)
            logging.getLogger("speedpipe.stats").propagate = False


def cmd_serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM / Ctrl-C, then drain. Exit 2 for bad flags (nothing spawned), 1 if start-up
    fails, 0 after a drain (launcher/serving/drain.py)."""
    from launcher.backends.multinode import run_member_node
    from launcher.cli.options import options_and_reason, say
    from launcher.cli.speculation_defaults import settle_auto
    from launcher.coordinator.run_plan import resolve
    from launcher.serving.drain import DrainSignals, serve_until_stopped
    from pipeline.weights.registry import model_key

    serve, tls, restarts = serve_options(args), tls_files(args), restart_budget(args)
    options, why = options_and_reason(args, progress=not getattr(args, "no_progress", False))
    if options.placement.multi_node and options.placement.node_rank > 0:  # only runs its stages; node 0 serves
        plan = resolve(options)
        return run_member_node(options.placement, num_stages=options.num_stages, log_level=options.log_level,
                               threads_per_stage=options.threads_per_stage, say=say, tls=tls,
                               model=(model_key(plan.model_dir), plan.model_dir.name))
    serve.check_ports()
    options, model, why = settle_auto(options, resolve(options), why)
    _show_stats_lines()
    settle_coordinator_process()  # one torch thread, frozen start-up heap; before the pipeline's objects exist
    with (PipelineSession(options, model, tls=tls, restart_budget=restarts) as session,
          ServingStack(session, serve) as stack):
        grpc_note = f", gRPC on {format_address(serve.host, stack.grpc_port)}" if stack.grpc_port is not None else ""
        say(f"serving {stack.engine.model_name} ({options.num_stages} stage(s)) on "  # [::1]:8000 for IPv6
            f"http://{format_address(serve.host, stack.http_port)}{grpc_note}; Ctrl-C or SIGTERM drains and stops")
        if why:
            say(f"speculation: {options.speculate} (--speculate auto: {why})")
        failover = session.coordinator.failover
        with DrainSignals(on_drain=None if failover is None else failover.shutting_down.set) as signals:
            serve_until_stopped(session, stack, signals)
    say("server stopped")
    return 0
