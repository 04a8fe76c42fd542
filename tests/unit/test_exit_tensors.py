"""Broken early-exit predictor files (a missing or mis-shaped tensor, an unknown arch) are refused
up front, with one line naming the first bad tensor, before any stage starts."""

from __future__ import annotations

import pytest
import torch

from launcher.cli.main import main
from launcher.coordinator.predictor_select import choose_exit_predictor
from pipeline.model.config import ModelConfig
from pipeline.speculation.drafting.drafter import DrafterMap
from pipeline.speculation.drafting.layer_drafter import DRAFT_LAYER_PREFIX, fused_layer
from pipeline.speculation.predictor_file import model_identity, save_predictor
from tests.tiny_model import write_tiny_model

LAYER = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_exit_tensors")
    model_dir = write_tiny_model(root / "model", seed=2)
    return model_dir, ModelConfig.from_model_dir(model_dir)


def _swiglu_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    return dict(DrafterMap(config.hidden_size, mlp_size=8, num_blocks=2).state_dict())


def _next_layer_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    layer = {DRAFT_LAYER_PREFIX + n: t for n, t in fused_layer(config, LAYER + 1).state_dict().items()}
    return {**layer, **_swiglu_tensors(config)}


def _write(tmp_path, model_dir, tensors, arch):
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": LAYER, "arch": arch,
            "corpus": "synthetic", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1}}
    return save_predictor(tmp_path / f"{arch}.safetensors", tensors, meta)


def _choose(tiny, path):
    model_dir, config = tiny
    return choose_exit_predictor(predictor=str(path), exit_predictor=None, model_dir=model_dir, config=config,
                                 exit_layer=LAYER)


@pytest.mark.parametrize("arch, build", [("swiglu", _swiglu_tensors), ("next-layer", _next_layer_tensors)])
def test_whole_files_pass(tiny, tmp_path, arch, build):
    assert _choose(tiny, _write(tmp_path, tiny[0], build(tiny[1]), arch)).file_bytes


def test_swiglu_file_missing_a_block_tensor_is_named(tiny, tmp_path):
    tensors = _swiglu_tensors(tiny[1])
    del tensors["blocks.0.up.weight"]
    with pytest.raises(ValueError, match="has no tensor 'blocks.0.up.weight', which arch 'swiglu' needs"):
        _choose(tiny, _write(tmp_path, tiny[0], tensors, "swiglu"))


def test_swiglu_file_with_a_mis_shaped_tensor_is_named(tiny, tmp_path):
    h = tiny[1].hidden_size
    tensors = _swiglu_tensors(tiny[1]) | {"blocks.1.up.weight": torch.zeros(10, h)}
    with pytest.raises(ValueError, match=rf"tensor 'blocks.1.up.weight' has shape \(10, {h}\), expected \(8, {h}\)"):
        _choose(tiny, _write(tmp_path, tiny[0], tensors, "swiglu"))


def test_file_with_a_tensor_its_arch_lacks_is_named(tiny, tmp_path):
    h = tiny[1].hidden_size
    tensors = {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h), "mlp.up.weight": torch.zeros(4, h)}
    with pytest.raises(ValueError, match="has tensor 'mlp.up.weight', which arch 'affine' does not have"):
        _choose(tiny, _write(tmp_path, tiny[0], tensors, "affine"))


def test_next_layer_file_missing_a_draft_layer_tensor_is_named(tiny, tmp_path):
    tensors = _next_layer_tensors(tiny[1])
    name = next(n for n in tensors if n.startswith(DRAFT_LAYER_PREFIX))
    del tensors[name]
    with pytest.raises(ValueError, match=f"has no tensor '{name}'"):
        _choose(tiny, _write(tmp_path, tiny[0], tensors, "next-layer"))


def test_unknown_arch_lists_every_valid_arch(tiny, tmp_path):
    with pytest.raises(ValueError, match="arch 'bogus' is not one of affine, mlp, swiglu, next-layer"):
        _choose(tiny, _write(tmp_path, tiny[0], _swiglu_tensors(tiny[1]), "bogus"))


def test_launch_with_a_broken_file_exits_2_in_one_line_before_stages(tiny, tmp_path, capsys):
    tensors = _swiglu_tensors(tiny[1])
    del tensors["blocks.0.up.weight"]
    path = _write(tmp_path, tiny[0], tensors, "swiglu")
    code = main(["launch", "--model", str(tiny[0]), "--stages", "2", "--speculate", "speed", "--predictor", str(path),
                 "--prompt", "hi", "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "has no tensor 'blocks.0.up.weight'" in err and "Traceback" not in err
