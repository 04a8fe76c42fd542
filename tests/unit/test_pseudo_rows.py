"""Unit tests for FIRP pseudo rows in StageModel ([Note: pseudo rows] in pipeline/model/stage_model.py).

What breaks when these fail: pseudo rows attending to the wrong keys (a wrong mask, wrong RoPE
positions), pseudo rows leaking into the persistent KV cache, or pseudo rows changing the real
rows' outputs. The reference runs each chain as real rows on a cloned, truncated cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.model.config import tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import build_stage_model
from tests.tiny_model import random_state_dict

TOL = {"rtol": 1e-5, "atol": 1e-5}
PROMPT = [5, 17, 200, 33, 9, 81, 140, 7, 99]


def _models(firp_layer: int):
    cfg = tiny_config()
    state = random_state_dict(cfg, seed=3, std=0.2)
    n = cfg.num_hidden_layers
    first = build_stage_model(cfg, LayerRange(0, firp_layer + 1), is_first=True, is_last=False, tensors=state)
    rest = build_stage_model(cfg, LayerRange(firp_layer + 1, n), is_first=False, is_last=True, tensors=state)
    full = build_stage_model(cfg, LayerRange(0, n), is_first=True, is_last=True, tensors=state)
    return cfg, first, rest, full


def _maps(cfg, chain_len: int):
    gen = torch.Generator().manual_seed(7)
    weights = 0.3 * torch.randn(chain_len, cfg.hidden_size, cfg.hidden_size, generator=gen)

    def make_pseudo(anchor_hidden: torch.Tensor) -> torch.Tensor:
        # [A, H] -> [A * k, H], chains in anchor order
        return torch.einsum("kij,aj->aki", weights, anchor_hidden).reshape(-1, cfg.hidden_size)

    return make_pseudo


@pytest.mark.parametrize("num_anchors,chain_len", [(1, 1), (1, 3), (3, 2), (4, 4)])
def test_pseudo_rows_equal_real_rows_on_a_cloned_cache_and_leave_the_cache_alone(num_anchors, chain_len):
    firp_layer = 1
    cfg, first, rest, _ = _models(firp_layer)
    make_pseudo = _maps(cfg, chain_len)
    kv_a, kv_b = (m.new_kv_cache(max_num_seqs=2, max_model_len=64) for m in (first, rest))
    # Prefill a context in slot 1, then a 4-row item [real, drafts] with pseudo chains.
    ctx = PROMPT
    h = first(torch.tensor(ctx), [Span(1, 0, len(ctx))], kv_a)
    rest(h, [Span(1, 0, len(ctx))], kv_b)
    item = [11, 12, 13, 14]
    start = len(ctx)
    plain = Span(1, start, len(item))
    span = Span(1, start, len(item), num_anchors=num_anchors, chain_len=chain_len)
    kv_b_before = copy.deepcopy(kv_b)

    # Reference: same real rows without pseudo rows (cloned caches).
    ref_a, ref_b = copy.deepcopy(kv_a), copy.deepcopy(kv_b)
    ref_h = first(torch.tensor(item), [plain], ref_a)
    ref_logits = rest(ref_h, [plain], ref_b, logit_rows=torch.arange(len(item)))

    out_a = first.forward_rows(torch.tensor(item), [span], kv_a, firp_layer=firp_layer, make_pseudo=make_pseudo)
    assert out_a.pseudo is not None and out_a.pseudo.shape == (span.num_pseudo, cfg.hidden_size)
    out_b = rest.forward_rows(out_a.out, [span], kv_b, pseudo=out_a.pseudo, logit_rows=torch.arange(len(item)))
    torch.testing.assert_close(out_a.out, ref_h, **TOL)
    torch.testing.assert_close(out_b.out, ref_logits, **TOL)
    # The persistent caches hold exactly what the plain run wrote.
    assert kv_a.lengths == ref_a.lengths and kv_b.lengths == ref_b.lengths
    end = start + len(item)
    torch.testing.assert_close(kv_b.k[:, :, :, :end], ref_b.k[:, :, :, :end], **TOL)
    torch.testing.assert_close(kv_b.v[:, :, :, :end], ref_b.v[:, :, :, :end], **TOL)
    assert not kv_b.k[:, :, :, end:].any(), "pseudo rows were written into the KV cache"

    # Each chain == its pseudo hidden states run as real rows after the anchor on a cloned cache.
    for a in range(num_anchors):
        anchor_row = len(item) - num_anchors + a
        kv = copy.deepcopy(kv_b_before)
        rest(ref_h[:anchor_row + 1], [Span(1, start, anchor_row + 1)], kv)
        chain = out_a.pseudo[a * chain_len:(a + 1) * chain_len]
        want = rest(chain, [Span(1, start + anchor_row + 1, chain_len)], kv, logit_rows=torch.arange(chain_len))
        torch.testing.assert_close(out_b.pseudo[a * chain_len:(a + 1) * chain_len], want, **TOL)


def test_pseudo_rows_made_mid_stage_equal_pseudo_rows_made_by_an_earlier_stage():
    firp_layer = 1
    cfg, first, rest, full = _models(firp_layer)
    make_pseudo = _maps(cfg, 2)
    kv_a, kv_b, kv_full = (m.new_kv_cache(max_num_seqs=3, max_model_len=64) for m in (first, rest, full))
    spans = [Span(0, 0, 5, num_anchors=1, chain_len=2), Span(2, 0, 3), Span(1, 0, 4, num_anchors=2, chain_len=2)]
    x = torch.tensor([3, 4, 5, 6, 7, 30, 31, 32, 60, 61, 62, 63])
    mid = first.forward_rows(x, spans, kv_a, firp_layer=firp_layer, make_pseudo=make_pseudo)
    split = rest.forward_rows(mid.out, spans, kv_b, pseudo=mid.pseudo)
    whole = full.forward_rows(x, spans, kv_full, firp_layer=firp_layer, make_pseudo=make_pseudo)
    torch.testing.assert_close(whole.out, split.out, **TOL)
    torch.testing.assert_close(whole.pseudo, split.pseudo, **TOL)
    assert whole.pseudo.shape == (6, cfg.vocab_size)


def test_wrong_number_of_pseudo_rows_is_an_error():
    _, _, rest, _ = _models(1)
    kv = rest.new_kv_cache(max_num_seqs=1, max_model_len=16)
    span = Span(0, 0, 2, num_anchors=1, chain_len=3)
    with pytest.raises(ValueError, match="pseudo rows"):
        rest.forward_rows(torch.zeros(2, 64), [span], kv, pseudo=torch.zeros(2, 64))
