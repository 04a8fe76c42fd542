"""Token-tree sibling rows in the model ([Note: sibling rows] in pipeline/model/row_layout.py).

What breaks when these fail: a sibling candidate row sees the primary candidate's key (a wrong
tree mask), sits at the wrong RoPE position, leaks its keys/values into the sequence's real
positions, or computes different numbers than the same token run as a plain 1-row item (so a
rescued sibling would commit a token plain decoding would not); or the KV fix-up that keeps a
verified sibling does not leave the cache exactly as a run that had the sibling token there.
The references are plain runs on a cloned cache; bitwise in the batch-invariant int modes and in
the attention alone, within float rounding in float32 `none` ([Note: batch invariance] in
pipeline/weights/quant.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.model.attention import AttentionPlan, span_attention
from pipeline.model.kv_cache import KVCache
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.weights.checkpoint import CheckpointReader
from pipeline.weights.quant_load import load_stage_model
from tests.tiny_model import write_tiny_model

PROMPT = [5, 17, 200, 33, 9, 81, 140, 7, 99]
OTHER = [44, 3, 12, 250, 1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4)


def _model(folder, mode: str, layers: LayerRange | None = None, *, is_first=True, is_last=True):
    n = CheckpointReader(folder).config.num_hidden_layers
    return load_stage_model(str(folder), layers or LayerRange(0, n), is_first=is_first, is_last=is_last,
                            quantization=mode)


def _check(a: torch.Tensor, b: torch.Tensor, mode: str) -> None:
    if mode == "none":  # float32 dense GEMM: only within rounding ([Note: batch invariance])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(a, b), f"{mode}: max diff {(a - b).abs().max().item()}"


def _prefilled(model, num_scratch: int) -> KVCache:
    kv = model.new_kv_cache(max_num_seqs=2, max_model_len=64, num_scratch=num_scratch)
    model(torch.tensor(PROMPT + OTHER), [Span(0, 0, len(PROMPT)), Span(1, 0, len(OTHER))], kv)
    return kv


def _tree_pass(model, kv, p: int, primary: int, siblings: list[int]) -> torch.Tensor:
    """One pass: sequence 0's draft item at p (primary + siblings) next to a decode of sequence 1."""
    spans = [Span(1, len(OTHER), 1), Span(0, p, 1), *(Span(0, p, 1, scratch=j) for j in range(len(siblings)))]
    x = torch.tensor([OTHER[-1], primary, *siblings])
    return model(x, spans, kv, logit_rows=torch.arange(len(spans)))


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_a_sibling_row_computes_what_a_plain_item_with_its_token_computes(folder, mode):
    model = _model(folder, mode)
    kv = _prefilled(model, num_scratch=3)
    p, primary, siblings = len(PROMPT), 17, [200, 81, 3]
    ref_kv = copy.deepcopy(kv)
    logits = _tree_pass(model, kv, p, primary, siblings)
    for row, token in enumerate([primary, *siblings]):
        alone = copy.deepcopy(ref_kv)
        plain = model(torch.tensor([token]), [Span(0, p, 1)], alone)[0]
        _check(logits[1 + row], plain, mode)
    assert kv.lengths == [p + 1, len(OTHER) + 1]  # siblings leave the slot length alone
    # the primary's keys/values went to position p, as a plain run of the primary writes them
    alone = copy.deepcopy(ref_kv)
    model(torch.tensor([primary]), [Span(0, p, 1)], alone)
    _check(kv.k[:, 0, :, :p + 1], alone.k[:, 0, :, :p + 1], mode)


@pytest.mark.parametrize("mode", ["none", "int4"])
@pytest.mark.parametrize("chosen", [0, 1])
def test_keeping_a_sibling_leaves_the_kv_of_a_run_that_had_its_token(folder, mode, chosen):
    model = _model(folder, mode)
    kv = _prefilled(model, num_scratch=2)
    p, primary, siblings = len(PROMPT), 17, [200, 81]
    ref = copy.deepcopy(kv)
    model(torch.tensor([siblings[chosen]]), [Span(0, p, 1)], ref)
    _tree_pass(model, kv, p, primary, siblings)
    kv.keep_scratch(0, chosen, p)
    _check(kv.k[:, 0, :, :p + 1], ref.k[:, 0, :, :p + 1], mode)
    _check(kv.v[:, 0, :, :p + 1], ref.v[:, 0, :, :p + 1], mode)
    # and the next token decodes alike from both caches
    nxt_a = model(torch.tensor([5]), [Span(0, p + 1, 1)], kv)[0]
    nxt_b = model(torch.tensor([5]), [Span(0, p + 1, 1)], ref)[0]
    _check(nxt_a, nxt_b, mode)


def test_sibling_rows_are_exact_across_a_stage_split(folder):
    n = CheckpointReader(folder).config.num_hidden_layers
    first = _model(folder, "int4", LayerRange(0, 1), is_last=False)
    rest = _model(folder, "int4", LayerRange(1, n), is_first=False)
    full = _model(folder, "int4")
    kv0, kv1 = (m.new_kv_cache(max_num_seqs=2, max_model_len=64, num_scratch=1) for m in (first, rest))
    p = len(PROMPT)
    rest(first(torch.tensor(PROMPT), [Span(0, 0, p)], kv0), [Span(0, 0, p)], kv1)
    spans = [Span(0, p, 1), Span(0, p, 1, scratch=0)]
    logits = rest(first(torch.tensor([17, 200]), spans, kv0), spans, kv1, logit_rows=torch.arange(2))
    kv = full.new_kv_cache(max_num_seqs=2, max_model_len=64)
    full(torch.tensor(PROMPT), [Span(0, 0, p)], kv)
    plain = full(torch.tensor([200]), [Span(0, p, 1)], kv)[0]
    assert torch.equal(logits[1], plain)


def test_a_sibling_row_ignores_the_primary_and_the_scratch_of_others_bitwise_in_attention():
    heads, kv_heads, d, p = 9, 3, 64, 40
    gen = torch.Generator().manual_seed(1)
    kv = KVCache(num_layers=1, max_num_seqs=1, max_model_len=100, num_kv_heads=kv_heads, head_dim=d,
                 dtype=torch.float32, num_scratch=2)
    k0, v0 = torch.randn(kv_heads, p, d, generator=gen), torch.randn(kv_heads, p, d, generator=gen)
    kv.write(0, 0, 0, k0, v0)
    kv.set_length(0, p)
    q, k, v = (torch.randn(3, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    spans = [Span(0, p, 1), Span(0, p, 1, scratch=0), Span(0, p, 1, scratch=1)]
    ref_kv = copy.deepcopy(kv)
    out = span_attention(q, k, v, AttentionPlan.build(spans, None, torch.device("cpu"), scratch_base=100), kv, 0)
    for row in range(3):
        alone = copy.deepcopy(ref_kv)
        plan = AttentionPlan.build([Span(0, p, 1)], None, torch.device("cpu"))
        ref = span_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], plan, alone, 0)
        assert torch.equal(out[row], ref[0]), row
    assert torch.equal(kv.k[0, 0, :, p], k[0]) and torch.equal(kv.k[0, 0, :, 100 + 1], k[2])  # primary, scratch 1
    with pytest.raises(ValueError, match="scratch position 2"):
        kv.keep_scratch(0, 2, p)
