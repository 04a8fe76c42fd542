"""Building a stage in a quantised numeric mode ([Note: numeric modes] in pipeline/weights/quant.py).

Owns which checkpoint tensors feed which (fused) linear of a StageModel, where a stage's quantised
weights come from (the GGUF's own blocks for `auto`, the folder's dense tensors requantised for
`int4` / `int8`), and `load_stage_model`, the one entry point the stage worker and the benchmarks
call for every mode. Must not: talk to other processes or pick a split.
"""

from __future__ import annotations

import torch

from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import StageModel, build_stage_model, checkpoint_shapes, set_rope_buffers
from pipeline.model.tensor_names import (
    EMBED_TOKENS,
    LM_HEAD,
    checkpoint_name,
    family_tensor_name,
    head_tensor_name,
)
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from pipeline.weights.dense_layout import apply_dense_layout, release_freed_heap, validate_dense_layout
from pipeline.weights.gguf_blocks import INT4_TYPES, INT8_TYPES, GgufBlockReader, gguf_source_of
from pipeline.weights.quant import (
    ACTIVATION_DTYPE,
    INT4_GROUP_SIZE,
    QuantWeight,
    cat_rows,
    packed_weight_bytes,
    quantize_dense,
    quantize_stage_model,
    validate_quantization,
)

ROUTER = "mlp.gate"  # a mixture-of-experts layer's router module (pipeline/model/moe.py)


def effective_mode(mode: str, model_dir: str, device: str = "cpu") -> str:
    """`auto` becomes `gguf` for a folder converted from a GGUF whose file is still there, else `none`
    (and `none` on a non-CPU device: dense fallback, the int kernels here are torch's CPU ones);
    other modes are returned as they are. Raises ValueError for an unknown mode."""
    validate_quantization(mode)
    if mode != "auto":
        return mode
    if torch.device(device).type != "cpu":
        return "none"
    return "gguf" if gguf_source_of(model_dir) is not None else "none"


def activation_dtype(mode: str, model_dir: str, dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """Dtype of a stage's activations in `mode`: `dtype` for dense weights, else bfloat16."""
    return dtype if effective_mode(mode, model_dir, device) == "none" else ACTIVATION_DTYPE


def fused_linears(config: ModelConfig, layer_range: LayerRange, *, is_last: bool) -> dict[str, list[str]]:
    """Module name of every linear after `fuse` -> the checkpoint weights stacked into it, in order.

    Follows the family's checkpoint layout: phi3's q/k/v and gate/up come fused already
    (`qkv_proj`, `gate_up_proj`); a mixture-of-experts layer has its router (`mlp.gate`) and one
    gate_up / down pair per expert, under the family's names (Mixtral's `block_sparse_moe.experts.{e}.w1`).
    """
    fused_qkv = config.model_type == "phi3"
    out: dict[str, list[str]] = {}
    for i in layer_range:
        p = f"model.layers.{i}"
        out[f"layers.{i}.self_attn.qkv_proj"] = [f"{p}.self_attn.{n}_proj.weight"
                                                 for n in (("qkv",) if fused_qkv else ("q", "k", "v"))]
        out[f"layers.{i}.self_attn.o_proj"] = [f"{p}.self_attn.o_proj.weight"]
        if not config.is_moe_layer(i):
            out |= _mlp_linears(config, f"layers.{i}.mlp", f"{p}.mlp")
            continue
        out[f"layers.{i}.{ROUTER}"] = [family_tensor_name(f"{p}.mlp.gate.weight", config)]
        for e in range(config.num_experts):
            out |= _mlp_linears(config, f"layers.{i}.mlp.experts.{e}", f"{p}.mlp.experts.{e}")
    if is_last:
        out["lm_head"] = [head_tensor_name(config)]
    return out


def _mlp_linears(config: ModelConfig, module: str, prefix: str) -> dict[str, list[str]]:
    """The fused gate_up and the down projection of one gated MLP (a dense layer's or an expert's)."""
    gate_up = ("gate_up",) if config.model_type == "phi3" else ("gate", "up")
    return {f"{module}.gate_up_proj": [family_tensor_name(f"{prefix}.{n}_proj.weight", config) for n in gate_up],
            f"{module}.down_proj": [family_tensor_name(f"{prefix}.down_proj.weight", config)]}


def _requantised_format(module: str, in_features: int, mode: str) -> str:
    """The format ("int4" / "int8") a dense weight of linear `module` is requantised to in `mode`: a
    router and a weight whose input size is not a multiple of INT4_GROUP_SIZE become int8 rows
    ([Note: numeric modes])."""
    return "int8" if module.endswith(ROUTER) or in_features % INT4_GROUP_SIZE else mode


def _requantise(module: str, w: torch.Tensor, mode: str) -> QuantWeight:
    """Dense `w` [out, in] of linear `module` as a record in `_requantised_format`."""
    return quantize_dense(w, _requantised_format(module, w.shape[1], mode))


def _gguf_format(module: str, in_features: int, kind) -> str:
    """The format a GGUF tensor of GGML type `kind` runs as in `auto` (`GgufBlockReader.read_one`,
    `_quant_weights`): its own int4 / int8 blocks, else requantised."""
    if kind in INT4_TYPES:
        return "int4"
    return "int8" if kind in INT8_TYPES else _requantised_format(module, in_features, "int4")


def linear_weight_bytes(config: ModelConfig, layer_range: LayerRange, *, is_last: bool, quantization: str,
                        dtype: torch.dtype, model_dir: str, device: str = "cpu") -> dict[str, int]:
    """Checkpoint name -> the bytes its weight holds once built in numeric mode `quantization`, what a
    decode pass streams (`packed_weight_bytes`), for every linear of a stage of `layer_range` (and
    its LM head when `is_last`), as `load_stage_model` would build it: dense `dtype`, or int4 / int8
    requantised, or in `auto` the GGUF's own block types. Reads the GGUF's tensor table only, never
    tensor data, so the coordinator can cost a split before any stage loads. Raises ValueError for an
    unknown mode or a tensor the GGUF lacks."""
    mode = effective_mode(quantization, model_dir, device)
    shapes = checkpoint_shapes(config, layer_range, is_first=False, is_last=is_last)
    blocks = GgufBlockReader(gguf_source_of(model_dir), config, model_dir=model_dir) if mode == "gguf" else None
    out = {}
    for module, names in fused_linears(config, layer_range, is_last=is_last).items():
        for name in names:
            shape = shapes[name]
            if mode == "none":
                fmt = dtype
            elif blocks is not None:
                fmt = _gguf_format(module, shape[1], blocks.kind(name))
            else:
                fmt = _requantised_format(module, shape[1], mode)
            out[name] = packed_weight_bytes(fmt, shape)
    return out


def _quant_weights(mode: str, groups: dict[str, list[str]], reader: CheckpointReader,
                   blocks: GgufBlockReader | None) -> dict[str, QuantWeight]:
    """One quantised record per fused linear, read tensor by tensor (never a whole dense model)."""
    out: dict[str, QuantWeight] = {}
    for module, names in groups.items():
        parts = []
        for name in names:
            if blocks is not None:
                w = blocks.read_one(name)
                parts.append(_requantise(module, w, "int4") if isinstance(w, torch.Tensor) else w)
            else:
                parts.append(_requantise(module, reader.read([name], dtype=torch.float32)[name], mode))
        out[module] = parts[0] if len(parts) == 1 else cat_rows(parts)
    return out


def build_quantized_stage_model(config: ModelConfig, layer_range: LayerRange, *, is_first: bool, is_last: bool,
                                mode: str, reader: CheckpointReader) -> StageModel:
    """A StageModel whose projections and head run int4/int8 kernels and whose other tensors
    (embedding, norms, biases) are dense bfloat16; activations and KV are bfloat16.

    mode: "int4", "int8" (requantised from the folder's dense tensors) or "gguf" (the GGUF's own
    blocks). CPU only (the kernels are torch's CPU ones). Raises ValueError for a missing tensor.
    """
    groups = fused_linears(config, layer_range, is_last=is_last)
    linear_names = {n for names in groups.values() for n in names}
    names = stage_tensor_names(config, layer_range, is_first=is_first, is_last=is_last)
    dense_names = [n for n in names if n not in linear_names or (is_first and n == EMBED_TOKENS)]
    blocks = None
    if mode == "gguf":
        blocks = GgufBlockReader(gguf_source_of(reader.model_dir), config, model_dir=reader.model_dir)
    dense = reader.read(dense_names, dtype=ACTIVATION_DTYPE)
    with torch.device("meta"):
        model = StageModel(config, layer_range, is_first=is_first, is_last=is_last)
    state = {}
    for name, _ in model.named_parameters():
        ckpt = checkpoint_name(name, config)
        if ckpt in dense and name != LM_HEAD:  # (the parameter name)
            state[name] = dense[ckpt]
    model.load_state_dict(state, assign=True, strict=False)
    for layer in model.layers.values():
        layer.self_attn.fuse()
        layer.mlp.fuse()
    quantize_stage_model(model, _quant_weights(mode, groups, reader, blocks))
    set_rope_buffers(model, config)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if left:
        raise ValueError(f"quantised stage {layer_range} left tensors unloaded: {left[:3]}")
    return model.eval()


def load_stage_model(model_dir: str, layer_range: LayerRange, *, is_first: bool, is_last: bool,
                     quantization: str = "none", dtype: torch.dtype = torch.float32,
                     device: str = "cpu", reader: CheckpointReader | None = None,
                     dense_layout: str = "reference") -> StageModel:
    """Build one stage of the model in `model_dir` in numeric mode `quantization`.

    `none`: dense in `dtype` on `device` (the previous path), its wide linears transposed when
    `dense_layout` is "fast" ([Note: dense layout] in pipeline/weights/dense_layout.py). Other
    modes: see `build_quantized_stage_model`; `dtype` is then bfloat16. Raises ValueError for an
    unknown mode or layout, a quantised mode on a non-CPU device, `fast` outside float32 on CPU,
    or a missing tensor.
    """
    reader = reader or CheckpointReader(model_dir)
    config = reader.config
    validate_dense_layout(dense_layout, quantization=quantization, dtype=dtype, device=str(device))
    mode = effective_mode(quantization, str(model_dir), str(device))
    if mode == "none":
        names = stage_tensor_names(config, layer_range, is_first=is_first, is_last=is_last)
        tensors = reader.read(names, dtype=dtype, device=device)
        model = build_stage_model(config, layer_range, is_first=is_first, is_last=is_last, tensors=tensors,
                                  dtype=dtype, device=device, consume=True)  # fusing frees the unfused copies
        apply_dense_layout(model, dense_layout)
        release_freed_heap()  # the unfused and untransposed copies (~40 MB of RSS on the default model)
        return model
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization {quantization} runs torch's CPU int kernels only; on device {device} "
                         "use none")
    return build_quantized_stage_model(config, layer_range, is_first=is_first, is_last=is_last, mode=mode,
                                       reader=reader)
