"""The words of predictor-file and train-predictor errors: tensor names stay tensor names, a file's
impossible exit layer is blamed on the file, articles agree, and Ctrl-C names no stages that never ran."""

from __future__ import annotations

import pytest
import torch

from launcher.cli.errors import flag_message
from launcher.cli.main import main
from launcher.cli.training import train_predictor
from pipeline.speculation.predictor_file import ModelIdentity, load_predictor_bytes, predictor_bytes

H = 8


def _file(*, exit_layer: int = 1, kind: str = "early-exit", tensors: dict | None = None, num_layers: int = 30) -> bytes:
    model = ModelIdentity(name="m", hash="ab" * 32, hidden_size=H, num_layers=num_layers, vocab_size=64)
    meta = {"kind": kind, "model": model.to_dict(), "exit_layer": exit_layer, "arch": "affine", **(
        {"k": 1} if kind == "firp" else {})}
    if tensors is None:
        tensors = ({"maps.1.weight": torch.eye(H), "maps.1.bias": torch.zeros(H)} if kind == "firp"
                   else {"proj.weight": torch.eye(H), "proj.bias": torch.zeros(H)})
    return predictor_bytes(tensors, meta)


def test_tensor_name_in_a_message_is_not_rewritten_as_a_flag():
    bad = _file(tensors={"proj.weight": torch.eye(H), "proj.bias": torch.zeros(H),
                         "draft_vocab": torch.tensor([3, 3])})
    with pytest.raises(ValueError) as exc:
        load_predictor_bytes(bad)
    message = flag_message(str(exc.value))
    assert "tensor 'draft_vocab' must hold distinct token ids" in message and "--draft-vocab" not in message
    assert flag_message("draft_vocab must be >= 0") == "--draft-vocab must be >= 0"  # parameters still are


@pytest.mark.parametrize("layer", [29, 40, -1])
def test_exit_layer_outside_the_model_blames_the_file_not_the_flag(layer):
    with pytest.raises(ValueError) as exc:
        load_predictor_bytes(_file(exit_layer=layer), exit_layer=14, where="predictor file p.safetensors")
    message = flag_message(str(exc.value))
    assert f"claims exit layer {layer}, outside its model's layers before the last (0 to 28 of 30)" in message
    assert "--exit-layer" not in message


def test_firp_maps_may_follow_the_last_layer_but_not_beyond():
    assert load_predictor_bytes(_file(kind="firp", exit_layer=29)).exit_layer == 29
    with pytest.raises(ValueError, match="claims exit layer 30, outside its model's layers \\(0 to 29 of 30\\)"):
        load_predictor_bytes(_file(kind="firp", exit_layer=30))


def test_a_layer_inside_the_model_still_suggests_the_flag():
    with pytest.raises(ValueError, match="pass exit_layer 3"):
        load_predictor_bytes(_file(exit_layer=3), exit_layer=14)


def test_kind_mismatch_uses_the_right_article():
    with pytest.raises(ValueError, match="is a 'firp' predictor, but an 'early-exit' one is needed"):
        load_predictor_bytes(_file(kind="firp"), kind="early-exit")
    with pytest.raises(ValueError, match="is an 'early-exit' predictor, but a 'firp' one is needed"):
        load_predictor_bytes(_file(), kind="firp")


def test_ctrl_c_in_train_predictor_does_not_mention_stages(monkeypatch, capsys):
    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_predictor, "cmd_train", interrupted)
    assert main(["train-predictor", "--out", "/tmp/x.safetensors"]) == 130
    assert capsys.readouterr().err.strip() == "speedpipe train-predictor: interrupted"
