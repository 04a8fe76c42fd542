"""Stage assembly: build one stage's model, KV cache, exit head and FIRP maps from its load spec.

Owns `StageLoadSpec` (what one stage worker is told to load: the stage view of the run
configuration, launcher/coordinator/session.py derives it) and `assemble_stage`, which reads only this stage's
tensors and returns a ready `StageExecutor`. Pure of processes: no gRPC, no torch.distributed
(workers/stage_worker.py serves the result; workers/load_spec_codec.py maps the spec to protobuf).
"""

from __future__ import annotations

import dataclasses
import errno

import torch

from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import rank_of_stage, world_size
from pipeline.model.config import MODEL_DTYPES, ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import StageModel
from pipeline.speculation.drafting.drafter import DRAFTER_ARCH
from pipeline.speculation.drafting.exit_tensors import exit_map_from_tensors
from pipeline.speculation.drafting.layer_drafter import NEXT_LAYER_ARCH, build_draft_layer, split_tensors
from pipeline.speculation.firp import FirpMaps
from pipeline.speculation.items import MAX_TREE_SCRATCH
from pipeline.speculation.predictor_file import load_predictor_bytes
from pipeline.speculation.predictors import ExitHead
from pipeline.weights.checkpoint import CheckpointReader, read_norm_and_head
from pipeline.weights.dense_layout import validate_dense_layout
from pipeline.weights.quant import validate_quantization
from pipeline.weights.quant_load import activation_dtype, load_stage_model


class SpecBookkeepingError(ValueError):
    """A StageLoadSpec whose fields that only the coordinator's own bookkeeping sets are inconsistent:
    a stage index outside [0, num_stages), an invalid layer range, distributed ranks that disagree with
    the stage, FIRP's layer without its k, a calibration size out of range. Never the user's input
    (their model files and settings are checked with plain ValueError): a bug, or a coordinator of
    another version; a stage answers it FAILED_PRECONDITION, and `launch` exits 1."""


# [Note: the user's files or the machine]
# An OSError while a model loads is the user's input (exit 2) only when it says a file they named is
# missing or unreadable: no such file (our own FileNotFoundError carries no errno), no permission, a
# folder where a file belongs or the reverse, a symlink loop, a name too long. Anything else (EMFILE
# "Too many open files", ENFILE, ENOMEM, ENOSPC, EIO, EAGAIN, ...) is a limit or fault of the machine
# the stage runs on: an internal error (exit 1), reported by `machine_error` naming the errno.
USER_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
USER_FILE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP,
                              errno.ENAMETOOLONG})


def is_user_file_error(exc: OSError) -> bool:
    """Whether `exc` is about a file the user named ([Note: the user's files or the machine])."""
    return isinstance(exc, USER_FILE_ERRORS) or exc.errno in USER_FILE_ERRNOS


def machine_error(exc: OSError) -> str:
    """One line for an OSError that is not the user's files: its type and message, and the errno's
    name when it has one, e.g. "OSError: [Errno 24] Too many open files: 'x' (EMFILE: a limit or
    fault of this machine, not of the model's files)"."""
    name = errno.errorcode.get(exc.errno) if exc.errno is not None else None
    why = f" ({name}: a limit or fault of this machine, not of the model's files)" if name else ""
    return f"{type(exc).__name__}: {exc}{why}"

@dataclasses.dataclass(frozen=True, kw_only=True)
class StageLoadSpec:
    """Everything one stage worker needs to load its weights and join the data plane.

    Ranks: the coordinator is rank 0 and stage i is rank i + 1 of `dist_world_size` = S + 1.
    `exit_layer`: the pipeline's exit layer when it runs an exit head (the stage holding it runs
    the head after that layer and reports exit guesses), -1 for none. `exit_predictor` holds the
    bytes of a trained early-exit predictor file (pipeline/speculation/predictor_file.py) for the exit head, or
    b"" (the untrained logit lens). `firp_layer` -1 / `firp_k` 0 mean FIRP off; `firp_file`
    (predictor-file bytes) is sent only to the stage holding firp_layer.
    Raises ValueError naming the field for inconsistent values (the spec may come off the wire):
    SpecBookkeepingError for the fields the coordinator derives (stage_index, FIRP's pair), plain
    ValueError for the user's settings (dtype, quantization, dense_layout, stage_timeout_s, tree_scratch).
    """

    model_dir: str
    stage_index: int
    num_stages: int
    layer_range: LayerRange
    dtype: str = "float32"
    quantization: str = "none"  # pipeline/weights/quant.py [Note: numeric modes]
    dense_layout: str = "reference"  # pipeline/weights/dense_layout.py [Note: dense layout]
    device: str = "cpu"
    max_num_seqs: int = 8
    max_model_len: int = 2048
    num_threads: int = 1
    dist_master_addr: str = "127.0.0.1"
    dist_master_port: int = 29500
    stage_timeout_s: float = 120.0
    exit_layer: int = -1
    exit_predictor: bytes = b""
    firp_layer: int = -1
    firp_k: int = 0
    firp_file: bytes = b""
    calibrate_max_rows: int = 0  # > 0: time 1..N-row passes after loading (pipeline/measure/stage_calibration.py)
    tree_scratch: int = 0  # token-tree KV scratch positions per slot, allocated at load (tree.py `scratch_positions`)

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < self.num_stages:
            raise SpecBookkeepingError(f"stage_index {self.stage_index} out of range [0, {self.num_stages})")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        validate_quantization(self.quantization)
        validate_dense_layout(self.dense_layout, quantization=self.quantization, dtype=self.dtype, device=self.device)
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s must be > 0, got {self.stage_timeout_s}")
        if not 0 <= self.tree_scratch <= MAX_TREE_SCRATCH:
            raise ValueError(f"tree_scratch must be in [0, {MAX_TREE_SCRATCH}], got {self.tree_scratch}")
        if self.firp_k < 0 or (self.firp_k > 0) != (self.firp_layer >= 0):
            raise SpecBookkeepingError(f"FIRP needs both firp_layer and firp_k (got {self.firp_layer}, {self.firp_k})")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def dist_rank(self) -> int:
        return rank_of_stage(self.stage_index)

    @property
    def dist_world_size(self) -> int:
        return world_size(self.num_stages)

    @property
    def holds_exit_head(self) -> bool:
        """This stage runs the exit head (the pipeline has one, after a layer of this stage)."""
        return self.exit_layer >= 0 and self.exit_layer in self.layer_range

    @property
    def holds_firp_maps(self) -> bool:
        """This stage runs the FIRP maps (FIRP is on and firp_layer is one of its layers)."""
        return self.firp_k > 0 and self.firp_layer in self.layer_range

    @property
    def torch_dtype(self) -> torch.dtype:
        return MODEL_DTYPES[self.dtype]

    @property
    def activation_dtype(self) -> torch.dtype:
        """Dtype of this stage's activations (and of its exit head and FIRP maps): `dtype` for dense
        weights, bfloat16 for the quantised modes (pipeline/weights/quant_load.py)."""
        return activation_dtype(self.quantization, self.model_dir, self.torch_dtype, self.device)


@dataclasses.dataclass(frozen=True)
class AssembledStage:
    """A loaded stage: its executor (model, KV cache, exit head, FIRP maps), the bytes of the
    parameters it holds in the loaded dtype, and the checkpoint tensor names it read (sorted)."""

    executor: StageExecutor
    weights_bytes: int
    tensor_names: list[str]


def _param_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights: its parameters and persistent buffers (quantised weights are
    buffers; RoPE tables are not persistent and not counted; a tied tensor counts once)."""
    tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def assemble_stage(spec: StageLoadSpec) -> AssembledStage:
    """Read this stage's tensors from `spec.model_dir` (only its own) and build the StageExecutor.

    Raises ValueError / FileNotFoundError / OSError naming the problem (missing tensors, a bad
    predictor file, a FIRP or exit predictor that does not fit the model).
    """
    config = ModelConfig.from_model_dir(spec.model_dir)
    reader = CheckpointReader(spec.model_dir)
    model = load_stage_model(spec.model_dir, spec.layer_range, is_first=spec.is_first, is_last=spec.is_last,
                             quantization=spec.quantization, dtype=spec.torch_dtype, device=spec.device,
                             reader=reader, dense_layout=spec.dense_layout)
    exit_head = build_exit_head(config, reader, spec, model=model) if spec.holds_exit_head else None
    kv = model.new_kv_cache(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, num_scratch=spec.tree_scratch)
    firp_maps = None
    if spec.holds_firp_maps:
        pred = load_predictor_bytes(spec.firp_file, kind="firp", exit_layer=spec.firp_layer,
                                    where=f"FIRP file for stage {spec.stage_index}")
        firp_maps = FirpMaps.from_predictor(pred, k=spec.firp_k, dtype=spec.activation_dtype, device=spec.device)
    executor = StageExecutor(model, kv, exit_layer=spec.exit_layer if spec.holds_exit_head else None,
                             exit_head=exit_head, firp_layer=spec.firp_layer if spec.firp_k > 0 else None,
                             firp_maps=firp_maps, max_scratch=spec.tree_scratch)
    weights = sum(_param_bytes(m) for m in (model, exit_head, firp_maps) if m is not None)
    return AssembledStage(executor, weights, sorted(reader.read_names))


def build_exit_head(config: ModelConfig, reader: CheckpointReader, spec: StageLoadSpec, *,
                    model: StageModel | None = None) -> ExitHead:
    """Copies of the final norm and LM head (and the final logit soft-cap) for the exit head after
    `spec.exit_layer`, behind the trained map of `spec.exit_predictor` when one was sent (validated:
    kind, exit layer, hidden size), restricted to the file's draft vocabulary when it has one. A
    next-layer file's draft layer is attached to `model` ([Note: next-layer drafter]). Raises ValueError."""
    norm, lm_head = read_norm_and_head(reader, config, dtype=spec.activation_dtype, device=spec.device)
    exit_map, vocab = None, None
    if spec.exit_predictor:
        pred = load_predictor_bytes(spec.exit_predictor, exit_layer=spec.exit_layer, kind="early-exit",
                                    where="exit predictor")
        if pred.meta["model"]["hidden_size"] != config.hidden_size:
            raise ValueError(f"exit predictor has hidden size {pred.meta['model']['hidden_size']}, the model "
                             f"{config.hidden_size}")
        arch, tensors = pred.meta.get("arch", "affine"), pred.tensors
        if arch == NEXT_LAYER_ARCH:
            arch, tensors = DRAFTER_ARCH, _attach_draft_layer(config, spec, tensors, model)
        exit_map = exit_map_from_tensors(tensors, arch=arch, eps=config.rms_norm_eps).to(
            device=spec.device, dtype=spec.activation_dtype)
        vocab = pred.draft_vocab
    with torch.device("meta"):
        head = ExitHead(config.hidden_size, config.vocab_size, config.rms_norm_eps,
                        softcap=config.final_logit_softcapping)
    head.load_state_dict({"norm.weight": norm, "lm_head.weight": lm_head}, assign=True)
    head.exit_map = exit_map
    if vocab is not None:  # [Note: draft vocabulary] in pipeline/speculation/predictors.py
        head.restrict_vocab(vocab)
    return head.eval()



def _attach_draft_layer(config: ModelConfig, spec: StageLoadSpec, tensors: dict[str, torch.Tensor],
                        model: StageModel | None) -> dict[str, torch.Tensor]:
    """Build a next-layer file's draft layer onto `model`; returns the file's swiglu-map tensors."""
    if model is None:
        raise ValueError("a next-layer exit predictor needs the exit stage's model")
    if spec.firp_k > 0:
        raise ValueError("the next-layer drafter does not run with FIRP (--speculate firp / speed+firp): "
                         "use a swiglu or affine exit predictor")
    layer_tensors, rest = split_tensors(tensors)
    model.attach_draft_layer(build_draft_layer(config, spec.exit_layer, layer_tensors, dtype=spec.activation_dtype,
                                               device=spec.device), after=spec.exit_layer)
    return rest
