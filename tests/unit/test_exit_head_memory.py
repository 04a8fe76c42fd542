"""The exit head's copies of the final norm and LM head rows, in the memory plan and the start-up check.

With SPEED's exit head (`logit-lens`, or a trained head), the exit stage holds its own copy of the
final norm and of the LM head rows it scores (a trained head's draft vocabulary, else the whole
vocabulary) in its activation dtype (pipeline/engine/stage_assembly.py `build_exit_head`). Neither
`--stages auto` (launcher/cli/options.py `_auto_stages`) nor `check_lengths` charged them: about
113 MB in float32 on the default model with the logit lens, so a budget could fit the plan but not
the stage. tests/stage_bytes.py builds the head as a stage does and measures its storages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.cli.main import build_parser
from launcher.cli.options import _auto_stages
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import check_lengths
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.speculation.predictor_file import model_identity, save_predictor
from pipeline.speculation.tree import scratch_positions
from tests.family_models import write_family_model
from tests.stage_bytes import measured_stage_bytes

DRAFT_VOCAB = 5


def _trained_head(folder, path, layer: int):
    """An affine exit head for the model in `folder` at `layer`, with a 5-token draft vocabulary."""
    h = ModelConfig.from_model_dir(folder).hidden_size
    meta = {"kind": "early-exit", "model": model_identity(folder).to_dict(), "exit_layer": layer, "arch": "affine",
            "corpus": "synthetic", "train_tokens": 1, "eval": {"top1_agreement": 0.5, "eval_tokens": 1},
            "draft_vocab_size": DRAFT_VOCAB}
    tensors = {"proj.weight": torch.eye(h), "proj.bias": torch.zeros(h), "draft_vocab": torch.arange(DRAFT_VOCAB) * 3}
    return save_predictor(path, tensors, meta)


def _predictor(kind: str, folder, tmp_path, layer: int) -> tuple[str, bytes, int]:
    """(--predictor, the bytes the exit stage gets, the file size the plan charges for its own tensors)."""
    if kind == "logit-lens":
        return "logit-lens", b"", 0
    path = _trained_head(folder, tmp_path / "head.safetensors", layer)
    return str(path), path.read_bytes(), path.stat().st_size


@pytest.mark.parametrize("mode", ["none", "int8"])  # float32 rows; bfloat16 rows beside packed linears
@pytest.mark.parametrize("kind", ["logit-lens", "trained"])
def test_the_auto_plan_charges_the_exit_heads_norm_and_head_rows(tmp_path, monkeypatch, kind, mode):
    """The plan's exit stage == the stage as built, exit head included (the whole vocabulary for the logit
    lens, the 5 draft-vocabulary rows of a trained head, which keeps no copy of the full head), so a budget
    one byte short of it takes a second stage. The plan left the norm and head rows out."""
    import pipeline.weights.stage_memory as stage_memory

    folder = write_family_model(tmp_path / "m", "qwen2")
    config = ModelConfig.from_model_dir(folder)
    predictor, file_bytes, file_size = _predictor(kind, folder, tmp_path, 1)
    plans, real = [], stage_memory.plan_stages_for_budget
    monkeypatch.setattr(stage_memory, "plan_stages_for_budget", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib", "1",
                                      "--max-model-len", "64", "--max-num-seqs", "2", "--speculate", "speed",
                                      "--predictor", predictor, "--quantization", mode, "--prompt", "x"])
    assert _auto_stages(args, progress=False)[0] == 1
    kw = {"max_num_seqs": 2, "max_model_len": 64, "quantization": mode}
    (held,) = measured_stage_bytes(folder, plans[0].ranges, exit_head=(1, file_bytes), **kw)
    (bare,) = measured_stage_bytes(folder, plans[0].ranges, **kw)
    rows = config.vocab_size if kind == "logit-lens" else DRAFT_VOCAB
    itemsize = 4 if mode == "none" else 2
    assert held[0] - bare[0] == (1 + rows) * config.hidden_size * itemsize  # norm + rows, nothing more
    assert plans[0].stage_bytes == [sum(held) + file_size]
    args.stage_memory_gib = (sum(held) + file_size - 1) / 2**30
    assert _auto_stages(args, progress=False)[0] == 2
    args.predictor = "ngram"  # drafts from the context: no exit head, nothing charged
    args.stage_memory_gib = sum(bare) / 2**30
    assert _auto_stages(args, progress=False)[0] == 1


def test_speculate_auto_charges_no_exit_head_where_no_trained_head_serves(tmp_path):
    """`--speculate auto` runs SPEED only with a trained exit head (else `none`: speculation_defaults
    `settle_auto`), so where none ships the plan charges no norm and head rows; charging the logit lens's
    whole vocabulary there planned the default model's 0.4 GiB auto example with a stage-0 head it never holds."""
    import pipeline.weights.stage_memory as stage_memory

    folder = write_family_model(tmp_path / "m", "qwen2")
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--max-model-len", "64",
                                      "--max-num-seqs", "2", "--speculate", "auto", "--prompt", "x"])
    (bare,) = measured_stage_bytes(folder, [LayerRange(0, ModelConfig.from_model_dir(folder).num_hidden_layers)],
                                   max_num_seqs=2, max_model_len=64)
    args.stage_memory_gib = sum(bare) / 2**30
    plans, real = [], stage_memory.plan_stages_for_budget
    with pytest.MonkeyPatch.context() as m:
        m.setattr(stage_memory, "plan_stages_for_budget", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
        assert _auto_stages(args, progress=False)[0] == 1
    assert plans[0].stage_bytes == [sum(bare)]


@pytest.mark.parametrize("mode", ["none", "int8"])
@pytest.mark.parametrize("kind", ["logit-lens", "trained"])
def test_the_memory_check_charges_the_exit_heads_norm_and_head_rows(tmp_path, kind, mode):
    """`check_lengths` passes at what the stages hold with the exit head on stage 0's last layer (the default
    exit layer) and refuses one byte less; without SPEED no head is charged."""
    folder = write_family_model(tmp_path / "m", "qwen2")
    config = ModelConfig.from_model_dir(folder)
    predictor, file_bytes, file_size = _predictor(kind, folder, tmp_path, 1)
    kw = {"max_num_seqs": 2, "max_model_len": 64, "quantization": mode}
    options = PipelineOptions(model="unused", num_stages=2, speculate="speed", predictor=predictor, **kw)
    ranges = [LayerRange(0, 2), LayerRange(2, config.num_hidden_layers)]
    held = measured_stage_bytes(folder, ranges, num_scratch=scratch_positions(1, 2), exit_head=(1, file_bytes), **kw)
    need = sum(map(sum, held)) + file_size
    check_lengths(options, config, folder, ranges=ranges, available=need)
    with pytest.raises(ValueError, match="of memory available on this machine"):
        check_lengths(options, config, folder, ranges=ranges, available=need - 1)
    plain = dataclasses.replace(options, speculate="none")
    check_lengths(plain, config, folder, ranges=ranges, available=sum(map(sum, measured_stage_bytes(folder, ranges, **kw))))
