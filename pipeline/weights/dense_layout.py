"""How dense float32 weights are laid out for the CPU's one-row products (`--dense-layout`).

Owns `DENSE_LAYOUTS`, `TransposedLinear` and `apply_dense_layout`, which swaps a built StageModel's
wide `nn.Linear`s (more outputs than inputs) for their transposed copies. Must not: read files,
change a weight's values, or touch the int modes (pipeline/weights/quant.py) or any head outside
the StageModel (exit heads, FIRP maps, drafters keep their own layout).

[Note: dense layout]
A decode step multiplies one row by every weight: a GEMV, bound by how fast the BLAS streams
the weight. `nn.Linear` keeps W as [out, in] and computes x @ Wᵀ through the transposed-GEMV
path; stored as Wᵀ ([in, out] contiguous), the same product runs through the non-transposed path,
which on this machine's BLAS is 1.4-1.9× faster for wide weights (default model, one thread,
weights out of cache: qkv 960×576 200 → 145 µs, gate_up 3072×576 643 → 355 µs, LM head
49152×576 9.8 → 5.2 ms; on the Intel Xeon with AMX 1.2× for all three) and slower for tall ones
(down 576×1536 228 → 280 µs). So `fast` stores Wᵀ for every linear with out_features >
in_features and leaves the others as they are. Two and three rows through Wᵀ take the BLAS's
small-GEMM path and cost ~1.3× what they cost through W (gate_up 2 rows 531 → 698 µs on the Intel
machine); four rows and more are again as fast or faster (LM head 8 rows 25.4 → 15.8 ms).
- `reference` (default): transformers' own op order: the float32 reference, logits within 1e-4
  of transformers (tests/integration/test_real_model.py).
- `fast`: float32 on CPU with `--quantization none` only. One-row products sum in another order,
  so logits differ from `reference` in the last bits (measured ≤ 3.1e-4 over 40 decode steps of
  the default model); greedy output stays token-identical across `--stages` and `--speculate`
  modes (every stage runs the same module for a layer), and its agreement with transformers is
  measured, not assumed (tests/benchmarks/mode_agreement.py, mode `none-fast`). Passes of two
  or more rows also sum in another order than `reference` (within ~3e-6 on random weights), and
  as in `reference` a row's result may differ in the last bits with the number of rows in the
  pass. The wide weights take no extra memory once loaded (each is transposed and its [out, in]
  copy dropped before the next, then the freed heap returned to the OS), except a tied LM head on
  a stage that also holds the embedding (a one-stage run): it gets its own transposed copy
  (+113 MB for the default model; the embedding keeps [vocab, hidden]). Row-cost tables name the
  mode `fp32-fast` (pipeline/measure/row_cost.py), apart from `fp32`.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

DENSE_LAYOUTS = ("reference", "fast")  # --dense-layout; the first is the default


def validate_dense_layout(layout: str, *, quantization: str, dtype: str | torch.dtype, device: str) -> str:
    """Return `layout` if it is valid for the numeric mode, else raise ValueError in one line:
    an unknown layout, or `fast` with a quantised mode, a dtype other than float32, or a non-CPU device."""
    if layout not in DENSE_LAYOUTS:
        raise ValueError(f"dense_layout must be one of {', '.join(DENSE_LAYOUTS)}, got {layout!r}")
    if layout == "fast":
        dtype_name = str(dtype).removeprefix("torch.")
        if quantization != "none" or dtype_name != "float32" or torch.device(device).type != "cpu":
            raise ValueError(f"dense_layout fast needs quantization none, dtype float32 and a CPU device "
                             f"(got {quantization}, {dtype_name}, {device})")
    return layout


def wants_transposed(out_features: int, in_features: int) -> bool:
    """The `fast` layout's rule: store Wᵀ for wide weights (out_features > in_features)."""
    return out_features > in_features


class TransposedLinear(nn.Module):
    """A dense linear holding Wᵀ ([in, out], contiguous): y = x @ Wᵀ + b, x: [num_rows, in] →
    [num_rows, out]. The same product as `nn.Linear` up to float summation order ([Note: dense
    layout]). Built by `from_linear`; the weight is never trained."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight_t.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = self.weight_t.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        """Wᵀ of `linear` (a copy; the caller drops `linear`)."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().t().contiguous(), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        if x.dim() == 2:
            return torch.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t + self.bias


def apply_dense_layout(model: nn.Module, layout: str) -> list[str]:
    """Swap the `nn.Linear`s of `model` that the layout stores transposed (none for `reference`).
    Returns the swapped module names, in module order. Call after `fuse` (the fused shapes decide);
    the model is changed in place. Each old weight is dropped before the next is copied, so the
    peak is one weight above the model (`release_freed_heap` then returns the freed pages)."""
    if layout == "reference":
        return []
    swapped = [name for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and wants_transposed(mod.out_features, mod.in_features)]
    for name in swapped:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, TransposedLinear.from_linear(getattr(parent, attr)))
    return swapped


def release_freed_heap() -> bool:
    """Ask glibc to return freed heap pages to the OS (`malloc_trim(0)`): weights freed during a
    load stay in malloc's arenas otherwise and count in the process's RSS. Returns False where
    the C library has no malloc_trim (musl, macOS, Windows); nothing is changed then."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
