"""Unit tests for pipeline.model.kv_cache: write/view/truncate/free semantics and write validation."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.kv_cache import KVCache

NUM_KV_HEADS, HEAD_DIM = 2, 4


def _cache(*, num_layers: int = 2, max_num_seqs: int = 3, max_model_len: int = 8) -> KVCache:
    return KVCache(num_layers=num_layers, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32)


def _kv(num_tokens: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct k, v: [num_kv_heads, num_tokens, head_dim] filled from `base`."""
    k = base + torch.arange(NUM_KV_HEADS * num_tokens * HEAD_DIM, dtype=torch.float32)
    k = k.view(NUM_KV_HEADS, num_tokens, HEAD_DIM)
    return k, -k


def test_buffers_have_the_documented_shape_and_size():
    kv = _cache(num_layers=2, max_num_seqs=3, max_model_len=8)
    assert kv.k.shape == (2, 3, NUM_KV_HEADS, 8, HEAD_DIM) == kv.v.shape
    assert kv.nbytes == 2 * 2 * 3 * NUM_KV_HEADS * 8 * HEAD_DIM * 4
    assert kv.lengths == [0, 0, 0]


def test_write_then_view_returns_what_was_written_per_layer_and_slot():
    kv = _cache()
    k0, v0 = _kv(3, 0.0)
    k1, v1 = _kv(3, 1000.0)
    kv.write(0, 1, 0, k0, v0)
    kv.write(1, 1, 0, k1, v1)
    kv.set_length(1, 3)
    keys, values = kv.view(0, 1, 3)
    assert keys.shape == (NUM_KV_HEADS, 3, HEAD_DIM)
    torch.testing.assert_close(keys, k0, rtol=0, atol=0)
    torch.testing.assert_close(values, v0, rtol=0, atol=0)
    torch.testing.assert_close(kv.view(1, 1, 3)[0], k1, rtol=0, atol=0)
    # Other slots are untouched.
    assert kv.view(0, 0, 8)[0].abs().sum() == 0 and kv.view(0, 2, 8)[0].abs().sum() == 0
    assert kv.lengths == [0, 3, 0]


def test_write_appends_after_existing_positions():
    kv = _cache()
    k_a, v_a = _kv(2, 0.0)
    k_b, v_b = _kv(1, 500.0)
    kv.write(0, 0, 0, k_a, v_a)
    kv.set_length(0, 2)
    kv.check_write(0, 2, 1)
    kv.write(0, 0, 2, k_b, v_b)
    kv.set_length(0, 3)
    keys, values = kv.view(0, 0, 3)
    torch.testing.assert_close(keys, torch.cat([k_a, k_b], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v_a, v_b], dim=1), rtol=0, atol=0)


def test_truncate_rolls_back_and_a_rewrite_replaces_the_dead_positions():
    kv = _cache()
    k, v = _kv(5, 0.0)
    kv.write(0, 0, 0, k, v)
    kv.set_length(0, 5)
    kv.truncate(0, 3)
    assert kv.lengths[0] == 3
    with pytest.raises(ValueError, match="gap"):
        kv.check_write(0, 4, 1)  # position 3 is dead now: writing at 4 would leave a gap
    k_new, v_new = _kv(2, 900.0)
    kv.check_write(0, 3, 2)
    kv.write(0, 0, 3, k_new, v_new)
    kv.set_length(0, 5)
    keys, _ = kv.view(0, 0, 5)
    torch.testing.assert_close(keys[:, :3], k[:, :3], rtol=0, atol=0)
    torch.testing.assert_close(keys[:, 3:], k_new, rtol=0, atol=0)


def test_truncate_to_a_longer_length_is_a_no_op():
    kv = _cache()
    kv.set_length(1, 2)
    kv.truncate(1, 6)
    assert kv.lengths[1] == 2


def test_free_resets_the_slot_length_and_slots_in_use():
    kv = _cache()
    kv.set_length(0, 4)
    kv.set_length(2, 1)
    assert kv.slots_in_use() == 2
    kv.free(0)
    assert kv.lengths == [0, 0, 1]
    assert kv.slots_in_use() == 1
    kv.check_write(0, 0, 8)  # a freed slot takes a fresh sequence from position 0 ...
    with pytest.raises(ValueError, match="gap"):
        kv.check_write(0, 1, 1)  # ... and nothing after it


def test_check_write_accepts_a_rewrite_inside_the_valid_prefix():
    kv = _cache()
    kv.set_length(0, 5)
    kv.check_write(0, 2, 3)  # squash + re-run from position 2
    kv.check_write(0, 5, 3)  # append exactly up to max_model_len


def test_check_write_rejects_a_gap_naming_position_and_length():
    kv = _cache()
    kv.set_length(1, 2)
    with pytest.raises(ValueError, match=r"KV slot 1: write at position 3 leaves a gap after length 2"):
        kv.check_write(1, 3, 1)


@pytest.mark.parametrize(("start", "num_tokens"), [(0, 9), (7, 2), (8, 1)])
def test_check_write_rejects_positions_past_max_model_len(start, num_tokens):
    kv = _cache(max_model_len=8)
    kv.set_length(0, start)
    with pytest.raises(ValueError, match=rf"up to {start + num_tokens} exceed max_model_len 8"):
        kv.check_write(0, start, num_tokens)


@pytest.mark.parametrize("slot", [-1, 3, 100])
def test_check_write_rejects_a_slot_out_of_range(slot):
    kv = _cache(max_num_seqs=3)
    with pytest.raises(ValueError, match=rf"KV slot {slot} out of range \[0, 3\)"):
        kv.check_write(slot, 0, 1)


def test_read_block_rounds_the_positions_up_so_block_reads_are_views():
    # a sequence near max_model_len 40 is read in blocks of 32 keys: 64 positions, one view, no padded copy
    kv = KVCache(num_layers=1, max_num_seqs=2, max_model_len=40, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                 dtype=torch.float32, read_block=32)
    assert kv.k.shape[3] == 64
    kv.write(0, 1, 0, *_kv(39, 0.0))
    kv.set_length(1, 39)
    keys, values = kv.gather(0, torch.tensor([1]), 64)
    assert keys.shape == (1, NUM_KV_HEADS, 64, HEAD_DIM)
    assert keys.data_ptr() == kv.k[0, 1].data_ptr() and values.data_ptr() == kv.v[0, 1].data_ptr()
    with pytest.raises(ValueError, match="max_model_len 40"):  # the extra positions are not the sequence's
        kv.check_write(1, 39, 2)


def test_scratch_fits_in_the_rounding_or_grows_the_buffers():
    kv = KVCache(num_layers=1, max_num_seqs=1, max_model_len=40, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                 dtype=torch.float32, num_scratch=2, read_block=32)
    assert kv.k.shape[3] == 64 and kv.scratch_index(1) == 41
    kv.ensure_scratch(20)  # 40 + 20 still fits in 64 positions
    assert kv.k.shape[3] == 64 and kv.scratch_index(19) == 59
    kv.write(0, 0, 0, *_kv(3, 5.0))
    kv.ensure_scratch(30)  # 70 positions, rounded to 96; what was written stays
    assert kv.k.shape[3] == 96 and kv.scratch_index(29) == 69
    assert torch.equal(kv.view(0, 0, 3)[0], _kv(3, 5.0)[0])


def test_a_block_read_over_filled_scratch_positions_gives_the_padded_reads_logits_bitwise():
    # near max_model_len the batched attention's 32-key block covers the scratch positions: with the
    # rounded buffer they are read (masked) where a cache without rounding pads zeros
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.row_layout import Span
    from pipeline.model.stage_model import build_stage_model
    from tests.tiny_model import random_state_dict

    cfg = tiny_config()
    model = build_stage_model(cfg, LayerRange(0, 4), is_first=True, is_last=True, tensors=random_state_dict(cfg))
    rounded = model.new_kv_cache(max_num_seqs=1, max_model_len=40, num_scratch=2)
    padded = KVCache(num_layers=4, max_num_seqs=1, max_model_len=40, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, dtype=torch.float32, num_scratch=2)
    assert rounded.k.shape[3] == 64 and padded.k.shape[3] == 42
    gen = torch.Generator().manual_seed(0)
    logits = []
    for kv in (rounded, padded):
        model.forward_rows(torch.arange(38) + 3, [Span(0, 0, 38)], kv)
        kv.k[:, :, :, 40:] = 1e3 * torch.randn(kv.k[:, :, :, 40:].shape, generator=gen)  # stale sibling keys
        kv.v[:, :, :, 40:] = 1e3 * torch.randn(kv.v[:, :, :, 40:].shape, generator=gen)
        gen.manual_seed(0)
        logits.append(model.forward_rows(torch.tensor([7]), [Span(0, 38, 1)], kv).out)
    assert torch.equal(logits[0], logits[1])
