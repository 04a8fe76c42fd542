"""Early-exit training on the tiny model: the trained map beats the logit lens on held-out text,
the written file round-trips into the runtime ExitHead, and the CLI refuses bad input."""

from __future__ import annotations

import random

import pytest
import torch

from launcher.cli.main import main
from launcher.cli.training.train_predictor import DataSpec, prepare_data
from pipeline.speculation.predictor_file import load_predictor, model_identity
from pipeline.speculation.predictors import ExitHead, ExitMap
from pipeline.training.early_exit import ExitTrainConfig, draft_vocabulary, top1_agreement, train_exit_map
from tests.tiny_model import write_tiny_model

EXIT_LAYER = 1


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
    rc = main(["train-predictor", "--model", str(model_dir), "--exit-layer", str(EXIT_LAYER), "--data", "corpus",
               "--corpus", str(corpus),
               "--tokens", "1024", "--eval-tokens", "256", "--window", "64", "--steps", "30", "--out", str(out),
               "--cache-dir", str(cache), "--no-progress"])
    assert rc == 0
    assert "top-1 agreement" in capsys.readouterr().out
    pred = load_predictor(out, expect=model_identity(model_dir), exit_layer=EXIT_LAYER, kind="early-exit")
    assert pred.meta["train_tokens"] == 1024 and pred.meta["eval"]["eval_tokens"] == 256
    vocab = pred.draft_vocab  # the training targets, most frequent first
    assert pred.meta["draft_vocab_size"] == vocab.numel() and 0 < vocab.numel() < 256
    assert "draft_vocab_top1_agreement" in pred.meta["eval"]
    exit_map = ExitMap.from_tensors(pred.tensors, arch=pred.meta["arch"])
    head = ExitHead(exit_map.proj.in_features, 256, 1e-5, exit_map=exit_map)
    tokens, probs = head(torch.randn(3, exit_map.proj.in_features))
    assert tokens.shape == (3,) and bool((probs > 0).all())


def test_draft_vocabulary_is_the_most_frequent_targets():
    targets = torch.tensor([[5, 9, 9, 2], [9, 5, 7, 7]])
    assert draft_vocabulary(targets, max_size=10).tolist() == [9, 5, 7, 2]  # ties: lower id first
    assert draft_vocabulary(targets, max_size=2).tolist() == [9, 5]
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        draft_vocabulary(targets, max_size=0)


def test_restricted_exit_head_is_the_argmax_over_its_vocabulary_and_agreement_matches():
    torch.manual_seed(0)
    h, v = 8, 40
    head = ExitHead(h, v, 1e-5)
    with torch.no_grad():
        head.lm_head.weight.normal_()
    hidden = torch.randn(64, h)
    vocab = torch.tensor([3, 17, 0, 25, 9, 31])
    full_logits = head.lm_head(head.norm(hidden))
    want = vocab[full_logits[:, vocab].argmax(-1)]
    head.restrict_vocab(vocab)
    tokens, probs = head(hidden)
    assert tokens.tolist() == want.tolist() and head.lm_head.weight.shape == (6, h)
    assert bool((probs >= 1 / 6).all())  # softmax over 6 rows: the top one has at least 1/6
    weight = torch.zeros(v, h)  # rows outside the vocabulary are never read
    weight[vocab] = head.lm_head.weight.detach()
    agree = top1_agreement(hidden=hidden, targets=want, norm_weight=head.norm.weight.detach(), lm_head_weight=weight,
                           eps=1e-5, vocab_ids=vocab)
    assert agree == 1.0
    for bad in (torch.tensor([]), torch.tensor([40]), torch.tensor([1, 1])):
        with pytest.raises(ValueError, match="draft vocabulary"):
            ExitHead(h, v, 1e-5).restrict_vocab(bad)


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
    args = ["train-predictor", "--model", str(model_dir), "--exit-layer", "1", "--data", "corpus", "--corpus", str(corpus),
            "--window", "64", "--out", str(tmp_path / "p.safetensors"), "--cache-dir", str(cache), "--no-progress"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("arch", ["affine", "mlp"])
def test_exit_map_tensors_of_another_arch_are_a_value_error_naming_what_is_missing(arch):
    """A swiglu drafter's tensors given as an affine or mlp map raised KeyError 'proj.weight' (a
    traceback), where the docstring and the loaders' error handling promise ValueError."""
    swiglu = {"gate.weight": torch.zeros(8, 4), "up.weight": torch.zeros(8, 4), "down.weight": torch.zeros(4, 8)}
    with pytest.raises(ValueError, match=f"do not fit arch '{arch}': it needs proj.weight"):
        ExitMap.from_tensors(swiglu, arch=arch)
    affine = {"proj.weight": torch.zeros(4, 4), "proj.bias": torch.zeros(4)}
    if arch == "mlp":
        with pytest.raises(ValueError, match="mlp.up.weight"):
            ExitMap.from_tensors(affine, arch=arch)
    else:
        assert ExitMap.from_tensors(affine, arch=arch).proj.weight.shape == (4, 4)
