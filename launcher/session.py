"""Pipeline session: validate a launch request, place the stages, start the coordinator, tear down.

Owns the order of start-up (validate everything that can be validated *before* any process is
spawned, so bad input leaves nothing behind), the choice of placement backend (local processes, Ray
actors, or the torchrun-style multi-node mode; see launcher/placement.py), the health check before
any work is admitted, and teardown on every exit path. Serving and benchmarking front ends reuse it.
Must not: parse command lines (launcher/cli.py) or format output.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from launcher.coordinator import Coordinator, CoordinatorConfig, PipelineError
from launcher.local_backend import LocalStageBackend
from launcher.local_launch_config import LocalLaunchConfig
from launcher.placement import PlacementOptions, StageBackend, node_stages
from launcher.predictor_select import choose_exit_predictor, exit_head_rows
from launcher.stage_processes import LocalStageProcesses
from pipeline.config import ModelConfig
from pipeline.draft_gate import DraftGate
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.partition import (
    LayerRange,
    balanced_split,
    head_cost_layers,
    parse_layer_split,
    split_from_sizes,
)
from pipeline.predictor_file import SHIPPED_DIR, ModelIdentity, load_predictor, model_identity
from pipeline.predictors import PREDICTORS, Predictor, is_predictor_file, make_predictor
from pipeline.tokenizer import Tokenizer
from pipeline.weights import CheckpointReader, stage_tensor_names
from proto import speedpipe_pb2 as pb
from workers.control_auth import SECRET_ENV, TlsFiles, new_secret
from workers.convert import DTYPE_CHOICES, StageLoadSpec

log = logging.getLogger("speedpipe.launch")

SPECULATE_MODES = ("none", "speed", "firp", "speed+firp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Where and how to run the pipeline (everything except the requests)."""

    num_stages: int = 2
    model: str = DEFAULT_MODEL
    layer_split: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    threads_per_stage: int = 1
    stage_timeout_s: float = 120.0
    log_level: str = "WARNING"
    cache_dir: str | None = None
    progress: bool = True
    speculate: str = "none"
    predictor: str = "hybrid"  # a name in PREDICTORS or a trained predictor file (*.safetensors)
    exit_predictor: str | None = None  # trained early-exit file for early-exit / hybrid (default: shipped)
    exit_layer: int | None = None  # None = last layer of stage 0
    max_inflight: int = 0  # per sequence; 0 = num_stages
    min_acceptance: float | None = None  # adaptive drafting threshold; None = break-even for num_stages
    placement: PlacementOptions = dataclasses.field(default_factory=PlacementOptions)
    record_timeline: bool = True  # per-item stage timings (off: measure the recording overhead)
    firp_k: int | None = None  # FIRP drafts per chain; None = all maps of the file
    firp_file: str | None = None  # None = the shipped file for the model
    firp_min_prob: float = 0.0  # FIRP drafts carried only while at least this probable

    @property
    def uses_speed(self) -> bool:
        """SPEED run-ahead drafts are on (`speed` or `speed+firp`)."""
        return self.speculate in ("speed", "speed+firp")

    @property
    def uses_firp(self) -> bool:
        """FIRP chains are on (`firp` or `speed+firp`)."""
        return self.speculate in ("firp", "speed+firp")

    def __post_init__(self) -> None:
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.speculate!r}")
        if self.firp_k is not None and self.firp_k < 1:
            raise ValueError(f"--firp-k must be >= 1, got {self.firp_k}")
        if not 0.0 <= self.firp_min_prob <= 1.0:
            raise ValueError(f"--firp-min-prob must be in [0, 1], got {self.firp_min_prob}")
        if self.predictor not in PREDICTORS and not is_predictor_file(self.predictor):
            raise ValueError(f"--predictor must be one of {', '.join(PREDICTORS)} or a trained predictor file "
                             f"(*.safetensors), got {self.predictor!r}")
        if self.max_inflight < 0:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
        if self.min_acceptance is not None and not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"--min-acceptance must be 'auto' or in [0, 1], got {self.min_acceptance}")
        if self.num_stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.num_stages}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device on this machine")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.threads_per_stage < 1:
            raise ValueError(f"--threads-per-stage must be >= 1, got {self.threads_per_stage}")
        if self.stage_timeout_s <= 0:
            raise ValueError(f"--stage-timeout-s must be > 0, got {self.stage_timeout_s}")
        if self.placement.multi_node:  # every node runs at least one stage
            node_stages(num_stages=self.num_stages, nnodes=self.placement.nnodes, node_rank=self.placement.node_rank)


@dataclasses.dataclass(frozen=True)
class FirpSetup:
    """FIRP maps for the run: the predictor file's bytes, its layer, and how many maps are used."""

    file_bytes: bytes = dataclasses.field(repr=False)
    layer: int = -1
    k: int = 0


def shipped_firp_file(identity: ModelIdentity, exit_layer: int, folder: Path = SHIPPED_DIR) -> Path | None:
    """The shipped FIRP file for this model (pipeline/assets/predictors/<model>-<hash12>-firp-L<layer>-k<k>):
    the one at `exit_layer` if shipped, else the one at the nearest layer; None if none is shipped."""
    files = sorted(folder.glob(f"{identity.name}-{identity.hash[:12]}-firp-L*.safetensors"))
    layers = {int(f.name.split("-firp-L")[1].split("-")[0].split(".")[0]): f for f in files}
    return layers[min(layers, key=lambda layer: (abs(layer - exit_layer), layer))] if layers else None


def default_firp_k(meta: dict) -> int:
    """--firp-k when not given: the shortest chain whose held-out accepted drafts per pass (the file's
    eval) is within 0.02 of the best (longer chains cost pseudo rows for almost nothing), else all maps."""
    per_pass = {int(k): float(v) for k, v in meta.get("eval", {}).get("accepted_per_pass", {}).items()
                if int(k) <= int(meta["k"])}
    if not per_pass:
        return int(meta["k"])
    best = max(per_pass.values())
    return min(k for k, v in per_pass.items() if v >= best - 0.02)


def resolve_firp(options: PipelineOptions, model_dir: Path, config: ModelConfig, exit_layer: int) -> FirpSetup:
    """Load and check the FIRP file (--firp-file, else the shipped one nearest to `exit_layer`).
    Raises ValueError / FileNotFoundError naming the problem (no file, wrong model, too few maps)."""
    identity = model_identity(model_dir, config)
    path = options.firp_file or shipped_firp_file(identity, exit_layer)
    if path is None:
        raise ValueError(f"--speculate {options.speculate} needs --firp-file PATH: no FIRP maps are shipped for "
                         f"model {identity.name!r} (train them with `speedpipe train-predictor --kind firp`)")
    pred = load_predictor(path, expect=identity, kind="firp")
    k = default_firp_k(pred.meta) if options.firp_k is None else options.firp_k
    if k > int(pred.meta["k"]):
        raise ValueError(f"--firp-k {k} is more than the {pred.meta['k']} maps in {path}")
    if not 0 <= pred.exit_layer < config.num_hidden_layers:
        raise ValueError(f"FIRP file {path} has layer {pred.exit_layer}, outside the model's {config.num_hidden_layers}")
    return FirpSetup(Path(path).read_bytes(), pred.exit_layer, k)


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """A validated model: folder, architecture, tokenizer and the per-stage layer ranges."""

    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer
    ranges: list[LayerRange]
    exit_layer: int
    firp: FirpSetup | None = None
    exit_predictor: bytes = b""  # trained early-exit predictor file for the exit stage; b"" = logit lens
    predictor_note: str = ""  # what the exit head is, for the user

    @property
    def exit_stage(self) -> int:
        """Index of the stage holding the exit layer."""
        return next(i for i, r in enumerate(self.ranges) if self.exit_layer in r)


def stage_extra_cost(options: PipelineOptions, config: ModelConfig, *, exit_rows: int | None = None) -> list[float]:
    """Per-stage cost beyond its decoder layers, in layer units: the LM head on the last stage, and an
    exit head on stage 0 when speculation uses one there ([Note: partition cost]). exit_rows: the
    LM-head rows the exit head scores (a trained head's draft vocabulary; default the whole vocabulary)."""
    h, d = config.hidden_size, config.head_dim
    layer_params = (h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
                    + 3 * h * config.intermediate_size)
    head = head_cost_layers(vocab_size=config.vocab_size, hidden_size=h, layer_params=layer_params)
    extra = [0.0] * options.num_stages
    extra[-1] += head
    if _stage0_exit_head(options):
        extra[0] += head * (exit_rows or config.vocab_size) / config.vocab_size
    return extra


def _stage0_exit_head(options: PipelineOptions) -> bool:
    return options.uses_speed and options.exit_layer is None and make_predictor(options.predictor).needs_exit_head


def default_split(options: PipelineOptions, config: ModelConfig, model_dir: Path) -> list[LayerRange]:
    """The balanced split, costing the exit head by the draft vocabulary of the head it will run.

    The exit layer (last layer of stage 0) picks the head and the head's cost moves the split, so
    every exit layer is tried: a layer is consistent when the split costed with that layer's head
    ends stage 0 there. The cheapest consistent split wins (ties: the earlier exit layer); without
    one, the whole-vocabulary split ([Note: partition cost] in pipeline/partition.py)."""
    def split(rows: int) -> tuple[float, list[LayerRange]]:
        extra = stage_extra_cost(options, config, exit_rows=rows)
        ranges = balanced_split(config.num_hidden_layers, options.num_stages, extra_cost=extra)
        return max(len(r) + c for r, c in zip(ranges, extra, strict=True)), ranges

    fallback = split(config.vocab_size)[1]
    if not _stage0_exit_head(options):
        return fallback
    consistent = []
    for layer in range(config.num_hidden_layers - 1):
        rows = exit_head_rows(predictor=options.predictor, exit_predictor=options.exit_predictor,
                              model_dir=model_dir, config=config, exit_layer=layer)
        cost, ranges = split(rows)
        if ranges[0].stop - 1 == layer:
            consistent.append((cost, layer, ranges))
    return min(consistent, key=lambda c: c[:2])[2] if consistent else fallback


def resolve(options: PipelineOptions) -> ResolvedModel:
    """Resolve and validate the model and split. Raises ValueError / FileNotFoundError (user errors)."""
    model_dir = resolve_model(options.model, cache_dir=options.cache_dir, progress=options.progress)
    config = ModelConfig.from_model_dir(model_dir)
    if options.layer_split:
        ranges = split_from_sizes(parse_layer_split(options.layer_split), config.num_hidden_layers)
        if len(ranges) != options.num_stages:
            raise ValueError(f"--layer-split {options.layer_split} has {len(ranges)} stages, but --stages is "
                             f"{options.num_stages}")
    else:
        ranges = default_split(options, config, model_dir)
    reader = CheckpointReader(model_dir)
    for i, r in enumerate(ranges):  # every stage's tensors exist and the files' headers are sound
        reader.nbytes(stage_tensor_names(config, r, is_first=i == 0, is_last=i == len(ranges) - 1))
    exit_layer = ranges[0].stop - 1 if options.exit_layer is None else options.exit_layer
    if options.uses_speed:
        if options.num_stages < 2:
            raise ValueError(f"--speculate {options.speculate} needs --stages >= 2 (one stage has no idle stage "
                             f"for drafts to fill)")
        if not 0 <= exit_layer < config.num_hidden_layers - 1:
            raise ValueError(f"--exit-layer {exit_layer} must be in [0, {config.num_hidden_layers - 1}) "
                             f"(a layer before the model's last)")
    choice = None
    if options.uses_speed and make_predictor(options.predictor).needs_exit_head:
        choice = choose_exit_predictor(predictor=options.predictor, exit_predictor=options.exit_predictor,
                                       model_dir=model_dir, config=config, exit_layer=exit_layer)
    firp = resolve_firp(options, model_dir, config, exit_layer) if options.uses_firp else None
    return ResolvedModel(model_dir, config, Tokenizer(model_dir), ranges, exit_layer, firp,
                         exit_predictor=choice.file_bytes if choice else b"", predictor_note=choice.note if choice else "")


class PipelineSession:
    """Context manager: spawn the stage workers, load them, start the coordinator; stop all on exit.

    Raises PipelineError if a stage fails to start or load (naming the stage).
    """

    def __init__(self, options: PipelineOptions, model: ResolvedModel, *, predictor: Predictor | None = None,
                 tls: TlsFiles | None = None) -> None:
        """predictor: a Predictor object overriding options.predictor on the coordinator side;
        tls: TLS files of the stages' control plane (serve --tls-cert/--tls-key)."""
        self.tls = tls
        self.predictor = predictor
        self.options = options
        self.model = model
        self.backend: StageBackend | None = None
        self.coordinator: Coordinator | None = None
        self.load_responses = []
        self.control_secret = new_secret()  # [Note: control-plane secret] in workers/control_auth.py

    def __enter__(self) -> PipelineSession:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _needs_exit_head(self) -> bool:
        """Whether the exit stage must run an exit head and report exit events (predictors that
        draft from the context alone, like ngram, draft at send time instead)."""
        if not self.options.uses_speed:
            return False
        predictor = self.predictor or make_predictor(self.options.predictor)
        return predictor.needs_exit_head

    def placement(self) -> list[str]:
        """One line per stage: which layers (and which extra modules) it holds."""
        m, lines = self.model, []
        for i, r in enumerate(m.ranges):
            extra = [name for name, holds in (("embedding", i == 0), ("final norm + LM head", i == len(m.ranges) - 1),
                     (f"{'trained ' if m.exit_predictor else ''}exit head after layer {m.exit_layer}",
                      self._needs_exit_head and i == m.exit_stage),
                     (f"FIRP maps (k={m.firp.k}) after layer {m.firp.layer}" if m.firp else "",
                      m.firp is not None and m.firp.layer in r))
                     if holds]
            lines.append(f"stage {i}: layers {r} ({len(r)})" + "".join(f" + {e}" for e in extra))
        return lines

    @property
    def processes(self) -> LocalStageProcesses | None:
        """The local stage processes (local backend only; None otherwise)."""
        return self.backend.processes if isinstance(self.backend, LocalStageBackend) else None

    def _make_backend(self) -> StageBackend:
        opt = self.options
        if opt.placement.backend == "ray":
            from launcher.ray_backend import RayStageActors  # ray is imported only there

            return RayStageActors(num_stages=opt.num_stages, placement=opt.placement, device=opt.device,
                                  log_level=opt.log_level, threads_per_stage=opt.threads_per_stage,
                                  control_secret=self.control_secret, tls=self.tls)
        if opt.placement.multi_node:
            from launcher.multinode import MultiNodeStages

            return MultiNodeStages(num_stages=opt.num_stages, placement=opt.placement, log_level=opt.log_level,
                                   threads_per_stage=opt.threads_per_stage, control_secret=self.control_secret,
                                   tls=self.tls)
        return LocalStageBackend(LocalLaunchConfig(
            num_stages=opt.num_stages, log_level=opt.log_level, threads_per_stage=opt.threads_per_stage,
            env={SECRET_ENV: self.control_secret, **(self.tls.env() if self.tls else {})}))

    def _start(self) -> None:
        opt, m = self.options, self.model
        for line in self.placement():
            log.info("%s", line)
        self.backend = self._make_backend()
        addresses = self.backend.start()
        master_addr, port = self.backend.master_addr, self.backend.data_port()
        self.coordinator = Coordinator(CoordinatorConfig(
            num_stages=opt.num_stages, max_num_seqs=opt.max_num_seqs, max_model_len=opt.max_model_len,
            stage_timeout_s=opt.stage_timeout_s, dist_master_addr=master_addr, dist_master_port=port,
            device=opt.device, speculate=opt.uses_speed, predictor=opt.predictor,
            exit_stage=m.exit_stage if self._needs_exit_head else -1, max_inflight=opt.max_inflight,
            min_acceptance=(DraftGate.break_even(opt.num_stages) if opt.min_acceptance is None
                            else opt.min_acceptance), record_timeline=opt.record_timeline,
            firp_k=m.firp.k if m.firp else 0, firp_min_prob=opt.firp_min_prob), m.tokenizer, addresses,
            predictor=self.predictor, control_secret=self.control_secret, tls=self.tls)
        self.backend.watch(self._on_stage_death)
        specs = [StageLoadSpec(
            model_dir=str(m.model_dir), stage_index=i, num_stages=opt.num_stages, layer_range=r, dtype=opt.dtype,
            device=opt.device, max_num_seqs=opt.max_num_seqs, max_model_len=opt.max_model_len,
            num_threads=opt.threads_per_stage, dist_master_addr=master_addr, dist_master_port=port,
            stage_timeout_s=opt.stage_timeout_s,
            exit_layer=m.exit_layer if self._needs_exit_head else -1,
            predictor=opt.predictor if opt.uses_speed else "",
            exit_predictor=m.exit_predictor if self._needs_exit_head and i == m.exit_stage else b"",
            firp_layer=m.firp.layer if m.firp else -1, firp_k=m.firp.k if m.firp else 0,
            firp_file=m.firp.file_bytes if m.firp and m.firp.layer in r else b"") for i, r in enumerate(m.ranges)]
        self.load_responses = self.coordinator.start(specs)
        self._check_health()

    def _check_health(self) -> None:
        """Every stage must report SERVING before any work is admitted. Raises PipelineError."""
        for i, health in enumerate(self.coordinator.health()):
            if health.status != pb.HealthResponse.SERVING:
                raise PipelineError(f"{self.backend.describe(i)} is not healthy after start-up: "
                                    f"{pb.HealthResponse.Status.Name(health.status)} {health.message}".rstrip())

    def _on_stage_death(self, stage_index: int, description: str) -> None:
        if self.coordinator is not None:
            self.coordinator.fail(PipelineError(description))

    def close(self) -> None:
        """Stop the coordinator and every stage worker; idempotent."""
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
