"""Per-stage memory: what each layer, the embedding and the head need, and the auto stage count.

Owns `StagePlan` and `plan_stages_for_budget`, which measures a model folder's weights per layer
as a stage holds them in the run's numeric mode (`model_weight_bytes`: the linears through
pipeline/weights/quant_load.py `linear_weight_bytes`, packed when quantised, the rest dense at the
stage's dtype; from safetensors headers and the GGUF's tensor table: no tensor data is read) plus
each layer's KV cache for `max_num_seqs` x (`max_model_len` + the token-tree scratch positions)
plus every stage's RoPE rotation tables (`rotation_table_bytes`), the cache and tables in the
stage's activation dtype (`stage_dtype`), and picks the fewest stages that fit a per-stage budget
(`--stages auto --stage-memory-gib`, pipeline/model/partition.py `smallest_fitting_split`).
The start-up memory check (launcher/coordinator/run_plan.py `check_lengths`) uses the same helpers.
Must not: start processes or allocate tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pipeline.model.attention import KEY_BLOCK
from pipeline.model.kv_cache import buffer_positions
from pipeline.model.partition import LayerRange, smallest_fitting_split
from pipeline.model.tensor_names import EMBED_TOKENS, FINAL_NORM, head_tensor_name
from pipeline.weights.checkpoint import CheckpointReader, layer_tensor_names
from pipeline.weights.quant_load import activation_dtype, effective_mode, linear_weight_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """The chosen split and each stage's bytes (weights + KV cache + rotation tables) against the budget;
    kv_bytes, rotation_table_bytes: each stage's share of its bytes in those two; num_scratch: the
    token-tree scratch positions every slot of every stage's KV cache holds past max_model_len."""

    ranges: list[LayerRange]
    stage_bytes: list[int]
    budget_bytes: int
    kv_bytes: list[int]
    rotation_table_bytes: list[int]
    num_scratch: int = 0

    def layer_split(self) -> str:
        """The split as `--layer-split` spells it (e.g. "8,8,7,7")."""
        return ",".join(str(len(r)) for r in self.ranges)

    @property
    def weight_bytes(self) -> list[int]:
        """Each stage's weights (an exit head's file included): its bytes less its KV cache and tables."""
        return [b - kv - t for b, kv, t in zip(self.stage_bytes, self.kv_bytes, self.rotation_table_bytes, strict=True)]

    def lines(self) -> list[str]:
        """One start-up log line per stage: layers, need (with the weights', the KV cache's and the
        rotation tables' shares) and budget."""
        scratch = f" with {self.num_scratch} token-tree scratch positions a slot" if self.num_scratch else ""
        return [f"stage {i}: layers {r}, {b / 2**30:.2f} GiB ({w / 2**30:.2f} GiB weights + "
                f"{kv / 2**20:.1f} MiB KV cache{scratch} + "
                f"{tables / 2**20:.1f} MiB RoPE tables) of a {self.budget_bytes / 2**30:.2f} GiB budget"
                for i, (r, b, w, kv, tables) in enumerate(zip(self.ranges, self.stage_bytes, self.weight_bytes,
                                                              self.kv_bytes, self.rotation_table_bytes, strict=True))]


def kv_bytes_per_layer(config, *, dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
                       num_scratch: int = 0) -> int:
    """K and V of one layer for every slot: 2 x seqs x positions x kv_heads x head_dim x itemsize, where
    positions is max_model_len plus `num_scratch` token-tree scratch positions (pipeline/speculation/tree.py
    `scratch_positions`), rounded up to whole key blocks, as the cache holds it (pipeline/model/kv_cache.py).
    dtype: the stage's activation dtype (`stage_dtype`)."""
    positions = buffer_positions(max_model_len + num_scratch, KEY_BLOCK)
    return 2 * max_num_seqs * positions * config.num_key_value_heads * config.head_dim * dtype.itemsize


def rotation_table_bytes(config, layers: Iterable[int], *, dtype: torch.dtype, max_model_len: int,
                         num_scratch: int = 0, device: str = "cpu") -> int:
    """Bytes of the RoPE rotation tables a stage holding `layers` keeps at their bound ([Note: cached
    rotation tables] in pipeline/model/rope.py: max_model_len + num_scratch positions, what its KV cache
    holds): cos and signed sin, [positions, 1, rotary_dim] each in `dtype` (the stage's activation
    dtype, `stage_dtype`: bfloat16 for a quantised stage), per table key: the global RoPE, plus Gemma 3's
    local one when one of `layers` is a sliding layer (`StageModel.rope_tables` builds no other).
    0 on a device other than the CPU, where a pass computes its rows instead of caching tables.
    The one formula of the plan and of the start-up memory check (launcher/coordinator/run_plan.py)."""
    if torch.device(device).type != "cpu":
        return 0
    num_keys = 1 + config.uses_local_rope(layers)
    return num_keys * 2 * (max_model_len + num_scratch) * config.rotary_dim * dtype.itemsize


def stage_dtype(quantization: str, model_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype a stage's KV cache and rotation tables are in: `dtype` when its weights run dense, else
    bfloat16 (pipeline/weights/quant_load.py `activation_dtype`). Raises ValueError for an unknown mode."""
    return activation_dtype(quantization, str(model_dir), dtype, device)


def exit_head_bytes(config, *, rows: int, dtype: torch.dtype) -> int:
    """Bytes of the exit head's copies of the final norm [H] and of the `rows` LM-head rows [rows, H] it
    scores (launcher/coordinator/predictor_select.py `exit_head_shape`: a trained head's draft
    vocabulary, else the whole vocabulary), dense in `dtype`, the stage's activation dtype (`stage_dtype`),
    as pipeline/engine/stage_assembly.py `build_exit_head` holds them: once a draft vocabulary is cut,
    the full head it was cut from is freed. A trained head's own tensors (its map, its draft vocabulary
    ids) are its file's (`given_exit_memory`)."""
    return (1 + rows) * config.hidden_size * dtype.itemsize


def shares_tied_head(config, *, quantization: str, model_dir: str | Path, device: str = "cpu",
                     dense_layout: str = "reference") -> bool:
    """Whether a stage that is first and last holds a tied embedding and LM head as one tensor: dense
    weights (`load_stage_model` ties them, as the checkpoint does) in the `reference` layout. A
    quantised stage keeps its embedding dense and its head packed, and the `fast` layout gives the head
    its own transposed copy ([Note: dense layout] in pipeline/weights/dense_layout.py): two tensors.
    False for an untied model. Raises ValueError for an unknown quantization mode."""
    dense = effective_mode(quantization, str(model_dir), device) == "none"
    return config.tie_word_embeddings and dense and dense_layout == "reference"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightBytes:
    """The bytes of a model's weights as its stages hold them (`model_weight_bytes`): layers[i], decoder
    layer i's tensors; embedding, the first stage's token embedding; head, the last stage's final norm
    and LM head; shared, what a one-stage split holds once rather than twice (the tied embedding and
    head as one tensor, `shares_tied_head`; else 0)."""

    layers: list[int]
    embedding: int
    head: int
    shared: int

    def total(self, num_stages: int) -> int:
        """Bytes of the weights of all `num_stages` stages together."""
        return sum(self.layers) + self.embedding + self.head - (self.shared if num_stages == 1 else 0)


def model_weight_bytes(reader: CheckpointReader, *, dtype: torch.dtype, quantization: str = "none", device: str = "cpu",
                 dense_layout: str = "reference") -> WeightBytes:
    """The bytes each part of the model in `reader` holds once a stage is built in numeric mode
    `quantization` (pipeline/weights/quant_load.py `load_stage_model`'s rules): every linear (the
    LM head included) as `linear_weight_bytes` gives it (dense `dtype`, or packed int4 / int8, in
    `auto` the GGUF's own block types), everything else (embedding, norms, biases) dense in the
    stage's dtype (`stage_dtype`: bfloat16 when quantised). A tied model's quantised stages keep a
    dense embedding and a packed head. Reads headers and the GGUF's tensor table, never tensor data.
    Raises ValueError for an unknown mode, a missing tensor or a bad folder."""
    config, model_dir = reader.config, str(reader.model_dir)
    dense_dtype = stage_dtype(quantization, model_dir, dtype, device)
    linears = linear_weight_bytes(config, LayerRange(0, config.num_hidden_layers), is_last=True,
                                  quantization=quantization, dtype=dtype, model_dir=model_dir, device=device)

    def held(names: list[str]) -> int:
        return (sum(linears[n] for n in names if n in linears)
                + reader.nbytes([n for n in names if n not in linears], dtype=dense_dtype))

    embedding = reader.nbytes([EMBED_TOKENS], dtype=dense_dtype)
    shared = shares_tied_head(config, quantization=quantization, model_dir=model_dir, device=device,
                              dense_layout=dense_layout)
    return WeightBytes(layers=[held(layer_tensor_names(config, i)) for i in range(config.num_hidden_layers)],
                       embedding=embedding, head=held([FINAL_NORM, head_tensor_name(config)]),
                       shared=embedding if shared else 0)


def plan_stages_for_budget(model_dir: str | Path, *, budget_bytes: int, dtype: torch.dtype, max_num_seqs: int,
                           max_model_len: int, exit_bytes: int = 0, exit_kv_layers: int = 0,
                           exit_layer: int | None = None, device: str = "cpu", quantization: str = "none",
                           dense_layout: str = "reference",
                           scratch_of: Callable[[int], int] = lambda num_stages: 0) -> StagePlan:
    """The fewest stages (and their split) whose weights + KV + rotation tables each fit `budget_bytes`
    (every stage holds its own tables: `rotation_table_bytes` of its layers on `device`).

    dtype: `--dtype`; the weights are charged as the stages hold them in `quantization`
    (`model_weight_bytes`: dense in `dtype`, or packed linears beside a dense bfloat16 embedding and
    norms); the KV cache and the tables in `stage_dtype(quantization, ...)`, with the token-tree
    scratch positions a slot that `num_stages` stages hold, `scratch_of(num_stages)` (nondecreasing;
    the CLI passes pipeline/speculation/tree.py `scratch_positions(draft_tree, max_inflight or
    num_stages)`, which this layer does not import: speculation imports weights). They may grow with
    the stage count, so the count is found at its own scratch: plan at the scratch of k stages (k = 1 first); when that needs k' > k stages, no count
    in [k, k') fits at its own scratch (at least k's), so try k = k'; when it needs k, that is it.
    exit_bytes, exit_kv_layers: what a trained exit head adds to the stage holding `exit_layer`: its
    file's tensors, and KV cache layers (a next-layer drafter's own: 1), each charged as a decoder
    layer's (scratch positions included) and counted in that stage's KV cache share; exit_layer None:
    the default exit layer, stage 0's last, so stage 0 pays it. A tied embedding and LM head is charged
    once on a stage that is first and last when it holds them as one tensor (`shares_tied_head`), else
    to both the first and the last stage (a quantised stage: a dense embedding and a packed head).

    Raises ValueError (from `smallest_fitting_split`) when one layer with the embedding or head
    does not fit, and FileNotFoundError / ValueError for a bad model folder.
    """
    reader = CheckpointReader(model_dir)
    cache_dtype = stage_dtype(quantization, model_dir, dtype, device)
    weights = model_weight_bytes(reader, dtype=dtype, quantization=quantization, device=device,
                                 dense_layout=dense_layout)
    stages = 1
    while True:
        plan = _plan_at(reader.config, weights, budget_bytes=budget_bytes, cache_dtype=cache_dtype,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        num_scratch=scratch_of(stages),
                        exit_bytes=exit_bytes, exit_kv_layers=exit_kv_layers, exit_layer=exit_layer, device=device)
        assert len(plan.ranges) >= stages, (plan.ranges, stages)  # fewer did not fit at less scratch
        if len(plan.ranges) == stages:
            return plan
        stages = len(plan.ranges)


def _plan_at(config, weights: WeightBytes, *, budget_bytes: int, cache_dtype: torch.dtype,
             max_num_seqs: int, max_model_len: int, num_scratch: int, exit_bytes: int, exit_kv_layers: int,
             exit_layer: int | None, device: str) -> StagePlan:
    """`plan_stages_for_budget` with a fixed number of scratch positions a slot; weights: `model_weight_bytes`."""
    kv = kv_bytes_per_layer(config, dtype=cache_dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            num_scratch=num_scratch)
    layer = [b + kv for b in weights.layers]
    first = weights.embedding
    exit_kv = exit_kv_layers * kv
    if exit_layer is not None and 0 <= exit_layer < len(layer):
        layer[exit_layer] += exit_bytes + exit_kv
    else:  # the default exit layer (or a bad one, which resolving the run reports)
        first += exit_bytes + exit_kv
    last, shared = weights.head, weights.shared

    def tables(start: int, stop: int) -> int:
        return rotation_table_bytes(config, range(start, stop), dtype=cache_dtype, max_model_len=max_model_len,
                                    num_scratch=num_scratch, device=device)

    ranges = smallest_fitting_split(layer, first_bytes=first, last_bytes=last, stage_bytes=tables,
                                    budget_bytes=budget_bytes, shared_bytes=shared)
    table_bytes = [tables(r.start, r.stop) for r in ranges]
    sizes = [sum(layer[r.start:r.stop]) + (first if i == 0 else 0) + (last if i == len(ranges) - 1 else 0)
             - (shared if len(ranges) == 1 else 0) + table_bytes[i] for i, r in enumerate(ranges)]
    holder = next((i for i, r in enumerate(ranges) if exit_layer in r), 0)  # (a bad or no exit_layer: stage 0)
    kv_bytes = [kv * len(r) + (exit_kv if i == holder else 0) for i, r in enumerate(ranges)]
    return StagePlan(ranges=ranges, stage_bytes=sizes, budget_bytes=budget_bytes, kv_bytes=kv_bytes,
                     rotation_table_bytes=table_bytes, num_scratch=num_scratch)
