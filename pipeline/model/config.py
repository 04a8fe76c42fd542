"""Model configuration: the architecture hyper-parameters of a Llama-family decoder.

Owns the one typed description of a model (`ModelConfig`), how it is read from a Hugging Face
`config.json`, the dtypes its weights and activations may be loaded in (`MODEL_DTYPES`), and a tiny
named config that unit tests use instead of real weights.
Must not: read weights, touch the file system beyond `config.json`, or import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pipeline.model.rope import RopeScaling

# The dtypes model weights and activations may be loaded in (names as on the wire and in the CLI).
MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
# model_type values whose layout this decoder implements. Families differ only by configuration
# (see [Note: model families] below); the HF class each one is checked against in tests.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(HF_ARCHITECTURES)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_O_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text")  # o bias iff attention_bias
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")  # (1 + w) norms, GeGLU, sqrt(hidden) embedding scale, tied head
_UNIFORM_WINDOW = ("mistral", "mixtral", "phi3", "qwen3_moe")  # a sliding_window applies to every layer

# [Note: model families]
# One decoder, switched by these ModelConfig fields (all default to plain Llama):
#   attention_bias / o_proj_bias   q,k,v (and o) biases: qwen2 (q,k,v only), llama/qwen3/gemma* when set
#   qk_norm                        RMSNorm over head_dim on q and k before RoPE: qwen3, qwen3_moe, gemma3
#   norm_weight_offset             gemma's RMSNorm multiplies by (1 + w): 1.0 for gemma, gemma2, gemma3
#   sandwich_norms                 gemma2/3: norm the attention output, and pre-/post-feed-forward norms
#   hidden_act                     silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, gemma*)
#   embedding_scale                token embedding times sqrt(hidden_size) (gemma*)
#   query_pre_attn_scalar          attention scale 1/sqrt(this) instead of 1/sqrt(head_dim) (gemma2/3)
#   layer_types, sliding_window    per-layer full or sliding-window causal attention (mistral, gemma2/3)
#   rope_local_theta               RoPE base of sliding layers, unscaled (gemma3's rope_local_base_freq)
#   attn_logit_softcapping         attention scores = cap * tanh(scores / cap), before the mask (gemma2 only)
#   final_logit_softcapping        logits = cap * tanh(logits / cap) (gemma2, gemma3 when set)
#   num_experts, ...               sparse mixture-of-experts feed-forward (mixtral, qwen3_moe)
# phi3 differs only in the checkpoint (fused qkv_proj and gate_up_proj); see pipeline/weights/checkpoint.py.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder of one of SUPPORTED_MODEL_TYPES, by configuration ([Note: model families]).

    Sizes are counts; `head_dim` defaults to hidden_size // num_attention_heads; `layer_types`
    defaults to full attention on every layer. Raises ValueError when the sizes are inconsistent
    (e.g. heads not divisible by KV heads) or a family field is out of range.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # pipeline/model/rope.py
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * this) dims of a head (phi3)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    o_proj_bias: bool | None = None  # None: the family's rule (_O_BIAS_FAMILIES follow attention_bias)
    qk_norm: bool = False
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = ()
    # The multimodal architecture this is the text model of (its vision part is not loaded:
    # [Note: text-only multimodal] in pipeline/model/family_config.py), or None.
    text_only_of: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.o_proj_bias is None:
            object.__setattr__(self, "o_proj_bias", self.attention_bias and self.model_type in _O_BIAS_FAMILIES)
        _check_family_fields(self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_position_embeddings < 2:  # a prompt token and one to generate
            raise ValueError(f"max_position_embeddings must be >= 2, got {self.max_position_embeddings}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not (0 < self.partial_rotary_factor <= 1 and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0):
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and give head_dim {self.head_dim} an even "
                             f"rotary_dim >= 2, got {self.partial_rotary_factor}")
        if self.rope_scaling is not None:
            self.rope_scaling.check_rotary_dim(self.rotary_dim)
        if not self.layer_types:  # one attention kind for every layer (mistral, mixtral, phi3: all sliding)
            kind = SLIDING_ATTENTION if self.sliding_window and self.model_type in _UNIFORM_WINDOW else FULL_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)

    @property
    def max_context(self) -> int:
        """The longest sequence the model supports, in positions (the ceiling of `max_model_len`):
        `max_position_embeddings`, or for YaRN `original_max_position_embeddings x factor` where that
        is longer, as vLLM derives it (Qwen2.5 with YaRN factor 4 over 32768: 131072). Linear,
        llama3 and LongRoPE configs state their long context in `max_position_embeddings` already
        (Gemma 3's linear factor 8 is not a stretch of its 131072; vLLM special-cases it so)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type != "yarn":
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(scaling.original_max_position_embeddings * scaling.factor))

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        """True when decoder layer `layer` uses sliding-window attention."""
        return self.layer_types[layer] == SLIDING_ATTENTION

    def uses_local_rope(self, layers: Iterable[int]) -> bool:
        """True when one of `layers` (absolute indices) is a sliding layer with its own unscaled RoPE base
        (Gemma 3's rope_local_base_freq): a stage holding it keeps a second set of rotation tables."""
        return self.rope_local_theta is not None and any(self.is_sliding(i) for i in layers)

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer `layer` has a sparse mixture-of-experts feed-forward."""
        return (self.num_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.moe_layer_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict. Raises ValueError on unsupported models,
        naming the model_type or field and what is supported."""
        from pipeline.model.family_config import (
            family_fields,
            multimodal_architecture,
            rope_fields,
            text_model_dict,
        )

        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        text_only_of = multimodal_architecture(d)
        d = text_model_dict(d)  # a multimodal config's text_config, with transformers' defaults
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; gemma3 multimodal: text only)")
        _check_required_fields(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_attention_heads"] if d.get("num_key_value_heads") is None
                                    else d["num_key_value_heads"]),  # absent or null: one KV head per head, as HF
            head_dim=int(d.get("head_dim") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in GEMMA_FAMILIES)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            text_only_of=text_only_of,
        )
        return cls(**(fields | rope_fields(d, model_type) | family_fields(d, model_type)))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`. Raises FileNotFoundError, or ValueError (one line naming the
        file) for bad JSON, an unsupported model or value, or a value of the wrong type."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        try:
            return cls.from_hf_dict(d)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        except (TypeError, AttributeError) as exc:  # a value of the wrong JSON type, e.g. "layer_types": 5
            raise ValueError(f"{path}: a field holds a value of the wrong type ({exc})") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` form (loadable by transformers' config class of the family)."""
        from pipeline.model.family_config import family_hf_dict

        d: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
            if self.model_type == "phi3":  # Phi3Config reads its own top-level key (default 4096), not the dict's
                d["original_max_position_embeddings"] = self.rope_scaling.original_max_position_embeddings
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        d.update(family_hf_dict(self))
        return d


def _check_family_fields(c: ModelConfig) -> None:
    """Validate the family fields of [Note: model families]; ValueError naming the field and limit."""
    if c.hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {c.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if c.layer_types:
        if len(c.layer_types) != c.num_hidden_layers:
            raise ValueError(f"layer_types has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
        bad = sorted(set(c.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if bad:
            raise ValueError(f"layer type {bad[0]!r} is not supported ({FULL_ATTENTION}, {SLIDING_ATTENTION})")
        if SLIDING_ATTENTION in c.layer_types and not (c.sliding_window or 0) > 0:
            raise ValueError(f"sliding_window must be > 0 for sliding-window layers, got {c.sliding_window}")
    if c.num_experts:
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {c.num_experts}], got {c.num_experts_per_tok}")
        if c.moe_intermediate_size <= 0 or c.moe_layer_step < 1:
            raise ValueError(f"moe_intermediate_size ({c.moe_intermediate_size}) must be > 0 and moe_layer_step "
                             f"({c.moe_layer_step}) >= 1")
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar"):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(c, name)}")


_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                  "sliding_window_pattern", "max_window_layers", "num_local_experts", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_FLOATS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping",
           "attn_logit_softcapping", "partial_rotary_factor")
_ROPE_FLOATS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "partial_rotary_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
# transformers checks no types inside rope_scaling: 8192.0 works there (llama3 divides by it), so it does here.
_ROPE_INTS = ("original_max_position_embeddings",)
# Numeric keys whose null means "absent / off" (as in transformers' config classes); any other null is refused.
_NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")  # the last five: transformers' yarn defaults


def _check_required_fields(d: dict[str, Any]) -> None:
    """Raise ValueError naming the field and its value when a config.json dict lacks a required size
    or holds a value of the wrong type: a size or count that is not an integer, a float field
    (rms_norm_eps, rope_theta, rope_scaling.factor, ...) that is not a finite number, a flag that is
    not true/false, a token id that is not an integer (the checks of values come after, in __post_init__)."""
    for name in _REQUIRED_INTS:
        if name not in d:
            raise ValueError(f"config.json has no {name!r}")
    _check_numbers(d, "", ints=_REQUIRED_INTS + _OPTIONAL_INTS, floats=_FLOATS)
    layers = d.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(_is_int(i) for i in layers)):
        raise ValueError(f"config.json field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    for name in ("rope_scaling", "rope_parameters"):
        rope = d.get(name)
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"config.json field {name!r} must be an object, got {rope!r}")
        nested = [(f"{name}.{k}.", v) for k, v in (rope or {}).items() if k in (FULL_ATTENTION, SLIDING_ATTENTION)]
        for prefix, part in [(f"{name}.", rope or {}), *nested]:
            if not isinstance(part, dict):
                raise ValueError(f"config.json field {prefix[:-1]!r} must be an object, got {part!r}")
            _check_numbers(part, prefix, ints=_ROPE_INTS, floats=_ROPE_FLOATS, integral_floats=True)
    for name in ("tie_word_embeddings", "attention_bias"):  # bool("false") is True
        if d.get(name) is not None and not isinstance(d[name], bool):
            raise ValueError(f"config.json field {name!r} must be true or false, got {d[name]!r}")
    for name in ("bos_token_id", "eos_token_id"):  # a string id would never match a token
        ids = d.get(name)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in (ids if isinstance(ids, list) else [ids])
               if ids is not None):
            raise ValueError(f"config.json field {name!r} must be a token id (an integer) or a list of them, "
                             f"got {ids!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(d: dict[str, Any], prefix: str, *, ints: tuple[str, ...], floats: tuple[str, ...],
                   integral_floats: bool = False) -> None:
    """Raise ValueError naming the key (`prefix` + key, e.g. 'rope_scaling.factor') and the value when
    one of `ints` is not an integer (`integral_floats`: 8192.0 is one) or one of `floats` is not a
    finite number (true/false are neither; null only for _NULLABLE keys). float("abc") or float([1])
    would not name the key."""
    for name in (n for n in ints + floats if n in d):
        value = d[name]
        if value is None and name in _NULLABLE:
            continue
        integral = integral_floats and isinstance(value, float) and value.is_integer()
        if name in ints and not (_is_int(value) or integral):
            raise ValueError(f"config.json field {prefix + name!r} must be an integer, got {value!r}")
        if name in floats and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                   and math.isfinite(value)):
            raise ValueError(f"config.json field {prefix + name!r} must be a number, got {value!r}")


def tiny_config(**overrides: Any) -> ModelConfig:
    """A tiny random-weight Llama config for unit tests (4 layers, hidden 64, GQA 4/2, vocab 256)."""
    base: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, max_position_embeddings=8192, eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)
