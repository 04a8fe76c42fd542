"""Early-exit training on the tiny model: the trained map beats the logit lens on held-out text,
the written file round-trips into the runtime ExitHead, and the CLI refuses bad input."""

from __future__ import annotations

import random

import pytest
import torch

from launcher.cli import main
from launcher.train_predictor import DataSpec, prepare_data
from pipeline.predictor_file import load_predictor, model_identity
from pipeline.predictor_training import ExitTrainConfig, top1_agreement, train_exit_map
from pipeline.predictors import ExitHead, ExitMap
from tests.tiny_model import write_tiny_model

EXIT_LAYER = 1


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls: intra-op threads only add synchronisation (and stall on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_train")
    model_dir = write_tiny_model(root / "model", seed=5)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "state", "union", "people", "nation", "the", "of"]
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(200)))
    return model_dir, corpus, root / "cache"


def test_training_beats_the_logit_lens_on_held_out_documents(tiny):
    model_dir, corpus, cache = tiny
    data = prepare_data(DataSpec(model_dir=model_dir, corpus=str(corpus), train_tokens=2048, eval_tokens=512,
                                 window=64), cache_dir=cache, layers=[EXIT_LAYER], progress=False)
    h = data.norm_weight.shape[0]
    head = dict(norm_weight=data.norm_weight, lm_head_weight=data.lm_head_weight, eps=data.rms_norm_eps)
    train_h, train_t = data.train.hidden[EXIT_LAYER].reshape(-1, h), data.train.targets.reshape(-1)
    eval_h, eval_t = data.eval.hidden[EXIT_LAYER].reshape(-1, h), data.eval.targets.reshape(-1)
    lens = top1_agreement(hidden=eval_h, targets=eval_t, **head)
    identity = ExitMap(h)
    assert top1_agreement(hidden=eval_h, targets=eval_t, exit_map=identity, **head) == pytest.approx(lens)
    for arch in ("affine", "mlp"):
        exit_map = train_exit_map(hidden=train_h, targets=train_t, config=ExitTrainConfig(arch=arch, steps=150, lr=3e-3),
                                  **head)
        trained = top1_agreement(hidden=eval_h, targets=eval_t, exit_map=exit_map, **head)
        assert trained > lens + 0.05, (arch, trained, lens)


def test_cli_writes_a_file_the_exit_head_uses(tiny, tmp_path, capsys):
    model_dir, corpus, cache = tiny
    out = tmp_path / "head.safetensors"
    rc = main(["train-predictor", "--model", str(model_dir), "--exit-layer", str(EXIT_LAYER), "--corpus", str(corpus),
               "--tokens", "1024", "--eval-tokens", "256", "--window", "64", "--steps", "30", "--out", str(out),
               "--cache-dir", str(cache), "--no-progress"])
    assert rc == 0
    assert "top-1 agreement" in capsys.readouterr().out
    pred = load_predictor(out, expect=model_identity(model_dir), exit_layer=EXIT_LAYER, kind="early-exit")
    assert pred.meta["train_tokens"] == 1024 and pred.meta["eval"]["eval_tokens"] == 256
    exit_map = ExitMap.from_tensors(pred.tensors, arch=pred.meta["arch"])
    head = ExitHead(exit_map.proj.in_features, 256, 1e-5, exit_map=exit_map)
    tokens, probs = head(torch.randn(3, exit_map.proj.in_features))
    assert tokens.shape == (3,) and bool((probs > 0).all())


@pytest.mark.parametrize(("extra", "message"), [
    (["--kind", "medusa"], "--kind"),
    (["--kind", "early-exit", "--exit-layer", "3"], "--exit-layer 3"),
    (["--arch", "transformer"], "--arch"),
    (["--corpus", "/nonexistent/corpus"], "no such file"),
    (["--out", "head.bin"], "--out"),
    (["--tokens", "3"], "--tokens"),
])
def test_cli_bad_input_exits_2(tiny, tmp_path, capsys, extra, message):
    model_dir, corpus, cache = tiny
    args = ["train-predictor", "--model", str(model_dir), "--exit-layer", "1", "--corpus", str(corpus),
            "--window", "64", "--out", str(tmp_path / "p.safetensors"), "--cache-dir", str(cache), "--no-progress"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
