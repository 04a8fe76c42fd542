"""A stage's raw GGUF blocks, as quantised weight records (for `--quantization auto`).

Owns decoding llama.cpp's Q4_0 / Q4_1 / Q8_0 block layouts straight into `Int4Groups` / `Int8Rows`
(pipeline/weights/quant.py), undoing the Q/K row permutation on the records, and finding the GGUF a
converted folder came from. Reads only the tensors asked for, from the memory-mapped file: a stage
never inflates the model to float32. Must not: build modules or write files.

Block layouts (ggml-common.h), 32 weights per block along the input dimension:
    Q4_0: f16 d, u8 qs[16]          w = d * (q - 8)         q = low nibbles (0..15), then high nibbles
    Q4_1: f16 d, f16 m, u8 qs[16]   w = d * q + m
    Q8_0: f16 d, i8 qs[32]          w = d * q
and the K-quant super-block of 256 weights (8 sub-blocks of 32):
    Q4_K: f16 d, f16 dmin, u8 scales[12] (6-bit sc[8], m[8]; unpacked by gguf's own
          `Q4_K.get_scale_min`), u8 qs[128]: w = (d * sc[j]) * q - dmin * m[j] in sub-block j,
          whose q are the low nibbles of 32 bytes (even j) or their high nibbles (odd j)
so Q4_K is exactly int4 groups of 32 with scale d * sc[j] and minimum -dmin * m[j].
Other types (Q5_*, Q6_K, Q2_K, Q3_K, ...) have no torch kernel: they are dequantised to float32 here
and requantised by the caller (int4 groups of 32, [Note: numeric modes] in pipeline/weights/quant.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from pipeline.model.config import ModelConfig
from pipeline.model.tensor_names import LM_HEAD
from pipeline.weights.file_memo import load_index
from pipeline.weights.gguf_import import open_gguf, read_source, unpermute_qk
from pipeline.weights.gguf_metadata.families import PERMUTED_ARCHITECTURES, field, tensor_targets
from pipeline.weights.quant import Int4Groups, QuantWeight, int8_rows_from_float

# Checkpoint names of projections: every family's `*_proj`, and Mixtral's experts (`w1`, `w2`, `w3`).
_LINEAR_SUFFIXES = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")

BLOCK = 32
INT4_TYPES = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K}
Q4_K_BYTES = 144  # bytes of one 256-weight Q4_K super-block
INT8_TYPES = {gguf.GGMLQuantizationType.Q8_0}


def gguf_source_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted folder was made from (its `speedpipe_source.json`), or None for a
    plain Hugging Face folder or when that file is gone. Raises ValueError (one line naming the file)
    for a malformed speedpipe_source.json (gguf_import.read_source)."""
    source = read_source(model_dir)
    path = None if source is None else Path(source.path)
    return path if path is not None and path.is_file() else None


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] packed bytes -> [rows, blocks * 32] values 0..15 (low nibbles first)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return q.reshape(qs.shape[0], -1)


def decode_int4(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> Int4Groups:
    """Q4_0 / Q4_1 bytes [rows, row_bytes] -> Int4Groups with the file's own q, scale and minimum."""
    rows = data.shape[0]
    block_bytes = 18 if kind == gguf.GGMLQuantizationType.Q4_0 else 20
    blocks = np.ascontiguousarray(data).reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == gguf.GGMLQuantizationType.Q4_0:
        minimum, qs = -8.0 * d, blocks[..., 2:]
    else:
        minimum, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    q = _nibbles(qs)
    return Int4Groups(q=torch.from_numpy(q.astype(np.uint8)), scale=torch.from_numpy(d),
                      minimum=torch.from_numpy(np.ascontiguousarray(minimum)), group_size=BLOCK)


def decode_q4_k(data: np.ndarray) -> Int4Groups:
    """Q4_K bytes [rows, row_bytes] -> Int4Groups (group 32) with the file's own q, and each
    sub-block's scale d * sc and minimum -dmin * m: dequantises to exactly gguf's float32 values."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, Q4_K_BYTES)  # [rows * super-blocks, 144]
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, -1)  # sub-block j: low nibbles (even j) / high nibbles (odd j) of 32 bytes
    scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin[:, None] * m.astype(np.float32)).reshape(rows, -1)
    return Int4Groups(q=torch.from_numpy(q.astype(np.uint8)), scale=torch.from_numpy(np.ascontiguousarray(scale)),
                      minimum=torch.from_numpy(np.ascontiguousarray(minimum)), group_size=BLOCK)


def decode_q8_0(data: np.ndarray) -> torch.Tensor:
    """Q8_0 bytes [rows, row_bytes] -> the exact float32 weight [rows, in]."""
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d[..., None]).reshape(data.shape[0], -1))


def _unpermute(w: QuantWeight, num_heads: int) -> QuantWeight:
    """Undo llama.cpp's Q/K row interleaving on a per-row record ([Note: GGUF Q/K permutation])."""
    order = unpermute_qk(np.arange(w.shape[0]), num_heads)
    return w.rows(torch.from_numpy(np.ascontiguousarray(order)).long())


class GgufBlockReader:
    """Reads named tensors of a GGUF file as quantised records or dense float32 tensors.

    `read(names)` returns {HF name: Int4Groups | Int8Rows | float32 tensor}: Q4_0/Q4_1/Q4_K → Int4Groups
    (exact), Q8_0 → Int8Rows when `int8_for_q8` (re-scaled per row, see [Note: numeric modes] in
    pipeline/weights/quant.py) else its exact float32 values, anything else → float32 through `gguf`.
    A stacked expert tensor ([num_experts, out, in]) answers for each expert's HF name with its slice.
    Raises ValueError naming a tensor the file lacks.
    """

    def __init__(self, path: str | Path, config: ModelConfig, *, model_dir: str | Path | None = None) -> None:
        """`model_dir`: the folder converted from `path`; its tensor table (pipeline/weights/file_memo.py)
        spares parsing the file's metadata, which takes seconds. Raises ValueError for an unreadable file."""
        indexed = load_index(model_dir, path) if model_dir is not None else None
        if indexed is None:
            reader = open_gguf(path)
            indexed = field(reader, "general.architecture"), reader.tensors
        arch, tensors = indexed
        self.config = config
        self.permuted = arch in PERMUTED_ARCHITECTURES
        self.tensors = {name: (t, expert) for t in tensors for name, expert in tensor_targets(t.name, arch, config)}

    def kind(self, name: str) -> gguf.GGMLQuantizationType:
        """The GGML type of HF-named tensor `name`."""
        return self._tensor(name)[0].tensor_type

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise ValueError(f"GGUF file has no tensor for {name!r}")
        return self.tensors[name]

    def read_one(self, name: str, *, int8_for_q8: bool = True) -> QuantWeight | torch.Tensor:
        """One tensor, as described in the class docstring."""
        t, expert = self._tensor(name)
        data = np.asarray(t.data)
        shape = tuple(reversed(t.shape.tolist()))
        if expert is not None:
            data, shape = data[expert], shape[1:]
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_K:
            out: QuantWeight | torch.Tensor = decode_q4_k(data)
        elif t.tensor_type in INT4_TYPES:
            out = decode_int4(data, t.tensor_type)
        elif t.tensor_type in INT8_TYPES:
            dense = decode_q8_0(data)
            out = int8_rows_from_float(dense) if int8_for_q8 else dense
        else:
            w = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
            out = torch.from_numpy(np.array(w, order="C"))
        if self.permuted and (".q_proj." in name or ".k_proj." in name) and not isinstance(out, torch.Tensor):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            out = _unpermute(out, heads)
        elif self.permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            out = torch.from_numpy(unpermute_qk(out.numpy(), heads).copy())
        return out


def requantised_linears(path: str | Path, config: ModelConfig, *, model_dir: str | Path | None = None) -> dict[str, int]:
    """GGML type name -> how many of the GGUF's projection / LM-head weights of that type
    `--quantization auto` requantises to int4 groups (types without a kernel here: not
    Q4_0/Q4_1/Q4_K/Q8_0), e.g. {"Q6_K": 29} for Qwen2.5-Coder's Q4_K_M file. Reads only the header
    (or `model_dir`'s tensor table)."""
    reader = GgufBlockReader(path, config, model_dir=model_dir)
    counts: dict[str, int] = {}
    for name, (t, _) in reader.tensors.items():
        linear = name.endswith(_LINEAR_SUFFIXES) or name == LM_HEAD
        if linear and t.tensor_type not in INT4_TYPES | INT8_TYPES:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts
