"""The config spine: RunConfig (pipeline/run_config.py) validated once with parameter names, the CLI's
parameter -> flag rewrite (launcher/cli/errors.py), and the coordinator's and stages' views derived
from one PipelineOptions + RunPlan (launcher/coordinator/session.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re

import pytest

from launcher.cli.errors import PARAMETER_FLAGS, TRAINING_FLAGS, flag_message
from launcher.cli.main import build_parser
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.request_handle import encode_prompt
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import (
    PipelineSession,
    coordinator_config,
    stage_load_specs,
)
from pipeline.run_config import RunConfig, check_prompt_length
from pipeline.speculation.draft_gate import DraftGate
from pipeline.speculation.predictors import NGramPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.tiny_model import write_tiny_model
from workers.load_spec_codec import spec_from_proto, spec_to_proto

BAD_VALUES = [
    ({"num_stages": 0}, "num_stages must be >= 1, got 0", "--stages must be >= 1, got 0"),
    ({"speculative_disable_by_batch_size": 0}, "speculative_disable_by_batch_size must be >= 1",
     "--speculative-disable-by-batch-size must be >= 1"),
    ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16, got 'int8'", "--dtype must be one of"),
    ({"device": "tpu"}, "device must be cpu or cuda, got 'tpu'", "--device must be cpu or cuda"),
    ({"max_model_len": 1}, "max_model_len must be >= 2, got 1", "--max-model-len must be >= 2"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0", "--max-num-seqs must be >= 1, got 0"),
    ({"threads_per_stage": 0}, "threads_per_stage must be >= 1, got 0", "--threads-per-stage must be >= 1"),
    ({"stage_timeout_s": 0.0}, "stage_timeout_s must be > 0, got 0.0", "--stage-timeout-s must be > 0"),
    ({"speculate": "maybe"}, "speculate must be one of none, speed, firp, speed+firp", "--speculate must be one of"),
    ({"predictor": "medusa"}, "predictor must be one of logit-lens", "--predictor must be one of"),
    ({"max_inflight": -1}, "max_inflight must be >= 0 (0: chosen for you), got -1", "--max-inflight must be >= 0"),
    ({"min_acceptance": 1.5}, "min_acceptance must be 'auto' or in [0, 1], got 1.5", "--min-acceptance must be"),
    ({"firp_k": 0}, "firp_k must be >= 1, got 0", "--firp-k must be >= 1, got 0"),
    ({"firp_min_prob": 2.0}, "firp_min_prob must be in [0, 1], got 2.0", "--firp-min-prob must be in [0, 1]"),
    ({"dense_layout": "packed"}, "dense_layout must be one of reference, fast, got 'packed'",
     "--dense-layout must be one of"),
    ({"dense_layout": "fast", "quantization": "auto"}, "dense_layout fast needs quantization none, dtype float32 "
     "and a CPU device (got auto, float32, cpu)", "--dense-layout fast needs quantization none"),
    ({"speculate": "firp", "dtype": "bfloat16"}, "speculate firp needs float32 or an int mode (quantization "
     "auto/int8/int4): in dense bfloat16", "--speculate firp needs float32 or an int mode"),
    ({"speculate": "speed+firp", "dtype": "float16", "num_stages": 2}, "speculate speed+firp needs float32 or an "
     "int mode", "--speculate speed+firp needs float32"),
]


def test_launcher_options_refuse_an_unknown_log_level_naming_it():
    with pytest.raises(ValueError, match=re.escape("log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                                                   "got 'LOUD'")) as err:
        PipelineOptions(log_level="LOUD")
    assert flag_message(str(err.value)).startswith("--log-level must be one of")


@pytest.mark.parametrize(("fields", "message", "cli_message"), BAD_VALUES,
                         ids=[f"{next(iter(f))}-{i}" for i, (f, _, _) in enumerate(BAD_VALUES)])
def test_bad_value_names_the_parameter_and_the_cli_rewrites_it_to_the_flag(fields, message, cli_message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        RunConfig(**fields)
    assert flag_message(str(err.value)).startswith(cli_message)
    with pytest.raises(ValueError, match=re.escape(message)):  # the launcher's options run the same checks
        PipelineOptions(**fields)


def test_every_mapped_parameter_is_a_config_field_and_its_flag_a_launch_flag():
    fields = {f.name for f in dataclasses.fields(PipelineOptions)} | {f.name for f in dataclasses.fields(SamplingParams)}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    launch = commands.choices["launch"]
    flags = {s for action in launch._actions for s in action.option_strings}
    assert set(PARAMETER_FLAGS) <= fields, set(PARAMETER_FLAGS) - fields
    assert set(PARAMETER_FLAGS.values()) <= flags, set(PARAMETER_FLAGS.values()) - flags
    train = commands.choices["train-predictor"]
    assert set(TRAINING_FLAGS.values()) <= {s for action in train._actions for s in action.option_strings}


@pytest.mark.parametrize(("message", "expected"), [
    ("num_stages 5 is more than the model's 4 layers", "--stages 5 is more than the model's 4 layers"),
    ("layer_split 2,2 has 2 stages, but num_stages is 3", "--layer-split 2,2 has 2 stages, but --stages is 3"),
    ("speculate firp needs firp_file PATH: none shipped", "--speculate firp needs --firp-file PATH: none shipped"),
    ("predictor file /tmp/max_num_seqs/x.safetensors does not exist",
     "predictor file /tmp/max_num_seqs/x.safetensors does not exist"),
    ("--max-new-tokens must be > 0, got 0", "--max-new-tokens must be > 0, got 0"),
    ("max_new_tokens must be > 0, got 0", "--max-new-tokens must be > 0, got 0"),
    ("top_p must be in (0, 1], got 1.5", "--top-p must be in (0, 1], got 1.5"),
    ("stop must hold non-empty strings, got ''", "--stop must hold non-empty strings, got ''"),
    ("exit predictor has hidden size 8, the model 64", "exit predictor has hidden size 8, the model 64"),
    ("quantization int4 runs torch's CPU int kernels only; on device cuda use none",
     "--quantization int4 runs torch's CPU int kernels only; on device cuda use none"),
    ("h.safetensors was trained at exit layer 1, but this pipeline's exit layer is 2 (exit_layer; default: the "
     "last layer of stage 0): pass exit_layer 1", "h.safetensors was trained at exit layer 1, but this pipeline's "
     "exit layer is 2 (--exit-layer; default: the last layer of stage 0): pass --exit-layer 1"),
    ("corpus /no/such: no such file or folder", "--corpus /no/such: no such file or folder"),
    ("arch must be affine or mlp, got 'x'", "--arch must be affine or mlp, got 'x'"),
    ("draft_vocab must be >= 1, got 0", "--draft-vocab must be >= 1, got 0"),
])
def test_flag_message_rewrites_parameter_names_only(message, expected):
    assert flag_message(message) == expected


@pytest.mark.parametrize(("speculate", "predictor", "expected"), [
    ("speed", "logit-lens", True), ("speed", "hybrid", True), ("speed", "early-exit", True),
    ("speed+firp", "logit-lens", True), ("speed", "ngram", False), ("none", "logit-lens", False),
    ("firp", "hybrid", False),
])
def test_needs_exit_head_is_decided_by_mode_and_predictor(speculate, predictor, expected):
    assert RunConfig(speculate=speculate, predictor=predictor).needs_exit_head is expected


def test_draft_threshold_defaults_to_the_break_even_of_the_stage_count():
    assert RunConfig(num_stages=4).draft_min_acceptance() == DraftGate.break_even(4)
    assert RunConfig(num_stages=4).draft_min_acceptance(2) == DraftGate.break_even(4, parallel_stages=2) == 0.5
    assert RunConfig(num_stages=4, min_acceptance=0.0).draft_min_acceptance(2) == 0.0
    sched = RunConfig(num_stages=4, speculate="speed").scheduler_config(eos_token_ids=(0,), firp_k=0, parallel_stages=2)
    assert sched.min_acceptance == 0.5


def test_prompt_length_rule_names_the_parameters_and_allows_the_exact_fit():
    check_prompt_length(num_prompt_tokens=6, max_new_tokens=10, max_model_len=16)
    with pytest.raises(ValueError, match=re.escape("prompt 2 (7 tokens) + max_new_tokens (10) = 17 exceeds "
                                                   "max_model_len 16")):
        check_prompt_length(num_prompt_tokens=7, max_new_tokens=10, max_model_len=16, what="prompt 2")
    with pytest.raises(ValueError, match="prompt is empty"):
        check_prompt_length(num_prompt_tokens=0, max_new_tokens=1, max_model_len=16)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_views") / "model", seed=5)


def _options(tiny_dir, **kw) -> PipelineOptions:
    return PipelineOptions(num_stages=2, model=str(tiny_dir), layer_split="2,2", progress=False, max_num_seqs=3,
                           max_model_len=64, dtype="bfloat16", threads_per_stage=2, **kw)


def test_stage_views_carry_the_exit_head_only_where_the_plan_puts_it(tiny_dir, caplog, monkeypatch):
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 4)  # 2 stages x 2 threads fit
    options = _options(tiny_dir, speculate="speed", predictor="logit-lens")
    plan = resolve(options)
    specs = stage_load_specs(options, plan, master_addr="127.0.0.1", master_port=1234)
    assert options.needs_exit_head and plan.exit_layer == 1 and plan.exit_stage == 0
    assert [s.exit_layer for s in specs] == [1, 1] and [s.holds_exit_head for s in specs] == [True, False]
    assert [(s.stage_index, s.layer_range.start, s.layer_range.stop) for s in specs] == [(0, 0, 2), (1, 2, 4)]
    for s in specs:
        assert (s.dtype, s.max_num_seqs, s.max_model_len, s.num_threads, s.dist_master_port) == ("bfloat16", 3, 64, 2, 1234)
        assert spec_from_proto(spec_to_proto(s)) == s
    coord = coordinator_config(options, plan, master_addr="127.0.0.1", master_port=1234)
    assert coord.exit_stage == 0 and coord.scheduler == options.scheduler_config(
        eos_token_ids=tuple(plan.tokenizer.eos_token_ids), firp_k=0, parallel_stages=options.parallel_stages)
    staged = dataclasses.replace(options, draft_at="stage")  # the exit layer is on stage 0: the stage drafts
    assert coordinator_config(staged, plan, master_addr="127.0.0.1", master_port=1234).scheduler.draft_at_stage
    sched = coord.scheduler
    assert (sched.speculate, sched.num_stages, sched.max_num_seqs, sched.max_model_len, sched.min_acceptance) == (
        True, 2, 3, 64, DraftGate.break_even(2))
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 2)  # now only one stage at a time
    assert coordinator_config(options, plan, master_addr="h", master_port=1).scheduler.min_acceptance == 1.0
    later = dataclasses.replace(staged, exit_layer=2)  # on stage 1: the coordinator drafts, and says so
    with caplog.at_level(logging.WARNING, logger="speedpipe.launch"):
        assert not coordinator_config(later, resolve(later), master_addr="h", master_port=1).scheduler.draft_at_stage
    assert "layer 2 is on stage 1: the coordinator drafts" in caplog.text
    assert sched.eos_token_ids == tuple(plan.tokenizer.eos_token_ids) and sched.max_inflight == 2


def test_the_coordinator_applies_the_one_prompt_length_rule(tiny_dir):
    tokenizer = resolve(_options(tiny_dir)).tokenizer
    assert encode_prompt(tokenizer, [1] * 11, SamplingParams(max_new_tokens=5), max_model_len=16)[1] == [1] * 11
    with pytest.raises(ValueError, match=re.escape("prompt (12 tokens) + max_new_tokens (5) = 17 exceeds "
                                                   "max_model_len 16")):
        encode_prompt(tokenizer, [1] * 12, SamplingParams(max_new_tokens=5), max_model_len=16)
    for empty in ("", []):
        with pytest.raises(ValueError, match=re.escape("prompt is empty (0 tokens)")):
            encode_prompt(tokenizer, empty, SamplingParams(), max_model_len=16)


def test_a_context_only_predictor_gets_no_exit_head_anywhere(tiny_dir):
    options = _options(tiny_dir, speculate="speed", predictor="ngram")
    plan = resolve(options)
    assert not options.needs_exit_head
    assert [s.exit_layer for s in stage_load_specs(options, plan, master_addr="h", master_port=1)] == [-1, -1]
    assert coordinator_config(options, plan, master_addr="h", master_port=1).exit_stage == -1


def test_session_refuses_a_predictor_override_the_stages_were_not_built_for(tiny_dir):
    options = _options(tiny_dir, speculate="speed", predictor="logit-lens")
    with pytest.raises(ValueError, match="needs_exit_head"):
        PipelineSession(options, resolve(options), predictor=NGramPredictor())


def test_token_trees_size_every_stages_kv_scratch_in_its_load_spec(tiny_dir):
    """--draft-tree W: each stage's load spec asks for (W - 1) * (max_inflight + 1) scratch
    positions per slot (what `TokenTree.scratch_of` can name), through the wire; none without trees."""
    from pipeline.speculation.tree import TokenTree

    options = dataclasses.replace(_options(tiny_dir, speculate="speed", predictor="logit-lens"), dtype="float32",
                                  draft_tree=3)
    plan = resolve(options)
    specs = stage_load_specs(options, plan, master_addr="127.0.0.1", master_port=1234)
    tree = TokenTree(width=3, num_stages=2, max_inflight=options.scheduler_config(eos_token_ids=(0,), firp_k=0).max_inflight,
                     row_costs=None)
    most = max(tree.scratch_of(p) + 2 for p in range(64))
    assert [s.tree_scratch for s in specs] == [most, most]
    assert all(spec_from_proto(spec_to_proto(s)) == s for s in specs)
    plain = stage_load_specs(_options(tiny_dir), resolve(_options(tiny_dir)), master_addr="127.0.0.1", master_port=1)
    assert [s.tree_scratch for s in plain] == [0, 0]
    with pytest.raises(ValueError, match="KV scratch positions per slot: lower max_inflight"):
        RunConfig(speculate="speed", draft_tree=8, max_inflight=10_000)


def test_firp_in_an_int_mode_or_float32_is_allowed():
    """Only dense half precision refuses FIRP: the int kernels and the attention are batch-invariant,
    and float32 `none` agrees within rounding as everywhere (README, Numeric modes)."""
    for fields in ({"dtype": "bfloat16", "quantization": "int4"}, {"dtype": "float32"}, {"quantization": "auto"}):
        assert RunConfig(speculate="speed+firp", num_stages=2, **fields).uses_firp


@pytest.mark.parametrize("fields", [{"dtype": "bfloat16"}, {"dtype": "float16"}])
def test_jump_forward_is_off_where_multi_row_passes_round_rows_apart(fields):
    """Jump-forward sends a forced run as extra rows of one item (a draft item's, or riding on a real item),
    whose last row's result is a free token: a multi-row verify pass, as a FIRP chain's or a token tree's.
    Dense half precision rounds such a row apart from a 1-row pass and refuses those (the
    speculate/draft_tree cases of `test_bad_value_names_the_parameter_and_the_cli_rewrites_it_to_the_flag`), so there its forced tokens go one per item:
    grammar-aware drafting stays on, jump-forward is off. Float32 and the int modes keep it."""
    view = RunConfig(speculate="speed", **fields).scheduler_config(eos_token_ids=(0,), firp_k=0)
    assert (view.grammar_drafts, view.grammar_jump) == (True, False)
    for exact in ({"dtype": "float32"}, {**fields, "quantization": "int8"}, {**fields, "quantization": "auto"}):
        view = RunConfig(speculate="speed", **exact).scheduler_config(eos_token_ids=(0,), firp_k=0)
        assert (view.grammar_drafts, view.grammar_jump) == (True, True), exact


@pytest.mark.parametrize("firp_layer", [1, 2])
def test_firp_over_sliding_window_layers_is_planned(tmp_path, monkeypatch, firp_layer):
    """FIRP pseudo rows run every layer after the FIRP layer, windowed as real rows on sliding ones ([Note:
    windowed pseudo rows] in pipeline/model/attention.py): a run whose later layers slide with a window below
    max_model_len is planned (it was refused before the pseudo rows had a windowed mask), as is one whose later
    layers are all full attention (gemma3: layers 0 and 2 slide). Exactness: tests/unit/test_firp_window.py."""
    from tests.family_models import write_family_model
    from tests.tiny_model import write_firp_file

    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 4)
    model = write_family_model(tmp_path / "gemma3", "gemma3_text")
    firp = write_firp_file(model, tmp_path / "firp.safetensors", layer=firp_layer, k=2)
    options = PipelineOptions(num_stages=2, model=str(model), layer_split="2,2", progress=False, max_model_len=64,
                              speculate="speed+firp", firp_file=str(firp), predictor="ngram")
    assert resolve(options).firp.layer == firp_layer
