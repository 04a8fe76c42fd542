"""The self-distilled drafter on the tiny model: generation matches the reference greedy decode,
states and targets line up, the swiglu drafter starts at the logit lens and learns, its file loads
into the runtime exit head, speculation with it is greedy-identical, and the one command works."""

from __future__ import annotations

import random

import pytest
import torch

from launcher.cli.main import main
from launcher.cli.training.train_drafter import overfit_warnings
from pipeline.engine.stage_assembly import StageLoadSpec, build_exit_head
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.speculation.drafting.drafter import (
    DrafterMap,
    DrafterTrainConfig,
    train_drafter_map,
    validation_split,
)
from pipeline.speculation.drafting.exit_tensors import exit_map_from_tensors
from pipeline.speculation.predictor_file import (
    load_predictor,
    load_predictor_bytes,
    model_identity,
    predictor_bytes,
)
from pipeline.speculation.predictors import EarlyExitPredictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import collect_hidden_states, load_full_model
from pipeline.training.early_exit import top1_agreement
from pipeline.training.firp import greedy_continue
from pipeline.training.self_distill import (
    GenerationConfig,
    excerpts,
    generate,
    load_instructions,
    split_texts,
)
from pipeline.weights.checkpoint import CheckpointReader, read_norm_and_head
from pipeline.weights.quant_load import load_stage_model
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_tiny_model

EXIT_LAYER = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_drafter")
    model_dir = write_tiny_model(root / "model", seed=5)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "state", "union", "people", "nation", "the", "of"]
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(120)))
    return model_dir, corpus, root / "cache", load_full_model(model_dir)


def test_batched_generation_equals_the_reference_greedy_decode(tiny):
    model = tiny[3]
    prompts = [[5, 9, 14, 3], [40, 41], [7] * 9]
    out = generate(model, prompts, GenerationConfig(num_new_tokens=12, batch_size=2), layer=EXIT_LAYER)
    assert out.continuations == [greedy_continue(model, p, 12) for p in prompts]
    sampled = generate(model, prompts, GenerationConfig(num_new_tokens=12, temperature=1.0, seed=1), layer=EXIT_LAYER)
    assert all(len(c) == 12 for c in sampled.continuations) and sampled.continuations != out.continuations


def test_generation_stops_after_a_stop_token(tiny):
    model = tiny[3]
    first = greedy_continue(model, [5, 9, 14], 6)
    out = generate(model, [[5, 9, 14]], GenerationConfig(num_new_tokens=6), layer=EXIT_LAYER, stop_ids=[first[2]])
    assert out.continuations == [first[:first.index(first[2]) + 1]]


def test_generation_states_are_the_prefill_states_and_greedy_targets(tiny):
    """Each fed generated token's row: the exit layer's output as a whole-sequence prefill computes
    it, and the greedy next token; a sampled row's target is still the greedy token."""
    model = tiny[3]
    prompts = [[5, 9, 14, 3], [40, 41, 42]]
    for temperature in (0.0, 1.0):
        out = generate(model, prompts, GenerationConfig(num_new_tokens=8, temperature=temperature, seed=3),
                       layer=EXIT_LAYER, hidden_dtype=torch.float32)
        at = 0
        for p, c in zip(prompts, out.continuations, strict=True):
            seq = p + c
            ref = collect_hidden_states(model, torch.tensor([seq]), layers=[EXIT_LAYER])
            rows = slice(at, at + len(c) - 1)  # the last generated token is never fed
            assert out.states.token_ids[rows].tolist() == c[:-1]
            torch.testing.assert_close(out.states.hidden[rows], ref.hidden[EXIT_LAYER][0, len(p):len(seq) - 1],
                                       atol=1e-4, rtol=1e-4)
            assert out.states.targets[rows].tolist() == ref.targets[0, len(p):len(seq) - 1].tolist()
            if temperature == 0:
                assert out.states.targets[rows].tolist() == c[1:]
            at += len(c) - 1
        assert out.states.num_rows == at
        assert out.states.teacher_ids[:, 0].tolist() == out.states.targets.tolist()  # top-1 is the argmax
        probs = out.states.teacher_probs.float()
        assert bool((probs[:, :-1] >= probs[:, 1:]).all()) and bool((probs.sum(-1) <= 1.001).all())


def test_instruction_split_is_deterministic_and_disjoint():
    chat = load_instructions("chat")
    train, held = split_texts(chat)
    assert len(chat) >= 100 and held and train and not set(train) & set(held)
    assert split_texts(chat) == (train, held) and split_texts(list(reversed(chat)))[1] == list(reversed(held))
    with pytest.raises(ValueError, match="instruction set"):
        load_instructions("poems")


def test_untrained_drafter_is_the_logit_lens_and_training_beats_it():
    torch.manual_seed(0)
    h, v = 16, 48
    norm, head = torch.ones(h), torch.randn(v, h)
    hidden = torch.randn(2048, h)
    targets = (hidden @ torch.randn(h, h) @ head.T).argmax(-1)  # a fixed, learnable map of the state
    lens = top1_agreement(hidden=hidden, targets=targets, norm_weight=norm, lm_head_weight=head, eps=1e-5)
    same = top1_agreement(hidden=hidden, targets=targets, norm_weight=norm, lm_head_weight=head, eps=1e-5,
                          exit_map=DrafterMap(h, mlp_size=32))
    assert same == pytest.approx(lens)
    drafter = train_drafter_map(hidden=hidden[:1536], targets=targets[:1536], norm_weight=norm, lm_head_weight=head,
                                eps=1e-5, config=DrafterTrainConfig(steps=200, batch_size=128, mlp_size=32, lr=1e-2))
    trained = top1_agreement(hidden=hidden[1536:], targets=targets[1536:], norm_weight=norm, lm_head_weight=head,
                             eps=1e-5, exit_map=drafter)
    assert trained > lens + 0.2, (trained, lens)


def test_soft_targets_learn_the_teacher_distribution_and_need_a_teacher():
    torch.manual_seed(0)
    h, v = 16, 48
    norm, head = torch.ones(h), torch.randn(v, h)
    hidden = torch.randn(1024, h)
    logits = hidden @ torch.randn(h, h) @ head.T
    targets = logits.argmax(-1)
    top = torch.softmax(logits, -1).topk(8, dim=-1)
    config = DrafterTrainConfig(steps=150, batch_size=128, mlp_size=32, lr=1e-2, soft_weight=1.0)
    drafter = train_drafter_map(hidden=hidden[:768], targets=targets[:768], norm_weight=norm, lm_head_weight=head,
                                eps=1e-5, config=config, teacher=(top.indices[:768], top.values[:768]))
    lens = top1_agreement(hidden=hidden[768:], targets=targets[768:], norm_weight=norm, lm_head_weight=head, eps=1e-5)
    trained = top1_agreement(hidden=hidden[768:], targets=targets[768:], norm_weight=norm, lm_head_weight=head,
                             eps=1e-5, exit_map=drafter)
    assert trained > lens + 0.2, (trained, lens)  # soft targets alone (β = 1) still teach the argmax
    with pytest.raises(ValueError, match="soft_weight"):
        train_drafter_map(hidden=hidden, targets=targets, norm_weight=norm, lm_head_weight=head, eps=1e-5,
                          config=config)


def test_drafter_file_round_trips_and_rejects_bad_tensors():
    torch.manual_seed(0)
    drafter = DrafterMap(8, mlp_size=12, num_blocks=2)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.1)
    tensors = dict(drafter.state_dict())
    loaded = exit_map_from_tensors(tensors, arch="swiglu")
    x = torch.randn(5, 8)
    assert isinstance(loaded, DrafterMap) and len(loaded.blocks) == 2
    torch.testing.assert_close(loaded(x), drafter(x))
    del tensors["blocks.1.down.weight"]
    with pytest.raises(ValueError, match="swiglu"):
        exit_map_from_tensors(tensors, arch="swiglu")


def _speculative_matches_plain(model_dir, file_bytes: bytes) -> None:
    config = ModelConfig.from_model_dir(model_dir)
    ranges = [LayerRange(0, EXIT_LAYER + 1), LayerRange(EXIT_LAYER + 1, config.num_hidden_layers)]
    stages = [load_stage_model(str(model_dir), r, is_first=i == 0, is_last=i == 1) for i, r in enumerate(ranges)]
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=ranges[0],
                         exit_layer=EXIT_LAYER, exit_predictor=file_bytes)
    head = build_exit_head(config, CheckpointReader(model_dir), spec)
    assert isinstance(head.exit_map, DrafterMap)
    prompts = [[5, 9, 14, 3, 5, 9], [40, 41, 42]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in prompts:  # one at a time: a lone sequence leaves room for drafts
        plain = InProcessPipeline(stages, max_model_len=64).generate([prompt], params)
        spec_pipe = InProcessPipeline(stages, max_model_len=64, predictor=EarlyExitPredictor())
        spec_pipe.executors[0].exit_head = head
        assert spec_pipe.generate([prompt], params) == plain
    assert spec_pipe.engine.spec.verified_drafts > 0 and spec_pipe.engine.spec.exit_rows > 0  # the drafter drafted


def test_one_command_trains_evaluates_and_writes_a_drafter_the_pipeline_runs(tiny, tmp_path, capsys):
    model_dir, corpus, cache, _ = tiny
    out = tmp_path / "drafter.safetensors"
    args = ["train-predictor", "--model", str(model_dir), "--exit-layer", str(EXIT_LAYER), "--arch", "affine,swiglu",
            "--corpus", str(corpus), "--new-tokens", "6", "--sampled", "1", "--text-prompts", "4", "--steps", "20",
            "--mlp-size", "32", "--soft-weight", "0.5", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "chat" in printed and "speeches" in printed and "code" in printed and "acceptance" in printed
    pred = load_predictor(out, expect=model_identity(model_dir), exit_layer=EXIT_LAYER, kind="early-exit")
    held = pred.meta["eval"]["held_out"]
    candidates = pred.meta["eval"]["candidates"]
    assert set(candidates) == {"affine", "swiglu"} and set(held) == {"chat", "speeches", "code"}
    best = max(candidates, key=lambda c: sum(candidates[c].values()))
    assert pred.meta["arch"] == best and candidates[best] == {n: r["acceptance"] for n, r in held.items()}
    assert pred.meta["eval"]["acceptance"] == held["chat"]["acceptance"] and held["chat"]["tokens"] > 0
    cached = {p: p.stat().st_mtime_ns for p in (cache / "self-distill").glob("*.safetensors")}
    assert len(cached) == 5  # train greedy, train sampled, 3 held-out sets
    assert main(args[:6] + ["swiglu"] + args[7:]) == 0
    assert {p: p.stat().st_mtime_ns for p in (cache / "self-distill").glob("*.safetensors")} == cached  # reused
    assert load_predictor(out).meta["arch"] == "swiglu"
    _speculative_matches_plain(model_dir, out.read_bytes())


def test_overfit_warning_names_the_set_and_the_gap():
    lines = overfit_warnings(0.9, {"chat": {"acceptance": 0.7}, "code": {"acceptance": 0.85}})
    assert len(lines) == 1 and "chat" in lines[0] and "20 points" in lines[0]
    assert overfit_warnings(0.5, {"chat": {"acceptance": 0.45}}) == []


def test_swiglu_without_self_distill_exits_2(tiny, tmp_path, capsys):
    model_dir, corpus, cache, _ = tiny
    rc = main(["train-predictor", "--model", str(model_dir), "--exit-layer", "1", "--arch", "swiglu", "--data",
               "corpus", "--corpus", str(corpus), "--out", str(tmp_path / "p.safetensors"), "--no-progress"])
    assert rc == 2 and "--arch swiglu" in capsys.readouterr().err



def test_excerpts_skip_the_opening_and_spread_over_the_texts():
    texts = ["\n\n".join(f"t{t} p{p} w w w" for p in range(10)) for t in range(6)]
    one = excerpts(texts, per_text=1, words=3)
    assert one[0] == "t0 p5 w" and len(one) == 6
    assert excerpts(texts, per_text=2, words=2)[:2] == ["t0 p2", "t0 p7"]
    assert [e.split()[0] for e in excerpts(texts, per_text=1, words=1, max_total=3)] == ["t0", "t2", "t4"]


def test_a_drafter_too_large_for_the_control_plane_exits_2(tiny, tmp_path, capsys):
    model_dir, corpus, cache, _ = tiny
    rc = main(["train-predictor", "--model", str(model_dir), "--exit-layer", "1", "--arch", "swiglu", "--blocks", "2",
               "--mlp-size", "200000", "--corpus", str(corpus), "--out", str(tmp_path / "p.safetensors"),
               "--no-progress"])
    assert rc == 2 and "MiB" in capsys.readouterr().err


def test_offline_acceptance_of_a_file_is_its_in_pipeline_alpha(tiny):
    """A predictor file's offline acceptance (its top-1 agreement over its draft vocabulary with the
    model's own greedy continuation) is what the pipeline measures with that file at the exit stage,
    ungated, on the same text: the exit head, its trained map and its draft vocabulary are loaded as
    trained. (The launch's gap between 0.30 offline and 0.08 in the pipeline was the draft gate,
    tests/unit/test_draft_gate.py; this is the check that the two measure the same thing.)"""
    model_dir, _, _, model = tiny
    config = ModelConfig.from_model_dir(model_dir)
    torch.manual_seed(3)
    drafter = DrafterMap(config.hidden_size, mlp_size=24)
    with torch.no_grad():  # a non-trivial map: neither the logit lens nor always right
        drafter.proj.weight.add_(0.3 * torch.randn_like(drafter.proj.weight))
        drafter.blocks[0].down.weight.normal_(std=0.2)
    prompts = [[5, 9, 14, 3, 5, 9], [40, 41, 42], [7, 8, 7, 8, 100]]
    gen = generate(model, prompts, GenerationConfig(num_new_tokens=20), layer=EXIT_LAYER, hidden_dtype=torch.float32)
    vocab = torch.unique(gen.states.targets)[::2]  # a draft vocabulary that misses some targets
    identity = model_identity(model_dir)
    meta = {"kind": "early-exit", "model": identity.to_dict(), "exit_layer": EXIT_LAYER, "arch": "swiglu",
            "corpus": "test", "train_tokens": 0}
    file_bytes = predictor_bytes(dict(drafter.state_dict()) | {"draft_vocab": vocab}, meta, dtype=torch.float32)
    pred = load_predictor_bytes(file_bytes)
    reader = CheckpointReader(model_dir)
    norm, lm_head = read_norm_and_head(reader, config, dtype=torch.float32)
    offline = top1_agreement(hidden=gen.states.hidden, targets=gen.states.targets,
                             exit_map=exit_map_from_tensors(pred.tensors, arch="swiglu"), vocab_ids=pred.draft_vocab,
                             norm_weight=norm, lm_head_weight=lm_head,
                             eps=config.rms_norm_eps)
    assert 0.1 < offline < 0.9, offline  # a test that can tell the two apart
    ranges = [LayerRange(0, EXIT_LAYER + 1), LayerRange(EXIT_LAYER + 1, config.num_hidden_layers)]
    stages = [load_stage_model(str(model_dir), r, is_first=i == 0, is_last=i == 1) for i, r in enumerate(ranges)]
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=ranges[0],
                         exit_layer=EXIT_LAYER, exit_predictor=file_bytes)
    head = build_exit_head(config, reader, spec)
    verified = accepted = 0
    for prompt, cont in zip(prompts, gen.continuations, strict=True):
        pipe = InProcessPipeline(stages, max_model_len=64, predictor=EarlyExitPredictor())
        pipe.executors[0].exit_head = head
        assert pipe.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True)) == [cont]
        verified += pipe.engine.spec.verified_drafts
        accepted += pipe.engine.spec.accepted_tokens
    assert verified >= gen.states.num_rows - len(prompts)  # a draft after (nearly) every fed token
    assert accepted / verified == pytest.approx(offline, abs=0.05), (accepted, verified, offline)


def test_validation_split_takes_whole_blocks_and_leaves_training_rows():
    mask = validation_split(1000, fraction=0.2, block=100, seed=1)
    assert mask.shape == (1000,) and int(mask.sum()) == 200
    blocks = mask.reshape(10, 100)
    assert bool((blocks.all(1) | ~blocks.any(1)).all())  # a block is wholly in or out
    assert int(validation_split(250, fraction=0.9, block=100).sum()) < 250  # some rows are left to train on
    assert not validation_split(250, fraction=0.0).any()
    with pytest.raises(ValueError, match="fraction"):
        validation_split(10, fraction=1.0)


def test_early_stop_keeps_the_best_drafter_on_the_validation_rows():
    """Few training rows with noisy targets over-fit; the drafter kept is the best one seen on the
    validation rows (at least as good there as the last step's, which is the same run's end)."""
    torch.manual_seed(0)
    h, v = 16, 48
    norm, head = torch.ones(h), torch.randn(v, h)
    hidden = torch.randn(1200, h)
    targets = (hidden @ torch.randn(h, h) @ head.T).argmax(-1)
    noisy = torch.where(torch.rand(1200) < 0.4, torch.randint(0, v, (1200,)), targets)
    kw = dict(hidden=hidden[:200], targets=noisy[:200], norm_weight=norm, lm_head_weight=head, eps=1e-5)
    config = DrafterTrainConfig(steps=300, batch_size=64, mlp_size=64, lr=1e-2, dropout=0.0, weight_decay=0.0,
                                val_every=25)
    val = (hidden[200:], targets[200:])
    last = train_drafter_map(config=config, **kw)
    kept = train_drafter_map(config=config, val=val, **kw)
    agree = {name: top1_agreement(hidden=val[0], targets=val[1], norm_weight=norm, lm_head_weight=head, eps=1e-5,
                                  exit_map=m) for name, m in (("last", last), ("kept", kept))}
    assert last.early_stop is None and kept.early_stop is not None
    step, best = kept.early_stop
    assert step % 25 == 0 and 0 < step <= 300
    assert agree["kept"] >= agree["last"], agree
    # the recorded agreement is the kept drafter's (over the candidate vocabulary: every val target here)
    cand = torch.unique(noisy[:200])
    restricted = top1_agreement(hidden=val[0], targets=val[1], norm_weight=norm, lm_head_weight=head, eps=1e-5,
                                exit_map=kept, vocab_ids=cand)
    assert best == pytest.approx(restricted, abs=1e-6)


def test_a_val_fraction_outside_zero_to_one_exits_2(tiny, tmp_path, capsys):
    model_dir, corpus, cache, _ = tiny
    rc = main(["train-predictor", "--model", str(model_dir), "--exit-layer", "1", "--arch", "swiglu",
               "--val-fraction", "1.0", "--corpus", str(corpus), "--out", str(tmp_path / "p.safetensors"),
               "--no-progress"])
    assert rc == 2 and "--val-fraction" in capsys.readouterr().err
