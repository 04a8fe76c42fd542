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
from pipeline.weights.quant_load import load_stage_model


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by two tensors counts once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measured_stage_bytes(folder: Path, ranges: list[LayerRange], *, max_num_seqs: int, max_model_len: int,
                         num_scratch: int = 0, quantization: str = "none", dense_layout: str = "reference",
                         draft_after: int | None = None) -> list[tuple[int, int, int]]:
    """Per stage of `ranges`: (parameters, KV cache, rotation tables) bytes of a real stage after a pass at
    position max_model_len - 1 and a table look-up at max_model_len + num_scratch - 1 (parameters: dense tensors only; a quantised linear's packed weight is no
    parameter). draft_after: the stage holding that layer also gets a next-layer drafter after it (a copy
    of the layer, as `StageModel.attach_draft_layer` takes one), with its own KV cache layer.
    dense_layout: `load_stage_model`'s (`fast`: a tied head gets its own transposed copy)."""
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
        out.append((_storage_bytes(model.parameters()), _storage_bytes([kv.k, kv.v]), _storage_bytes(tables)))
    return out


def write_next_layer_file(folder: Path, path: Path, layer: int) -> Path:
    """A next-layer drafter's predictor file for the model in `folder` at exit `layer` (a 16 KiB
    placeholder tensor: the memory plan and the start-up check read its header and size only)."""
    from pipeline.speculation.predictor_file import model_identity, save_predictor

    meta = {"kind": "early-exit", "model": model_identity(folder).to_dict(), "exit_layer": layer, "arch": "next-layer",
            "corpus": "self-distill", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1}}
    return save_predictor(path, {"draft_layer.x": torch.zeros(4096)}, meta)
