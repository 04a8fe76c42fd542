"""Batch invariance of the batched attention path ([Note: batch-invariant attention] in pipeline/model/attention.py).

What breaks when these fail: a query row's attention output depends on how many rows its item
has, where the row sits in it, which other items (longer contexts: more key padding; prefills;
FIRP pseudo rows) share the pass. Speculative greedy output can then differ from plain greedy
output at a near-tie (a SPEED draft verified in a 1-row item, the same position inside a FIRP
chain). The check is bitwise, on the default model's head shape (9 heads, 3 KV heads, d = 64),
against the same row attended alone, with and without Gemma 2's attention soft-cap. Also: the cap is
applied to the scores before the mask on both paths (batched rows, SDPA prefills with and without
FIRP pseudo rows), as transformers' Gemma 2 eager attention does.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.model.attention import KEY_BLOCK, SMALL_ITEM_ROWS, AttentionPlan, span_attention
from pipeline.model.kv_cache import KVCache
from pipeline.model.row_layout import PseudoLayout, Span

HEADS, KV_HEADS, D = 9, 3, 64
MAX_LEN = 200


def _cache(dtype: torch.dtype, lengths: list[int], gen: torch.Generator) -> tuple[KVCache, list[tuple]]:
    """A one-layer cache with `lengths[s]` random positions in slot s; returns it and every slot's k/v."""
    kv = KVCache(num_layers=1, max_num_seqs=len(lengths), max_model_len=MAX_LEN, num_kv_heads=KV_HEADS,
                 head_dim=D, dtype=dtype)
    stored = []
    for slot, n in enumerate(lengths):
        k = torch.randn(KV_HEADS, MAX_LEN, D, generator=gen).to(dtype)
        v = torch.randn(KV_HEADS, MAX_LEN, D, generator=gen).to(dtype)
        kv.write(0, slot, 0, k[:, :n], v[:, :n])
        kv.set_length(slot, n)
        stored.append((k, v))
    return kv, stored


def _attend(kv, spans, q, k, v, pseudo: PseudoLayout | None = None, softcap: float | None = None) -> torch.Tensor:
    plan = AttentionPlan.build(spans, pseudo, torch.device("cpu"))
    return span_attention(q, k, v, plan, kv, 0, softcap=softcap)


def _item_rows(stored, span: Span, target_pos: int, q_target, gen, dtype):
    """q/k/v rows of `span`: its keys/values are the slot's stored ones (so the target sees the same
    context), the target position gets `q_target`, the other queries are random."""
    k, v = stored[span.slot]
    pos = slice(span.start, span.start + span.num_tokens)
    q = torch.randn(span.num_tokens, HEADS, D, generator=gen).to(dtype)
    if span.start <= target_pos < span.start + span.num_tokens:
        q[target_pos - span.start] = q_target
    return q, k[:, pos].transpose(0, 1).contiguous(), v[:, pos].transpose(0, 1).contiguous()


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "capped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("target_pos", [3, KEY_BLOCK - 1, KEY_BLOCK, 77])
def test_a_row_attends_bitwise_alike_in_every_item_shape_and_batch(dtype, target_pos, softcap):
    gen = torch.Generator().manual_seed(target_pos)
    others = [150, 40]  # slot 1: a longer context (more key padding for everyone), slot 2: shorter
    kv, stored = _cache(dtype, [target_pos + SMALL_ITEM_ROWS, *others], gen)
    q_target = torch.randn(HEADS, D, generator=gen).to(dtype)
    alone = Span(0, target_pos, 1)
    ref = _attend(kv, [alone], *_item_rows(stored, alone, target_pos, q_target, gen, dtype), softcap=softcap)[0]
    checked = 0
    for num_rows in range(1, SMALL_ITEM_ROWS + 1):
        for offset in sorted({0, num_rows // 2, num_rows - 1}):
            start = target_pos - offset
            if start < 0:
                continue
            span = Span(0, start, num_rows)
            for company in ([], [Span(1, others[0], 1)], [Span(2, others[1], 3), Span(1, others[0], 2)]):
                spans = [span, *company]
                parts = [_item_rows(stored, s, target_pos if s.slot == 0 else -1, q_target, gen, dtype) for s in spans]
                q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
                out = _attend(kv, spans, q, k, v, softcap=softcap)
                assert torch.equal(out[offset], ref), (
                    f"row at {target_pos} in a {num_rows}-row item (offset {offset}) with {len(company)} other "
                    f"items differs by {(out[offset].float() - ref.float()).abs().max().item():.3g}")
                checked += 1
    assert checked > 3 * SMALL_ITEM_ROWS


def test_pseudo_rows_and_a_prefill_in_the_pass_change_no_real_row():
    dtype, target_pos = torch.float32, 45
    gen = torch.Generator().manual_seed(1)
    kv, stored = _cache(dtype, [target_pos + 8, 60, 0], gen)
    q_target = torch.randn(HEADS, D, generator=gen)
    alone = Span(0, target_pos, 1)
    ref = _attend(kv, [alone], *_item_rows(stored, alone, target_pos, q_target, gen, dtype))[0]
    chained = Span(0, target_pos - 2, 4, num_anchors=4, chain_len=3)  # a FIRP k=3 verify item
    prefill = Span(2, 0, SMALL_ITEM_ROWS + 5)  # a large item: SDPA, attended on its own
    spans = [chained, Span(1, 60, 1), prefill]
    parts = [_item_rows(stored, s, target_pos if s.slot == 0 else -1, q_target, gen, dtype) for s in spans]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    num_pseudo = chained.num_pseudo
    q = torch.cat([q, torch.randn(num_pseudo, HEADS, D, generator=gen)])
    k = torch.cat([k, torch.randn(num_pseudo, KV_HEADS, D, generator=gen)])
    v = torch.cat([v, torch.randn(num_pseudo, KV_HEADS, D, generator=gen)])
    out = _attend(kv, spans, q, k, v, PseudoLayout.build(spans, "cpu"))
    assert torch.equal(out[2], ref), (out[2] - ref).abs().max()


def _eager_reference(q, keys, values, allowed, softcap):
    """transformers' Gemma 2 eager attention (the reference). q: [n, HEADS, D]; keys/values:
    [L, KV_HEADS, D]; allowed: [n, L] bool, True = attend. Returns [n, HEADS, D]."""
    import types

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = types.SimpleNamespace(head_dim=D, num_key_value_groups=HEADS // KV_HEADS, training=False)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                     values.transpose(0, 1)[None], mask, scaling=D ** -0.5, softcap=softcap)
    return out[0]


@pytest.mark.parametrize("span", [Span(0, 40, 1), Span(0, 40, 5), Span(0, 0, 40),
                                  Span(0, 0, SMALL_ITEM_ROWS + 4, num_anchors=2, chain_len=3)],
                         ids=["decode", "verify", "prefill", "prefill-with-pseudo-rows"])
def test_capped_attention_equals_transformers_eager_on_both_paths(span):
    gen = torch.Generator().manual_seed(7)
    kv, stored = _cache(torch.float32, [span.start], gen)
    end, num_pseudo = span.start + span.num_tokens, span.num_pseudo
    k_all, v_all = (t[:, :end].transpose(0, 1) for t in stored[0])  # [end, KV_HEADS, D]
    q = torch.randn(span.num_tokens + num_pseudo, HEADS, D, generator=gen)
    kp, vp = (torch.randn(num_pseudo, KV_HEADS, D, generator=gen) for _ in range(2))
    k, v = torch.cat([k_all[span.start:], kp]), torch.cat([v_all[span.start:], vp])
    pseudo = PseudoLayout.build([span], "cpu") if num_pseudo else None
    if pseudo is not None:
        allowed = pseudo.masks[0]
    else:
        allowed = torch.arange(end)[None, :] <= torch.arange(span.start, end)[:, None]
    keys, values = torch.cat([k_all, kp]), torch.cat([v_all, vp])
    capped = _attend(kv, [span], q, k, v, pseudo, softcap=2.0)
    torch.testing.assert_close(capped, _eager_reference(q, keys, values, allowed, 2.0), rtol=1e-5, atol=1e-5)
    uncapped = _attend(kv, [span], q, k, v, pseudo)
    torch.testing.assert_close(uncapped, _eager_reference(q, keys, values, allowed, None), rtol=1e-5, atol=1e-5)
    assert (capped - uncapped).abs().max() > 1e-2, "the cap does not bite: the comparison proves nothing"


@pytest.mark.parametrize("span", [Span(0, 40, 1), Span(0, 0, 40)], ids=["decode", "prefill"])
def test_no_cap_runs_no_cap_op_and_prefills_keep_sdpa(span):
    """Families without a cap pay nothing for Gemma 2's: no tanh and SDPA kept for prefills; a capped
    prefill leaves SDPA (it has no cap) for the written-out scores."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    seen = {}
    for softcap in (None, 2.0):
        kv, stored = _cache(torch.float32, [span.start], gen)
        rows = _item_rows(stored, span, -1, None, gen, torch.float32)
        with Ops() as ops:
            _attend(kv, [span], *rows, softcap=softcap)
        seen[softcap] = ops.names
    assert not any("tanh" in n for n in seen[None]) and any("tanh" in n for n in seen[2.0])
    if span.num_tokens > SMALL_ITEM_ROWS:
        sdpa = {n for n in seen[None] if "scaled_dot_product" in n}
        assert sdpa and not sdpa & seen[2.0], (sdpa, seen[2.0])


@pytest.mark.parametrize("span", [Span(0, 0, 40), Span(0, 0, SMALL_ITEM_ROWS + 4, num_anchors=2, chain_len=3)],
                         ids=["prefill", "prefill-with-pseudo-rows"])
def test_a_capped_prefill_holds_its_scores_in_query_blocks_and_equals_transformers_eager(monkeypatch, span):
    """A soft-capped prefill of n rows over L keys never makes the [heads, n, L] float32 scores (8 GiB
    per layer for a 8192-token Gemma 2 prompt with 32 heads, twice with the softmax), only
    [heads, block, L] ones; the blocks (a ragged last one too) still give transformers' eager result.
    Before: one [1, heads, n, L] scores tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.model import attention

    monkeypatch.setattr(attention, "CAPPED_QUERY_BLOCK", 16, raising=False)
    gen = torch.Generator().manual_seed(5)
    kv, stored = _cache(torch.float32, [0], gen)
    n, num_pseudo = span.num_tokens + span.num_pseudo, span.num_pseudo
    k_all, v_all = (t[:, :span.num_tokens].transpose(0, 1) for t in stored[0])
    q = torch.randn(n, HEADS, D, generator=gen)
    kp, vp = (torch.randn(num_pseudo, KV_HEADS, D, generator=gen) for _ in range(2))
    k, v = torch.cat([k_all, kp]), torch.cat([v_all, vp])
    pseudo = PseudoLayout.build([span], "cpu") if num_pseudo else None
    allowed = pseudo.masks[0] if pseudo is not None else torch.ones(n, n, dtype=torch.bool).tril()

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes: set[tuple[int, ...]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.shapes.add(tuple(out.shape))
            return out

    with Shapes() as seen:
        out = _attend(kv, [span], q, k, v, pseudo, softcap=2.0)
    assert (1, HEADS, n, n) not in seen.shapes and (1, HEADS, 16, n) in seen.shapes, sorted(seen.shapes)
    torch.testing.assert_close(out, _eager_reference(q, k, v, allowed, 2.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [*range(6), "block-edge", "zero"])
def test_the_one_row_plan_has_every_field_of_the_general_plan(seed):
    """[Note: one-row plans] in pipeline/model/attention.py: items of one real row each get their plan
    from a short path; each field (dtype, shape and values), and the sliding-window mask made from
    it, must be the general build's."""
    import dataclasses
    import random

    rng = random.Random(str(seed))
    starts = [0, 1, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 77, 150]
    spans = [Span(rng.randrange(4), rng.choice(starts), 1) for _ in range(rng.randint(1, 6))]
    if not isinstance(seed, int):  # the longest item ends on a key block's last position / at position 0
        spans = [Span(2, KEY_BLOCK - 1, 1), Span(0, 3, 1)] if seed == "block-edge" else [Span(1, 0, 1)]
    fast = AttentionPlan.build(spans, None, torch.device("cpu"), scratch_base=MAX_LEN)
    general = AttentionPlan._build_general(spans, None, torch.device("cpu"), scratch_base=MAX_LEN)
    for field in dataclasses.fields(AttentionPlan):
        a, b = getattr(fast, field.name), getattr(general, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    assert torch.equal(fast.masked_out_for(5), general.masked_out_for(5))
