"""The one conversion point between protobuf control-plane messages and domain types.

Owns `StageLoadSpec` (what a stage worker needs to load and join the pipeline) and its
to/from-protobuf functions. Must not: do any I/O.
"""

from __future__ import annotations

import dataclasses

from pipeline.partition import LayerRange
from proto import speedpipe_pb2 as pb

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageLoadSpec:
    """Everything one stage worker needs to load its weights and join the data plane.

    Ranks: the coordinator is rank 0 and stage i is rank i + 1 of `dist_world_size` = S + 1.
    `exit_layer` -1 means no early-exit predictor on this stage. `exit_predictor` holds the bytes of
    a trained early-exit predictor file (pipeline/predictor_file.py) for the exit head, or b"".
    `firp_layer` -1 / `firp_k` 0 mean FIRP off; `firp_file` (predictor-file bytes) is sent only to
    the stage holding firp_layer.
    """

    model_dir: str
    stage_index: int
    num_stages: int
    layer_range: LayerRange
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 8
    max_model_len: int = 2048
    num_threads: int = 1
    dist_master_addr: str = "127.0.0.1"
    dist_master_port: int = 29500
    dist_backend: str = "gloo"
    stage_timeout_s: float = 120.0
    exit_layer: int = -1
    predictor: str = ""
    exit_predictor: bytes = b""  # trained early-exit predictor file bytes; empty = logit lens
    firp_layer: int = -1
    firp_k: int = 0
    firp_file: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} out of range [0, {self.num_stages})")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.stage_timeout_s <= 0:
            raise ValueError(f"--stage-timeout-s must be > 0, got {self.stage_timeout_s}")
        if self.firp_k < 0 or (self.firp_k > 0) != (self.firp_layer >= 0):
            raise ValueError(f"FIRP needs both firp_layer and firp_k (got {self.firp_layer}, {self.firp_k})")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def dist_rank(self) -> int:
        return self.stage_index + 1

    @property
    def dist_world_size(self) -> int:
        return self.num_stages + 1


def spec_to_proto(spec: StageLoadSpec) -> pb.LoadStageRequest:
    """Domain spec -> LoadStageRequest (always writes exit_layer, -1 for none)."""
    return pb.LoadStageRequest(
        model_dir=spec.model_dir, stage_index=spec.stage_index, num_stages=spec.num_stages,
        layer_start=spec.layer_range.start, layer_stop=spec.layer_range.stop, dtype=spec.dtype,
        device=spec.device, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
        num_threads=spec.num_threads, dist_rank=spec.dist_rank, dist_world_size=spec.dist_world_size,
        dist_master_addr=spec.dist_master_addr, dist_master_port=spec.dist_master_port,
        dist_backend=spec.dist_backend, stage_timeout_s=spec.stage_timeout_s, exit_layer=spec.exit_layer,
        predictor=spec.predictor, exit_predictor=spec.exit_predictor, firp_layer=spec.firp_layer, firp_k=spec.firp_k,
        firp_file=spec.firp_file,
    )


def spec_from_proto(req: pb.LoadStageRequest) -> StageLoadSpec:
    """LoadStageRequest -> domain spec. Raises ValueError on inconsistent fields."""
    spec = StageLoadSpec(
        model_dir=req.model_dir, stage_index=req.stage_index, num_stages=req.num_stages,
        layer_range=LayerRange(req.layer_start, req.layer_stop), dtype=req.dtype, device=req.device,
        max_num_seqs=req.max_num_seqs, max_model_len=req.max_model_len, num_threads=req.num_threads,
        dist_master_addr=req.dist_master_addr, dist_master_port=req.dist_master_port,
        dist_backend=req.dist_backend, stage_timeout_s=req.stage_timeout_s, exit_layer=req.exit_layer,
        predictor=req.predictor, exit_predictor=req.exit_predictor, firp_layer=req.firp_layer, firp_k=req.firp_k,
        firp_file=req.firp_file,
    )
    if (req.dist_rank, req.dist_world_size) != (spec.dist_rank, spec.dist_world_size):
        raise ValueError(f"dist rank/world {req.dist_rank}/{req.dist_world_size} disagree with stage "
                         f"{spec.stage_index} of {spec.num_stages}")
    return spec
