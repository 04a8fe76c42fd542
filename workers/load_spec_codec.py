"""The one conversion point between protobuf control-plane messages and domain types.

Owns the to/from-protobuf functions of `StageLoadSpec` (pipeline/engine/stage_assembly.py: what a stage
worker needs to load and join the pipeline). Must not: do any I/O.
"""

from __future__ import annotations

from pipeline.engine.stage_assembly import SpecBookkeepingError, StageLoadSpec
from pipeline.model.partition import LayerRange
from proto import speedpipe_pb2 as pb


def spec_to_proto(spec: StageLoadSpec) -> pb.LoadStageRequest:
    """Domain spec -> LoadStageRequest (always writes exit_layer and firp_layer, -1 for none)."""
    return pb.LoadStageRequest(
        model_dir=spec.model_dir, stage_index=spec.stage_index, num_stages=spec.num_stages,
        layer_start=spec.layer_range.start, layer_stop=spec.layer_range.stop, dtype=spec.dtype,
        device=spec.device, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
        num_threads=spec.num_threads, dist_rank=spec.dist_rank, dist_world_size=spec.dist_world_size,
        dist_master_addr=spec.dist_master_addr, dist_master_port=spec.dist_master_port,
        stage_timeout_s=spec.stage_timeout_s, exit_layer=spec.exit_layer, exit_predictor=spec.exit_predictor,
        firp_layer=spec.firp_layer, firp_k=spec.firp_k, firp_file=spec.firp_file, quantization=spec.quantization,
        calibrate_max_rows=spec.calibrate_max_rows, tree_scratch=spec.tree_scratch, dense_layout=spec.dense_layout,
    )


def spec_from_proto(req: pb.LoadStageRequest) -> StageLoadSpec:
    """LoadStageRequest -> domain spec. Raises ValueError on inconsistent fields: SpecBookkeepingError
    for those the coordinator derives (stage index, layer range, ranks; see StageLoadSpec)."""
    try:
        layers = LayerRange(req.layer_start, req.layer_stop)
    except ValueError as exc:
        raise SpecBookkeepingError(str(exc)) from None
    spec = StageLoadSpec(
        model_dir=req.model_dir, stage_index=req.stage_index, num_stages=req.num_stages,
        layer_range=layers, dtype=req.dtype, device=req.device,
        max_num_seqs=req.max_num_seqs, max_model_len=req.max_model_len, num_threads=req.num_threads,
        dist_master_addr=req.dist_master_addr, dist_master_port=req.dist_master_port,
        stage_timeout_s=req.stage_timeout_s, exit_layer=req.exit_layer, exit_predictor=req.exit_predictor,
        firp_layer=req.firp_layer, firp_k=req.firp_k, firp_file=req.firp_file, quantization=req.quantization or "none",
        calibrate_max_rows=req.calibrate_max_rows, tree_scratch=req.tree_scratch,
        dense_layout=req.dense_layout or "reference",
    )
    if (req.dist_rank, req.dist_world_size) != (spec.dist_rank, spec.dist_world_size):
        raise SpecBookkeepingError(f"dist rank/world {req.dist_rank}/{req.dist_world_size} disagree with stage "
                         f"{spec.stage_index} of {spec.num_stages}")
    return spec
