"""Unit tests for pipeline.weights.checkpoint: per-stage tensor names and the lazy safetensors reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.model.config import ModelConfig, tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.tensor_names import EMBED_TOKENS, FINAL_NORM, LM_HEAD
from pipeline.weights import checkpoint as weights
from pipeline.weights.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointReader,
    all_tensor_names,
    layer_tensor_names,
    stage_tensor_names,
)


def _shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q, inter = config.num_attention_heads * config.head_dim, config.intermediate_size
    shapes = {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
              "o_proj.weight": (h, q), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
              "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h), "down_proj.weight": (h, inter),
              "layernorm.weight": (h,), "norm.weight": (h,)}
    if name in (EMBED_TOKENS, LM_HEAD):
        return (config.vocab_size, h)
    return next(shape for suffix, shape in shapes.items() if name.endswith(suffix))


def _random_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(_shape(config, n), generator=gen) for n in all_tensor_names(config)}


def _write_config(folder: Path, config: ModelConfig) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))


def _write_single(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = _random_tensors(config)
    _write_config(folder, config)
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return tensors


def _write_two_shards(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = _random_tensors(config)
    _write_config(folder, config)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / file), metadata={"format": "pt"})
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_stage_names_first_middle_last_tied():
    config = tiny_config(tie_word_embeddings=True)
    first = stage_tensor_names(config, LayerRange(0, 1), is_first=True, is_last=False)
    middle = stage_tensor_names(config, LayerRange(1, 3), is_first=False, is_last=False)
    last = stage_tensor_names(config, LayerRange(3, 4), is_first=False, is_last=True)
    assert first == [EMBED_TOKENS, *layer_tensor_names(config, 0)]
    assert middle == layer_tensor_names(config, 1) + layer_tensor_names(config, 2)
    assert last == [*layer_tensor_names(config, 3), FINAL_NORM, EMBED_TOKENS]
    assert LM_HEAD not in first + middle + last


def test_stage_names_untied_last_stage_reads_lm_head():
    config = tiny_config(tie_word_embeddings=False)
    last = stage_tensor_names(config, LayerRange(2, 4), is_first=False, is_last=True)
    assert last[-2:] == [FINAL_NORM, LM_HEAD]
    assert EMBED_TOKENS not in last


def test_single_stage_tied_lists_embedding_once():
    names = all_tensor_names(tiny_config(tie_word_embeddings=True))
    assert names.count(EMBED_TOKENS) == 1 and len(names) == len(set(names))
    assert len(names) == 1 + 4 * 9 + 1


def test_layer_names_with_attention_bias():
    names = layer_tensor_names(tiny_config(model_type="qwen2", attention_bias=True), 0)
    assert [n for n in names if n.endswith(".bias")] == [
        f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    llama = layer_tensor_names(tiny_config(attention_bias=True), 0)  # Llama's o_proj follows attention_bias
    assert [n for n in llama if n.endswith(".bias")] == [
        f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"]
    assert not any(n.endswith(".bias") for n in layer_tensor_names(tiny_config(), 0))


def test_stage_names_reject_range_past_model():
    with pytest.raises(ValueError, match=r"\[2, 5\) is outside the model's 4 layers"):
        stage_tensor_names(tiny_config(), LayerRange(2, 5), is_first=False, is_last=True)


@pytest.mark.parametrize("writer", [_write_single, _write_two_shards], ids=["single", "sharded"])
def test_reader_reads_only_requested_names_and_round_trips(tmp_path, writer):
    config = tiny_config(tie_word_embeddings=False)
    tensors = writer(tmp_path, config)
    reader = CheckpointReader(tmp_path)
    assert reader.tensor_names == set(tensors)
    names = stage_tensor_names(config, LayerRange(1, 2), is_first=False, is_last=False)
    got = reader.read(names, dtype=torch.float32)
    assert list(got) == names
    assert reader.read_names == set(names)
    for name in names:
        assert torch.equal(got[name], tensors[name])


def test_reader_converts_dtype_and_counts_bytes(tmp_path):
    config = tiny_config()
    tensors = _write_single(tmp_path, config)
    reader = CheckpointReader(tmp_path)
    got = reader.read([EMBED_TOKENS], dtype=torch.bfloat16)
    assert got[EMBED_TOKENS].dtype == torch.bfloat16
    assert torch.equal(got[EMBED_TOKENS], tensors[EMBED_TOKENS].to(torch.bfloat16))
    numel = config.vocab_size * config.hidden_size
    assert reader.nbytes([EMBED_TOKENS]) == 4 * numel
    assert reader.nbytes([EMBED_TOKENS], dtype=torch.float16) == 2 * numel


def test_sharded_reader_opens_only_shards_holding_the_names(tmp_path, monkeypatch):
    config = tiny_config()
    _write_two_shards(tmp_path, config)
    reader = CheckpointReader(tmp_path)
    opened: list[str] = []
    real_open = weights.safe_open

    def spy_open(path, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(weights, "safe_open", spy_open)
    reader.read([EMBED_TOKENS], dtype=torch.float32)
    assert opened == ["model-00001-of-00002.safetensors"]


def test_missing_name_is_a_clear_error(tmp_path):
    _write_single(tmp_path, tiny_config())
    reader = CheckpointReader(tmp_path)
    with pytest.raises(ValueError, match=r"not in checkpoint .*'lm_head.weight'"):
        reader.read([LM_HEAD], dtype=torch.float32)
    assert reader.read_names == set()


def test_truncated_file_is_a_clear_error(tmp_path):
    _write_single(tmp_path, tiny_config())
    path = tmp_path / SINGLE_FILE
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=rf"corrupt or truncated safetensors file {path}"):
        CheckpointReader(tmp_path)


def test_truncated_shard_is_a_clear_error_at_read(tmp_path):
    _write_two_shards(tmp_path, tiny_config())
    reader = CheckpointReader(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors file"):
        reader.read([FINAL_NORM], dtype=torch.float32)


def test_folder_without_config_or_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        CheckpointReader(tmp_path)
    _write_config(tmp_path, tiny_config())
    with pytest.raises(FileNotFoundError, match=f"no model.safetensors or {INDEX_FILE} in model folder"):
        CheckpointReader(tmp_path)


def test_index_naming_a_missing_shard_is_a_clear_error(tmp_path):
    _write_two_shards(tmp_path, tiny_config())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors listed in"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("weight_map", [5, ["model-00001-of-00002.safetensors"], {"model.norm.weight": 3}])
def test_an_index_whose_weight_map_is_not_names_to_files_is_a_clear_error(tmp_path, weight_map):
    """Before: an AttributeError / TypeError traceback (exit 1) instead of one line naming the file."""
    _write_two_shards(tmp_path, tiny_config())
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"malformed safetensors index .*{INDEX_FILE}: weight_map must map"):
        CheckpointReader(tmp_path)


def test_a_weights_file_this_process_may_not_read_is_named_as_such(tmp_path, monkeypatch):
    """safetensors reports every failure to open as "No such file or directory": before, a file
    without read permission for this user was named as missing."""
    from pathlib import Path

    from pipeline.weights import checkpoint

    _write_two_shards(tmp_path, tiny_config())
    shard = tmp_path / "model-00002-of-00002.safetensors"
    real_open = Path.open

    def no_read(self, *args, **kwargs):
        if self == shard:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    def safetensors_open(path, *args, **kwargs):  # what safetensors raises for an unreadable file
        if Path(path) == shard:
            raise FileNotFoundError(f"No such file or directory: {path}")
        return real_safe_open(path, *args, **kwargs)

    real_safe_open = checkpoint.safe_open
    monkeypatch.setattr(Path, "open", no_read)  # (root, which runs these tests, may read any file)
    monkeypatch.setattr(checkpoint, "safe_open", safetensors_open)
    with pytest.raises(ValueError, match="cannot read safetensors file .*model-00002-of-00002.safetensors: "
                                         "Permission denied"):
        reader = CheckpointReader(tmp_path)
        reader.read(sorted(reader.tensor_names), dtype=torch.float32)


@pytest.mark.parametrize(("dtype", "stored"), [(torch.uint16, "U16"), (torch.uint32, "U32"), (torch.uint64, "U64"),
                                               (torch.complex64, "C64")])
def test_a_tensor_of_a_dtype_the_reader_does_not_read_is_a_clear_error_naming_it(tmp_path, dtype, stored):
    """Before: `KeyError: 'U16'` (no tensor, no file; a stage reported it as an unexpected error, exit
    1). Now one ValueError naming the tensor, its dtype, the file and the dtypes read, from `read` (a
    stage's load) and from the header-only `shapes` / `nbytes` (the checks before any stage starts)."""
    tensors = _write_single(tmp_path, tiny_config())
    tensors[FINAL_NORM] = torch.ones(tensors[FINAL_NORM].shape).to(dtype)
    save_file(tensors, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    reader = CheckpointReader(tmp_path)
    message = (rf"^tensor '{FINAL_NORM}' in {tmp_path / SINGLE_FILE} has dtype {stored}, which speedpipe "
               r"cannot read \(supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2\)$")
    for check in (lambda: reader.read([EMBED_TOKENS, FINAL_NORM], dtype=torch.float32),
                  lambda: reader.shapes([FINAL_NORM]), lambda: reader.nbytes([FINAL_NORM])):
        with pytest.raises(ValueError, match=message):
            check()
    assert reader.shapes([EMBED_TOKENS]) == {EMBED_TOKENS: tuple(tensors[EMBED_TOKENS].shape)}
