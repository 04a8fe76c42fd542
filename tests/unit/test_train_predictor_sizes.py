"""`train-predictor` for any model in one reduced command: size flags and the default exit layer.

What breaks when these fail: `--prompts` / `--eval-prompts` not capping the self-distilled prompts
(a reduced run on a big model would generate every prompt), the caps not spreading over chat, code
and text, or the default `--exit-layer` not being the layer `launch --stages 2 --speculate speed`
uses on the model (the produced file would be refused by that launch).
"""

from __future__ import annotations

import pytest

from launcher.cli.main import main
from launcher.cli.training.distill_data import (
    DistillSpec,
    distill_sequences,
    prepare_distill_data,
    prompt_texts,
)
from launcher.cli.training.train_predictor import default_exit_layer
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.predictor_file import load_predictor, model_identity
from pipeline.training.data import load_full_model
from pipeline.training.self_distill import sequence_states
from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_sizes")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 13}" for j in range(100)))
    return write_tiny_model(root / "model", seed=2), corpus, root / "cache"


def test_prompt_caps_take_prompts_evenly_from_every_source(tiny):
    model_dir, corpus, _ = tiny
    tokenizer = Tokenizer(model_dir)
    full_train, full_evals = prompt_texts(DistillSpec(model_dir=model_dir, corpus=str(corpus)), tokenizer)
    train, evals = prompt_texts(DistillSpec(model_dir=model_dir, corpus=str(corpus), max_prompts=6,
                                            max_eval_prompts=2), tokenizer)
    assert len(full_train) > 6 and len(train) == 6 and set(train) <= set(full_train)
    assert train[0] == full_train[0] and train[-1] in full_train[len(full_train) // 2:]  # spread, not a prefix
    assert all(len(v) == min(2, len(full_evals[k])) and set(v) <= set(full_evals[k]) for k, v in evals.items())
    with pytest.raises(ValueError, match="--prompts and --eval-prompts must be >= 1"):
        DistillSpec(model_dir=model_dir, max_prompts=0)


def test_default_exit_layer_is_the_one_launch_uses_and_the_reduced_run_writes_a_head_it_accepts(tiny, tmp_path):
    model_dir, corpus, cache = tiny
    launch_layer = resolve(PipelineOptions(num_stages=2, model=str(model_dir), speculate="speed",
                                           predictor="logit-lens", progress=False)).exit_layer
    assert default_exit_layer(model_dir) == launch_layer
    out = tmp_path / "head.safetensors"
    assert main(["train-predictor", "--model", str(model_dir), "--corpus", str(corpus), "--prompts", "3",
                 "--eval-prompts", "1", "--new-tokens", "5", "--sampled", "0", "--text-prompts", "2", "--steps", "5",
                 "--out", str(out), "--cache-dir", str(cache), "--no-progress"]) == 0
    pred = load_predictor(out, expect=model_identity(model_dir), exit_layer=launch_layer, kind="early-exit")
    assert 0 < pred.meta["train_tokens"] <= 3 * 4  # 3 prompts, at most 4 fed tokens each (5 new tokens)
    assert all(r["tokens"] <= 4 for r in pred.meta["eval"]["held_out"].values())


def test_distill_sequences_reads_back_the_continuations_whose_states_prepare_cached(tiny, tmp_path):
    model_dir, corpus, _ = tiny
    spec = DistillSpec(model_dir=model_dir, corpus=str(corpus), max_prompts=3, max_eval_prompts=1, new_tokens=5,
                       sampled=0, max_text_prompts=2)
    with pytest.raises(FileNotFoundError, match="no cached continuations"):
        distill_sequences(spec, layer=1, cache_dir=tmp_path)
    data = prepare_distill_data(spec, layer=1, cache_dir=tmp_path, progress=False)
    seqs = distill_sequences(spec, layer=1, cache_dir=tmp_path)
    train_texts, eval_texts = prompt_texts(spec, Tokenizer(model_dir))
    assert set(seqs) == {"train", *[k for k, v in eval_texts.items() if v]}
    assert [p for p, _, _ in seqs["train"]] == [Tokenizer(model_dir).encode(t) for t in train_texts]
    # one state row per fed generated token: every continuation token but the last, and its greedy target
    assert all(len(t) == len(c) - 1 for _, c, t in seqs["train"])
    assert [t for _, c, _ in seqs["train"] for t in c[:-1]] == data.train.token_ids.tolist()
    assert [x for _, _, t in seqs["train"] for x in t] == data.train.targets.tolist()


def test_sampled_continuations_keep_the_greedy_targets_not_the_sampled_tokens(tiny, tmp_path):
    model_dir, corpus, _ = tiny
    spec = DistillSpec(model_dir=model_dir, corpus=str(corpus), max_prompts=4, max_eval_prompts=1, new_tokens=8,
                       sampled=1, temperature=1.5, max_text_prompts=2)
    prepare_distill_data(spec, layer=1, cache_dir=tmp_path, progress=False)
    seqs = distill_sequences(spec, layer=1, cache_dir=tmp_path)
    assert len(seqs["train"]) == 8  # 4 prompts, greedy then sampled
    greedy, sampled = seqs["train"][:4], seqs["train"][4:]
    assert all(t == c[1:] for _, c, t in greedy)  # greedy: the next token is the target
    assert any(t != c[1:] for _, c, t in sampled)  # sampled: the target is the argmax, not the draw
    model = load_full_model(model_dir)
    p, c, t = next(x for x in sampled if x[2] != x[1][1:])
    hidden, rows = sequence_states(model, 1, p, c, t)
    assert hidden.shape[0] == rows.shape[0] == len(p) + len(c) - 1
    assert rows[:len(p)].eq(-100).all() and rows[len(p):].tolist() == t
