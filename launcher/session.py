"""Pipeline session: validate a launch request, place the stages, start the coordinator, tear down.

Owns the order of start-up (validate everything that can be validated *before* any process is
spawned, so bad input leaves nothing behind), the local placement backend, and teardown on every
exit path. Serving and benchmarking front ends reuse it.
Must not: parse command lines (launcher/cli.py) or format output.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from launcher.coordinator import Coordinator, CoordinatorConfig, PipelineError
from launcher.local_backend import LocalLaunchConfig, LocalStageProcesses, StageProcessMonitor, free_port
from launcher.predictor_select import choose_exit_predictor
from pipeline.config import ModelConfig
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.partition import (
    LayerRange,
    balanced_split,
    head_cost_layers,
    parse_layer_split,
    split_from_sizes,
)
from pipeline.predictors import PREDICTORS, Predictor, is_predictor_file, make_predictor
from pipeline.tokenizer import Tokenizer
from pipeline.weights import CheckpointReader, stage_tensor_names
from workers.convert import DTYPE_CHOICES, StageLoadSpec

log = logging.getLogger("speedpipe.launch")

SPECULATE_MODES = ("none", "speed")


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

    def __post_init__(self) -> None:
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.speculate!r}")
        if self.predictor not in PREDICTORS and not is_predictor_file(self.predictor):
            raise ValueError(f"--predictor must be one of {', '.join(PREDICTORS)} or a trained predictor file "
                             f"(*.safetensors), got {self.predictor!r}")
        if self.max_inflight < 0:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
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


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """A validated model: folder, architecture, tokenizer and the per-stage layer ranges."""

    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer
    ranges: list[LayerRange]
    exit_layer: int
    exit_predictor: bytes = b""  # trained early-exit predictor file for the exit stage; b"" = logit lens
    predictor_note: str = ""  # what the exit head is, for the user

    @property
    def exit_stage(self) -> int:
        """Index of the stage holding the exit layer."""
        return next(i for i, r in enumerate(self.ranges) if self.exit_layer in r)


def stage_extra_cost(options: PipelineOptions, config: ModelConfig) -> list[float]:
    """Per-stage cost beyond its decoder layers, in layer units: the LM head on the last stage, and a
    logit-lens exit head on stage 0 when speculation uses one there ([Note: partition cost])."""
    h, d = config.hidden_size, config.head_dim
    layer_params = (h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
                    + 3 * h * config.intermediate_size)
    head = head_cost_layers(vocab_size=config.vocab_size, hidden_size=h, layer_params=layer_params)
    extra = [0.0] * options.num_stages
    extra[-1] += head
    if options.speculate == "speed" and options.exit_layer is None and make_predictor(options.predictor).needs_exit_head:
        extra[0] += head
    return extra


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
        ranges = balanced_split(config.num_hidden_layers, options.num_stages, extra_cost=stage_extra_cost(options, config))
    reader = CheckpointReader(model_dir)
    for i, r in enumerate(ranges):  # every stage's tensors exist and the files' headers are sound
        reader.nbytes(stage_tensor_names(config, r, is_first=i == 0, is_last=i == len(ranges) - 1))
    exit_layer = ranges[0].stop - 1 if options.exit_layer is None else options.exit_layer
    if options.speculate == "speed":
        if options.num_stages < 2:
            raise ValueError("--speculate speed needs --stages >= 2 (one stage has no idle stage for drafts to fill)")
        if not 0 <= exit_layer < config.num_hidden_layers - 1:
            raise ValueError(f"--exit-layer {exit_layer} must be in [0, {config.num_hidden_layers - 1}) "
                             f"(a layer before the model's last)")
    choice = None
    if options.speculate == "speed" and make_predictor(options.predictor).needs_exit_head:
        choice = choose_exit_predictor(predictor=options.predictor, exit_predictor=options.exit_predictor,
                                       model_dir=model_dir, config=config, exit_layer=exit_layer)
    return ResolvedModel(model_dir, config, Tokenizer(model_dir), ranges, exit_layer,
                         exit_predictor=choice.file_bytes if choice else b"", predictor_note=choice.note if choice else "")


class PipelineSession:
    """Context manager: spawn the stage workers, load them, start the coordinator; stop all on exit.

    Raises PipelineError if a stage fails to start or load (naming the stage).
    """

    def __init__(self, options: PipelineOptions, model: ResolvedModel, *, predictor: Predictor | None = None) -> None:
        """predictor: a Predictor object overriding options.predictor on the coordinator side."""
        self.predictor = predictor
        self.options = options
        self.model = model
        self.processes: LocalStageProcesses | None = None
        self.coordinator: Coordinator | None = None
        self.monitor: StageProcessMonitor | None = None
        self.load_responses = []

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
        if self.options.speculate != "speed":
            return False
        predictor = self.predictor or make_predictor(self.options.predictor)
        return predictor.needs_exit_head

    def placement(self) -> list[str]:
        """One line per stage: which layers (and which extra modules) it holds."""
        m, lines = self.model, []
        for i, r in enumerate(m.ranges):
            extra = [name for name, holds in (("embedding", i == 0), ("final norm + LM head", i == len(m.ranges) - 1),
                     (f"{'trained ' if m.exit_predictor else ''}exit head after layer {m.exit_layer}",
                      self._needs_exit_head and i == m.exit_stage))
                     if holds]
            lines.append(f"stage {i}: layers {r} ({len(r)})" + "".join(f" + {e}" for e in extra))
        return lines

    def _start(self) -> None:
        opt, m = self.options, self.model
        for line in self.placement():
            log.info("%s", line)
        self.processes = LocalStageProcesses(LocalLaunchConfig(
            num_stages=opt.num_stages, log_level=opt.log_level, threads_per_stage=opt.threads_per_stage))
        addresses = self.processes.start()
        port = free_port("127.0.0.1")
        self.coordinator = Coordinator(CoordinatorConfig(
            num_stages=opt.num_stages, max_num_seqs=opt.max_num_seqs, max_model_len=opt.max_model_len,
            stage_timeout_s=opt.stage_timeout_s, dist_master_addr="127.0.0.1", dist_master_port=port,
            device=opt.device, speculate=opt.speculate == "speed", predictor=opt.predictor,
            exit_stage=m.exit_stage if self._needs_exit_head else -1, max_inflight=opt.max_inflight), m.tokenizer, addresses,
            predictor=self.predictor)
        self.monitor = StageProcessMonitor(self.processes, self._on_stage_death)
        self.monitor.start()
        specs = [StageLoadSpec(
            model_dir=str(m.model_dir), stage_index=i, num_stages=opt.num_stages, layer_range=r, dtype=opt.dtype,
            device=opt.device, max_num_seqs=opt.max_num_seqs, max_model_len=opt.max_model_len,
            num_threads=opt.threads_per_stage, dist_master_addr="127.0.0.1", dist_master_port=port,
            stage_timeout_s=opt.stage_timeout_s,
            exit_layer=m.exit_layer if self._needs_exit_head else -1,
            predictor=opt.predictor if opt.speculate == "speed" else "",
            exit_predictor=m.exit_predictor if self._needs_exit_head and i == m.exit_stage else b"")
            for i, r in enumerate(m.ranges)]
        self.load_responses = self.coordinator.start(specs)

    def _on_stage_death(self, stage_index: int, returncode: int) -> None:
        pid = self.processes.pids[stage_index] if self.processes else "?"
        error = PipelineError(f"stage {stage_index} (pid {pid}) exited unexpectedly with code {returncode}")
        if self.coordinator is not None:
            self.coordinator.fail(error)

    def close(self) -> None:
        """Stop the coordinator and every stage process; idempotent."""
        if self.monitor is not None:
            self.monitor.stop()
        if self.coordinator is not None:
            try:
                self.coordinator.shutdown()
            except Exception as exc:  # noqa: BLE001 - teardown must go on
                log.warning("coordinator shutdown: %s", exc)
            self.coordinator = None
        if self.processes is not None:
            self.processes.stop()
            self.processes = None
