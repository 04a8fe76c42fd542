"""Checkpoint tensors: which Hugging Face tensor names a stage needs, and reading exactly those.

Owns the tensor naming of every supported family's layers (`model.layers.{i}.self_attn.q_proj.weight`,
...; phi3's fused `qkv_proj` / `gate_up_proj`, Mixtral's experts through pipeline/model/tensor_names.py,
which spells the single names), the choice of names per stage (`stage_tensor_names`), the exit
head's copies of the final norm and head (`read_norm_and_head`), and `CheckpointReader`, a lazy
reader of a Hugging Face model folder: one `model.safetensors`, or shards listed in
`model.safetensors.index.json`; of a multimodal checkpoint it sees only the language model's tensors,
under this decoder's names ([Note: text-only multimodal] in pipeline/model/family_config.py).
Must not: build modules, materialise the whole model, or know about GGUF (see `gguf_import`).
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open

from pipeline.model.config import ModelConfig
from pipeline.model.family_blocks import plain_norm_weight
from pipeline.model.partition import LayerRange
from pipeline.model.tensor_names import (
    EMBED_TOKENS,
    FINAL_NORM,
    family_tensor_name,
    head_tensor_name,
    text_model_name,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
# The safetensors dtypes this reader reads (U16, U32, U64, C64, ... have no torch dtype it computes with).
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _mlp_names(config: ModelConfig, prefix: str, layer: int) -> list[str]:
    """Feed-forward tensors of one layer: gate/up/down (phi3: gate_up/down), or router + experts."""
    projections = ("gate_up_proj", "down_proj") if config.model_type == "phi3" else _MLP_PROJ
    if not config.is_moe_layer(layer):
        return [f"{prefix}.mlp.{proj}.weight" for proj in projections]
    names = [f"{prefix}.mlp.gate.weight"]
    names += [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(config.num_experts) for proj in projections]
    return [family_tensor_name(n, config) for n in names]


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """Checkpoint names of decoder layer `layer` (norms, q/k/v/o or phi3's fused qkv, q/k/v biases
    when `config.attention_bias`, o bias when `config.o_proj_bias`, q/k norms, Gemma's feed-forward
    norms, gate/up/down or the MoE router and experts). Raises ValueError when the layer does not exist."""
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(f"layer {layer} is outside the model's {config.num_hidden_layers} layers")
    p = f"model.layers.{layer}"
    names = [f"{p}.input_layernorm.weight"]
    qkv = ("qkv_proj",) if config.model_type == "phi3" else ("q_proj", "k_proj", "v_proj")
    names += [f"{p}.self_attn.{proj}.weight" for proj in (*qkv, "o_proj")]
    if config.attention_bias:
        names += [f"{p}.self_attn.{proj}.bias" for proj in qkv]
    if config.o_proj_bias:
        names.append(f"{p}.self_attn.o_proj.bias")
    if config.qk_norm:
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    names.append(f"{p}.post_attention_layernorm.weight")
    if config.sandwich_norms:
        names += [f"{p}.pre_feedforward_layernorm.weight", f"{p}.post_feedforward_layernorm.weight"]
    return names + _mlp_names(config, p, layer)


def stage_tensor_names(config: ModelConfig, layer_range: LayerRange, *, is_first: bool,
                       is_last: bool) -> list[str]:
    """Exactly the checkpoint tensors one stage needs, each once, in checkpoint order.

    First stage: the token embedding; every stage: its layers; last stage: the final norm and the
    head (`model.embed_tokens.weight` when tied, else `lm_head.weight`).
    Raises ValueError when `layer_range` reaches past the model's layers.
    """
    if layer_range.stop > config.num_hidden_layers:
        raise ValueError(f"layer range {layer_range} is outside the model's {config.num_hidden_layers} layers")
    names = [EMBED_TOKENS] if is_first else []
    for layer in layer_range:
        names += layer_tensor_names(config, layer)
    if is_last:
        names.append(FINAL_NORM)
        if head_tensor_name(config) not in names:
            names.append(head_tensor_name(config))
    return names


def read_norm_and_head(reader: CheckpointReader, config: ModelConfig, *, dtype: torch.dtype,
                       device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(norm [H], head [V, H]) as `dtype` on `device`: the final norm as the weight of a plain RMSNorm
    (`plain_norm_weight`: Gemma's offset added) and the LM head (the embedding when tied), what an
    exit head and the predictor trainers hold. Raises ValueError for a tensor the checkpoint lacks."""
    head_name = head_tensor_name(config)
    t = reader.read([FINAL_NORM, head_name], dtype=dtype, device=device)
    return plain_norm_weight(t[FINAL_NORM], config), t[head_name]


def all_tensor_names(config: ModelConfig) -> list[str]:
    """Every tensor of a complete checkpoint of this config (a single stage holding all layers)."""
    return stage_tensor_names(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True)


@contextlib.contextmanager
def _open_safetensors(path: Path) -> Iterator[safetensors.safe_open]:
    """`safe_open(path)` with a clear ValueError for a truncated or corrupt file, or one this process
    may not read."""
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {path} does not exist")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:  # safetensors reports every failure to open as "No such file or directory"
        raise ValueError(f"cannot read safetensors file {path}: {exc.strerror or exc}") from None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except safetensors.SafetensorError as err:
        raise ValueError(f"corrupt or truncated safetensors file {path}: {err}") from None


def _index_weight_map(model_dir: Path) -> dict[str, Path]:
    """name -> shard path from `model.safetensors.index.json` (`_check_shards` checks they exist)."""
    index_path = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:  # bad JSON or UTF-8, no weight_map, not an object
        raise ValueError(f"malformed safetensors index {index_path}: {err!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"malformed safetensors index {index_path}: weight_map must map tensor names to "
                         f"file names, got {json.dumps(weight_map)[:80]}")
    return {name: model_dir / file for name, file in weight_map.items()}


def _check_shards(model_dir: Path, weight_map: dict[str, Path]) -> None:
    """Raise FileNotFoundError naming the first file of `weight_map` (from the index) that is missing."""
    for shard in sorted(set(weight_map.values())):
        if not shard.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {model_dir / INDEX_FILE} does not exist")


def _text_model_view(weight_map: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str], frozenset[str]]:
    """A multimodal checkpoint's language model ([Note: text-only multimodal]): (our name -> file,
    our name -> stored name, the stored names left out: vision tower and projector). Raises
    ValueError when two stored names are one tensor of ours (both layouts in one checkpoint)."""
    kept: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for name, path in weight_map.items():
        ours = text_model_name(name)
        if ours is None:
            continue
        if ours in kept:
            raise ValueError(f"the checkpoint holds tensor {ours!r} twice: as {stored[ours]!r} and {name!r}")
        kept[ours], stored[ours] = path, name
    return kept, stored, frozenset(weight_map) - set(stored.values())


def _header_weight_map(files: list[Path]) -> dict[str, Path]:
    """name -> file from the headers of unindexed safetensors files (headers only, no data)."""
    weight_map: dict[str, Path] = {}
    for path in files:
        with _open_safetensors(path) as f:
            for name in f.keys():
                if name in weight_map:
                    raise ValueError(f"tensor {name!r} is in both {weight_map[name]} and {path}")
                weight_map[name] = path
    return weight_map


def _torch_dtype(name: str, dtype: str, path: Path) -> torch.dtype:
    """The torch dtype of tensor `name`, stored in `path` as safetensors dtype `dtype`. Raises
    ValueError naming the tensor, the dtype, the file and the dtypes read, for any other dtype."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"tensor {name!r} in {path} has dtype {dtype}, which speedpipe cannot read "
                         f"(supported: {', '.join(_TORCH_DTYPES)})")
    return _TORCH_DTYPES[dtype]


def _read_direct(path: Path, names: list[str], stored: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `names` read from safetensors `path` with plain reads into fresh tensors;
    `stored` maps a name to the one the file spells it (absent: the same).

    [Note: reading without mmap] A memory map of the file would leave every page a stage read
    resident in the process (counted in its RSS) next to the tensors copied out of it, doubling a
    stage's peak memory while it loads; reading straight into each tensor's own buffer keeps the
    peak at the stage's weights. Raises ValueError when the file ends before a tensor's data does
    or a tensor has a dtype this reader does not read (`_torch_dtype`).
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        for name in names:
            info = header[stored.get(name, name)]
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_torch_dtype(name, info["dtype"], path))
            f.seek(8 + header_len + begin)
            if f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != end - begin:
                raise ValueError(f"corrupt or truncated safetensors file {path}: tensor {name!r} is cut short")
            yield name, t


class CheckpointReader:
    """Lazy reader of a Hugging Face model folder's safetensors weights.

    Construction reads `config.json` and the index (or the single file's header), never tensor
    data. `read` opens only the files that hold the requested names and copies only those tensors,
    so a stage never materialises the whole model. `read_names` records every name read so far.
    Of a multimodal checkpoint (`config.text_only_of`), names are this decoder's (`model.layers.0...`)
    and the vision tower and projector (`skipped_names`) can never be read; their shards need not exist.
    Raises FileNotFoundError (folder without config.json or without safetensors files, missing
    shard) and ValueError (corrupt/truncated file, malformed index) naming the path.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_model_dir(self.model_dir)
        self.read_names: set[str] = set()
        if (self.model_dir / INDEX_FILE).is_file():
            weight_map = _index_weight_map(self.model_dir)
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no {SINGLE_FILE} or {INDEX_FILE} in model folder {self.model_dir}")
            weight_map = _header_weight_map(files)
        self._stored: dict[str, str] = {}
        self.skipped_names: frozenset[str] = frozenset()
        if self.config.text_only_of:
            weight_map, self._stored, self.skipped_names = _text_model_view(weight_map)
        _check_shards(self.model_dir, weight_map)
        self._weight_map = weight_map

    @property
    def tensor_names(self) -> frozenset[str]:
        """Every tensor name in the checkpoint (of a multimodal one: its language model's, as ours)."""
        return frozenset(self._weight_map)

    def _files_for(self, names: Iterable[str]) -> dict[Path, list[str]]:
        """Group names by the file holding them. Raises ValueError naming missing tensors."""
        missing = [n for n in names if n not in self._weight_map]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise ValueError(f"{len(missing)} tensor(s) not in checkpoint {self.model_dir}: {shown}")
        groups: dict[Path, list[str]] = {}
        for name in names:
            groups.setdefault(self._weight_map[name], []).append(name)
        return groups

    def read(self, names: Iterable[str], *, dtype: torch.dtype,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read `names` as `dtype` on `device`; returns {name: tensor} in the order asked.

        Shapes are the checkpoint's (HF layout, e.g. q_proj: [num_heads * head_dim, hidden_size]).
        Raises ValueError for a name missing from the checkpoint, a corrupt/truncated file, or a
        tensor stored in a dtype this reader does not read (U16, U32, U64, C64, ...).
        """
        names = list(dict.fromkeys(names))
        tensors: dict[str, torch.Tensor] = {}
        for path, group in self._files_for(names).items():
            with _open_safetensors(path):  # validates the header (clear error for a corrupt file)
                pass
            for name, t in _read_direct(path, group, self._stored):
                tensors[name] = t.to(device=device, dtype=dtype)
        self.read_names.update(names)
        return {name: tensors[name] for name in names}

    def shapes(self, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """{name: shape as stored} of `names`, from the headers only: what the checks before start-up
        compare with the config. Raises ValueError for a missing name, a corrupt file, or a tensor
        stored in a dtype `read` would refuse (so it is refused before any stage starts)."""
        out: dict[str, tuple[int, ...]] = {}
        for path, group in self._files_for(list(dict.fromkeys(names))).items():
            with _open_safetensors(path) as f:
                for name in group:
                    info = f.get_slice(self._stored.get(name, name))
                    _torch_dtype(name, info.get_dtype(), path)
                    out[name] = tuple(info.get_shape())
        return out

    def nbytes(self, names: Iterable[str], *, dtype: torch.dtype | None = None) -> int:
        """Bytes the tensors `names` take: as stored on disk, or once read as `dtype` when given.

        Reads headers only. Raises ValueError for a missing name, a corrupt file, or (`dtype` None)
        a tensor stored in a dtype this reader does not read.
        """
        total = 0
        for path, group in self._files_for(list(dict.fromkeys(names))).items():
            with _open_safetensors(path) as f:
                for name in group:
                    info = f.get_slice(self._stored.get(name, name))
                    numel = 1
                    for dim in info.get_shape():
                        numel *= dim
                    itemsize = (dtype if dtype is not None else _torch_dtype(name, info.get_dtype(), path)).itemsize
                    total += numel * itemsize
        return total
