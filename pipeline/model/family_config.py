"""Per-family reading and writing of Hugging Face `config.json` keys ([Note: model families] in config.py).

Owns what each supported `model_type` means in terms of ModelConfig's family fields: the defaults
of transformers' config class of that family when a key is absent, the RoPE keys in both the
legacy form (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and transformers 5's
`rope_parameters` (flat, or per layer type), and the reverse mapping for `to_hf_dict`.
Must not: import torch or transformers, or read files.

Also owns the text model's config of a multimodal checkpoint (`text_model_dict`, [Note: text-only
multimodal] at the end).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.model.config import FULL_ATTENTION, GEMMA_FAMILIES, SLIDING_ATTENTION
from pipeline.model.rope import partial_rotary_factor, scaling_from_dict

# Families whose config classes derive per-layer sliding windows from `use_sliding_window`.
_QWEN = ("qwen2", "qwen3", "qwen3_moe")
# transformers' defaults for a key missing from config.json, per family.
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0}
_DEFAULT_EPS = {"gemma": 1e-6, "gemma2": 1e-6, "gemma3_text": 1e-6, "qwen3": 1e-6, "qwen3_moe": 1e-6}
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "gemma2": 4096, "gemma3_text": 4096}
_GEMMA_SLIDING_PATTERN = 6
# Gemma2Config's defaults of its soft-caps (Gemma3TextConfig's are None); null in config.json: no cap.
_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# Families that read a cap on the attention scores; any other family refuses one (transformers' Gemma 3
# attention passes no cap to its attention function, so a gemma3 config that sets one is refused too).
_ATTN_CAP_FAMILIES = ("gemma2",)


def rope_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, partial_rotary_factor and rope_local_theta from a config dict (the rules of
    pipeline/model/rope.py). Raises ValueError for an unsupported scaling type or partial rotary factor."""
    params = d.get("rope_parameters") or {}
    per_type = FULL_ATTENTION in params or SLIDING_ATTENTION in params
    full = params.get(FULL_ATTENTION, {}) if per_type else params
    local = params.get(SLIDING_ATTENTION, {}) if per_type else {}
    rope = d.get("rope_scaling") or full
    theta = full.get("rope_theta", d.get("rope_theta", _DEFAULT_THETA.get(model_type, 10000.0)))
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": scaling_from_dict(rope, d, model_type),
                           "partial_rotary_factor": partial_rotary_factor(d, rope, model_type)}
    if model_type == "gemma3_text":
        out["rope_local_theta"] = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        if scaling_from_dict(local, d, model_type) is not None:
            raise ValueError("gemma3 RoPE scaling of sliding-window layers is not supported")
    return out


def _layer_types(d: dict[str, Any], model_type: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    if window is None:
        return (FULL_ATTENTION,) * num_layers
    if model_type in ("gemma2", "gemma3_text"):  # Gemma2Config: every 2nd layer global; Gemma3's pattern: every 6th
        pattern = int(d.get("sliding_window_pattern", _GEMMA_SLIDING_PATTERN)) if model_type == "gemma3_text" else 2
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers))
    if model_type in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers", 28))
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    return (SLIDING_ATTENTION,) * num_layers  # mistral, mixtral, phi3, qwen3_moe: every layer


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    if model_type == "gemma" or (model_type in _QWEN and not d.get("use_sliding_window", False)):
        return None  # GemmaConfig has no sliding window
    window = d.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type))
    return None if window is None else int(window)


def _moe_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    if model_type == "mixtral":
        return {"num_experts": int(d.get("num_local_experts", 8)),
                "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": int(d["intermediate_size"]), "norm_topk_prob": True}
    return {"num_experts": int(d.get("num_experts", d.get("num_local_experts", 128))),
            "num_experts_per_tok": int(d.get("num_experts_per_tok", 8)),
            "moe_intermediate_size": int(d.get("moe_intermediate_size", 768)),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "moe_layer_step": int(d.get("decoder_sparse_step", 1)),
            "dense_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ())}


def _activation(d: dict[str, Any], model_type: str) -> str:
    """The feed-forward activation transformers' config class of the family reads: GemmaConfig's
    `hidden_act` (its legacy "gelu" means the tanh approximation), Gemma2/3's `hidden_activation`."""
    if model_type == "gemma":
        act = d.get("hidden_act") or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act
    if model_type in GEMMA_FAMILIES:
        return d.get("hidden_activation") or "gelu_pytorch_tanh"
    return d.get("hidden_activation") or d.get("hidden_act") or "silu"


def _reject_unsupported(d: dict[str, Any], model_type: str) -> None:
    refused = ("mlp_bias", "use_bidirectional_attention") + (() if model_type in _ATTN_CAP_FAMILIES
                                                             else ("attn_logit_softcapping",))
    for key in refused:
        if d.get(key) not in (None, False):
            raise ValueError(f"{model_type} config {key}={d[key]!r} is not supported (only null/false)")
    act = _activation(d, model_type)
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"{model_type} config activation {act!r} is not supported (silu, gelu_pytorch_tanh)")


def _gemma_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 1 (GemmaConfig), Gemma 2 (Gemma2Config) and Gemma 3 (Gemma3TextConfig) fields: (1 + w)
    norms, sqrt(hidden) embedding scale, head_dim 256 when absent; Gemma 2/3 add sandwich norms, the
    query scale and the final logit soft-cap (Gemma 2 also the attention one; its caps default to 50 / 30
    when absent, Gemma 3's to none)."""
    out: dict[str, Any] = {"norm_weight_offset": 1.0, "embedding_scale": math.sqrt(int(d["hidden_size"])),
                           "head_dim": int(d.get("head_dim") or 256)}
    if model_type == "gemma":
        return out
    caps = _GEMMA2_CAPS if model_type == "gemma2" else {"final_logit_softcapping": None}
    return out | {"sandwich_norms": True, "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
                  **{k: d.get(k, default) for k, default in caps.items()}}


def family_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The family fields of ModelConfig (and family defaults of core fields) for a config dict.

    Raises ValueError naming a key whose value this decoder does not implement.
    """
    _reject_unsupported(d, model_type)
    window = _sliding_window(d, model_type)
    out: dict[str, Any] = {
        "qk_norm": model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        "hidden_act": _activation(d, model_type),
        "layer_types": _layer_types(d, model_type, int(d["num_hidden_layers"]), window),
        "sliding_window": window,
    }
    if "rms_norm_eps" not in d and model_type in _DEFAULT_EPS:
        out["rms_norm_eps"] = _DEFAULT_EPS[model_type]
    if model_type in GEMMA_FAMILIES:
        out.update(_gemma_fields(d, model_type))
    if model_type in ("mixtral", "qwen3_moe"):
        out.update(_moe_fields(d, model_type))
    return out


def family_hf_dict(c: Any) -> dict[str, Any]:
    """config.json keys for the family fields of ModelConfig `c` (what transformers reads back)."""
    d: dict[str, Any] = {"hidden_act": c.hidden_act, "sliding_window": c.sliding_window}
    if c.model_type in (*_QWEN, "gemma2", "gemma3_text"):
        d["layer_types"] = list(c.layer_types)
    elif len(set(c.layer_types)) > 1:
        raise ValueError(f"{c.model_type} has one attention kind for all layers, not {sorted(set(c.layer_types))}")
    if c.model_type in _QWEN:
        d["use_sliding_window"] = c.sliding_window is not None
        d["max_window_layers"] = next((i for i, t in enumerate(c.layer_types) if t == SLIDING_ATTENTION),
                                      c.num_hidden_layers)
    if c.model_type in ("gemma2", "gemma3_text"):
        d.update(hidden_activation=c.hidden_act, query_pre_attn_scalar=c.query_pre_attn_scalar,
                 final_logit_softcapping=c.final_logit_softcapping)
    if c.model_type == "gemma2":
        d["attn_logit_softcapping"] = c.attn_logit_softcapping
    if c.model_type == "gemma3_text":
        d["rope_local_base_freq"] = c.rope_theta if c.rope_local_theta is None else c.rope_local_theta
    if c.model_type == "mixtral":
        d.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    if c.model_type == "qwen3_moe":
        d.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                 moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                 decoder_sparse_step=c.moe_layer_step, mlp_only_layers=list(c.dense_layers))
    return d


# -- multimodal checkpoints, text only ------------------------------------------------------------------
# [Note: text-only multimodal]
# Gemma 3 4B/12B/27B (`model_type` "gemma3", Gemma3ForConditionalGeneration) run as their text model:
# `text_model_dict` turns the config.json into the text model's (text_config over transformers'
# Gemma3TextConfig defaults for the keys it omits, as the Hub's configs omit most; the top-level token
# ids where given, and the top-level tied-head flag (absent: Gemma3Config's True), by which alone
# transformers' conditional-generation model ties its head, whatever text_config says). Its logits are not
# soft-capped: transformers' Gemma3ForConditionalGeneration (the class these checkpoints name) ignores
# `final_logit_softcapping` (its Gemma3ForCausalLM applies it), and the released checkpoints set none.
# The vision tower and projector are never read (the checkpoint reader maps only the language model's
# tensors: pipeline/model/tensor_names.py `text_model_name`), and the API takes text only, as vLLM's
# and llama.cpp's text-only use of these models. `launch` says so once on stderr.

# multimodal model_type -> (its text model's model_type, transformers' defaults of the text config).
# Gemma3TextConfig (transformers 5.x); tests/unit/test_gemma3_multimodal.py checks them against it.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
MULTIMODAL_TEXT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {"gemma3": ("gemma3_text", _GEMMA3_TEXT_DEFAULTS)}
# Top-level token ids, which transformers' generation reads instead of text_config's where given.
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id")
# Whether the head is the embedding: transformers' conditional-generation model ties by the top-level flag
# alone (Gemma3Config's default True when absent), never by text_config's.
_TIED_HEAD_DEFAULT = {"gemma3": True}


def multimodal_architecture(d: dict[str, Any]) -> str | None:
    """The architecture name of a multimodal config dict whose text side speedpipe runs (e.g.
    "Gemma3ForConditionalGeneration"), or None for a text model's config."""
    if d.get("model_type") not in MULTIMODAL_TEXT_MODELS:
        return None
    names = d.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else \
        f"{d['model_type']} (multimodal)"


def text_model_dict(d: dict[str, Any]) -> dict[str, Any]:
    """`d` itself for a text model; for a multimodal config ([Note: text-only multimodal]) the
    config dict of its text model: `text_config` over transformers' defaults, with the top-level
    bos/eos token ids where given, the top-level tie_word_embeddings (absent: True; text_config's is
    ignored, as transformers ignores it), and no final logit soft-capping. Raises ValueError (one
    line) when `text_config` is not an object or names another model_type."""
    if d.get("model_type") not in MULTIMODAL_TEXT_MODELS:
        return d
    text_type, defaults = MULTIMODAL_TEXT_MODELS[d["model_type"]]
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"config.json field 'text_config' must be an object, got {text!r}")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"{d['model_type']} config.json: text_config.model_type {text['model_type']!r} is not "
                         f"supported (only {text_type!r})")
    out = defaults | text | {"model_type": text_type, "final_logit_softcapping": None}  # see the Note
    out.update({k: d[k] for k in _TOP_LEVEL_KEYS if d.get(k) is not None})
    out["tie_word_embeddings"] = d.get("tie_word_embeddings", _TIED_HEAD_DEFAULT[d["model_type"]])
    return out
