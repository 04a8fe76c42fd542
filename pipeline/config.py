"""Model configuration: the architecture hyper-parameters of a Llama-family decoder.

Owns the one typed description of a model (`ModelConfig`), how it is read from a Hugging Face
`config.json`, and a tiny named config that unit tests use instead of real weights.
Must not: read weights, touch the file system beyond `config.json`, or import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# model_type values whose layout this decoder implements. Families differ only by configuration
# (qkv bias for Qwen2, sliding windows are not supported yet).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling`.

    `rope_type` is one of "default", "linear" (positions divided by `factor`) or "llama3"
    (Llama 3.1 wavelength-dependent scaling with `low_freq_factor`, `high_freq_factor` and
    `original_max_position_embeddings`).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported (default, linear, llama3)")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2 by configuration).

    Sizes are counts; `head_dim` defaults to hidden_size // num_attention_heads.
    Raises ValueError when the sizes are inconsistent (e.g. heads not divisible by KV heads).
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
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
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

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict. Raises ValueError on unsupported models."""
        model_type = d.get("model_type", "llama")
        scaling = d.get("rope_scaling")
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            rope_scaling = RopeScaling(
                rope_type=kind,
                factor=float(scaling.get("factor", 1.0)),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
            head_dim=int(d.get("head_dim") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`. Raises FileNotFoundError / ValueError."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` form (loadable by transformers' LlamaConfig)."""
        d: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[self.model_type]],
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
            d["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


def tiny_config(**overrides: Any) -> ModelConfig:
    """A tiny random-weight Llama config for unit tests (4 layers, hidden 64, GQA 4/2, vocab 256)."""
    base: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, max_position_embeddings=512, eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)
