"""Choosing the exit head for a launch: trained file, shipped head, or the logit lens, with
mismatches refused before anything is spawned."""

from __future__ import annotations

import pytest
import torch

from launcher.cli.main import main
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.predictor_select import choose_exit_predictor, exit_head_shape, given_exit_layer
from launcher.coordinator.run_plan import default_split
from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.speculation.predictor_file import load_predictor_bytes, model_identity, save_predictor
from pipeline.speculation.predictors import EarlyExitPredictor, make_predictor
from tests.tiny_model import write_tiny_model
from workers.load_spec_codec import spec_from_proto, spec_to_proto


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_select")
    model_dir = write_tiny_model(root / "model", seed=2)
    config = ModelConfig.from_model_dir(model_dir)
    h = config.hidden_size
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": 1, "arch": "affine",
            "corpus": "synthetic", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1}}
    path = save_predictor(root / "head.safetensors", {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h)}, meta)
    return model_dir, config, path


def test_file_is_validated_and_its_bytes_sent(tiny):
    model_dir, config, path = tiny
    choice = choose_exit_predictor(predictor=str(path), exit_predictor=None, model_dir=model_dir, config=config,
                                   exit_layer=1)
    assert choice.file_bytes == path.read_bytes() and "50%" in choice.note
    assert load_predictor_bytes(choice.file_bytes, exit_layer=1).kind == "early-exit"
    assert isinstance(make_predictor(str(path)), EarlyExitPredictor)
    hybrid = choose_exit_predictor(predictor="hybrid", exit_predictor=str(path), model_dir=model_dir, config=config,
                                   exit_layer=1)
    assert hybrid.file_bytes == choice.file_bytes


def test_mismatches_and_missing_heads_are_user_errors(tiny, tmp_path):
    model_dir, config, path = tiny
    with pytest.raises(ValueError, match="exit layer 1, but this pipeline.s exit layer is 2"):
        choose_exit_predictor(predictor=str(path), exit_predictor=None, model_dir=model_dir, config=config, exit_layer=2)
    other = write_tiny_model(tmp_path / "other", seed=3)
    with pytest.raises(ValueError, match="hash"):
        choose_exit_predictor(predictor=str(path), exit_predictor=None, model_dir=other, config=config, exit_layer=1)
    with pytest.raises(ValueError, match="no trained head ships"):
        choose_exit_predictor(predictor="early-exit", exit_predictor=None, model_dir=model_dir, config=config,
                              exit_layer=1)
    with pytest.raises(ValueError, match="--exit-predictor needs"):
        choose_exit_predictor(predictor="ngram", exit_predictor=str(path), model_dir=model_dir, config=config,
                              exit_layer=1)
    note = choose_exit_predictor(predictor="hybrid", exit_predictor=None, model_dir=model_dir, config=config,
                                 exit_layer=1).note
    assert "untrained logit lens" in note


def test_exit_predictor_bytes_cross_the_proto(tiny):
    _, _, path = tiny
    spec = StageLoadSpec(model_dir="m", stage_index=0, num_stages=2, layer_range=LayerRange(0, 2), exit_layer=1,
                         exit_predictor=path.read_bytes())
    assert spec_from_proto(spec_to_proto(spec)) == spec


@pytest.mark.parametrize(("flags", "message"), [
    (["--predictor", "missing.safetensors"], "does not exist"),
    (["--predictor", "medusa"], "--predictor"),
    (["--predictor", "logit-lens", "--exit-predictor", "x.safetensors"], "--exit-predictor needs"),
])
def test_launch_refuses_bad_predictor_before_spawning(tiny, capsys, flags, message):
    model_dir, _, _ = tiny
    rc = main(["launch", "--model", str(model_dir), "--stages", "2", "--speculate", "speed", "--prompt", "hi",
               "--max-new-tokens", "2", *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_exit_head_shape_reads_the_draft_vocabulary_of_the_head_it_would_use(tiny, tmp_path):
    model_dir, config, path = tiny
    h = config.hidden_size
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": 2, "arch": "affine",
            "corpus": "synthetic", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1},
            "draft_vocab_size": 5}
    tensors = {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h), "draft_vocab": torch.arange(5)}
    shipped = tmp_path / "shipped"
    save_predictor(shipped / f"{model_dir.name}-abc-early-exit-L2.safetensors", tensors, meta)
    explicit = save_predictor(tmp_path / "mine.safetensors", tensors, meta)

    def rows(predictor, exit_predictor=None, layer=2):
        shape = exit_head_shape(predictor=predictor, exit_predictor=exit_predictor, model_dir=model_dir,
                                config=config, exit_layer=layer, folder=shipped)
        assert shape.draft_layers == 0  # row drafters run no decoder layer
        return shape.rows

    assert rows("hybrid") == rows("early-exit") == rows(str(explicit)) == rows("hybrid", str(explicit)) == 5
    assert rows("hybrid", layer=1) == config.vocab_size  # no head ships at layer 1
    assert rows(str(explicit), layer=1) == config.vocab_size  # the given file was trained at layer 2
    assert rows("logit-lens") == rows("hybrid", "none") == config.vocab_size
    other = save_predictor(shipped / f"{model_dir.name}-extra-abc-early-exit-L3.safetensors", tensors,
                           meta | {"exit_layer": 3})  # model `<name>-extra`'s head, not this model's
    assert rows("hybrid", layer=3) == config.vocab_size, other.name
    assert rows(str(path), layer=1) == config.vocab_size  # a trained head without a draft vocabulary
    assert rows(str(tmp_path / "missing.safetensors")) == config.vocab_size  # reported later by choose_*
    meta["eval"] |= {"draft_vocab_top1_agreement": 0.75}
    drafted = save_predictor(tmp_path / "drafted.safetensors", tensors, meta)
    note = choose_exit_predictor(predictor=str(drafted), exit_predictor=None, model_dir=model_dir, config=config,
                                 exit_layer=2).note
    assert "75% over its 5-token draft vocabulary" in note  # what the exit stage runs, not the 50%


def _next_layer_file(tiny, tmp_path, layer):
    model_dir, _, _ = tiny
    meta = {"kind": "early-exit", "model": model_identity(model_dir).to_dict(), "exit_layer": layer,
            "arch": "next-layer", "corpus": "self-distill", "train_tokens": 1,
            "eval": {"top1_agreement": 0.5, "eval_tokens": 1}}  # the header is all the split reads
    return save_predictor(tmp_path / f"next-L{layer}.safetensors", {"draft_layer.x": torch.zeros(1)}, meta)


def test_a_next_layer_file_costs_its_draft_layer_at_its_own_layer_only(tiny, tmp_path):
    model_dir, config, _ = tiny
    path = _next_layer_file(tiny, tmp_path, 1)
    for predictor, exit_predictor in ((str(path), None), ("hybrid", str(path))):
        def shape(layer, predictor=predictor, exit_predictor=exit_predictor):
            return exit_head_shape(predictor=predictor, exit_predictor=exit_predictor, model_dir=model_dir,
                                   config=config, exit_layer=layer, folder=tmp_path / "none")
        assert (shape(1).rows, shape(1).draft_layers) == (config.vocab_size, 1)
        assert shape(0).draft_layers == 0  # trained at layer 1: not the head that would run at layer 0
        assert given_exit_layer(predictor=predictor, exit_predictor=exit_predictor) == 1
    assert given_exit_layer(predictor="hybrid", exit_predictor=None) is None
    assert given_exit_layer(predictor=str(tmp_path / "missing.safetensors"), exit_predictor=None) is None


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_a_given_file_ends_stage_0_at_its_own_exit_layer(tiny, tmp_path, layer):
    """Whatever the balance would prefer, the split ends stage 0 at the layer the given head was
    trained at (it runs nowhere else), and water-fills the rest; without a file, plain balance."""
    model_dir, config, _ = tiny
    path = _next_layer_file(tiny, tmp_path, layer)
    n = config.num_hidden_layers
    for stages in (2, 3):
        if layer + 1 > n - (stages - 1):
            continue
        options = PipelineOptions(num_stages=stages, model=str(model_dir), speculate="speed", predictor=str(path))
        ranges = default_split(options, config, model_dir)
        assert ranges[0].stop - 1 == layer and len(ranges) == stages and ranges[-1].stop == n, ranges
        assert all(len(r) >= 1 for r in ranges), ranges


def test_a_shipped_head_of_another_checkpoint_with_the_same_name_does_not_size_the_exit_head(tmp_path):
    """Shipped heads are named `<model>-<hash12>-early-exit-L<n>`: a converted folder's hash is on
    record, so a head trained on other weights of the same name (another quantisation of it) is not
    the one that runs; the name alone picked the first such file."""
    from pipeline.weights.gguf_import import convert_gguf
    from tests.unit.test_gguf_import_tiny import tiny as tiny_gguf_config
    from tests.unit.test_gguf_import_tiny import write_gguf

    write_gguf(tmp_path / "m.gguf", tiny_gguf_config())
    model_dir = convert_gguf(tmp_path / "m.gguf", tmp_path / "m-0123", progress=False)
    config = ModelConfig.from_model_dir(model_dir)
    identity = model_identity(model_dir)
    h = config.hidden_size
    tensors = {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h), "draft_vocab": torch.arange(5)}
    shipped = tmp_path / "shipped"
    meta = {"kind": "early-exit", "model": identity.to_dict(), "exit_layer": 1, "arch": "affine", "corpus": "x",
            "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1}, "draft_vocab_size": 5}
    save_predictor(shipped / f"{identity.name}-000000000000-early-exit-L1.safetensors", tensors, meta)

    def rows():
        return exit_head_shape(predictor="hybrid", exit_predictor=None, model_dir=model_dir, config=config,
                               exit_layer=1, folder=shipped).rows

    assert rows() == config.vocab_size
    save_predictor(shipped / f"{identity.name}-{identity.hash[:12]}-early-exit-L1.safetensors", tensors, meta)
    assert rows() == 5
