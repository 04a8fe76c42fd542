"""RoPE's rotation and the RMSNorm's float32 path: the op-saving forms give the textbook numbers bit for bit."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.family_blocks import RMSNorm
from pipeline.model.rope import rope_cos_sin, rope_inv_freq, rotate, rotation_tables


def textbook_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb writes it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_rotate_equals_the_textbook_rotation_bitwise(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.arange(num_tokens) * 37 + 5
    cos, sin = rope_cos_sin(positions, rope_inv_freq(64, 10000.0, None), dtype)
    x = (torch.randn(num_tokens, 12, 64, generator=gen) * 3).to(dtype)
    expected = textbook_rope(x, cos, sin)
    assert torch.equal(rotate(x, *rotation_tables(cos, sin)), expected)


def test_rotate_reads_a_strided_view_of_fused_qkv_columns():
    # Attention rotates q and k as one view of the fused projection's output, without a copy
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen)
    qk = qkv[:, :6 * 16].reshape(5, 6, 16)
    assert not qk.is_contiguous()
    cos, sin = rope_cos_sin(torch.arange(5) + 100, rope_inv_freq(16, 10000.0, None), torch.float32)
    assert torch.equal(rotate(qk, *rotation_tables(cos, sin)), textbook_rope(qk.contiguous(), cos, sin))


def test_rotation_tables_shapes_and_sign():
    cos, sin = rope_cos_sin(torch.arange(3), rope_inv_freq(8, 10000.0, None), torch.float32)
    c, s = rotation_tables(cos, sin)
    assert c.shape == s.shape == (3, 1, 8)
    assert torch.equal(s[:, 0, :4], -sin[:, :4]) and torch.equal(s[:, 0, 4:], sin[:, 4:])


@pytest.mark.parametrize("num_rows", [1, 2, 9])
def test_rms_norm_float32_path_equals_the_cast_formula_bitwise(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x = torch.randn(num_rows, 576, generator=gen) * 4
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)
        norm_bf, bf = RMSNorm(576, 1e-5).to(torch.bfloat16), x.to(torch.bfloat16)
        norm_bf.weight.data = norm.weight.data.to(torch.bfloat16)
        bf32 = bf.float()  # the bfloat16 path: normalise in float32, cast back, then the weight
        expected_bf = norm_bf.weight * (bf32 * torch.rsqrt(bf32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        out = norm_bf(bf)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected_bf)


# -- [Note: cached rotation tables] in pipeline/model/rope.py -----------------------------------------

@pytest.mark.parametrize("family", ["tiny", "llama3", "gemma3_text", "phi3-longrope", "qwen3-yarn", "llama-longrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_rotation_tables_are_the_per_pass_computation_bitwise(family, dtype):
    """StageModel.rope_tables gathers from tables computed once; every position's rows must be the
    bits the per-pass `rotation_tables(*config_cos_sin(...))` gives, alone (a decode pass) and among
    others (a verify pass, a prefill), past the first growth of the tables, for each RoPE kind."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.rope import ROTATION_TABLE_CHUNK, config_cos_sin
    from pipeline.model.stage_model import StageModel, set_rope_buffers
    from tests.family_models import family_config

    config = tiny_config() if family == "tiny" else family_config(family)
    with torch.device("meta"):
        model = StageModel(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True)
    set_rope_buffers(model, config)

    def per_pass(positions):
        tables = {False: rotation_tables(*config_cos_sin(config, positions, model.inv_freq, model.inv_freq_long, dtype))}
        if config.rope_local_theta is not None:
            tables[True] = rotation_tables(*rope_cos_sin(positions, model.inv_freq_local, dtype))
        return {i: tables[config.rope_local_theta is not None and config.is_sliding(i)] for i in model.layer_range}

    def check(positions):
        with torch.inference_mode():
            got, want = model.rope_tables(positions, dtype), per_pass(positions)
        for layer in model.layer_range:
            assert all(torch.equal(g, w) for g, w in zip(got[layer], want[layer], strict=True)), (layer, positions)

    check(torch.tensor([3]))  # first tables: one chunk
    for p in range(2 * ROTATION_TABLE_CHUNK + 40):  # every position alone, across two growths
        check(torch.tensor([p]))
    check(torch.arange(ROTATION_TABLE_CHUNK - 5, ROTATION_TABLE_CHUNK + 300))  # a long prefill across chunks
    check(torch.tensor([700, 5, 701, 702, 30]))  # rows in any order


def test_cached_rotation_tables_follow_new_frequencies_and_serve_autograd():
    """New frequency buffers (a model moved or re-filled) rebuild the tables; tables first built in
    inference mode are plain tensors that ops recorded for backward may use (training code)."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.stage_model import StageModel, set_rope_buffers

    config = tiny_config()
    with torch.device("meta"):
        model = StageModel(config, LayerRange(0, 1), is_first=True, is_last=False)
    set_rope_buffers(model, config)
    with torch.inference_mode():
        before = model.rope_tables(torch.tensor([9]), torch.float32)[0]
    x = torch.randn(1, 2, config.head_dim, requires_grad=True)
    rotate(x, *model.rope_tables(torch.tensor([9]), torch.float32)[0]).sum().backward()  # the same tables
    assert x.grad is not None
    model.inv_freq = model.inv_freq * 2
    after = model.rope_tables(torch.tensor([9]), torch.float32)[0]
    assert torch.equal(after[0], rope_cos_sin(torch.tensor([9]), model.inv_freq, torch.float32)[0][:, None, :])
    assert not torch.equal(before[0], after[0])


def test_cached_rotation_tables_grow_by_a_bounded_headroom():
    """[Note: cached rotation tables]: a position past the tables grows them at most
    ROTATION_TABLE_HEADROOM positions past it (no doubling of a long context's tables), with the
    per-pass values there."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.rope import ROTATION_TABLE_HEADROOM, config_cos_sin
    from pipeline.model.stage_model import StageModel, set_rope_buffers

    config = tiny_config()
    with torch.device("meta"):
        model = StageModel(config, LayerRange(0, 1), is_first=True, is_last=False)
    set_rope_buffers(model, config)
    for p in (9, 20_000, 20_001):
        got = model.rope_tables(torch.tensor([p]), torch.float32)[0]
        want = rotation_tables(*config_cos_sin(config, torch.tensor([p]), model.inv_freq, None, torch.float32))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert model._rotations[(False, torch.float32)]._cos.shape[0] <= p + 1 + ROTATION_TABLE_HEADROOM


def test_cached_rotation_tables_of_no_positions_are_the_per_pass_empty_tables():
    """A lookup of zero positions before any table exists gives the per-pass (empty) tables, as the
    uncached `rotation_tables(*config_cos_sin(...))` does, instead of failing on the absent tables."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.rope import config_cos_sin
    from pipeline.model.stage_model import StageModel, set_rope_buffers

    config = tiny_config()
    with torch.device("meta"):
        model = StageModel(config, LayerRange(0, 1), is_first=True, is_last=False)
    set_rope_buffers(model, config)
    none = torch.tensor([], dtype=torch.int64)
    got = model.rope_tables(none, torch.float32)[0]
    want = rotation_tables(*config_cos_sin(config, none, model.inv_freq, None, torch.float32))
    assert all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want, strict=True))


def test_positions_off_the_cpu_get_the_per_pass_tables_without_reading_a_position_back():
    """[Note: cached rotation tables]: on an accelerator the lookup would read the largest position
    back to the host every pass (a device sync); such positions get the per-pass computation and
    never touch the cache. "meta" stands in for the accelerator: reading a meta tensor's value fails."""
    from pipeline.model.rope import RotationTables

    inv_freq = rope_inv_freq(16, 10_000.0, None)
    tables = RotationTables()
    positions = torch.arange(5, device="meta")
    cos, signed_sin = tables.lookup(positions, (inv_freq,), lambda p: rope_cos_sin(p, inv_freq.to(p.device),
                                                                                   torch.float32))
    assert cos.device.type == "meta" and cos.shape == (5, 1, 16) and signed_sin.shape == (5, 1, 16)
    assert tables._cos is None  # nothing cached


@pytest.mark.parametrize("family", ["tiny", "gemma3_text", "phi3-longrope"])
def test_cached_rotation_tables_stop_at_their_bound_and_answer_past_it_per_pass(family):
    """[Note: cached rotation tables]: with `max_positions` B the tables never hold more than B positions
    (a decode walk to the last position leaves exactly B, where the headroom would have taken 256), and a
    pass reaching past B gets the per-pass bits while the tables stay as they were."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.rope import config_cos_sin
    from pipeline.model.stage_model import StageModel, set_rope_buffers
    from tests.family_models import family_config

    config = tiny_config() if family == "tiny" else family_config(family)
    with torch.device("meta"):
        model = StageModel(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True)
    set_rope_buffers(model, config)
    bound = 40

    def per_pass(positions):
        tables = {False: rotation_tables(*config_cos_sin(config, positions, model.inv_freq, model.inv_freq_long,
                                                         torch.float32))}
        if config.rope_local_theta is not None:
            tables[True] = rotation_tables(*rope_cos_sin(positions, model.inv_freq_local, torch.float32))
        return {i: tables[config.rope_local_theta is not None and config.is_sliding(i)] for i in model.layer_range}

    def check(positions):
        got, want = model.rope_tables(positions, torch.float32, max_positions=bound), per_pass(positions)
        for layer in model.layer_range:
            assert all(torch.equal(g, w) for g, w in zip(got[layer], want[layer], strict=True)), (layer, positions)
        return [(t._cos, t._signed_sin) for t in model._rotations.values()]

    for p in range(bound):
        held = check(torch.tensor([p]))
        assert all(c.shape[0] <= bound and s.shape[0] <= bound for c, s in held)
    assert all(c.shape[0] == bound for c, _ in held)
    assert len(held) == 1 + (config.rope_local_theta is not None)
    for positions in (torch.tensor([bound]), torch.tensor([bound - 1, bound, bound + 2]), torch.tensor([5000])):
        after = check(positions)  # past the bound: the per-pass values, the tables untouched
        assert all(a[0] is h[0] and a[1] is h[1] for a, h in zip(after, held, strict=True))


def test_a_stage_bounds_its_tables_by_its_kv_cache_and_rotates_firp_rows_past_it_exactly():
    """StageModel.forward_rows bounds the tables by the positions its KV cache holds (max_model_len plus
    token-tree scratch positions): a pass at the last position leaves exactly that many. FIRP pseudo rows
    of the last position reach past it; they get the per-pass tables, so the pass's logits equal those of
    the same pass on a cache long enough for cached tables to cover them."""
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.row_layout import Span
    from pipeline.model.stage_model import build_stage_model
    from tests.tiny_model import random_state_dict

    cfg = tiny_config()
    state = random_state_dict(cfg, seed=3, std=0.2)
    outs = []
    for max_model_len, num_scratch in ((40, 3), (64, 0)):
        model = build_stage_model(cfg, LayerRange(0, cfg.num_hidden_layers), is_first=True, is_last=True,
                                  tensors=dict(state))
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=max_model_len, num_scratch=num_scratch)
        model.forward(torch.arange(39) % cfg.vocab_size, [Span(0, 0, 39)], kv)
        tables = model._rotations[(False, torch.float32)]
        if max_model_len == 40:
            assert tables._cos.shape[0] == 43  # 40 positions + 3 scratch, not the 256 of a first chunk
        pseudo = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # positions 40..44
        outs.append(model.forward_rows(torch.tensor([7]), [Span(0, 39, 1, num_anchors=1, chain_len=5)], kv,
                                       pseudo=pseudo))
        assert tables._cos.shape[0] == (43 if max_model_len == 40 else 64)
    assert torch.equal(outs[0].out, outs[1].out) and torch.equal(outs[0].pseudo, outs[1].pseudo)
