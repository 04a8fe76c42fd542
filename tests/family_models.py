"""Tiny random models of every supported family, built from transformers' own config classes.

Owns FAMILY_CONFIGS (one tiny transformers config per family, with the family's features switched
on: Llama-3 RoPE scaling, sliding windows shorter than the test prompts, q/k norms, Gemma's
interleaved local/global layers with their own RoPE bases and soft-capping (attention scores too in Gemma 2), fused phi3 tensors,
MoE with dense layers) and `write_family_model`, which writes a Hugging Face folder with
checkpoint-format tensor names (as on the Hub) that both speedpipe and transformers load.
Must not: download anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.model.config import ModelConfig
from tests.tiny_model import byte_tokenizer, random_state_dict

_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                               eos_token_id=2, bos_token_id=1, pad_token_id=0)

# family name -> (transformers config class name, overrides). Windows of 5-6 tokens are shorter than
# the prompts the tests use, so sliding layers really differ from full ones.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(sliding_window=5, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True, attention_bias=False)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention", "full_attention"],
                                             rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                             rope_scaling=dict(rope_type="linear", factor=2.0),
                                             final_logit_softcapping=5.0)),
    # Gemma 1: head_dim 24 is not hidden / heads; Gemma 2: transformers' own layer_types rule (sliding,
    # full, ...), soft-caps small enough to bite on random weights (5.0 on the scores, 3.0 on the logits).
    "gemma": ("GemmaConfig", dict(head_dim=24)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=0)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=False, mlp_only_layers=[1], head_dim=16)),
}

# Long-context RoPE variants (tests/unit/test_rope_scaling.py), kept out of FAMILY_CONFIGS so the
# per-family suites do not run them again: an original context of 16 positions, which a 12-token
# prompt and its continuation cross. llama: YaRN with DeepSeek-style mscale / mscale_all_dim, its own
# betas and no truncation; qwen2: YaRN as Qwen2.5 long-context configs write it; qwen3: YaRN with an
# explicit attention_factor; phi3: LongRoPE with partial rotary 0.75 (Phi-4-mini's), no `factor` (the
# ratio of the two contexts, as Phi-3-128k configs leave it); llama: LongRoPE on a family whose
# transformers `generate` keeps its cache when the factor set switches (phi3's re-encodes it).
ROPE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-yarn": ("LlamaConfig", dict(tie_word_embeddings=False, max_position_embeddings=64, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0, beta_slow=0.5,
        mscale=1.0, mscale_all_dim=0.5, truncate=False))),
    "qwen2-yarn": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=64,
                                       rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=16))),
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True, max_position_embeddings=64,
                                       rope_scaling=dict(rope_type="yarn", factor=4.0, attention_factor=1.3,
                                                         original_max_position_embeddings=16))),
    "phi3-longrope": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=0, max_position_embeddings=64,
                                         original_max_position_embeddings=16, partial_rotary_factor=0.75,
                                         rope_scaling=dict(type="longrope",
                                                           short_factor=[1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
                                                           long_factor=[1.0, 1.5, 2.0, 4.0, 8.0, 16.0]))),
    "llama-longrope": ("LlamaConfig", dict(tie_word_embeddings=False, max_position_embeddings=64, rope_scaling=dict(
        rope_type="longrope", original_max_position_embeddings=16, short_factor=[1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.4, 1.5],
        long_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 16.0]))),
}


def hf_config(family: str, **changes: Any):
    """The transformers config object of `family`'s tiny model (`changes`: config fields to set apart)."""
    import transformers

    cls_name, overrides = (FAMILY_CONFIGS | ROPE_CONFIGS)[family]
    return getattr(transformers, cls_name)(**(_COMMON | overrides | changes))


def family_config(family: str) -> ModelConfig:
    """speedpipe's ModelConfig parsed from the transformers config's own `to_dict()`."""
    return ModelConfig.from_hf_dict(hf_config(family).to_dict())


def family_state_dict(config: ModelConfig, *, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors (checkpoint names), with std `std` so greedy output varies (a scaled
    embedding is drawn smaller by its scale, else it drowns the layers' contributions)."""
    tensors = random_state_dict(config, seed=seed, std=std)
    tensors["model.embed_tokens.weight"] *= 1.0 / config.embedding_scale
    return tensors


def write_family_model(path: str | Path, family: str, *, seed: int = 0, std: float = 0.2, **changes: Any) -> Path:
    """Write a tiny HF folder of `family`: transformers' config.json, safetensors weights under
    checkpoint names, the 256-byte tokenizer of tests/tiny_model.py. `changes`: config fields set apart
    from FAMILY_CONFIGS' (e.g. `sliding_window`). Returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, **changes)
    d = cfg.to_dict()
    d["architectures"] = [type(cfg).__name__.replace("Config", "ForCausalLM").replace("TextForCausalLM",
                                                                                      "ForCausalLM")]
    d["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(d, indent=2))
    tensors = family_state_dict(ModelConfig.from_hf_dict(d), seed=seed, std=std)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "Ă"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return path
