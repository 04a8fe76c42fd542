"""tests/benchmarks/compile_blocks.py times the model's own maths, not something close to it.

What breaks when this fails: the benchmark's `blocks` (and so its compiled passes) would time a
layer that differs from DecoderLayer, and its ratios would say nothing about the runtime.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.model.attention import AttentionPlan, span_attention
from pipeline.model.row_layout import Span
from tests.benchmarks import compile_blocks
from tests.benchmarks.row_cost import load_mode
from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_mode(write_tiny_model(tmp_path_factory.mktemp("compile-blocks") / "tiny", seed=5), "fp32-fast")


@pytest.mark.parametrize("num_rows", [1, 3])
def test_block_functions_equal_the_decoder_layers_bitwise(model, num_rows):
    pre, post = compile_blocks.block_functions(model.config)
    kv_a, kv_b = (model.new_kv_cache(max_num_seqs=1, max_model_len=64) for _ in range(2))
    with torch.inference_mode():
        for kv in (kv_a, kv_b):
            model.forward_rows(torch.arange(20) + 3, [Span(0, 0, 20)], kv)
        spans = [Span(0, 20, num_rows)]
        plan = AttentionPlan.build(spans, None, torch.device("cpu"), scratch_base=64)
        cos, sin = model.rope_tables(torch.arange(20, 20 + num_rows), torch.float32)[0]
        x = y = model.embed_tokens(torch.arange(num_rows) + 40)
        for i, layer in enumerate(model.layers.values()):
            x = layer(x, cos, sin, plan, kv_a, i)
            ln_w, qkv_t, o_w, ln2_w, gate_up_t, down_w = compile_blocks.layer_weights(layer)
            q, k, v = pre(y, ln_w, qkv_t, cos, sin)
            y = post(y, span_attention(q, k, v, plan, kv_b, i), o_w, ln2_w, gate_up_t, down_w)
            assert torch.equal(x, y), f"layer {i}"
        assert torch.equal(kv_a.k, kv_b.k) and torch.equal(kv_a.v, kv_b.v)
