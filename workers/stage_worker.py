"""Stage worker process: a gRPC control-plane server plus the stage's data-plane loop.

Owns one pipeline stage's lifetime: `Load` reads only this stage's tensors, builds the StageModel
and KV cache, joins the torch.distributed group (rank = stage_index + 1) and starts the data-plane
loop in a thread; `Health`, `GetStats`, `Reset`, `Shutdown` answer the coordinator.
Must not: talk to clients or decide what runs.

Run: python -m workers.stage_worker --stage-index I [--host 127.0.0.1] [--port 0]
Prints `SPEEDPIPE_STAGE_READY port=<N>` on stdout once listening; logs go to stderr. Exits when
stdin reaches EOF (its launcher died) or on Shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures

import grpc
import psutil
import torch

from pipeline.config import ModelConfig
from pipeline.firp import FirpMaps
from pipeline.predictor_file import load_predictor_bytes
from pipeline.predictors import ExitHead, ExitMap, make_predictor
from pipeline.quant_load import activation_dtype, load_stage_model
from pipeline.stage_executor import StageExecutor
from pipeline.weights import CheckpointReader
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.channel import Channel, DataPlaneGroup
from workers.convert import StageLoadSpec, spec_from_proto
from workers.parent_death import arm_parent_death_signal
from workers.stage_loop import StageLoop

log = logging.getLogger("speedpipe.worker")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
READY_LINE = "SPEEDPIPE_STAGE_READY port={port}"


class StageServicer(pb_grpc.StageServiceServicer):
    """gRPC StageService of one worker. Errors in Load map to INVALID_ARGUMENT / INTERNAL."""

    def __init__(self, stage_index: int, stop_event: threading.Event) -> None:
        self.stage_index = stage_index
        self.stop_event = stop_event
        self.spec: StageLoadSpec | None = None
        self.executor: StageExecutor | None = None
        self.loop: StageLoop | None = None
        self.weights_bytes = 0
        self.failure: str | None = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------
    def Load(self, request, context):
        with self._lock:
            if self.executor is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.stage_index} is already loaded")
            try:
                spec = spec_from_proto(request)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if spec.stage_index != self.stage_index:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"worker was started as stage {self.stage_index}, Load asks for {spec.stage_index}")
            start = time.perf_counter()
            try:
                names = self._load_model(spec)
            except (ValueError, FileNotFoundError, OSError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {self.stage_index}: {exc}")
            self._join_data_plane(spec)
            self.spec = spec
            log.info("[Stage %d] loaded layers %s (%.1f MB) in %.2f s", spec.stage_index, spec.layer_range,
                     self.weights_bytes / 2**20, time.perf_counter() - start)
            return pb.LoadStageResponse(weights_bytes=self.weights_bytes,
                                        num_parameters=sum(p.numel() for p in self.executor.model.parameters()),
                                        load_s=time.perf_counter() - start, tensor_names=names)

    def _load_model(self, spec: StageLoadSpec) -> list[str]:
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        config = ModelConfig.from_model_dir(spec.model_dir)
        reader = CheckpointReader(spec.model_dir)
        model = load_stage_model(spec.model_dir, spec.layer_range, is_first=spec.is_first, is_last=spec.is_last,
                                 quantization=spec.quantization, dtype=TORCH_DTYPES[spec.dtype], device=spec.device,
                                 reader=reader)
        self.act_dtype = activation_dtype(spec.quantization, spec.model_dir, TORCH_DTYPES[spec.dtype], spec.device)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        kv = model.new_kv_cache(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
        exit_layer = spec.exit_layer if spec.exit_layer in spec.layer_range else None
        exit_head = None
        if exit_layer is not None and make_predictor(spec.predictor).needs_exit_head:
            exit_head = self._load_exit_head(config, reader, spec)
        firp_layer = spec.firp_layer if spec.firp_k > 0 else None
        firp_maps = None
        if firp_layer is not None and firp_layer in spec.layer_range:
            pred = load_predictor_bytes(spec.firp_file, kind="firp", exit_layer=firp_layer,
                                        where=f"FIRP file for stage {spec.stage_index}")
            firp_maps = FirpMaps.from_predictor(pred, k=spec.firp_k, dtype=self.act_dtype, device=spec.device)
            self.weights_bytes += sum(p.numel() * p.element_size() for p in firp_maps.parameters())
        self.executor = StageExecutor(model, kv, exit_layer=exit_layer, exit_head=exit_head, firp_layer=firp_layer,
                                      firp_maps=firp_maps)
        return sorted(reader.read_names)

    def _load_exit_head(self, config: ModelConfig, reader: CheckpointReader, spec: StageLoadSpec) -> ExitHead:
        """Copies of the final norm and LM head for the exit head on this stage, behind the trained
        map of `spec.exit_predictor` when one was sent (validated: kind, exit layer, hidden size),
        restricted to the file's draft vocabulary when it has one."""
        norm_name = "model.norm.weight"
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        t = reader.read([norm_name, head_name], dtype=self.act_dtype, device=spec.device)
        exit_map, vocab = None, None
        if spec.exit_predictor:
            pred = load_predictor_bytes(spec.exit_predictor, exit_layer=spec.exit_layer, kind="early-exit",
                                        where="exit predictor")
            if pred.meta["model"]["hidden_size"] != config.hidden_size:
                raise ValueError(f"exit predictor has hidden size {pred.meta['model']['hidden_size']}, the model "
                                 f"{config.hidden_size}")
            exit_map = ExitMap.from_tensors(pred.tensors, arch=pred.meta.get("arch", "affine"),
                                            eps=config.rms_norm_eps).to(device=spec.device, dtype=self.act_dtype)
            vocab = pred.draft_vocab
        with torch.device("meta"):
            head = ExitHead(config.hidden_size, config.vocab_size, config.rms_norm_eps)
        head.load_state_dict({"norm.weight": t[norm_name], "lm_head.weight": t[head_name]}, assign=True)
        head.exit_map = exit_map
        if vocab is not None:  # [Note: draft vocabulary] in pipeline/predictors.py
            head.restrict_vocab(vocab)
        self.weights_bytes += sum(p.numel() * p.element_size() for p in head.parameters())
        return head.eval()

    def _join_data_plane(self, spec: StageLoadSpec) -> None:
        """Join the process group (blocks until every rank joined) and start the data-plane loop."""
        group = DataPlaneGroup(master_addr=spec.dist_master_addr, master_port=spec.dist_master_port,
                               rank=spec.dist_rank, world_size=spec.dist_world_size,
                               timeout_s=spec.stage_timeout_s, device=spec.device)
        hidden_bytes = self.executor.model.config.hidden_size * 4
        channel = Channel(group, timeout_s=spec.stage_timeout_s, device=spec.device, label=f"[Stage {spec.stage_index}] ",
                          max_payload_bytes=max(hidden_bytes, self.executor.model.config.vocab_size * 4)
                          * spec.max_model_len * spec.max_num_seqs)
        self.loop = StageLoop(executor=self.executor, channel=channel, stage_index=spec.stage_index,
                              num_stages=spec.num_stages)
        threading.Thread(target=self._run_loop, name="data-plane", daemon=True).start()

    def _run_loop(self) -> None:
        try:
            self.loop.run()
        except Exception as exc:  # fatal: report and exit so the launcher tears everything down
            self.failure = str(exc)
            log.error("[Stage %d] data plane failed: %s", self.stage_index, exc)
            sys.stderr.flush()
            os._exit(3)

    # -- queries ----------------------------------------------------------------------------------
    def GetInfo(self, request, context):
        spec = self.spec
        return pb.StageInfo(
            stage_index=self.stage_index, num_stages=spec.num_stages if spec else 0,
            layer_start=spec.layer_range.start if spec else 0, layer_stop=spec.layer_range.stop if spec else 0,
            pid=os.getpid(), hostname=socket.gethostname(), device=spec.device if spec else "",
            dtype=spec.dtype if spec else "", loaded=spec is not None,
        )

    def Health(self, request, context):
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
            wall_ns=time.perf_counter_ns() - c.reset_at_ns, busy_ns=c.busy_ns, useful_ns=c.busy_ns, wasted_ns=0,
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


def _exit_on_stdin_eof(stop_event: threading.Event) -> None:
    """The launcher holds our stdin open; EOF means it died: stop at once (no orphans)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    if not stop_event.is_set():
        log.warning("launcher went away (stdin closed); exiting")
    os._exit(0 if stop_event.is_set() else 1)


def start_server(*, stage_index: int, host: str, port: int = 0,
                 stop_event: threading.Event) -> tuple[grpc.Server, StageServicer, int]:
    """Start one stage's StageService on host:port (0 = a free port) in this process.

    Returns (server, servicer, bound port). The Shutdown RPC sets `stop_event`; the caller then
    calls `stop_server`. Used by `serve` (a process per stage) and by the Ray stage actor (the same
    worker code inside an actor). Raises OSError if the address cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="grpc"))
    servicer = StageServicer(stage_index, stop_event)
    pb_grpc.add_StageServiceServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
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
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--no-stdin-watch", action="store_true", help="do not exit on stdin EOF")
    args = parser.parse_args(argv)
    arm_parent_death_signal()  # a SIGKILLed launcher takes its stages with it
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    # Ctrl-C in a terminal reaches the whole process group; the launcher owns shutdown (it closes our
    # stdin, and PR_SET_PDEATHSIG covers a killed launcher), so a stage never dies of SIGINT itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_event = threading.Event()
    try:
        server, servicer, port = start_server(stage_index=args.stage_index, host=args.host, port=args.port,
                                              stop_event=stop_event)
    except OSError as exc:
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
