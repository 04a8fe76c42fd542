"""`speedpipe serve` (and `launch --serve`): a long-running pipeline behind HTTP and gRPC.

Owns the serve flags, checking them (and that the ports are free) before any stage is spawned,
and `ServingStack`, which puts the front ends on a started PipelineSession: the serving engine,
the OpenAI-compatible HTTP server (launcher/server.py), the gRPC GenerateService
(launcher/grpc_generate.py) and the periodic stats log line (launcher/metrics.py).
If the pipeline fails, the remaining stage processes are stopped at once and the front ends stay
up answering 503 / UNAVAILABLE (and /health 503 with the reason) until the server is stopped.
Must not: parse requests or hold generation logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
import threading

from launcher.session import PipelineSession

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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be in [0, 65535] or -1 (off), got {self.grpc_port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.stats_interval_s < 0:
            raise ValueError(f"--stats-interval-s must be >= 0, got {self.stats_interval_s}")

    def check_ports(self) -> None:
        """Raise ValueError if the host does not resolve or a port is taken (before spawning anything)."""
        ports = [("--port", self.port)] + ([("--grpc-port", self.grpc_port)] if self.grpc_port > 0 else [])
        for flag, port in ports:
            try:
                family, socktype, proto, _, addr = socket.getaddrinfo(self.host, port, type=socket.SOCK_STREAM)[0]
            except socket.gaierror as exc:
                raise ValueError(f"--host {self.host!r} does not resolve: {exc.strerror}") from None
            with socket.socket(family, socktype, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(addr)
                except OSError as exc:
                    raise ValueError(f"{flag} {port}: cannot listen on {self.host}:{port} ({exc.strerror})") from None


class ServingStack:
    """Engine + HTTP + gRPC + stats logger on a started session; a context manager.

    `http_port` / `grpc_port` are the bound ports (useful with port 0). Raises RuntimeError if a
    server cannot listen.
    """

    def __init__(self, session: PipelineSession, options: ServeOptions) -> None:
        from launcher.grpc_generate import GrpcServer
        from launcher.metrics import StatsLogger
        from launcher.server import HttpServer
        from launcher.serving_engine import ServingEngine

        coord, opt = session.coordinator, session.options
        self.session = session
        self.engine = ServingEngine(coord, model_name=options.model_name or default_model_name(session),
                                    max_num_seqs=opt.max_num_seqs, max_queue=options.max_queue,
                                    max_model_len=opt.max_model_len)
        self.http = HttpServer(self.engine, host=options.host, port=options.port, log_level=options.http_log_level)
        self.grpc = GrpcServer(self.engine, host=options.host, port=options.grpc_port) if options.grpc_port >= 0 else None
        self.stats = StatsLogger(coord, self.engine.metrics, self.engine, interval_s=options.stats_interval_s)
        self.host = options.host

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
            self.http.start()
            self.stats.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stats.stop()
        self.http.stop()
        if self.grpc is not None:
            self.grpc.stop()


def default_model_name(session: PipelineSession) -> str:
    """The name clients send: the registered name (e.g. smollm2-135m), else the model folder's name."""
    name = session.options.model
    if "/" in name or "\\" in name or name.endswith(".gguf"):
        return session.model.model_dir.name
    return name


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, grpc_port=args.grpc_port, model_name=args.served_model_name,
                        max_queue=args.max_queue, stats_interval_s=args.stats_interval_s)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run until Ctrl-C / SIGTERM. Exit 2 for bad flags (nothing spawned), 1 if start-up fails."""
    from launcher.cli import pipeline_options, run_member, say
    from launcher.run_plan import resolve

    serve = serve_options(args)
    options = pipeline_options(args, progress=not getattr(args, "no_progress", False))
    if options.placement.multi_node and options.placement.node_rank > 0:
        return run_member(options)  # node R > 0 only runs its stages; node 0 serves
    serve.check_ports()
    model = resolve(options)
    if logging.getLogger().level > logging.INFO:  # the stats line is the server's heartbeat: show it
        logging.getLogger("speedpipe.stats").setLevel(logging.INFO)
        if not logging.getLogger("speedpipe.stats").handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("speedpipe.stats").addHandler(handler)
            logging.getLogger("speedpipe.stats").propagate = False
    with PipelineSession(options, model) as session, ServingStack(session, serve) as stack:
        grpc_note = f", gRPC on {serve.host}:{stack.grpc_port}" if stack.grpc_port is not None else ""
        say(f"serving {stack.engine.model_name} ({options.num_stages} stage(s)) on http://{serve.host}:{stack.http_port}"
            f"{grpc_note}; Ctrl-C to stop")
        stopped = threading.Event()
        while not stopped.wait(0.5):
            coord = session.coordinator
            if coord is not None and coord.failure is not None and session.processes is not None:
                log.error("pipeline failed (%s); stopping the stages, answering 503 until stopped", coord.failure)
                session.processes.stop()
                session.processes = None
    return 0
