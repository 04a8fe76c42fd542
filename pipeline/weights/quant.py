"""Weight-only quantised linear layers and the numeric modes (`--quantization auto|none|int8|int4`).

Owns the quantised weight records (`Int4Groups`, `Int8Rows`), their packing into the layouts of
torch's CPU kernels (`torch._weight_int4pack_mm_for_cpu`, `torch._weight_int8pack_mm`, the kernels
gpt-fast uses), the modules that run them (`Int4Linear`, `Int8Linear`), and `quantize_stage_model`, which swaps a built StageModel's
`nn.Linear`s for them. Must not: read files (pipeline/weights/gguf_blocks.py reads a GGUF's own blocks,
pipeline/weights/checkpoint.py a folder's dense tensors) or change the model's structure beyond the swap.

[Note: numeric modes]
- `none`: dense weights in `--dtype` (float32: the exact reference, token-identical to transformers;
  `--dense-layout fast` stores the wide ones transposed, [Note: dense layout] in pipeline/weights/dense_layout.py).
- `int4`: every projection and the LM head as int4, groups of 32 along the input dimension,
  asymmetric (w = q * scale + minimum, q in 0..15), requantised from the dense weights.
- `int8`: every projection and the LM head as int8, one symmetric scale per output row.
- `auto`: the checkpoint's own blocks where a kernel exists: GGUF Q4_0/Q4_1/Q4_K → int4 groups of 32
  (exact: the same q, scale and minimum as the file, scales rounded to bfloat16 by the kernel),
  Q8_0 → int8 rows (re-scaled: a row's block scales are merged into one; error <= half a step of
  the row's largest block). Projections and heads of other types (Q5_*, Q6_K, Q2_K, F32, ...) have no
  kernel here: they are requantised to int4 groups of 32, and `launch` names them in a warning
  (Qwen2.5-Coder's Q4_K_M file: 29 Q6_K tensors, the head among them). Embeddings, norms and biases
  are dense bfloat16; a Hugging Face folder stays dense (`none`).
- Every family's layout is quantised (pipeline/weights/quant_load.py `fused_linears`: phi3's fused
  qkv / gate_up, each expert of an MoE layer). A router (`mlp.gate`) is int8 rows in every int mode
  (its top-k picks the experts, so it keeps int8's precision; llama.cpp keeps it float), and so is a
  weight whose input size is not a multiple of the int4 group (e.g. experts of width 48); in `auto`
  a router the GGUF itself stores as Q4_0/Q4_1/Q4_K runs those blocks (int4: the file's own values).
The int modes run bfloat16 activations and KV (the kernels are 10-20x slower with float32 input).

[Note: batch invariance]
Greedy output must not depend on how many rows share a pass (ARCHITECTURE.md §3). The int4 and
int8 CPU kernels compute each output row with the same reduction order whatever the number of
rows (tests/unit/test_quant.py checks it bitwise), so in the int modes speculation is exact by
construction. Dense float32 GEMM (MKL/oneDNN) is not: the blocking depends on M, and a row's
result differs by ~1e-9 between a 2-row and a 3-row pass. Where float32 rows must not depend on
their neighbours (the exit head, whose skipped rows change the row count), `ExitHead.forward`
(pipeline/speculation/predictors.py) runs every row in the shape of a lone row.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZE = 32
INT4_OUT_TILE = 16  # torch's CPU int4 packing needs a multiple of this many output rows
ACTIVATION_DTYPE = torch.bfloat16  # what the int kernels run fast on (AMX / AVX-512 bf16)
_INT4_MAX = 15
_INT8_MAX = 127


def validate_quantization(mode: str) -> str:
    """Return `mode` if it is one of QUANTIZATION_CHOICES, else raise ValueError naming the choices."""
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {mode!r}")
    return mode


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Groups:
    """An int4 weight: w[n, k] = q[n, k] * scale[n, k // g] + minimum[n, k // g].

    q: [out, in] uint8 in 0..15; scale, minimum: [out, in // group_size] float32.
    """

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    group_size: int = INT4_GROUP_SIZE

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % self.group_size or tuple(self.scale.shape) != (n, k // self.group_size) \
                or self.scale.shape != self.minimum.shape:
            raise ValueError(f"int4 groups: q {tuple(self.q.shape)}, scale {tuple(self.scale.shape)}, minimum "
                             f"{tuple(self.minimum.shape)} do not fit group size {self.group_size}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] these groups stand for."""
        n, k = self.q.shape
        g = self.q.reshape(n, k // self.group_size, self.group_size).float()
        return (g * self.scale[..., None] + self.minimum[..., None]).reshape(n, k)

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The same weight with its rows reordered/selected by `index` [m] (int64)."""
        return Int4Groups(q=self.q[index], scale=self.scale[index], minimum=self.minimum[index],
                          group_size=self.group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8Rows:
    """An int8 weight: w[n, k] = q[n, k] * scale[n]. q: [out, in] int8; scale: [out] float32."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        return self.q.float() * self.scale[:, None]

    def rows(self, index: torch.Tensor) -> Int8Rows:
        """The same weight with its rows reordered/selected by `index` [m] (int64)."""
        return Int8Rows(q=self.q[index], scale=self.scale[index])


QuantWeight = Int4Groups | Int8Rows


def int4_groups_from_float(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Groups:
    """Asymmetric min/max int4 quantisation of w: [out, in] per group of `group_size` inputs.

    Raises ValueError when `in` is not a multiple of group_size.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input size {k} to be a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / _INT4_MAX).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, _INT4_MAX).to(torch.uint8)
    return Int4Groups(q=q.reshape(n, k), scale=scale, minimum=lo, group_size=group_size)


def int8_rows_from_float(w: torch.Tensor) -> Int8Rows:
    """Symmetric int8 quantisation of w: [out, in], one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(-1) / _INT8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return Int8Rows(q=q, scale=scale)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack quantised weights along the output dimension (fused q/k/v, gate/up): exact, since
    every record is per output row. Raises ValueError when the parts differ in kind or group."""
    first = parts[0]
    if isinstance(first, Int4Groups):
        if not all(isinstance(p, Int4Groups) and p.group_size == first.group_size for p in parts):
            raise ValueError("cannot fuse int4 weights with other kinds or group sizes")
        return Int4Groups(q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
                          minimum=torch.cat([p.minimum for p in parts]), group_size=first.group_size)
    if not all(isinstance(p, Int8Rows) for p in parts):
        raise ValueError("cannot fuse int8 weights with other kinds")
    return Int8Rows(q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]))


class Int4Linear(nn.Module):
    """y = x @ w.T (+ bias) with w held as packed int4 groups (`torch._weight_int4pack_mm_for_cpu`).

    x: [num_rows, in_features] bfloat16 → [num_rows, out_features] bfloat16. The kernel computes
    (q - 8) * scale + zero, so zero = minimum + 8 * scale; scales and zeros are stored in bfloat16.
    The kernel packs outputs in tiles of INT4_OUT_TILE: a weight with another number of rows (a
    vocabulary of 32001, a router over 8 experts) is packed with zero rows appended, and their
    outputs are cut off (each output is its own row's dot product, so the others do not change).
    """

    def __init__(self, weight: Int4Groups, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        weight = _pad_rows(weight, -self.out_features % INT4_OUT_TILE)
        packed = torch._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32).contiguous(), 1)
        zero = weight.minimum + 8 * weight.scale
        scales_zeros = torch.stack([weight.scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros.to(ACTIVATION_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATION_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)
        if y.shape[-1] != self.out_features:  # padded rows (see the class docstring)
            y = y[..., :self.out_features].contiguous()
        return y if self.bias is None else y + self.bias


def _pad_rows(weight: Int4Groups, num_rows: int) -> Int4Groups:
    """`weight` with `num_rows` all-zero output rows (q, scale and minimum 0) appended."""
    if num_rows == 0:
        return weight
    q, scale, minimum = (torch.cat([t, t.new_zeros(num_rows, t.shape[1])])
                         for t in (weight.q, weight.scale, weight.minimum))
    return Int4Groups(q=q, scale=scale, minimum=minimum, group_size=weight.group_size)


class Int8Linear(nn.Module):
    """y = x @ w.T (+ bias) with w held as int8 rows (`torch._weight_int8pack_mm`).

    x: [num_rows, in_features] bfloat16 → [num_rows, out_features] bfloat16.
    """

    def __init__(self, weight: Int8Rows, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("q", weight.q.contiguous())
        self.register_buffer("scale", weight.scale.to(ACTIVATION_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATION_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias


def quant_linear(weight: QuantWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """The module that runs `weight`: Int4Linear or Int8Linear."""
    return Int4Linear(weight, bias) if isinstance(weight, Int4Groups) else Int8Linear(weight, bias)


def quantize_dense(w: torch.Tensor, mode: str) -> QuantWeight:
    """Requantise a dense weight [out, in] for `mode` ("int4" or "int8"). Raises ValueError otherwise."""
    if mode == "int4":
        return int4_groups_from_float(w)
    if mode == "int8":
        return int8_rows_from_float(w)
    raise ValueError(f"no quantised format for mode {mode!r}")


def packed_weight_bytes(fmt: str | torch.dtype, shape: tuple[int, int]) -> int:
    """Bytes a linear's weight [out, in] holds in format `fmt`, what one decode pass streams through
    the kernel: "int4" as `Int4Linear` packs it (half a byte a weight plus a bfloat16 scale and zero per
    group of INT4_GROUP_SIZE, rows padded to INT4_OUT_TILE), "int8" as `Int8Linear` (a byte a weight
    plus a bfloat16 scale per row), a torch dtype dense (its itemsize a weight). The one formula of
    the split's head cost ([Note: partition cost] in pipeline/model/partition.py). Raises ValueError
    for another format."""
    out, k = shape
    if fmt == "int4":
        rows = out + (-out % INT4_OUT_TILE)
        return rows * k // 2 + rows * (k // INT4_GROUP_SIZE) * 2 * ACTIVATION_DTYPE.itemsize
    if fmt == "int8":
        return out * k + out * ACTIVATION_DTYPE.itemsize
    if isinstance(fmt, torch.dtype):
        return out * k * fmt.itemsize
    raise ValueError(f"no packed format {fmt!r}: int4, int8 or a torch dtype")


def stage_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of a StageModel by qualified name (fused names after `fuse`)."""
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def quantize_stage_model(model: nn.Module, weights: dict[str, QuantWeight]) -> nn.Module:
    """Replace the StageModel's linears named in `weights` (module names, e.g.
    `layers.3.self_attn.qkv_proj`, `lm_head`) by quantised modules; biases stay.

    Raises ValueError naming a module that is missing or whose shape differs from its weight.
    Returns the model (changed in place).
    """
    linears = stage_linears(model)
    for name, weight in weights.items():
        if name not in linears:
            raise ValueError(f"stage has no linear {name!r} to quantise")
        lin = linears[name]
        if weight.shape != (lin.out_features, lin.in_features):
            raise ValueError(f"quantised {name!r} has shape {weight.shape}, the layer "
                             f"{(lin.out_features, lin.in_features)}")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = lin.bias.detach() if lin.bias is not None and lin.bias.device.type != "meta" else None
        setattr(parent, attr, quant_linear(weight, bias))
    return model
