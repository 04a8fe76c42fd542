"""Predictor files: round trip through safetensors + JSON metadata, and refusal of mismatches."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.config import tiny_config
from pipeline.speculation.predictor_file import (
    FORMAT,
    ModelIdentity,
    PredictorFileError,
    load_predictor,
    load_predictor_bytes,
    model_identity,
    predictor_bytes,
    read_predictor_meta,
    save_predictor,
    shipped_predictor_name,
    shipped_predictors,
)
from tests.tiny_model import write_tiny_model

H = 16


def _identity(**overrides) -> ModelIdentity:
    fields = dict(name="tiny", hash="ab" * 32, hidden_size=H, num_layers=4, vocab_size=256)
    return ModelIdentity(**(fields | overrides))


def _early_exit(exit_layer: int = 1, **meta_overrides):
    tensors = {"proj.weight": torch.randn(H, H), "proj.bias": torch.randn(H)}
    meta = {"kind": "early-exit", "model": _identity().to_dict(), "exit_layer": exit_layer, "arch": "affine",
            "corpus": "synthetic", "train_tokens": 100, "eval": {"top1_agreement": 0.5, "eval_tokens": 10}}
    return tensors, meta | meta_overrides


def test_round_trip_keeps_tensors_and_metadata(tmp_path):
    tensors, meta = _early_exit()
    path = save_predictor(tmp_path / "sub" / "p.safetensors", tensors, meta, dtype=torch.float32)
    pred = load_predictor(path, expect=_identity(), exit_layer=1, kind="early-exit")
    assert pred.meta == {"format": FORMAT, **meta}
    assert read_predictor_meta(path) == pred.meta
    for name, t in tensors.items():
        torch.testing.assert_close(pred.tensors[name], t)


def test_fp16_storage_is_close_and_bytes_parse_the_same(tmp_path):
    tensors, meta = _early_exit()
    data = predictor_bytes(tensors, meta)
    pred = load_predictor_bytes(data, expect=_identity())
    assert pred.tensors["proj.weight"].dtype == torch.float32
    torch.testing.assert_close(pred.tensors["proj.weight"], tensors["proj.weight"], atol=2e-3, rtol=2e-3)


def test_firp_file_needs_every_map(tmp_path):
    tensors = {f"maps.{i}.{p}": torch.zeros((H, H) if p == "weight" else (H,)) for i in (1, 2) for p in ("weight", "bias")}
    meta = _early_exit()[1] | {"kind": "firp", "k": 3}
    path = save_predictor(tmp_path / "f.safetensors", tensors, meta)
    with pytest.raises(PredictorFileError, match="maps.3.weight"):
        load_predictor(path)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"expect": _identity(hash="cd" * 32)}, "hash"),
    ({"expect": _identity(hidden_size=32)}, "hidden size"),
    ({"expect": _identity(num_layers=8)}, "num layers"),
    ({"exit_layer": 2}, "exit layer 1, but this pipeline's exit layer is 2"),
    ({"kind": "firp"}, "'firp' one is needed"),
])
def test_mismatch_is_refused_naming_the_field(tmp_path, kwargs, message):
    path = save_predictor(tmp_path / "p.safetensors", *_early_exit())
    with pytest.raises(PredictorFileError, match=message) as info:
        load_predictor(path, **kwargs)
    assert "\n" not in str(info.value)


def test_plain_safetensors_and_garbage_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(PredictorFileError, match="not a speedpipe predictor"):
        load_predictor(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file at all")
    with pytest.raises(PredictorFileError, match="not a safetensors file"):
        load_predictor(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        load_predictor(tmp_path / "missing.safetensors")


def test_bad_metadata_is_refused_before_writing(tmp_path):
    tensors, meta = _early_exit(kind="medusa")
    with pytest.raises(PredictorFileError, match="kind"):
        save_predictor(tmp_path / "p.safetensors", tensors, meta)
    assert not (tmp_path / "p.safetensors").exists()


def test_model_identity_changes_with_the_weights(tmp_path):
    a = model_identity(write_tiny_model(tmp_path / "a", seed=0))
    b = model_identity(write_tiny_model(tmp_path / "b", seed=0))
    c = model_identity(write_tiny_model(tmp_path / "c", seed=1))
    assert a.hash == b.hash and a.hidden_size == tiny_config().hidden_size
    assert c.hash != a.hash


def test_draft_vocab_round_trips_as_int64_and_bad_ids_are_refused(tmp_path):
    tensors, meta = _early_exit()
    vocab = torch.tensor([7, 3, 255, 0])
    data = predictor_bytes(tensors | {"draft_vocab": vocab}, meta | {"draft_vocab_size": 4})
    pred = load_predictor_bytes(data, expect=_identity())
    assert pred.draft_vocab.dtype == torch.int64 and pred.draft_vocab.tolist() == vocab.tolist()
    assert load_predictor_bytes(predictor_bytes(tensors, meta)).draft_vocab is None
    for bad in (torch.tensor([1, 256]), torch.tensor([2, 2]), torch.tensor([-1])):
        with pytest.raises(PredictorFileError, match="draft_vocab"):
            load_predictor_bytes(predictor_bytes(tensors | {"draft_vocab": bad}, meta))


def test_shipped_names_parse_back_to_their_layers_for_one_model_kind_and_checkpoint(tmp_path):
    """`shipped_predictors` reads back what `shipped_predictor_name` writes (with and without -k),
    for one model, kind and checkpoint hash, or any hash; another model whose name starts with this
    one's, another kind or a name that does not parse is not picked up."""
    mine, other_hash = _identity(name="m"), _identity(name="m", hash="cd" * 32)
    names = [shipped_predictor_name(mine, kind="early-exit", exit_layer=7),
             shipped_predictor_name(mine, kind="early-exit", exit_layer=16),
             shipped_predictor_name(mine, kind="firp", exit_layer=16, k=4),
             shipped_predictor_name(other_hash, kind="early-exit", exit_layer=10),
             shipped_predictor_name(_identity(name="m-extra"), kind="early-exit", exit_layer=3),
             "m-abababababab-early-exit-Lx.safetensors"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    found = shipped_predictors("m", kind="early-exit", hash12=mine.hash[:12], folder=tmp_path)
    assert {layer: p.name for layer, p in found.items()} == {7: names[0], 16: names[1]}
    assert shipped_predictors("m", kind="firp", hash12=mine.hash[:12], folder=tmp_path) == {16: tmp_path / names[2]}
    assert sorted(shipped_predictors("m", kind="early-exit", folder=tmp_path)) == [7, 10, 16]
    assert list(shipped_predictors("m-extra", kind="early-exit", folder=tmp_path)) == [3]
