"""GGUF architectures: metadata -> Hugging Face config, tensor names, and per-tensor dequantisation.

Owns, per GGUF `general.architecture` (llama, qwen2, qwen3, gemma3): the HF `model_type`, the
`config.json` dict built from `{arch}.*` metadata (then read by ModelConfig.from_hf_dict, so family
defaults live in one place), the GGUF -> HF tensor-name map, and undoing what llama.cpp's
`convert_hf_to_gguf.py` did to a tensor: the Q/K row permutation ([Note: GGUF Q/K permutation] in
gguf_import.py; llama only) and Gemma's norm shift (the converter stores w + 1 for every Gemma
norm; HF stores w). Dequantisation is tensor by tensor, so no process ever holds a whole float32 model.
Must not: write files or build tokenizers (gguf_import.py does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from pipeline.model.config import ModelConfig

# GGUF general.architecture -> HF model_type.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's converter interleaves Q/K rows only for these
NORM_SHIFTED_ARCHITECTURES = {"gemma3": 1.0}  # the converter adds this to every *norm.weight
_GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every 6th gemma3 layer is global
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer: llama.cpp's ffn_norm is its pre-feed-forward norm.
_GEMMA3_LAYER_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MISSING = object()


def dequantisable_types() -> list[str]:
    """Names of the GGUF tensor types this importer can dequantise (the gguf package's)."""
    return ["F32", "F16"] + [t.name for t in gguf.quants._type_traits]


def check_tensor_types(reader: gguf.GGUFReader, where: str) -> None:
    """Raise ValueError (one line) naming the first tensor whose type has no dequantiser."""
    ok = set(dequantisable_types())
    for t in reader.tensors:
        if t.tensor_type.name not in ok:
            raise ValueError(f"{where}: tensor {t.name!r} has type {t.tensor_type.name}, which has no "
                             f"dequantiser (supported: {', '.join(sorted(ok))})")


def field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (int, float, str or list). Raises ValueError when required and absent."""
    f = reader.get_field(key)
    if f is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return f.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stored (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _rope_scaling(kind: str, factor: float) -> dict[str, Any] | None:
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear)")


def hf_config_dict(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF `config.json` dict of a GGUF file's model. Raises ValueError when unsupported."""
    arch = field(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported yet")

    def meta(key: str, default: Any = _MISSING) -> Any:
        return field(reader, f"{arch}.{key}", default)

    eos = [field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    d: dict[str, Any] = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": meta("vocab_size", None) or len(field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": meta("embedding_length"), "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"), "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv", None) or meta("attention.head_count"),
        "head_dim": meta("attention.key_length", 0),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta("rope.scaling.type", "none"), meta("rope.scaling.factor", 1.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "max_position_embeddings": meta("context_length", 2048),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if arch == "gemma3":
        head_dim = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
        d |= {"head_dim": head_dim, "query_pre_attn_scalar": head_dim,
              "sliding_window": meta("attention.sliding_window", 4096),
              "sliding_window_pattern": _GEMMA3_SLIDING_PATTERN, "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
              "final_logit_softcapping": meta("final_logit_softcapping", None)}
    return d


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """ModelConfig of a GGUF file (through `hf_config_dict`). Raises ValueError when unsupported."""
    return ModelConfig.from_hf_dict(hf_config_dict(reader))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """HF checkpoint name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight').

    Raises ValueError for a tensor this converter does not know.
    """
    layer_map = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_map:
        return f"model.layers.{parts[1]}.{layer_map[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving. w: [num_heads * head_dim, in] or [num_heads * head_dim].

    See [Note: GGUF Q/K permutation] in gguf_import.py. Returns a new array of the same shape.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_blocks(tensor: Any, config: ModelConfig, arch: str, *,
                     block_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
    """One GGUF tensor dequantised to float32 in HF layout ([out, in]; GGUF lists dims innermost
    first), Q/K un-permuted and norm shift removed where the converter applied them, yielded in
    blocks of whole rows of about `block_bytes` float32 bytes (so a 151936-row embedding never
    exists in full; un-permuted Q/K come whole: the permutation mixes rows)."""
    shape = tuple(reversed(tensor.shape.tolist()))
    # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles dequantise time.
    data = np.asarray(tensor.data)
    permute = arch in PERMUTED_ARCHITECTURES and (".attn_q." in tensor.name or ".attn_k." in tensor.name)
    row_bytes = 4 * (int(np.prod(shape[1:])) if len(shape) > 1 else shape[0])
    step = shape[0] if permute or len(shape) == 1 else max(1, block_bytes // row_bytes)
    for lo in range(0, shape[0] if len(shape) > 1 else 1, step):
        part = data[lo:lo + step] if len(shape) > 1 else data
        w = gguf.quants.dequantize(part, tensor.tensor_type).astype(np.float32, copy=False)
        w = w.reshape((-1, *shape[1:]) if len(shape) > 1 else shape)
        if permute:
            w = unpermute_qk(w, config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads)
        shift = NORM_SHIFTED_ARCHITECTURES.get(arch)
        if shift and tensor.name.endswith("norm.weight"):
            w = w - np.float32(shift)
        # F32 tensors come back as read-only views of the memory map: copy those.
        yield np.ascontiguousarray(w) if w.flags.writeable else np.array(w, order="C")

