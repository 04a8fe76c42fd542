"""`--dense-layout fast` (pipeline/weights/dense_layout.py): wide float32 linears stored transposed.

What breaks if these fail: the fast layout computes another product than the linear it replaces,
transposes the wrong layers (a tall one runs slower, a missed wide one stays slow), changes greedy
output or its identity across stage splits, or is accepted where it does not apply (an int mode,
half precision, a GPU) instead of exiting with a one-line error.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.measure.row_cost import numeric_mode_name
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel
from pipeline.run_config import RunConfig
from pipeline.weights.dense_layout import (
    TransposedLinear,
    apply_dense_layout,
    release_freed_heap,
    validate_dense_layout,
)
from pipeline.weights.quant_load import load_stage_model
from tests.tiny_model import write_tiny_model
from workers.load_spec_codec import spec_from_proto, spec_to_proto

NUM_LAYERS = 4  # tiny_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dense-layout") / "tiny", seed=3)


def _stages(model_dir: Path, layout: str, cuts: list[int]) -> list[StageModel]:
    bounds = [0, *cuts, NUM_LAYERS]
    last = len(bounds) - 2
    return [load_stage_model(str(model_dir), LayerRange(a, b), is_first=i == 0, is_last=i == last,
                             dense_layout=layout) for i, (a, b) in enumerate(itertools.pairwise(bounds))]


def _greedy(stages: list[StageModel], prompt: list[int], num_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits [vocab] through the chained stages (prefill, then 1-row decode)."""
    kvs = [s.new_kv_cache(max_num_seqs=1, max_model_len=len(prompt) + num_new) for s in stages]
    tokens, logits, ids, start = [], [], prompt, 0
    for _ in range(num_new):
        x = torch.tensor(ids, dtype=torch.int64)
        spans = [Span(0, start, len(ids))]
        for stage, kv in zip(stages, kvs, strict=True):
            x = stage(x, spans, kv)
        logits.append(x[-1])
        start += len(ids)
        ids = [int(x[-1].argmax())]
        tokens.append(ids[0])
    return tokens, logits


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3])
def test_transposed_linear_computes_the_linears_product(bias, num_rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 160, bias=bias)
    fast = TransposedLinear.from_linear(linear)
    x = torch.randn(num_rows, 48)
    assert fast.weight_t.shape == (48, 160) and fast.weight_t.is_contiguous()
    assert (fast.in_features, fast.out_features) == (48, 160)
    torch.testing.assert_close(fast(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_fast_layout_transposes_exactly_the_wide_linears(tiny_dir):
    (model,) = _stages(tiny_dir, "fast", [])
    fast = {n for n, m in model.named_modules() if isinstance(m, TransposedLinear)}
    dense = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # tiny: hidden 64; qkv 128 x 64, gate_up 256 x 64 and the 256 x 64 head are wide; o 64 x 64 and down 64 x 128 not
    for i in range(NUM_LAYERS):
        assert {f"layers.{i}.self_attn.qkv_proj", f"layers.{i}.mlp.gate_up_proj"} <= fast
        assert {f"layers.{i}.self_attn.o_proj", f"layers.{i}.mlp.down_proj"} <= dense
    assert "lm_head" in fast and len(fast) == 2 * NUM_LAYERS + 1
    (ref,) = _stages(tiny_dir, "reference", [])
    assert not any(isinstance(m, TransposedLinear) for m in ref.modules())
    assert apply_dense_layout(ref, "reference") == []


def test_a_tied_head_gets_its_own_transposed_copy_and_the_embedding_stays(tiny_dir):
    (model,) = _stages(tiny_dir, "fast", [])
    assert model.embed_tokens.weight.shape == (256, 64)
    torch.testing.assert_close(model.lm_head.weight_t, model.embed_tokens.weight.t(), rtol=0, atol=0)


@pytest.mark.parametrize("cuts", [[], [2], [1, 3]], ids=["1-stage", "2-stages", "3-stages"])
def test_fast_layout_keeps_greedy_tokens_and_logits_within_rounding(tiny_dir, cuts):
    prompt = [5, 17, 99, 3, 250, 42, 7]
    want, want_logits = _greedy(_stages(tiny_dir, "reference", []), prompt, 24)
    got, got_logits = _greedy(_stages(tiny_dir, "fast", cuts), prompt, 24)
    assert got == want
    for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"decode step {step}")


@pytest.mark.parametrize(("layout", "quantization", "dtype", "device", "message"), [
    ("packed", "none", "float32", "cpu", "dense_layout must be one of reference, fast, got 'packed'"),
    ("fast", "int4", "float32", "cpu", "needs quantization none, dtype float32 and a CPU device (got int4,"),
    ("fast", "none", "bfloat16", "cpu", "(got none, bfloat16, cpu)"),
    ("fast", "none", torch.float16, "cpu", "(got none, float16, cpu)"),
    ("fast", "none", "float32", "cuda:0", "(got none, float32, cuda:0)"),
])
def test_fast_layout_outside_float32_on_cpu_is_refused_in_one_line(layout, quantization, dtype, device, message):
    with pytest.raises(ValueError, match=r".*" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        validate_dense_layout(layout, quantization=quantization, dtype=dtype, device=device)
    assert "\n" not in str(err.value)
    assert validate_dense_layout("reference", quantization=quantization, dtype="bfloat16", device=device) == "reference"


def test_loading_an_int_mode_with_the_fast_layout_fails_before_reading_weights(tiny_dir):
    with pytest.raises(ValueError, match="dense_layout fast needs quantization none"):
        load_stage_model(str(tiny_dir), LayerRange(0, NUM_LAYERS), is_first=True, is_last=True,
                         quantization="int8", dense_layout="fast")


def test_the_layout_survives_the_load_request_and_an_empty_field_means_reference(tiny_dir):
    spec = StageLoadSpec(model_dir=str(tiny_dir), stage_index=0, num_stages=2, layer_range=LayerRange(0, 2),
                         dense_layout="fast")
    req = spec_to_proto(spec)
    assert req.dense_layout == "fast" and spec_from_proto(req).dense_layout == "fast"
    req.dense_layout = ""
    assert spec_from_proto(req).dense_layout == "reference"
    with pytest.raises(ValueError, match="dense_layout fast needs"):
        StageLoadSpec(model_dir=str(tiny_dir), stage_index=0, num_stages=2, layer_range=LayerRange(0, 2),
                      dense_layout="fast", quantization="int4")


def test_swapping_drops_each_old_weight_and_names_the_layout_in_row_cost_tables():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))
    old = weakref.ref(model[0])
    assert apply_dense_layout(model, "fast") == ["0"]
    gc.collect()
    assert old() is None, "the untransposed linear must not outlive the swap"
    assert "in_features=8, out_features=32, bias=True" in repr(model[0])
    assert isinstance(release_freed_heap(), bool)
    assert numeric_mode_name(dtype="float32", quantization="none", dense_layout="fast") == "fp32-fast"
    assert numeric_mode_name(dtype="float32", quantization="none") == "fp32"
    assert RunConfig(dense_layout="fast").row_cost_mode == "fp32-fast"
    assert RunConfig().row_cost_mode == "fp32"
