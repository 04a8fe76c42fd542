"""ship_heads replaces only the heads of the depths asked for, and keeps a shipped self-distilled
head against a corpus-trained one unless told otherwise (on a temp folder, with fake training)."""

from __future__ import annotations

import torch

from launcher.cli.training.ship_predictors import ship_heads, training_data
from pipeline.model.config import tiny_config
from pipeline.speculation.predictor_file import (
    ModelIdentity,
    read_predictor_meta,
    save_predictor,
    shipped_predictor_name,
)

IDENTITY = ModelIdentity(name="m", hash="cd" * 32, hidden_size=4, num_layers=30, vocab_size=64)
DEFAULT_LAYER = {2: 16, 3: 10, 4: 7}  # depth -> its default exit layer


def _head(folder, layer: int, data: str):
    meta = {"kind": "early-exit", "model": IDENTITY.to_dict(), "exit_layer": layer, "arch": "affine", "data": data,
            "eval": {}, "train_tokens": 1}
    return save_predictor(folder / shipped_predictor_name(IDENTITY, kind="early-exit", exit_layer=layer),
                          {"proj.weight": torch.eye(4), "proj.bias": torch.zeros(4)}, meta)


def _run(folder, stages, extra=(), **kwargs):
    trained = []

    def train(model, layer, out, extra):
        trained.append(layer)
        _head(folder, layer, training_data(extra))
        return read_predictor_meta(out)

    ship = ship_heads("m", tiny_config(), IDENTITY, stages, list(extra), folder=folder, train=train,
                      default_layer=lambda model, s: DEFAULT_LAYER[s],
                      split_layer=lambda model, config, s, rows: DEFAULT_LAYER[s], **kwargs)
    return ship, trained


def _shipped(tmp_path):
    heads = {layer: _head(tmp_path, layer, data) for layer, data in ((7, "corpus"), (10, "corpus"),
                                                                     (16, "self-distill"))}
    return heads, {layer: p.read_bytes() for layer, p in heads.items()}


def test_one_depth_leaves_the_other_depths_heads_alone(tmp_path):
    heads, before = _shipped(tmp_path)
    ship, trained = _run(tmp_path, [3])
    assert ship == {10: 3} and trained == [10]
    assert heads[7].read_bytes() == before[7] and heads[16].read_bytes() == before[16]


def test_corpus_run_keeps_a_self_distilled_head_with_a_note(tmp_path, capsys):
    heads, before = _shipped(tmp_path)
    ship, trained = _run(tmp_path, [2])
    assert ship == {16: 2} and trained == []
    assert all(heads[layer].read_bytes() == before[layer] for layer in heads)
    assert "kept the self-distilled head" in capsys.readouterr().err


def test_replace_flag_or_a_self_distill_run_replaces_it(tmp_path):
    heads, _ = _shipped(tmp_path)
    assert _run(tmp_path, [2], replace_self_distilled=True)[1] == [16]
    assert read_predictor_meta(heads[16])["data"] == "corpus"
    assert _run(tmp_path, [2], ["--data", "self-distill"])[1] == [16]
    assert read_predictor_meta(heads[16])["data"] == "self-distill"
    assert heads[7].is_file() and heads[10].is_file()
