"""Pipeline session: place the stages, load them, start the coordinator, tear down on every exit path.

Owns the order of start-up (everything that can be validated is validated *before* any process is
spawned, in PipelineOptions and launcher/coordinator/run_plan.py, so bad input leaves nothing behind), the
choice of placement backend (local processes, Ray actors, or the torchrun-style multi-node mode;
see launcher/backends/placement.py), the coordinator's and the stages' views of the run configuration, the
health check before any work is admitted, the hooks the coordinator's fail-over uses to restart a
stage (launcher/coordinator/stage_failover.py; every backend's `restart_stage`), and teardown. Serving and benchmarking front
ends reuse it.
Must not: parse command lines (launcher/cli/main.py) or format output.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch

from launcher.backends.local import LocalStageBackend
from launcher.backends.placement import StageBackend
from launcher.backends.stage_group import LocalStageProcesses
from launcher.backends.worker_command import LocalLaunchConfig
from launcher.coordinator.coordinator import Coordinator, CoordinatorConfig, PipelineError
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import RunPlan
from launcher.coordinator.stage_failover import StageFailover
from launcher.coordinator.stage_restarts import RestartBudget, RestartLedger
from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.measure.row_cost import RowCostTable, combine_stage_tables, firp_pass_rows
from pipeline.measure.stage_calibration import MAX_CALIBRATION_ROWS
from pipeline.speculation.predictors import Predictor
from pipeline.speculation.tree import scratch_positions
from pipeline.weights.registry import model_key
from proto import speedpipe_pb2 as pb
from workers.channel import release_listener
from workers.heap import freeze_startup_heap
from workers.rpc.control_auth import SECRET_ENV, TlsFiles, new_secret

log = logging.getLogger("speedpipe.launch")
REJOIN_WAIT_S = 120  # how long a stage whose data plane broke waits for the coordinator's Rejoin


def settle_coordinator_process() -> None:
    """Ready the coordinator's process for the per-token path, once, after its start-up (model
    resolution, a GGUF's conversion, the tokenizer) and before the session: one torch thread and a
    frozen start-up heap ([Note: the collector on the per-token path] in workers/heap.py).

    [Note: the coordinator's torch threads]
    The coordinator runs no model layers, but it does run torch ops on the per-token path (softmax,
    top-k and multinomial over a vocabulary row for sampled requests, the grammar mask). With torch's
    default of one intra-op thread per core, an op over a 49k-entry row splits across OpenMP
    workers that spin after it, on the cores the stages run on (`--threads-per-stage` counts only
    the stages). One thread keeps the coordinator off them; `launch`, `serve` and the benchmark
    driver (launcher/bench/driver.py) all take this path, so benchmarks measure what users run.
    """
    torch.set_num_threads(1)
    freeze_startup_heap()


def coordinator_config(options: PipelineOptions, plan: RunPlan, *, master_addr: str,
                       master_port: int) -> CoordinatorConfig:
    """The coordinator's view of the run: its limits, the data-plane rendezvous, and the exit stage
    (-1 when the pipeline runs no exit head)."""
    scheduler = options.scheduler_config(eos_token_ids=tuple(plan.tokenizer.eos_token_ids),
                                         primary_eos=plan.tokenizer.eos_token_id is not None,
                                         firp_k=plan.firp.k if plan.firp else 0, row_costs=plan.row_costs,
                                         firp_pseudo_weight=plan.firp_pseudo_weight,
                                         parallel_stages=options.parallel_stages)
    # stage-local drafting needs the exit layer on stage 0 (else: the coordinator drafts, as documented)
    draft_at_stage = options.draft_at == "stage" and options.needs_exit_head and plan.exit_stage == 0
    if options.draft_at == "stage" and options.needs_exit_head and plan.exit_stage != 0:
        log.warning("draft_at stage needs the exit layer on stage 0, but layer %d is on stage %d: the "
                    "coordinator drafts", plan.exit_layer, plan.exit_stage)
    return CoordinatorConfig(
        scheduler=dataclasses.replace(scheduler, draft_at_stage=draft_at_stage and scheduler.speculate,
                                      deep_acceptance=options.deep_draft_min_acceptance,
                                      # plain decode only: pipeline/engine/decode_feed.py
                                      decode_feed=options.decode_feed == "stage" and not scheduler.speculate),
        stage_timeout_s=options.stage_timeout_s, dist_master_addr=master_addr, dist_master_port=master_port,
        predictor=options.predictor, exit_stage=plan.exit_stage if options.needs_exit_head else -1,
        record_timeline=options.record_timeline)


def calibration_max_rows(options: PipelineOptions, plan: RunPlan) -> int:
    """The most rows the scheduler could send one stage in a pass: every sequence's item of 1 + k
    rows, or one FIRP verify pass in row equivalents (at most 32, pipeline/measure/stage_calibration.py)."""
    k = plan.firp.k if plan.firp else 0
    return min(MAX_CALIBRATION_ROWS, max(options.max_num_seqs * (1 + k), math.ceil(firp_pass_rows(k))))


def stage_load_specs(options: PipelineOptions, plan: RunPlan, *, master_addr: str,
                     master_port: int, calibrate: bool = False) -> list[StageLoadSpec]:
    """Each stage's view of the run, in stage order: its layers and limits, whether the pipeline
    runs an exit head (exit_layer, -1 for none) and, for the stages that hold them, the exit
    head's and the FIRP maps' files. calibrate: every stage times its passes after loading
    (`--row-cost calibrate`; only at start-up, not when fail-over reloads a stage)."""
    firp = plan.firp
    calibrate_rows = calibration_max_rows(options, plan) if calibrate else 0
    return [StageLoadSpec(
        model_dir=str(plan.model_dir), stage_index=i, num_stages=options.num_stages, layer_range=r,
        dtype=options.dtype, device=options.device, max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len, num_threads=options.threads_per_stage, dist_master_addr=master_addr,
        dist_master_port=master_port, stage_timeout_s=options.stage_timeout_s,
        exit_layer=plan.exit_layer if options.needs_exit_head else -1,
        exit_predictor=plan.exit_predictor if options.needs_exit_head and i == plan.exit_stage else b"",
        firp_layer=firp.layer if firp else -1, firp_k=firp.k if firp else 0,
        firp_file=firp.file_bytes if firp and firp.layer in r else b"", quantization=options.quantization,
        dense_layout=options.dense_layout, calibrate_max_rows=calibrate_rows,
        tree_scratch=scratch_positions(options.draft_tree, options.max_inflight or options.num_stages))
        for i, r in enumerate(plan.ranges)]


def calibrated_table(responses: Sequence[pb.LoadStageResponse]) -> RowCostTable:
    """The pipeline's row-cost table from the stages' calibrations in their Load responses
    ([Note: combining stage tables] in pipeline/measure/row_cost.py). Raises PipelineError when a
    stage reported none or a malformed one."""
    tables = []
    for i, r in enumerate(responses):
        try:
            tables.append(RowCostTable(mode=r.row_cost_mode, num_rows=tuple(c.num_rows for c in r.row_costs),
                                       pass_s=tuple(c.pass_s for c in r.row_costs)))
        except ValueError as exc:
            raise PipelineError(f"stage {i} reported no usable row-cost calibration: {exc}") from None
    return combine_stage_tables(tables)


class PipelineSession:
    """Context manager: spawn the stage workers, load them, start the coordinator; stop all on exit.

    Raises PipelineError if a stage fails to start or load (naming the stage).
    """

    def __init__(self, options: PipelineOptions, model: RunPlan, *, predictor: Predictor | None = None,
                 restart_budget: RestartBudget | None = None, tls: TlsFiles | None = None) -> None:
        """model: the plan `launcher.coordinator.run_plan.resolve(options)` made. predictor: a Predictor object
        overriding options.predictor on the coordinator side; it must agree with it on
        `needs_exit_head` (the stages are built for that). Raises ValueError if it does not.
        restart_budget: stage fail-over (--max-stage-restarts); None or 0 restarts: a failed stage
        fails every request. tls: TLS files of the stages' control plane (serve --tls-cert/--tls-key)."""
        if predictor is not None and options.uses_speed and predictor.needs_exit_head != options.needs_exit_head:
            raise ValueError(f"predictor override {type(predictor).__name__} needs_exit_head={predictor.needs_exit_head}, "
                             f"but predictor {options.predictor!r} (the stages' build) has {options.needs_exit_head}")
        self.tls = tls
        self.predictor = predictor
        self.restart_budget = restart_budget or RestartBudget(max_restarts=0)
        self.options = options
        self.model = model
        self.backend: StageBackend | None = None
        self.coordinator: Coordinator | None = None
        self.load_responses = []
        self.row_costs = model.row_costs  # the table rows are priced with (--row-cost); None: fixed choices
        self.control_secret = new_secret()  # [Note: control-plane secret] in workers/rpc/control_auth.py
        self._data_ports: list[tuple[str, int]] = []  # held rendezvous ports, released at close

    def __enter__(self) -> PipelineSession:
        try:
            self._start()
        except BaseException as exc:
            self.close(failure=exc)
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failure=exc)

    def placement(self) -> list[str]:
        """One line per stage: which layers (and which extra modules) it holds."""
        m, lines = self.model, []
        for i, r in enumerate(m.ranges):
            extra = [name for name, holds in (("embedding", i == 0), ("final norm + LM head", i == len(m.ranges) - 1),
                     (f"{'trained ' if m.exit_predictor else ''}exit head after layer {m.exit_layer}",
                      self.options.needs_exit_head and i == m.exit_stage),
                     (f"FIRP maps (k={m.firp.k}) after layer {m.firp.layer}" if m.firp else "",
                      m.firp is not None and m.firp.layer in r))
                     if holds]
            lines.append(f"stage {i}: layers {r} ({len(r)})" + "".join(f" + {e}" for e in extra))
        return lines

    @property
    def exit_head_ms(self) -> float:
        """Milliseconds the exit stage's exit head takes on one row, as the stage timed it at load
        (workers/stage_worker.py); 0 where no stage runs an exit head or before start."""
        return max((r.exit_head_row_s for r in self.load_responses), default=0.0) * 1e3

    @property
    def processes(self) -> LocalStageProcesses | None:
        """The local stage processes (local backend only; None otherwise)."""
        return self.backend.processes if isinstance(self.backend, LocalStageBackend) else None

    def _make_backend(self) -> StageBackend:
        opt = self.options
        # a stage whose data plane broke waits to be rejoined ([Note: fail-over]):
        rejoin_wait_s = REJOIN_WAIT_S if self.restart_budget.max_restarts else 0
        if opt.placement.backend == "ray":
            from launcher.backends.ray_cluster.stage_actors import (
                RayStageActors,  # ray is imported only there
            )

            return RayStageActors(num_stages=opt.num_stages, placement=opt.placement, device=opt.device,
                                  log_level=opt.log_level, threads_per_stage=opt.threads_per_stage,
                                  control_secret=self.control_secret, tls=self.tls, rejoin_wait_s=rejoin_wait_s)
        if opt.placement.multi_node:
            from launcher.backends.multinode import MultiNodeStages

            return MultiNodeStages(num_stages=opt.num_stages, placement=opt.placement, log_level=opt.log_level,
                                   threads_per_stage=opt.threads_per_stage, control_secret=self.control_secret,
                                   tls=self.tls, rejoin_wait_s=rejoin_wait_s, model=(model_key(self.model.model_dir), self.model.model_dir.name))
        return LocalStageBackend(LocalLaunchConfig(
            num_stages=opt.num_stages, log_level=opt.log_level, threads_per_stage=opt.threads_per_stage,
            env={SECRET_ENV: self.control_secret, **(self.tls.env() if self.tls else {})},
            extra_args=("--rejoin-wait-s", str(rejoin_wait_s)) if rejoin_wait_s else ()))

    def _start(self) -> None:
        opt, m = self.options, self.model
        for line in self.placement():
            log.info("%s", line)
        self.backend = self._make_backend()
        addresses = self.backend.start()
        master_addr, port = self.backend.master_addr, self._data_port()
        self.coordinator = Coordinator(coordinator_config(opt, m, master_addr=master_addr, master_port=port),
                                       m.tokenizer, addresses, predictor=self.predictor,
                                       control_secret=self.control_secret, tls=self.tls)
        self.backend.watch(self._on_stage_death(0))
        specs = stage_load_specs(opt, m, master_addr=master_addr, master_port=port, calibrate=opt.calibrates_row_costs)
        self.load_responses = self.coordinator.start(specs)
        if opt.calibrates_row_costs:
            self.row_costs = calibrated_table(self.load_responses)
            self.coordinator.engine.use_row_costs(self.row_costs)
        self._check_health()
        self.coordinator.failover = self._failover(master_addr)

    def _failover(self, master_addr: str) -> StageFailover | None:
        """The coordinator's fail-over hooks ([Note: fail-over]), or None (no restarts allowed): every
        backend restarts one stage (local: a new process; Ray: a new actor in the same bundle;
        multi-node: the stage's node launcher respawns it)."""
        if not self.restart_budget.max_restarts:
            return None
        backend, opt, m = self.backend, self.options, self.model
        return StageFailover(
            budget=RestartLedger(self.restart_budget), restart_stage=backend.restart_stage,
            dead_stages=backend.dead_stages, data_port=self._data_port,
            load_specs=lambda port: stage_load_specs(opt, m, master_addr=master_addr, master_port=port),
            pause_watch=backend.pause_watch,
            resume_watch=lambda: backend.watch(self._on_stage_death(self.coordinator.generation)))

    def _check_health(self) -> None:
        """Every stage must report SERVING before any work is admitted. Raises PipelineError."""
        for i, health in enumerate(self.coordinator.health()):
            if health.status != pb.HealthResponse.SERVING:
                raise PipelineError(f"{self.backend.describe(i)} is not healthy after start-up: "
                                    f"{pb.HealthResponse.Status.Name(health.status)} {health.message}".rstrip())

    def _on_stage_death(self, generation: int):
        """The backend's death callback of the stages of data-plane `generation`: a death reported
        late, after a fail-over replaced that ring, is dropped (it would spend another restart)."""
        def died(stage_index: int, description: str) -> None:
            if self.coordinator is not None:
                self.coordinator.fail(PipelineError(description), generation=generation)
        return died

    def _data_port(self) -> int:
        """The backend's rendezvous port for the next data-plane group, held until rank 0 joins
        ([Note: held rendezvous port] in workers/channel.py); `close` releases it if none did."""
        port = self.backend.data_port()
        self._data_ports.append((self.backend.master_addr, port))
        return port

    def stop_stages(self) -> None:
        """Stop every stage worker now, for any backend, and keep the coordinator (a fenced server
        answers 503 until it is stopped): local processes are killed; Ray actors are killed and their
        placement group removed, freeing the cluster's resources. `close` still runs the rest."""
        if self.backend is not None:
            self.backend.stop()

    def close(self, *, failure: BaseException | None = None) -> None:
        """Stop the coordinator and every stage worker; idempotent. `failure`: why the run ended
        badly (multi-node: the other nodes then exit non-zero too)."""
        for host, port in self._data_ports:
            release_listener(host, port)
        self._data_ports.clear()
        if failure is not None and self.options.placement.multi_node and self.backend is not None:
            why = str(failure) or ("interrupted (Ctrl-C)" if isinstance(failure, KeyboardInterrupt)
                                   else type(failure).__name__)
            self.backend.mark_failed(why)  # MultiNodeStages
        if self.backend is not None:
            self.backend.unwatch()
        if self.coordinator is not None:
            try:
                self.coordinator.shutdown()
            except Exception as exc:  # noqa: BLE001 - teardown must go on
                log.warning("coordinator shutdown: %s", exc)
            self.coordinator = None
        if self.backend is not None:
            self.backend.stop()
            self.backend = None
