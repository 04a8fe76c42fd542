"""The next-layer drafter ([Note: next-layer drafter] in pipeline/speculation/drafting/layer_drafter.py) on
the tiny model: its KV at the exit stage stays in step with the stage's own through prefill, decode
and a squash, its file round-trips, it trains, and its offline acceptance is its in-pipeline α.

What breaks when these fail: the draft layer reading stale or missing keys (guesses from a context
the sequence never had), a file that loads a different layer than was trained, or a pipeline that
drafts with something other than what was measured offline."""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.cli.main import main
from pipeline.engine.stage_assembly import StageLoadSpec, build_exit_head
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.rope import config_inv_freq
from pipeline.model.row_layout import Span
from pipeline.speculation.drafting.drafter import DrafterMap
from pipeline.speculation.drafting.exit_tensors import exit_map_from_tensors
from pipeline.speculation.drafting.layer_drafter import (
    LayerDrafterConfig,
    build_draft_layer,
    file_tensors,
    sequence_top1,
    split_tensors,
    train_forward,
    train_layer_drafter,
    train_sequence_model,
)
from pipeline.speculation.predictor_file import load_predictor, model_identity, predictor_bytes
from pipeline.speculation.predictors import EarlyExitPredictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.training.data import load_full_model
from pipeline.training.self_distill import GenerationConfig, generate, sequence_layer_states, sequence_states
from pipeline.weights.checkpoint import CheckpointReader, read_norm_and_head
from pipeline.weights.quant_load import load_stage_model
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_tiny_model

EXIT_LAYER = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny_layer_drafter") / "model", seed=5)
    return model_dir, ModelConfig.from_model_dir(model_dir)


def _exit_states(model, tokens: list[int]) -> torch.Tensor:
    """Layer EXIT_LAYER's output at every position of `tokens` (one prefill of a fresh cache)."""
    seen = {}
    hook = model.layers[str(EXIT_LAYER)].register_forward_hook(lambda m, i, o: seen.__setitem__("h", o))
    try:
        with torch.inference_mode():
            model(torch.tensor(tokens), [Span(0, 0, len(tokens))], model.new_kv_cache(max_num_seqs=1, max_model_len=64))
    finally:
        hook.remove()
    return seen["h"].clone()


def _perturbed_copy(model, seed: int = 0):
    layer = copy.deepcopy(model.layers[str(EXIT_LAYER + 1)])
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return layer


def test_the_draft_layer_keeps_its_kv_in_step_through_prefill_decode_and_a_squash(tiny):
    model_dir, config = tiny
    model = load_full_model(model_dir)
    layer = _perturbed_copy(model)
    inv_freq = config_inv_freq(config, local=False)
    model.attach_draft_layer(layer, after=EXIT_LAYER)
    kv = model.new_kv_cache(max_num_seqs=2, max_model_len=64)
    assert kv.k.shape[0] == config.num_hidden_layers + 1  # one extra cache layer

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return train_forward(layer, _exit_states(model, tokens)[None], inv_freq)[0]

    def step(tokens: list[int], start: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.forward_rows(torch.tensor(tokens), [Span(1, start, len(tokens))], kv, exit_layer=EXIT_LAYER).exit_hidden[0]

    seq = [5, 9, 14, 3, 5, 9, 40, 41, 42, 7, 8, 7]
    ref = reference(seq + [100, 101])
    torch.testing.assert_close(step(seq[:8], 0), ref[7], atol=1e-5, rtol=1e-5)  # prefill: its last row
    for p in range(8, len(seq)):  # decode, one row at a time, reading its own keys of every earlier row
        torch.testing.assert_close(step([seq[p]], p), ref[p], atol=1e-5, rtol=1e-5)
    wrong = step([77], len(seq))  # a wrong draft at position 12, then squashed: the real token re-runs there
    kv.truncate(1, len(seq))
    torch.testing.assert_close(step([100], len(seq)), ref[12], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step([101], len(seq) + 1), ref[13], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(wrong, ref[12], atol=1e-3)  # the test can tell a stale key from the right one


def test_a_next_layer_file_round_trips_and_other_readers_refuse_it(tiny):
    model_dir, config = tiny
    layer = _perturbed_copy(load_full_model(model_dir), seed=1)
    tensors = file_tensors(layer, DrafterMap(config.hidden_size, mlp_size=24))
    layer_tensors, rest = split_tensors(tensors)
    assert set(rest) == set(DrafterMap(config.hidden_size, mlp_size=24).state_dict())
    built = build_draft_layer(config, EXIT_LAYER, layer_tensors, dtype=torch.float32, device="cpu")
    x = torch.randn(2, 7, config.hidden_size)
    inv_freq = config_inv_freq(config, local=False)
    with torch.no_grad():
        torch.testing.assert_close(train_forward(built, x, inv_freq), train_forward(layer, x, inv_freq))
    with pytest.raises(ValueError, match="draft layer tensors do not fit"):
        build_draft_layer(config, EXIT_LAYER, {k: v for k, v in layer_tensors.items() if "o_proj" not in k},
                          dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="only at the exit stage"):
        exit_map_from_tensors(tensors, arch="next-layer")


def _drafter_file(model_dir, config, layer, exit_map, **meta) -> bytes:
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": EXIT_LAYER,
            "arch": "next-layer", "corpus": "test", "train_tokens": 0, **meta}
    return predictor_bytes(file_tensors(layer, exit_map), meta, dtype=torch.float32)


def test_offline_acceptance_of_a_next_layer_file_is_its_in_pipeline_alpha(tiny):
    """The in-process pipeline with the file at the exit stage (every draft sent, squashes and
    re-runs included) accepts as often as the drafter agrees offline over whole sequences."""
    model_dir, config = tiny
    full = load_full_model(model_dir)
    layer, exit_map = _perturbed_copy(full, seed=2), DrafterMap(config.hidden_size, mlp_size=24)
    prompts = [[5, 9, 14, 3, 5, 9], [40, 41, 42], [7, 8, 7, 8, 100]]
    gen = generate(full, prompts, GenerationConfig(num_new_tokens=20), layer=EXIT_LAYER)
    reader = CheckpointReader(model_dir)
    norm, lm_head = read_norm_and_head(reader, config, dtype=torch.float32)
    head = norm[None] * lm_head
    seqs = []
    for p, c in zip(prompts, gen.continuations, strict=True):
        t = torch.full((len(p) + len(c) - 1,), -100, dtype=torch.int64)
        t[len(p):] = torch.tensor(c[1:])
        seqs.append((_exit_states(full, p + c[:-1]), t))
    inv_freq = config_inv_freq(config, local=False)
    offline = sequence_top1(lambda x: exit_map(train_forward(layer, x, inv_freq)), seqs, head, config.rms_norm_eps)
    assert 0.1 < offline < 0.9, offline  # a test that can tell the two apart
    file_bytes = _drafter_file(model_dir, config, layer, exit_map)
    ranges = [LayerRange(0, EXIT_LAYER + 1), LayerRange(EXIT_LAYER + 1, config.num_hidden_layers)]
    stages = [load_stage_model(str(model_dir), r, is_first=i == 0, is_last=i == 1) for i, r in enumerate(ranges)]
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=ranges[0],
                         exit_layer=EXIT_LAYER, exit_predictor=file_bytes)
    exit_head = build_exit_head(config, reader, spec, model=stages[0])
    assert stages[0].draft_layer is not None
    verified = accepted = 0
    for prompt, cont in zip(prompts, gen.continuations, strict=True):
        pipe = InProcessPipeline(stages, max_model_len=64, predictor=EarlyExitPredictor())
        pipe.executors[0].exit_head = exit_head
        assert pipe.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True)) == [cont]
        verified += pipe.engine.spec.verified_drafts
        accepted += pipe.engine.spec.accepted_tokens
    assert verified >= sum(len(c) - 1 for c in gen.continuations) - len(prompts)
    assert accepted / verified == pytest.approx(offline, abs=0.05), (accepted, verified, offline)
    with pytest.raises(ValueError, match="does not run with FIRP"):
        firp_spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=ranges[0],
                                  exit_layer=EXIT_LAYER, exit_predictor=file_bytes, firp_layer=EXIT_LAYER, firp_k=2)
        build_exit_head(config, reader, firp_spec, model=stages[0])


def test_training_starts_from_the_next_layer_and_keeps_its_best_validation_state(tiny):
    model_dir, config = tiny
    full = load_full_model(model_dir)
    prompts = [[5, 9, 14, 3], [40, 41, 42], [7, 8, 7, 8], [3, 3, 4], [90, 91], [12, 13, 14]]
    gen = generate(full, prompts, GenerationConfig(num_new_tokens=12), layer=EXIT_LAYER)
    seqs = []
    for p, c in zip(prompts, gen.continuations, strict=True):
        t = torch.full((len(p) + len(c) - 1,), -100, dtype=torch.int64)
        t[len(p):] = torch.tensor(c[1:])
        seqs.append((_exit_states(full, p + c[:-1]), t))
    norm, lm_head = read_norm_and_head(CheckpointReader(model_dir), config, dtype=torch.float32)
    layer, exit_map = train_layer_drafter(train=seqs[1:], val=seqs[:1], init_layer=full.layers[str(EXIT_LAYER + 1)],
                                          config=config, norm_weight=norm,
                                          lm_head_weight=lm_head,
                                          settings=LayerDrafterConfig(steps=30, batch_size=3, lr=3e-3, val_every=10))
    assert exit_map.early_stop is not None and exit_map.early_stop[0] in (10, 20, 30)
    assert not any(p.requires_grad for p in layer.parameters())
    changed = any(not torch.equal(a, b) for a, b in zip(layer.state_dict().values(),
                                                        full.layers[str(EXIT_LAYER + 1)].state_dict().values(), strict=True))
    assert changed  # it trained a copy, and left the model's own layer alone
    with pytest.raises(ValueError, match="needs training rows"):
        train_layer_drafter(train=[], val=[], init_layer=full.layers[str(EXIT_LAYER + 1)], config=config,
                            norm_weight=norm, lm_head_weight=lm_head,
                            settings=LayerDrafterConfig())


def test_sequence_layer_states_are_each_layers_output_from_one_prefill(tiny):
    """Each requested layer's states equal what a stage ending at that layer outputs, in the order
    asked, and `sequence_states` is the one-layer case; targets sit at the fed generated tokens."""
    model_dir, config = tiny
    full = load_full_model(model_dir)
    prompt, cont, targets = [5, 9, 14], [40, 41, 42, 43], [7, 8, 9]
    layers = (EXIT_LAYER, 0)
    states, rows = sequence_layer_states(full, layers, prompt, cont, targets)
    tokens = torch.tensor(prompt + cont[:-1])
    for layer, h in zip(layers, states, strict=True):
        part = load_stage_model(str(model_dir), LayerRange(0, layer + 1), is_first=True, is_last=False)
        want = part(tokens, [Span(0, 0, len(tokens))], part.new_kv_cache(max_num_seqs=1, max_model_len=16))
        assert h.shape == (len(tokens), config.hidden_size) and torch.allclose(h, want.float(), atol=1e-6)
        one, one_rows = sequence_states(full, layer, prompt, cont, targets)
        assert torch.equal(one, h) and torch.equal(one_rows, rows)
    assert rows.tolist() == [-100] * len(prompt) + targets
    with pytest.raises(ValueError, match="one target per fed token"):
        sequence_layer_states(full, layers, prompt, cont, targets[:-1])


def test_the_sequence_trainer_fits_any_module_and_keeps_its_best_validation_state(tiny):
    """`train_sequence_model` trains a module of another input width (the fusion drafter's shape:
    [B, T, 2H] -> [B, T, H]) towards the targets, keeps a validation state and leaves it frozen."""
    model_dir, config = tiny
    h = config.hidden_size
    norm, lm_head = read_norm_and_head(CheckpointReader(model_dir), config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randn(9, 2 * h, generator=gen), torch.randint(0, 6, (9,), generator=gen)) for _ in range(8)]
    model = torch.nn.Linear(2 * h, h)
    before = sequence_top1(model, seqs, lm_head * norm, config.rms_norm_eps)
    kept = train_sequence_model(model, train=seqs, val=seqs[:2], norm_weight=norm,
                                lm_head_weight=lm_head, eps=config.rms_norm_eps,
                                settings=LayerDrafterConfig(steps=40, batch_size=4, lr=1e-2, val_every=10))
    after = sequence_top1(model, seqs, lm_head * norm, config.rms_norm_eps)
    assert kept is not None and kept[0] in (10, 20, 30, 40) and after > before
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_the_one_command_trains_a_next_layer_drafter_that_the_pipeline_runs_exactly(tiny, tmp_path, capsys):
    model_dir, config = tiny
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * 5 + j) % 11}" for j in range(150)))
    out, cache = tmp_path / "next.safetensors", tmp_path / "cache"
    args = ["train-predictor", "--model", str(model_dir), "--exit-layer", str(EXIT_LAYER), "--arch", "next-layer",
            "--corpus", str(corpus), "--prompts", "8", "--eval-prompts", "2", "--new-tokens", "8", "--sampled", "1",
            "--text-prompts", "3", "--steps", "12", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "next-layer (kept)" in printed and "chat" in printed and "acceptance" in printed
    pred = load_predictor(out, expect=model_identity(model_dir), exit_layer=EXIT_LAYER, kind="early-exit")
    assert pred.meta["arch"] == "next-layer" and set(pred.meta["eval"]["held_out"]) == {"chat", "speeches", "code"}
    assert any(n.startswith("draft_layer.") for n in pred.tensors) and pred.draft_vocab is not None
    ranges = [LayerRange(0, EXIT_LAYER + 1), LayerRange(EXIT_LAYER + 1, config.num_hidden_layers)]
    stages = [load_stage_model(str(model_dir), r, is_first=i == 0, is_last=i == 1) for i, r in enumerate(ranges)]
    spec = StageLoadSpec(model_dir=str(model_dir), stage_index=0, num_stages=2, layer_range=ranges[0],
                         exit_layer=EXIT_LAYER, exit_predictor=out.read_bytes())
    exit_head = build_exit_head(config, CheckpointReader(model_dir), spec, model=stages[0])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in ([5, 9, 14, 3, 5, 9], [40, 41, 42]):
        plain = InProcessPipeline(stages, max_model_len=64).generate([prompt], params)
        spec_pipe = InProcessPipeline(stages, max_model_len=64, predictor=EarlyExitPredictor())
        spec_pipe.executors[0].exit_head = exit_head
        assert spec_pipe.generate([prompt], params) == plain
    assert spec_pipe.engine.spec.verified_drafts > 0
    assert main(args[:6] + ["next-layer,swiglu"] + args[7:]) == 2
    assert "trains alone" in capsys.readouterr().err


def test_the_training_forward_is_the_stage_forward_on_gemma_1_and_gemma_2_is_refused(tmp_path):
    """Gemma 1 ((1 + w) norms, GeGLU, no sandwich norms, query scale or caps) may train a next-layer
    drafter: the differentiable training forward of a layer equals the stage's own forward of it.
    Gemma 2 (sliding layers, sandwich norms, query scale, attention cap) is refused."""
    from pipeline.model.stage_model import build_stage_model
    from pipeline.speculation.drafting.layer_drafter import unsupported_reason
    from pipeline.weights.checkpoint import all_tensor_names
    from tests.family_models import family_config, write_family_model

    assert unsupported_reason(family_config("gemma2")) is not None
    folder = write_family_model(tmp_path / "gemma", "gemma", seed=3)
    reader = CheckpointReader(folder)
    cfg = reader.config
    assert unsupported_reason(cfg) is None
    model = build_stage_model(cfg, LayerRange(0, cfg.num_hidden_layers), is_first=True, is_last=True,
                              tensors=reader.read(all_tensor_names(cfg), dtype=torch.float32))
    seen = {}
    hook = model.layers["2"].register_forward_hook(lambda m, i, o: seen.update(x=i[0].clone(), y=o.clone()))
    tokens = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250]
    with torch.inference_mode():
        model(torch.tensor(tokens), [Span(0, 0, len(tokens))], model.new_kv_cache(max_num_seqs=1, max_model_len=64))
    hook.remove()
    with torch.no_grad():
        trained = train_forward(model.layers["2"], seen["x"][None], config_inv_freq(cfg, local=False))[0]
    torch.testing.assert_close(trained, seen["y"], rtol=1e-5, atol=1e-5)
