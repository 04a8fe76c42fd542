"""Per-stage memory: what each layer, the embedding and the head need, and the auto stage count.

Owns `StagePlan` and `plan_stages_for_budget`, which measures a model folder's weights per layer
(from safetensors headers, at the run's dtype: no tensor data is read) plus each layer's KV cache for
`max_num_seqs` x `max_model_len` plus every stage's RoPE rotation tables (`rotation_table_bytes`),
and picks the fewest stages that fit a per-stage budget
(`--stages auto --stage-memory-gib`, pipeline/model/partition.py `smallest_fitting_split`).
Must not: start processes or allocate tensors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeline.model.attention import KEY_BLOCK
from pipeline.model.kv_cache import buffer_positions
from pipeline.model.partition import LayerRange, smallest_fitting_split
from pipeline.model.tensor_names import EMBED_TOKENS, FINAL_NORM, head_tensor_name
from pipeline.weights.checkpoint import CheckpointReader, layer_tensor_names


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """The chosen split and each stage's bytes (weights + KV + rotation tables) against the budget;
    rotation_table_bytes: the tables' share of every stage's bytes."""

    ranges: list[LayerRange]
    stage_bytes: list[int]
    budget_bytes: int
    rotation_table_bytes: int = 0

    def layer_split(self) -> str:
        """The split as `--layer-split` spells it (e.g. "8,8,7,7")."""
        return ",".join(str(len(r)) for r in self.ranges)

    def lines(self) -> list[str]:
        """One start-up log line per stage: layers, need (with the rotation tables' share) and budget."""
        tables = f"{self.rotation_table_bytes / 2**20:.1f} MiB"
        return [f"stage {i}: layers {r}, {b / 2**30:.2f} GiB (weights + KV cache + {tables} RoPE tables) "
                f"of a {self.budget_bytes / 2**30:.2f} GiB budget"
                for i, (r, b) in enumerate(zip(self.ranges, self.stage_bytes, strict=True))]


def kv_bytes_per_layer(config, *, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """K and V of one layer for every slot: 2 x seqs x positions x kv_heads x head_dim x itemsize, where
    positions is max_model_len rounded up to whole key blocks, as the cache holds it
    (pipeline/model/kv_cache.py; token-tree scratch positions, a few per slot, are not counted)."""
    positions = buffer_positions(max_model_len, KEY_BLOCK)
    return 2 * max_num_seqs * positions * config.num_key_value_heads * config.head_dim * dtype.itemsize


def rotation_table_bytes(config, *, dtype: torch.dtype, max_model_len: int, device: str = "cpu") -> int:
    """Bytes of the RoPE rotation tables one stage holds at their bound ([Note: cached rotation tables] in
    pipeline/model/rope.py): cos and signed sin, [max_model_len, 1, rotary_dim] each in `dtype`, per table
    key (the global RoPE, plus Gemma 3's local one when the model has sliding layers: a stage without
    one holds one set less). Token-tree scratch positions, a few, are not counted (as for the KV cache).
    0 on a device other than the CPU, where a pass computes its rows instead of caching tables."""
    if torch.device(device).type != "cpu":
        return 0
    num_keys = 1 + config.uses_local_rope(range(config.num_hidden_layers))
    return num_keys * 2 * max_model_len * config.rotary_dim * dtype.itemsize


def plan_stages_for_budget(model_dir: str | Path, *, budget_bytes: int, dtype: torch.dtype, max_num_seqs: int,
                           max_model_len: int, exit_bytes: int = 0, exit_layer: int | None = None,
                           device: str = "cpu") -> StagePlan:
    """The fewest stages (and their split) whose weights + KV + rotation tables each fit `budget_bytes`
    (every stage holds its own tables: `rotation_table_bytes` on `device`).

    exit_bytes: what a trained exit head adds to the stage holding `exit_layer` (its file's tensors,
    plus a next-layer drafter's KV layer); exit_layer None: the default exit layer, stage 0's last, so
    stage 0 pays it.

    Raises ValueError (from `smallest_fitting_split`) when one layer with the embedding or head
    does not fit, and FileNotFoundError / ValueError for a bad model folder.
    """
    reader = CheckpointReader(model_dir)
    config = reader.config
    kv = kv_bytes_per_layer(config, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    layer = [reader.nbytes(layer_tensor_names(config, i), dtype=dtype) + kv for i in range(config.num_hidden_layers)]
    first = reader.nbytes([EMBED_TOKENS], dtype=dtype)
    if exit_layer is not None and 0 <= exit_layer < len(layer):
        layer[exit_layer] += exit_bytes
    else:  # the default exit layer (or a bad one, which resolving the run reports)
        first += exit_bytes
    last = reader.nbytes([FINAL_NORM, head_tensor_name(config)], dtype=dtype)
    tables = rotation_table_bytes(config, dtype=dtype, max_model_len=max_model_len, device=device)
    ranges = smallest_fitting_split(layer, first_bytes=first, last_bytes=last, stage_bytes=tables,
                                    budget_bytes=budget_bytes)
    sizes = [sum(layer[r.start:r.stop]) + (first if i == 0 else 0) + (last if i == len(ranges) - 1 else 0) + tables
             for i, r in enumerate(ranges)]
    return StagePlan(ranges=ranges, stage_bytes=sizes, budget_bytes=budget_bytes, rotation_table_bytes=tables)
