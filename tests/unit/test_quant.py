"""Quantised weights (pipeline/weights/quant.py, pipeline/weights/gguf_blocks.py): formats, kernels, batch invariance.

What breaks when these fail: a quantised linear computes something other than its dequantised
weight (wrong nibble order, wrong zero point, Q/K rows left interleaved), GGUF blocks decode to
other numbers than the `gguf` package's dequantiser, or a kernel's row result starts depending on
how many rows share the pass, which would make speculative greedy output differ from plain greedy
output ([Note: batch invariance]).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pipeline.speculation.predictors import ExitHead
from pipeline.weights.gguf_blocks import _unpermute, decode_int4, decode_q4_k, decode_q8_0
from pipeline.weights.gguf_import import unpermute_qk
from pipeline.weights.quant import (
    ACTIVATION_DTYPE,
    Int4Groups,
    Int4Linear,
    Int8Linear,
    cat_rows,
    int4_groups_from_float,
    int8_rows_from_float,
    packed_weight_bytes,
    quantize_stage_model,
    validate_quantization,
)


def _w(out: int = 96, inp: int = 128, seed: int = 0) -> torch.Tensor:
    return 0.1 * torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


def test_int4_groups_stay_within_half_a_step_of_the_weight():
    w = _w()
    g = int4_groups_from_float(w)
    assert g.q.dtype == torch.uint8 and int(g.q.max()) <= 15
    step = g.scale.repeat_interleave(g.group_size, dim=1)
    assert ((g.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_int8_rows_stay_within_half_a_step_of_the_weight():
    w = _w()
    r = int8_rows_from_float(w)
    assert ((r.dequantize() - w).abs() <= r.scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantised_linear_computes_its_dequantised_weight(kind):
    w = _w()
    weight = int4_groups_from_float(w) if kind == "int4" else int8_rows_from_float(w)
    lin = Int4Linear(weight) if kind == "int4" else Int8Linear(weight)
    x = torch.randn(5, w.shape[1]).to(ACTIVATION_DTYPE)
    ref = x.float() @ weight.dequantize().T
    got = lin(x).float()
    # bf16 activations/scales: relative error ~ 2^-8 of the output scale
    assert torch.allclose(got, ref, atol=3e-2 * ref.abs().max().item(), rtol=0), (got - ref).abs().max()


def test_a_kernel_row_does_not_depend_on_the_other_rows():
    """[Note: batch invariance]: row i of an M-row pass equals the 1-row pass of row i, bitwise."""
    w = _w(192, 128)
    x = torch.randn(12, 128).to(ACTIVATION_DTYPE)
    for lin in (Int4Linear(int4_groups_from_float(w)), Int8Linear(int8_rows_from_float(w))):
        xx = x
        full = lin(xx)
        for m in (2, 3, 5, 8, 12):
            assert torch.equal(lin(xx[:m]), full[:m]), (type(lin).__name__, m)
        for i in range(12):
            assert torch.equal(lin(xx[i:i + 1])[0], full[i]), (type(lin).__name__, i)


@pytest.mark.parametrize("out_features", [264, 40, 8, 1])
def test_int4_takes_any_number_of_output_rows_and_each_row_is_that_of_a_whole_tile(out_features):
    """torch packs int4 weights in tiles of 16 output rows: a vocabulary of 264 (or 32001) or a
    router over 8 experts failed to load with `expect N to be dividable by 16`. Padded, each output
    must equal, bitwise, the same row of a weight whose rows fill whole tiles."""
    w = _w(272, 64)
    x = torch.randn(5, 64).to(ACTIVATION_DTYPE)
    whole = Int4Linear(int4_groups_from_float(w))(x)
    part = Int4Linear(int4_groups_from_float(w[:out_features]))
    assert part.out_features == out_features
    assert torch.equal(part(x), whole[:, :out_features])
    assert torch.equal(part(x[:1]), whole[:1, :out_features])


def _buffer_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("shape", [(272, 64), (40, 128), (8, 96), (1, 32)])
def test_packed_weight_bytes_are_what_the_kernel_modules_hold(shape):
    """The split costs a head by the bytes it streams ([Note: partition cost]): the formula must be
    what Int4Linear (nibbles, bfloat16 scale and zero a group, rows padded to whole tiles of 16) and
    Int8Linear (a byte a weight, a bfloat16 scale a row) really hold, and a dense weight's itemsize."""
    w = _w(*shape)
    assert packed_weight_bytes("int4", shape) == _buffer_bytes(Int4Linear(int4_groups_from_float(w)))
    assert packed_weight_bytes("int8", shape) == _buffer_bytes(Int8Linear(int8_rows_from_float(w)))
    for dtype in (torch.float32, torch.bfloat16):
        assert packed_weight_bytes(dtype, shape) == _buffer_bytes(torch.nn.Linear(shape[1], shape[0], bias=False,
                                                                                  dtype=dtype))
    with pytest.raises(ValueError, match="int3"):
        packed_weight_bytes("int3", shape)


def test_the_exit_head_guess_of_a_row_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    head = ExitHead(64, 256, 1e-5).eval()
    hidden = torch.randn(7, 64)
    tokens, probs = head(hidden)
    for i in range(7):
        t, p = head(hidden[i:i + 1])
        assert t[0] == tokens[i] and torch.equal(p[0], probs[i]), i
    t2, p2 = head(hidden[[0, 3, 5]])
    assert torch.equal(p2, probs[[0, 3, 5]]) and torch.equal(t2, tokens[[0, 3, 5]])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_int4_blocks_decode_to_the_files_own_values(kind):
    ggml = getattr(gguf.GGMLQuantizationType, kind)
    w = _w(8, 96, seed=1).numpy()
    blocks = gguf.quants.quantize(w, ggml)
    ref = gguf.quants.dequantize(blocks, ggml).reshape(w.shape)
    got = decode_int4(blocks, ggml).dequantize().numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-7)


def test_gguf_q4_k_super_blocks_decode_to_the_files_own_values_as_int4_groups():
    """Q4_K (Qwen2.5-Coder's GGUF; gguf-py cannot quantise to it): random super-blocks with sane
    f16 d/dmin, every 6-bit scale and minimum pattern; equal to gguf's own dequantisation, bit for bit."""
    rng = np.random.default_rng(3)
    rows, supers = 6, 2
    blocks = rng.integers(0, 256, size=(rows, supers, 144), dtype=np.uint8)
    for offset in (0, 2):  # d, dmin
        halves = rng.uniform(1e-3, 1e-2, size=(rows, supers)).astype(np.float16)
        blocks[..., offset:offset + 2] = halves.view(np.uint8).reshape(rows, supers, 2)
    data = blocks.reshape(rows, supers * 144)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K).reshape(rows, supers * 256)
    groups = decode_q4_k(data)
    assert groups.group_size == 32 and groups.scale.shape == (rows, supers * 8)
    np.testing.assert_array_equal(groups.dequantize().numpy(), ref)


def test_gguf_q8_0_blocks_decode_to_the_files_own_values():
    w = _w(8, 96, seed=2).numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
    np.testing.assert_array_equal(decode_q8_0(blocks).numpy(), ref)


def test_unpermuting_a_quantised_record_equals_unpermuting_its_dense_weight():
    w = _w(4 * 16, 64, seed=3)
    g = int4_groups_from_float(w)
    np.testing.assert_array_equal(_unpermute(g, 4).dequantize().numpy(), unpermute_qk(g.dequantize().numpy(), 4))


def test_fused_rows_are_the_parts_stacked():
    a, b = int4_groups_from_float(_w(32, 64, 4)), int4_groups_from_float(_w(16, 64, 5))
    assert torch.equal(cat_rows([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot fuse"):
        cat_rows([a, int8_rows_from_float(_w(16, 64))])


def test_bad_modes_shapes_and_groups_are_named():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, got 'int3'"):
        validate_quantization("int3")
    with pytest.raises(ValueError, match="multiple of the group size"):
        int4_groups_from_float(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="do not fit group size"):
        Int4Groups(q=torch.zeros(4, 64, dtype=torch.uint8), scale=torch.zeros(4, 3), minimum=torch.zeros(4, 3))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match="has shape"):
        quantize_stage_model(model, {"0": int4_groups_from_float(_w(16, 64))})
    with pytest.raises(ValueError, match="no linear 'nope'"):
        quantize_stage_model(model, {"nope": int4_groups_from_float(_w(32, 64))})
