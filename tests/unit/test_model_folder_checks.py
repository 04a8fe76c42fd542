"""What `resolve` (launcher/coordinator/run_plan.py) refuses before any stage starts: malformed
config.json or tokenizer.json, tensors of the wrong shape, a context longer than the model's, a KV
cache larger than this machine's memory; and the warning for weights of layers the config leaves out.

Each case used to surface only after the stages started (exit 1), as a traceback, or not at all;
likewise a model cache that cannot be written (`resolve_model`).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from launcher.backends.placement import PlacementOptions
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import check_lengths, resolve
from pipeline.model.config import ModelConfig, tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.tree import scratch_positions
from tests.family_models import write_family_model
from tests.stage_bytes import measured_stage_bytes, write_next_layer_file, write_quantised_gguf_folder
from tests.tiny_model import write_tiny_model


def _options(model_dir, **kw) -> PipelineOptions:
    return PipelineOptions(model=str(model_dir), num_stages=2, progress=False, speculate="none", **kw)


def _edit_config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("content", "message"), [
    ("{\"hidden_size\": ", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    (None, "has no 'hidden_size'"),
    ({"hidden_size": "abc"}, "field 'hidden_size' must be an integer, got 'abc'"),
    ({"num_key_value_heads": 1.5}, "field 'num_key_value_heads' must be an integer"),
    ({"layer_types": 5}, r"a field holds a value of the wrong type \('int' object is not iterable\)"),  # before:
    ({"rope_scaling": "linear"}, "field 'rope_scaling' must be an object, got 'linear'"),  # TypeError /
    ({"rope_theta": None}, "field 'rope_theta' must be a number, got None"),  # AttributeError tracebacks, exit 1
    # before: "could not convert string to float: 'abc'" / "a field holds a value of the wrong type", no name
    ({"rms_norm_eps": "abc"}, "field 'rms_norm_eps' must be a number, got 'abc'"),
    ({"rms_norm_eps": [1e-5]}, r"field 'rms_norm_eps' must be a number, got \[1e-05\]"),
    ({"rope_theta": "1e4"}, "field 'rope_theta' must be a number, got '1e4'"),
    ({"rms_norm_eps": True}, "field 'rms_norm_eps' must be a number, got True"),  # float(True) is 1.0
    # json reads NaN / Infinity; a NaN eps or an infinite base made every logit NaN, no error
    ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' must be a number, got nan"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "'rope_scaling.factor' must be a number, got inf"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "field 'rope_scaling.factor' must be a number"),
    # before: ZeroDivisionError (a traceback) once launch built the RoPE tables
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0}},
     "rope_scaling low_freq_factor must be > 0, got 0.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 0}},
     "rope_scaling high_freq_factor must be > 0, got 0"),
    ({"rope_parameters": {"full_attention": {"rope_theta": [1]}}},
     "field 'rope_parameters.full_attention.rope_theta' must be a number, got \\[1\\]"),
    ({"sliding_window": "4096"}, "field 'sliding_window' must be an integer, got '4096'"),
    ({"max_position_embeddings": None}, "field 'max_position_embeddings' must be an integer, got None"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 2, got 0"),  # blamed --max-model-len
    ({"tie_word_embeddings": "no"}, "field 'tie_word_embeddings' must be true or false, got 'no'"),  # read as true
    ({"eos_token_id": ["2"]}, r"field 'eos_token_id' must be a token id \(an integer\) or a list of them"),  # never
    ({"bos_token_id": 1.5}, "field 'bos_token_id' must be a token id"),  # matched a token
])
def test_a_malformed_config_json_is_named(tmp_path, content, message):
    model_dir = write_tiny_model(tmp_path / "m")
    path = model_dir / "config.json"
    if content is None:
        d = json.loads(path.read_text())
        del d["hidden_size"]
        path.write_text(json.dumps(d))
    elif isinstance(content, dict):
        _edit_config(model_dir, **content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_model_dir(model_dir)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("rms_norm_eps", "abc"), ("rope_theta", [1.0, 2.0])])
def test_launch_exits_2_with_one_line_naming_a_float_field_of_the_wrong_type(tmp_path, capsys, field, value):
    """Before: `float("abc")` / `float([...])` in from_hf_dict, a line without the field's name."""
    from launcher.cli.main import main

    model_dir = write_tiny_model(tmp_path / "m")
    _edit_config(model_dir, **{field: value})
    code = main(["launch", "--model", str(model_dir), "--prompt", "hi", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"field {field!r} must be a number, got {value!r}" in err and str(model_dir / "config.json") in err, err


def test_null_num_key_value_heads_means_one_kv_head_per_head_as_in_transformers(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    _edit_config(model_dir, num_key_value_heads=None, rope_theta=10000, sliding_window=None)  # ints pass as floats
    config = ModelConfig.from_model_dir(model_dir)
    assert config.num_key_value_heads == config.num_attention_heads and config.rope_theta == 10000.0


@pytest.mark.parametrize("content", ["garbage", "", "[1]"])
def test_an_unreadable_tokenizer_json_is_a_value_error_naming_it(tmp_path, content):
    model_dir = write_tiny_model(tmp_path / "m")
    (model_dir / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer file"):
        Tokenizer(model_dir)


def test_a_tokenizer_config_that_is_not_an_object_is_named(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    (model_dir / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="tokenizer_config.json must hold a JSON object"):
        Tokenizer(model_dir)


def test_a_tensor_of_the_wrong_shape_is_refused_before_any_stage_starts(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.3.self_attn.k_proj.weight"] = weights["model.layers.3.self_attn.k_proj.weight"][:7].clone()
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.3.self_attn.k_proj.weight' .* has shape \(7, 64\), but "
                                         r"config.json asks for \(32, 64\)"):
        resolve(_options(model_dir))
    _edit_config(write_tiny_model(tmp_path / "h"), hidden_size=96)  # weights of hidden 64
    with pytest.raises(ValueError, match="has shape"):
        resolve(_options(tmp_path / "h"))


def test_weights_of_layers_past_the_config_are_warned_of(tmp_path, caplog):
    model_dir = write_tiny_model(tmp_path / "m")
    with caplog.at_level(logging.WARNING):
        resolve(_options(model_dir))
    assert "num_hidden_layers" not in caplog.text
    _edit_config(model_dir, num_hidden_layers=3)  # the file still holds layer 3
    with caplog.at_level(logging.WARNING):
        plan = resolve(_options(model_dir))
    assert plan.config.num_hidden_layers == 3
    assert "decoder layers past config.json's num_hidden_layers = 3 (e.g. model.layers.3." in caplog.text


def test_max_model_len_beyond_the_models_context_is_refused(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", max_position_embeddings=128)
    resolve(_options(model_dir, max_model_len=128))
    with pytest.raises(ValueError, match=r"max_model_len 129 is more than the model's context 128 \(max_position_embeddings, config.json\)"):
        resolve(_options(model_dir, max_model_len=129))


def test_yarn_stretches_the_context_that_max_model_len_may_reach(tmp_path):
    """As vLLM: a YaRN config's context is original_max_position_embeddings x factor (Qwen2.5: 32768 x 4),
    not its max_position_embeddings; other scalings keep max_position_embeddings (Gemma 3's linear)."""
    model_dir = write_tiny_model(tmp_path / "m", max_position_embeddings=64)
    _edit_config(model_dir, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert ModelConfig.from_model_dir(model_dir).max_context == 256
    resolve(_options(model_dir, max_model_len=256))
    with pytest.raises(ValueError, match=r"max_model_len 257 is more than the model's context 256 "
                                         r"\(max_position_embeddings stretched by YaRN, config.json\)"):
        resolve(_options(model_dir, max_model_len=257))
    _edit_config(model_dir, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert ModelConfig.from_model_dir(model_dir).max_context == 64


def test_a_kv_cache_larger_than_the_memory_available_is_refused(tmp_path):
    """KV cache (with its token-tree scratch positions) and RoPE tables as the stages really hold them
    (tests/stage_bytes.py: built, one pass at the last position), plus the weights."""
    model_dir = write_tiny_model(tmp_path / "m")
    config = tiny_config()  # 4 layers, 2 KV heads of 16 dims: 256 B of float32 K and V per position and layer
    options = PipelineOptions(model="unused", num_stages=2, max_num_seqs=4, max_model_len=2048, speculate="none")
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    held = measured_stage_bytes(model_dir, ranges, max_num_seqs=4, max_model_len=2048)
    kv, tables = sum(m[1] for m in held), sum(m[2] for m in held)
    assert kv == 4 * 4 * 2048 * 2 * 2 * 16 * torch.float32.itemsize and tables > 0  # layers x seqs x positions x ...
    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values()) \
        + config.vocab_size * config.hidden_size  # the last stage reads its own copy of the tied head
    need = kv + tables + params * torch.float32.itemsize  # and the weights, which the stages hold too
    check_lengths(options, config, model_dir, ranges=ranges, available=need)
    with pytest.raises(ValueError, match=r"max_num_seqs 4 x max_model_len 2048 needs 8.0 MiB of KV cache, plus "
                                         r"0.\d MiB of weights and 0.5 MiB of RoPE tables: more than the 9.\d MiB "
                                         r"of memory available"):
        check_lengths(options, config, model_dir, ranges=ranges, available=need - 1)
    tree = dataclasses.replace(options, speculate="speed", draft_tree=3)  # 6 scratch positions a slot
    held = measured_stage_bytes(model_dir, ranges, max_num_seqs=4, max_model_len=2048,
                                num_scratch=scratch_positions(3, 2), exit_head=(1, b""))  # SPEED: the logit lens
    need_tree = sum(m[1] + m[2] for m in held) + held[0][0] + held[1][0]
    assert need_tree > need
    check_lengths(tree, config, model_dir, ranges=ranges, available=need_tree)
    with pytest.raises(ValueError, match="needs 8.1 MiB of KV cache"):
        check_lengths(tree, config, model_dir, ranges=ranges, available=need_tree - 1)
    with pytest.raises(ValueError, match="the weights alone do not fit: quantise them"):
        check_lengths(options, config, model_dir, ranges=ranges, available=params)
    private = dataclasses.replace(options, placement=PlacementOptions(backend="ray"))  # actors on this machine
    with pytest.raises(ValueError, match="needs 8.0 MiB of KV cache, plus"):
        check_lengths(private, config, model_dir, ranges=ranges, available=need - 1)
    cluster = dataclasses.replace(options, placement=PlacementOptions(backend="ray", ray_address="10.0.0.10:6379"))
    check_lengths(cluster, config, model_dir, ranges=ranges, available=1)  # its stages' memory is not this machine's


@pytest.mark.parametrize(("num_stages", "dense_layout"), [(2, "reference"), (1, "reference"), (1, "fast")])
def test_the_memory_check_counts_a_tied_head_as_often_as_the_stages_hold_it(tmp_path, num_stages, dense_layout):
    """A tied embedding and LM head are one tensor on a stage that is first and last (reference layout),
    two otherwise: the last stage reads its own head, and the fast layout gives the head its own
    transposed copy (as the memory plan charges them, stage_memory.shares_tied_head); the check
    counted one copy always."""
    model_dir = write_tiny_model(tmp_path / "m")  # tied
    config = tiny_config()
    options = PipelineOptions(model="unused", num_stages=num_stages, max_num_seqs=4, max_model_len=2048,
                              speculate="none", dense_layout=dense_layout)
    ranges = [LayerRange(0, 2), LayerRange(2, 4)] if num_stages == 2 else [LayerRange(0, 4)]
    need = sum(map(sum, measured_stage_bytes(model_dir, ranges, max_num_seqs=4, max_model_len=2048,
                                             dense_layout=dense_layout)))
    check_lengths(options, config, model_dir, ranges=ranges, available=need)
    with pytest.raises(ValueError, match="needs 8.0 MiB of KV cache"):
        check_lengths(options, config, model_dir, ranges=ranges, available=need - 1)


@pytest.mark.parametrize(("mode", "num_stages"), [("int8", 2), ("int4", 1), ("auto", 2), ("auto", 1)])
def test_the_memory_check_charges_quantised_weights_as_the_stages_hold_them(tmp_path, mode, num_stages):
    """Quantised stages hold packed linears beside a bfloat16 embedding, norms, biases, K, V and tables (tied: a
    packed head too; tests/stage_bytes.py): fits at that need, not a byte less (4 bits a weight fitted short)."""
    model_dir = write_quantised_gguf_folder(tmp_path, "qwen2", "Q4_0") if mode == "auto" else \
        write_family_model(tmp_path / "m", "qwen2")  # tied, with q/k/v biases
    kw = {"max_num_seqs": 2, "max_model_len": 64, "quantization": mode}
    options = PipelineOptions(model="unused", num_stages=num_stages, speculate="none", **kw)
    ranges = [LayerRange(0, 2), LayerRange(2, 4)] if num_stages == 2 else [LayerRange(0, 4)]
    held, config = measured_stage_bytes(model_dir, ranges, **kw), ModelConfig.from_model_dir(model_dir)
    check_lengths(options, config, model_dir, ranges=ranges, available=sum(map(sum, held)))
    with pytest.raises(ValueError, match=r"KV cache, plus 0.\d MiB of weights and .*lower max_model_len"):
        check_lengths(options, config, model_dir, ranges=ranges, available=sum(map(sum, held)) - 1)
    with pytest.raises(ValueError, match=r"weights alone do not fit in this mode: place stages on more machines$"):
        check_lengths(options, config, model_dir, ranges=ranges, available=sum(m[0] for m in held))  # no "quantise"


def test_the_memory_check_counts_a_next_layer_drafters_kv_layer(tmp_path):
    """A given next-layer drafter holds its own weights and KV layer on its exit stage, token-tree scratch
    positions included (tests/stage_bytes.py measures it), as the `--stages auto` plan charges them; the
    check left both out."""
    model_dir = write_tiny_model(tmp_path / "m")
    config = tiny_config()
    path = write_next_layer_file(model_dir, tmp_path / "next.safetensors", 1)  # stage 0's last layer: the default
    options = PipelineOptions(model="unused", num_stages=2, max_num_seqs=4, max_model_len=2048, speculate="speed",
                              predictor=str(path), draft_tree=3)
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    held = measured_stage_bytes(model_dir, ranges, max_num_seqs=4, max_model_len=2048,
                                num_scratch=scratch_positions(3, 2), draft_after=1)
    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values()) \
        + config.vocab_size * config.hidden_size  # the last stage reads its own copy of the tied head
    drafter = path.stat().st_size  # the drafter's own weights, as the plan charges them (`given_exit_memory`)
    need = sum(m[1] + m[2] for m in held) + (params + (1 + config.vocab_size) * config.hidden_size) * 4 + drafter  # + the exit head's norm and rows
    check_lengths(options, config, model_dir, ranges=ranges, available=need)
    with pytest.raises(ValueError, match="needs 10.2 MiB of KV cache"):  # 5 layers (8.1 MiB for 4)
        check_lengths(options, config, model_dir, ranges=ranges, available=need - 1)
    lens = dataclasses.replace(options, predictor="logit-lens")  # no drafter: one KV layer fewer
    check_lengths(lens, config, model_dir, ranges=ranges, available=need - drafter - (held[0][1] - held[1][1]))
    plain = dataclasses.replace(options, speculate="none", draft_tree=1)  # no SPEED: the drafter is not loaded
    held = measured_stage_bytes(model_dir, ranges, max_num_seqs=4, max_model_len=2048)
    check_lengths(plain, config, model_dir, ranges=ranges,
                  available=sum(m[1] + m[2] for m in held) + params * torch.float32.itemsize)


def test_the_training_commands_plan_without_the_serving_limits(tmp_path):
    """train-predictor and ship_predictors resolve a default plan only for its exit layer: a model
    with a context under the default max_model_len must not be refused for a flag they lack."""
    model_dir = write_tiny_model(tmp_path / "m", max_position_embeddings=1024)
    assert resolve(_options(model_dir), check_limits=False).config.max_position_embeddings == 1024
    with pytest.raises(ValueError, match="max_model_len 2048 is more than"):
        resolve(_options(model_dir))


@pytest.mark.parametrize(("proj_type", "expected"), [("Q4_1", None), ("Q5_0", "Q5_0"), (None, "F32")])
def test_auto_names_the_gguf_weights_it_requantises(tmp_path, caplog, proj_type, expected):
    """`--quantization auto` runs Q4_0/Q4_1/Q4_K/Q8_0 blocks as they are and requantises other types
    to int4 groups (Qwen2.5-Coder's Q6_K): a warning names the types and counts, none when all fit."""
    import gguf

    from pipeline.weights.gguf_blocks import requantised_linears
    from pipeline.weights.gguf_import import convert_gguf
    from tests.unit.test_gguf_import_tiny import tiny, write_gguf

    config = tiny(tie_word_embeddings=True)
    kind = None if proj_type is None else getattr(gguf.GGMLQuantizationType, proj_type)
    write_gguf(tmp_path / "m.gguf", config, proj_type=kind)
    model_dir = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    projections = 7 * config.num_hidden_layers  # q, k, v, o, gate, up, down; the head is the Q8_0 embedding
    assert requantised_linears(tmp_path / "m.gguf", config) == ({} if expected is None else {expected: projections})
    with caplog.at_level("WARNING"):
        resolve(_options(model_dir, quantization="auto", max_model_len=256))
        resolve(_options(model_dir, quantization="int8", max_model_len=256))
    notes = [r.getMessage() for r in caplog.records if "--quantization auto" in r.getMessage()]
    if expected is None:
        assert not notes
    else:
        assert len(notes) == 1 and f"GGUF's {projections} {expected} weights have no int kernel" in notes[0]


def test_auto_says_so_when_the_gguf_a_folder_came_from_is_gone(tmp_path, caplog):
    """A converted folder whose GGUF was deleted (its venv removed) ran `auto` dense without a word,
    giving other tokens than the same model by its registered name."""
    from pipeline.weights.gguf_import import convert_gguf
    from tests.unit.test_gguf_import_tiny import tiny, write_gguf

    write_gguf(tmp_path / "m.gguf", tiny(tie_word_embeddings=True))
    model_dir = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    with caplog.at_level("WARNING"):
        resolve(_options(model_dir, quantization="auto", max_model_len=256))
    assert "is gone" not in caplog.text
    (tmp_path / "m.gguf").unlink()
    with caplog.at_level("WARNING"):
        resolve(_options(model_dir, quantization="auto", max_model_len=256))
        resolve(_options(model_dir, quantization="none", max_model_len=256))
    notes = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(notes) == 1 and "the weights run dense (as --quantization none)" in notes[0], notes


@pytest.mark.parametrize(("content", "problem"), [
    ("{}", "no 'path', 'size_bytes', 'sha256'"),
    ("[1, 2]", "it holds a JSON list, not an object"),
    ('{"path": "/m.gguf", "size_bytes": 1}', "no 'sha256'"),
    ('{"path": 5, "size_bytes": 1, "sha256": "ab"}', "'path' must be a string, got 5"),
    ('{"path": "/m.gguf", "size_bytes": "1", "sha256": "ab"}', "'size_bytes' must be an integer, got '1'"),
    ("{", "not valid JSON"),
])
def test_a_malformed_speedpipe_source_json_is_one_line_naming_it(tmp_path, content, problem):
    """Before: KeyError 'path' (a traceback, exit 1) in gguf_source_of, or a TypeError for a list."""
    from pipeline.speculation.predictor_file import model_identity
    from pipeline.weights.gguf_blocks import gguf_source_of

    model_dir = write_tiny_model(tmp_path / "m")
    (model_dir / "speedpipe_source.json").write_text(content)
    for read in (gguf_source_of, model_identity):
        with pytest.raises(ValueError, match="speedpipe_source.json is malformed") as info:
            read(model_dir)
        assert problem in str(info.value) and "delete the folder and convert the GGUF again" in str(info.value)
        assert str(model_dir / "speedpipe_source.json") in str(info.value) and "\n" not in str(info.value)


def test_launch_exits_2_on_a_malformed_speedpipe_source_json(tmp_path, capsys):
    from launcher.cli.main import main

    model_dir = write_tiny_model(tmp_path / "m")
    (model_dir / "speedpipe_source.json").write_text("{}")
    code = main(["launch", "--model", str(model_dir), "--prompt", "hi", "--no-progress", "--quantization", "auto"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "speedpipe_source.json is malformed" in err, err


def test_a_model_cache_that_cannot_be_written_is_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    """Before: converting a GGUF into an unwritable --cache-dir ended in a PermissionError /
    NotADirectoryError traceback (exit 1)."""
    from pathlib import Path

    from launcher.cli.main import main
    from pipeline.weights.registry import resolve_model
    from tests.unit.test_gguf_import_tiny import tiny, write_gguf

    write_gguf(tmp_path / "m.gguf", tiny())
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"cannot write the model cache .*a-file \(Not a directory: .*a-file/models"
                                         r".*\); point --cache-dir or \$SPEEDPIPE_CACHE_DIR at a writable folder"):
        resolve_model(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "a-file", progress=False)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)  # a read-only folder, as root cannot make one
    code = main(["launch", "--model", str(tmp_path / "m.gguf"), "--cache-dir", str(tmp_path / "ro"),
                 "--prompt", "Hi", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot write the model cache" in err, err
    with pytest.raises(ValueError, match=r"cannot write the model cache .*ro \(Permission denied: .*ro/models"):
        resolve_model(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "ro", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a missing file is still named as such
        resolve_model(str(tmp_path / "gone.gguf"), cache_dir=tmp_path / "ro", progress=False)


def test_a_missing_or_unsupported_tokenizer_names_the_file_and_the_remedy(tmp_path, monkeypatch):
    """Before: 'no tokenizer.json in model folder X' with no way forward, and a GGUF vocabulary of an
    unsupported kind (then SentencePiece's 'llama', now e.g. 'bert') refused without the file's name."""
    import gguf

    from pipeline.weights.registry import resolve_model
    from tests.unit.test_gguf_import_tiny import tiny, write_gguf

    model_dir = write_tiny_model(tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in model folder .*m: .*write one with "
                                                r"transformers: AutoTokenizer.from_pretrained\(FOLDER\)"):
        Tokenizer(model_dir)
    add_model = gguf.GGUFWriter.add_tokenizer_model
    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_model", lambda self, _: add_model(self, "bert"))
    write_gguf(tmp_path / "bert.gguf", tiny())
    with pytest.raises(ValueError, match=r"^GGUF file .*bert.gguf: tokenizer.ggml.model 'bert' is not supported .*"
                                         r"SentencePiece\): give the model's Hugging Face folder"):
        resolve_model(str(tmp_path / "bert.gguf"), cache_dir=tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache" / "models").glob("*/bert-*"))  # no half-converted folder
