"""Stage assembly (pipeline/engine/stage_assembly.py): a load spec becomes exactly that stage, with only its
own tensors, its exit head and FIRP maps where the spec puts them, numerically equal to the whole model."""

from __future__ import annotations

import re

import pytest
import torch

from pipeline.engine.stage_assembly import StageLoadSpec, assemble_stage
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.speculation.predictor_file import model_identity, save_predictor
from pipeline.weights.checkpoint import stage_tensor_names
from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny_assembly") / "model", seed=4)
    return model_dir, ModelConfig.from_model_dir(model_dir)


def _spec(model_dir, index: int, ranges: list[LayerRange], **kw) -> StageLoadSpec:
    return StageLoadSpec(model_dir=str(model_dir), stage_index=index, num_stages=len(ranges),
                         layer_range=ranges[index], max_num_seqs=2, max_model_len=32, **kw)


def test_two_assembled_stages_compute_the_whole_models_logits(tiny):
    model_dir, config = tiny
    whole = assemble_stage(_spec(model_dir, 0, [LayerRange(0, 4)])).executor
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    first, last = (assemble_stage(_spec(model_dir, i, ranges)).executor for i in range(2))
    ids = torch.tensor([5, 17, 99, 3])
    spans = [Span(0, 0, len(ids))]
    expected = whole.model(ids, spans, whole.kv)
    got = last.model(first.model(ids, spans, first.kv), spans, last.kv)
    assert got.shape == expected.shape == (1, config.vocab_size)
    torch.testing.assert_close(got, expected)


def test_a_stage_reads_only_its_own_tensors_and_counts_their_bytes(tiny):
    model_dir, config = tiny
    ranges = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    stage = assemble_stage(_spec(model_dir, 1, ranges, dtype="bfloat16"))
    assert set(stage.tensor_names) == set(stage_tensor_names(config, ranges[1], is_first=False, is_last=False))
    params = list(stage.executor.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert stage.weights_bytes == sum(p.numel() * 2 for p in params)  # no quantised buffers; RoPE not counted
    assert stage.executor.exit_head is None and stage.executor.exit_layer is None


def test_exit_head_is_built_only_on_the_stage_holding_the_exit_layer(tiny):
    model_dir, _ = tiny
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    specs = [_spec(model_dir, i, ranges, exit_layer=1) for i in range(2)]
    assert [s.holds_exit_head for s in specs] == [True, False]
    first, last = (assemble_stage(s) for s in specs)
    assert first.executor.exit_head is not None and first.executor.exit_layer == 1
    assert last.executor.exit_head is None and last.executor.exit_layer is None
    head_bytes, model_bytes = (sum(p.numel() * p.element_size() for p in m.parameters())
                               for m in (first.executor.exit_head, first.executor.model))
    assert first.weights_bytes == model_bytes + head_bytes


def test_a_trained_exit_head_for_another_layer_is_refused_naming_the_layer(tiny, tmp_path):
    model_dir, config = tiny
    h = config.hidden_size
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": 0, "arch": "affine",
            "corpus": "synthetic", "train_tokens": 1, "eval": {}}
    path = save_predictor(tmp_path / "head.safetensors", {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h)},
                          meta)
    spec = _spec(model_dir, 0, [LayerRange(0, 2), LayerRange(2, 4)], exit_layer=1, exit_predictor=path.read_bytes())
    with pytest.raises(ValueError, match="exit layer 0"):
        assemble_stage(spec)


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"stage_index": 2}, "stage_index 2 out of range [0, 2)"),
    ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, got 'int8'"),
    ({"stage_timeout_s": 0.0}, "stage_timeout_s must be > 0"),
    ({"firp_k": 2}, "FIRP needs both firp_layer and firp_k"),
    ({"tree_scratch": -1}, "tree_scratch must be in [0, 65536], got -1"),
    ({"tree_scratch": 10**9}, "tree_scratch must be in [0, 65536], got 1000000000"),
])
def test_load_spec_refuses_inconsistent_fields_naming_them(fields, fragment):
    kwargs = dict(model_dir="m", stage_index=0, num_stages=2, layer_range=LayerRange(0, 2)) | fields
    with pytest.raises(ValueError, match=re.escape(fragment)):
        StageLoadSpec(**kwargs)


def test_token_tree_scratch_is_allocated_at_load_and_an_item_past_it_is_refused(tiny):
    """The load spec's tree_scratch sizes the KV scratch once, at load; an item (off the wire)
    naming scratch past it is a ValueError, not a giant allocation."""
    from pipeline.model.attention import KEY_BLOCK
    from pipeline.speculation.items import Item, ItemKind
    from pipeline.speculation.tree import scratch_positions

    model_dir, _ = tiny
    n = scratch_positions(3, 2)
    executor = assemble_stage(_spec(model_dir, 0, [LayerRange(0, 4)], tree_scratch=n)).executor
    assert executor.kv.num_scratch == n and executor.kv.k.shape[3] == -(-(32 + n) // KEY_BLOCK) * KEY_BLOCK
    assert executor.kv.scratch_index(n - 1) == 32 + n - 1
    shape = executor.kv.k.shape
    executor.admit([Item(seq_id=1, slot=0, start=0, num_tokens=1, kind=ItemKind.DRAFT, alt_token_ids=(4, 5),
                         tree_scratch=n - 2)])
    assert executor.kv.k.shape == shape  # no growth on the hot path
    huge = Item(seq_id=1, slot=0, start=0, num_tokens=1, kind=ItemKind.DRAFT, alt_token_ids=(4,),
                tree_scratch=60_000)
    with pytest.raises(ValueError, match="token-tree scratch 60000 \\+ 1 siblings past this stage's 6 positions"):
        executor.admit([huge])
    assert executor.kv.k.shape == shape
    off = assemble_stage(_spec(model_dir, 0, [LayerRange(0, 4)])).executor  # token trees off: no scratch at all
    with pytest.raises(ValueError, match="past this stage's 0 positions"):
        off.admit([huge])
    assert off.kv.num_scratch == 0
