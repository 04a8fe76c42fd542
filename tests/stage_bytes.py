"""The bytes a real stage holds, measured: the truth the memory plan (pipeline/weights/stage_memory.py)
and the start-up memory check (launcher/coordinator/run_plan.py `check_lengths`) are tested against.

Builds each stage of a split the way a stage worker does (`load_stage_model`, in the run's numeric
mode), allocates its KV cache (with the token-tree scratch positions), runs one pass at the last
position and asks for the RoPE rotation tables of the last position they may hold (as a FIRP pseudo row
past max_model_len does), so they grow to their bound, and sums the storages of what it holds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.weights.quant import Int4Linear, Int8Linear
from pipeline.weights.quant_load import load_stage_model


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by two tensors counts once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a built stage holds as weights: its parameters (dense tensors) and the buffers of its
    quantised linears (pipeline/weights/quant.py: `Int4Linear`'s packed int4 weight, bfloat16 scales
    and zeros and bias; `Int8Linear`'s int8 weight, scales and bias), none of which is a parameter."""
    packed = [t for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)) for t in m.buffers()]
    return [*model.parameters(), *packed]


def measured_stage_bytes(folder: Path, ranges: list[LayerRange], *, max_num_seqs: int, max_model_len: int,
                         num_scratch: int = 0, quantization: str = "none", dense_layout: str = "reference",
                         draft_after: int | None = None,
                         exit_head: tuple[int, bytes] | None = None) -> list[tuple[int, int, int]]:
    """Per stage of `ranges`: (weights, KV cache, rotation tables) bytes of a real stage after a pass at
    position max_model_len - 1 and a table look-up at max_model_len + num_scratch - 1 (weights:
    `weight_tensors`, the parameters and the quantised linears' packed buffers). draft_after: the stage
    holding that layer also gets a next-layer drafter after it (a copy of the layer, as
    `StageModel.attach_draft_layer` takes one), with its own KV cache layer.
    dense_layout: `load_stage_model`'s (`fast`: a tied head gets its own transposed copy).
    exit_head: (exit layer, predictor file bytes, b"" for the logit lens): the stage holding that layer
    also builds the exit head as a stage does (`build_exit_head`) and counts the storages of its copies of
    the final norm and LM head (after a draft vocabulary is cut: a view of the full head would count it
    whole); its trained map and draft vocabulary ids are the file's, which the plan charges by size."""
    out = []
    for i, r in enumerate(ranges):
        model = load_stage_model(str(folder), r, is_first=i == 0, is_last=i == len(ranges) - 1,
                                 quantization=quantization, dense_layout=dense_layout)
        if draft_after in r:
            model.attach_draft_layer(copy.deepcopy(model.layers[str(draft_after)]), after=draft_after)
        kv = model.new_kv_cache(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_scratch=num_scratch)
        kv.set_length(0, max_model_len - 1)
        x = torch.tensor([5]) if i == 0 else torch.randn(1, model.config.hidden_size, dtype=kv.k.dtype)
        bound = max_model_len + num_scratch  # the tables' bound ([Note: cached rotation tables] in rope.py)
        with torch.no_grad():
            model.forward(x, [Span(0, max_model_len - 1, 1)], kv)
            model.rope_tables(torch.tensor([bound - 1]), kv.k.dtype, max_positions=bound)  # a FIRP pseudo row's
        tables = [t for rot in model._rotations.values() for t in (rot._cos, rot._signed_sin)]
        weights = _storage_bytes(weight_tensors(model))
        if exit_head is not None and exit_head[0] in r:
            weights += _exit_head_bytes(folder, r, i, len(ranges), exit_head, quantization=quantization)
        out.append((weights, _storage_bytes([kv.k, kv.v]), _storage_bytes(tables)))
    return out


def _exit_head_bytes(folder: Path, r: LayerRange, index: int, num_stages: int, exit_head: tuple[int, bytes], *,
                     quantization: str) -> int:
    """Bytes of the norm and LM-head storages of the exit head stage `index` builds (`build_exit_head`)."""
    from pipeline.engine.stage_assembly import StageLoadSpec, build_exit_head
    from pipeline.weights.checkpoint import CheckpointReader

    reader = CheckpointReader(folder)
    spec = StageLoadSpec(model_dir=str(folder), stage_index=index, num_stages=num_stages, layer_range=r,
                         quantization=quantization, exit_layer=exit_head[0], exit_predictor=exit_head[1])
    head = build_exit_head(reader.config, reader, spec)
    return _storage_bytes([head.norm.weight, head.lm_head.weight])


def write_next_layer_file(folder: Path, path: Path, layer: int) -> Path:
    """A next-layer drafter's predictor file for the model in `folder` at exit `layer` (a 16 KiB
    placeholder tensor: the memory plan and the start-up check read its header and size only)."""
    from pipeline.speculation.predictor_file import model_identity, save_predictor

    meta = {"kind": "early-exit", "model": model_identity(folder).to_dict(), "exit_layer": layer, "arch": "next-layer",
            "corpus": "self-distill", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1}}
    return save_predictor(path, {"draft_layer.x": torch.zeros(4096)}, meta)


def write_quantised_gguf_folder(root: Path, family: str, quant_name: str) -> Path:
    """The folder `convert_gguf` writes for a tiny GGUF of `family` (tests/family_models.py: qwen2 ties its
    embedding and head, mistral does not; mixtral and qwen3_moe are MoE) whose matrices are stored as
    `quant_name` ("Q4_0", "Q8_0"), as tests/unit/test_gguf_quantised_families.py builds them (the GGUF
    architecture: tests/unit/test_gguf_families.py `HF_FAMILY_ARCH`, else the family's own name, as
    qwen2 and qwen3 write it): what `--quantization auto` runs as its own blocks."""
    import gguf

    from pipeline.weights.gguf_import import convert_gguf
    from tests.unit.test_gguf_families import HF_FAMILY_ARCH, _f16_rounded_family_model, write_hf_family_gguf

    d, tensors = _f16_rounded_family_model(root / "hf", family)
    path = root / f"{quant_name}.gguf"
    write_hf_family_gguf(path, d, tensors, family, arch=HF_FAMILY_ARCH.get(family, family),
                         quant=gguf.GGMLQuantizationType[quant_name])
    return convert_gguf(path, root / quant_name, progress=False)
