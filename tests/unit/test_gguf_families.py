"""GGUF import of the qwen3 and gemma3 architectures, streamed conversion, chunked models, bad input.

What breaks when these fail: a family's GGUF metadata or tensor names (qwen3 q/k norms; gemma3's
four norms per layer, its norm shift, sliding window and query scale), the Q/K un-permute applied
where llama.cpp did not permute, block-wise dequantisation, the streaming safetensors writer,
assembling a model from chunk packages (order, size and hash checks), or the one-line errors for
an unsupported architecture or a tensor type without a dequantiser.
The tiny GGUF files are written here with `gguf.GGUFWriter`, following llama.cpp's converter.
"""

from __future__ import annotations

import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipeline.model.config import ModelConfig
from pipeline.model.stage_model import random_state_dict
from pipeline.weights import model_chunks
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from pipeline.weights.gguf_families import hf_tensor_blocks
from pipeline.weights.gguf_import import convert_gguf, open_gguf
from pipeline.weights.safetensors_stream import write_streaming
from tests.family_models import family_config
from tests.unit.test_gguf_import_tiny import MERGES, SPECIALS, vocabulary

# HF layer tensor -> llama.cpp name, per architecture (written out independently of the converter).
_COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
LAYER_NAMES = {
    "qwen3": _COMMON | {"post_attention_layernorm": "ffn_norm"},
    "gemma3": _COMMON | {"post_attention_layernorm": "post_attention_norm",
                         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _gguf_name(arch: str, hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[arch][module]}.{suffix}"


def write_family_gguf(path: Path, arch: str, config: ModelConfig, *, bad_type: bool = False) -> dict[str, np.ndarray]:
    """A tiny GGUF of `arch` as llama.cpp writes it (gemma3: every norm stored as w + 1); returns HF tensors."""
    tensors = {k: v.numpy() for k, v in random_state_dict(config, seed=4, std=0.2).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(config.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocabulary())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocabulary()) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    for name, t in tensors.items():
        stored = t + 1.0 if arch == "gemma3" and name.endswith("norm.weight") else t
        if name == "model.embed_tokens.weight" and bad_type:  # F64: no dequantiser in gguf
            w.add_tensor(_gguf_name(arch, name), stored.astype(np.float64))
        elif name == "model.embed_tokens.weight":
            w.add_tensor(_gguf_name(arch, name), gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(arch, name), stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _config(family: str) -> ModelConfig:
    import dataclasses

    c = family_config(family)
    return dataclasses.replace(c, vocab_size=len(vocabulary()), hidden_size=256, intermediate_size=256,
                               num_attention_heads=4, head_dim=64, tie_word_embeddings=True,
                               rope_scaling=None, final_logit_softcapping=None)


@pytest.mark.parametrize("arch, family", [("qwen3", "qwen3"), ("gemma3", "gemma3_text")])
def test_family_gguf_converts_back_to_the_source_tensors_and_config(tmp_path, arch, family):
    config = _config(family)
    source = write_family_gguf(tmp_path / "m.gguf", arch, config)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    got = ModelConfig.from_model_dir(out)
    assert got.model_type == family and got.qk_norm
    if arch == "gemma3":
        assert (got.norm_weight_offset, got.sandwich_norms, got.embedding_scale) == (1.0, True, 16.0)
        assert got.sliding_window == config.sliding_window and got.query_pre_attn_scalar == 64
        assert got.rope_local_theta == 10000.0 and got.hidden_act == "gelu_pytorch_tanh"
    reader = CheckpointReader(out)
    assert reader.tensor_names == set(source)
    tensors = reader.read(sorted(source), dtype=torch.float32)
    for name, want in source.items():
        atol = 0.05 if name == "model.embed_tokens.weight" else 1e-6  # Q8_0 rounding / the +1 -1 shift
        torch.testing.assert_close(tensors[name], torch.from_numpy(want), atol=atol, rtol=0, msg=name)


def test_each_stage_reads_only_its_own_tensors_of_a_converted_gguf(tmp_path):
    config = _config("qwen3")
    write_family_gguf(tmp_path / "m.gguf", "qwen3", config)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    seen = []
    for i, r in enumerate([range(0, 2), range(2, 4)]):
        from pipeline.model.partition import LayerRange

        reader = CheckpointReader(out)
        names = stage_tensor_names(reader.config, LayerRange(r.start, r.stop), is_first=i == 0, is_last=i == 1)
        reader.read(names, dtype=torch.float32)
        assert reader.read_names == set(names)
        seen.append(reader.read_names)
    assert seen[0] & seen[1] == set() or seen[0] & seen[1] == {"model.embed_tokens.weight"}  # a tied head


def test_dequantisation_comes_in_row_blocks_that_join_to_the_whole_tensor(tmp_path):
    config = _config("qwen3")
    write_family_gguf(tmp_path / "m.gguf", "qwen3", config)
    reader = open_gguf(tmp_path / "m.gguf")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row_bytes = 4 * config.hidden_size
    blocks = list(hf_tensor_blocks(embed, config, "qwen3", block_bytes=10 * row_bytes))
    assert [b.shape[0] for b in blocks[:-1]] == [10] * (len(blocks) - 1) and len(blocks) > 1
    whole = gguf.quants.dequantize(np.asarray(embed.data), embed.tensor_type).reshape(-1, config.hidden_size)
    np.testing.assert_array_equal(np.concatenate(blocks), whole)


def test_streaming_writer_output_reads_back_and_checks_shapes(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(5, dtype=np.float32)}
    entries = [(k, v.shape) for k, v in arrays.items()]
    write_streaming(tmp_path / "x.safetensors", entries,
                    lambda i: iter(np.array_split(arrays[entries[i][0]], 2)) if i == 0 else [arrays["b"]])
    with safe_open(str(tmp_path / "x.safetensors"), framework="np") as f:
        for k, v in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(k), v)
    with pytest.raises(ValueError, match="produced 2 rows"):
        write_streaming(tmp_path / "y.safetensors", [("a", (4, 3))], lambda i: [arrays["a"][:2]])


def test_unsupported_architecture_and_tensor_type_are_one_line_errors(tmp_path):
    config = _config("qwen3")
    write_family_gguf(tmp_path / "bad.gguf", "qwen3", config, bad_type=True)
    with pytest.raises(ValueError, match=r"'token_embd.weight' has type F64, which has no dequantiser "
                                         r"\(supported: .*Q4_K.*\)") as err:
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported \(supported: llama, qwen2, "
                                         r"qwen3, gemma3\)"):
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "out2", progress=False)


# -- chunked models ---------------------------------------------------------------------------------

def _fake_chunks(tmp_path: Path, monkeypatch, data: bytes, num: int) -> model_chunks.ChunkedGguf:
    import hashlib

    size = -(-len(data) // num)
    for i in range(1, num + 1):
        folder = tmp_path / "site" / f"fake_part{i}" / "data"
        folder.mkdir(parents=True)
        (folder / f"part{i:02d}.bin").write_bytes(data[(i - 1) * size:i * size])
    monkeypatch.setattr(model_chunks.importlib.util, "find_spec", lambda name: types.SimpleNamespace(
        submodule_search_locations=[str(tmp_path / "site" / name)]) if (tmp_path / "site" / name).is_dir() else None)
    return model_chunks.ChunkedGguf(file_name="m.gguf", package_prefix="fake_part", pip_prefix="fake-part",
                                    version="1.0", num_chunks=num, size_bytes=len(data),
                                    sha256=hashlib.sha256(data).hexdigest(), extra="fake")


def test_chunks_are_assembled_in_order_once(tmp_path, monkeypatch):
    data = bytes(range(256)) * 40 + b"tail"
    chunked = _fake_chunks(tmp_path, monkeypatch, data, 12)  # part10..12 sort before part2 as strings
    out = model_chunks.assemble(chunked, tmp_path / "cache", progress=False)
    assert out.read_bytes() == data and out == tmp_path / "cache" / "gguf" / "m.gguf"
    mtime = out.stat().st_mtime_ns
    assert model_chunks.assemble(chunked, tmp_path / "cache", progress=False).stat().st_mtime_ns == mtime


def test_a_missing_or_corrupt_chunk_names_the_install_command_and_leaves_nothing(tmp_path, monkeypatch):
    data = b"x" * 1000
    chunked = _fake_chunks(tmp_path, monkeypatch, data, 3)
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"y" * 334)  # same size, other bytes
    with pytest.raises(ValueError, match=r"sha256 .* expected .*pip install -e '\.\[fake\]'"):
        model_chunks.assemble(chunked, tmp_path / "cache", progress=False)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [".m.gguf.lock"]
    import shutil

    shutil.rmtree(tmp_path / "site" / "fake_part3")
    with pytest.raises(ValueError, match=r"fake-part3==1\.0 is not installed"):
        model_chunks.assemble(chunked, tmp_path / "cache", progress=False)
