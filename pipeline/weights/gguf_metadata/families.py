"""GGUF architectures: metadata -> Hugging Face config, tensor names, and per-tensor dequantisation.

Owns, per GGUF `general.architecture` (llama, qwen2, qwen3, qwen3moe, gemma, gemma2, gemma3, phi3): the HF
`model_type` (llama.cpp writes Mistral and Mixtral as `llama`: a sliding window makes it mistral,
experts make it mixtral), the `config.json` dict built from `{arch}.*` metadata (then read by
ModelConfig.from_hf_dict, so family defaults live in one place), the GGUF -> HF tensor-name map
(one stacked `ffn_*_exps` tensor [experts, out, in] -> one HF tensor per expert), and undoing what
llama.cpp's `convert_hf_to_gguf.py` did to a tensor: the Q/K row permutation ([Note: GGUF Q/K
permutation] in gguf_import.py; llama only, so Mistral and Mixtral too) and Gemma's norm shift (the
converter stores w + 1 for every Gemma norm; HF stores w); RoPE factor tensors (Llama 3.x's `rope_freqs`)
become config.json's rope_scaling ([Note: GGUF RoPE factor tensors]). phi3 keeps HF's fused `qkv_proj` and
`gate_up_proj` (llama.cpp: `attn_qkv`, and `ffn_up` holding gate then up). Dequantisation is tensor
by tensor (expert by expert), so no process ever holds a whole float32 model.
Must not: write files or build tokenizers (gguf_import.py does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.tensor_names import family_tensor_name

# GGUF general.architecture -> HF model_type (llama: also mistral / mixtral, see `model_type_of`).
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                           "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's converter interleaves Q/K rows only for these
NORM_SHIFTED_ARCHITECTURES = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}  # the converter adds this to every *norm.weight
_GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every 6th gemma3 layer is global
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "attn_qkv": "self_attn.qkv_proj",
}
# Stacked expert tensors [num_experts, out, in] -> the decoder's per-expert projection.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# phi3: llama.cpp's ffn_up is HF's fused gate_up_proj (gate rows first, then up).
_PHI3_LAYER_TENSORS = _LAYER_TENSORS | {"ffn_up": "mlp.gate_up_proj"}
# Gemma 2 and 3 have four norms per layer: llama.cpp's ffn_norm is their pre-feed-forward norm.
_GEMMA3_LAYER_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MISSING = object()
# llama.cpp's Gemma 2 defaults for keys a file lacks (llama-model.cpp's hparams: window 4096, caps 50 / 30).
_GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# llama.cpp's Gemma 2 / 3 query scale (the converter writes no query_pre_attn_scalar): 1/sqrt(hidden / heads)
# for the 27B models (Gemma 2: 46 layers, Gemma 3: 62), 1/sqrt(head_dim) otherwise, as Google's gemma_pytorch
# config (the Hub's query_pre_attn_scalar: 144 for gemma-2-27b, 168 for gemma-3-27b, else head_dim).
_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# Qwen's chat models end a turn with <|im_end|> (the GGUF's eos) but also stop on <|endoftext|>:
# their generation_config.json lists both ([151645, 151643] in Qwen2.5 and Qwen3), the GGUF only one.
_QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_QWEN_END_OF_TEXT = "<|endoftext|>"
# Tensors that hold RoPE settings, not weights ([Note: GGUF RoPE factor tensors]): read into config.json's
# rope_scaling, never written to model.safetensors, the same for every stage.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)

# [Note: GGUF RoPE factor tensors]
# llama.cpp's converter writes some RoPE scalings as float32 tensors of per-frequency divisors
# ([rotary_dim // 2]) instead of metadata, and `ggml_rope_ext` divides frequency i by entry i
# (its `freq_factors`: theta_i = position * base^(-2i / rotary_dim) / factor_i). Llama 3.1 / 3.2
# (`rope_type: llama3`) become `rope_freqs`: LlamaModel.generate_extra_tensors stores 1 for the high
# frequencies, `factor` for the low ones and 1 / ((1 - smooth) / factor + smooth) between, so every
# Llama 3.x GGUF carries one (llama.cpp uses it for every layer). Inverse frequencies divided by
# per-frequency factors are exactly LongRoPE's rule (rope.py's `rope_inv_freq`), so the conversion
# writes `rope_freqs` as a `longrope` rope_scaling whose short and long factors are both the tensor's
# values and whose attention_factor is 1: this runtime and transformers then read the converted folder
# with llama.cpp's frequencies, and the factors travel in config.json, which every stage reads.
# (transformers' own GGUF loader ignores the tensor, i.e. loads Llama 3.1 unscaled.) The values
# equal those of config.json's llama3 rope_scaling up to float32 rounding (llama.cpp divides by
# the reciprocal of HF's interpolation weight).
# Phi-3 LongRoPE (Phi3MiniModel) becomes `rope_factors_short` / `rope_factors_long` (config.json's
# short_factor / long_factor) with metadata `{arch}.rope.scaling.original_context_length` and
# `{arch}.rope.scaling.attn_factor` (the converter's sqrt(1 + ln(scale) / ln(original)), transformers'
# default too), `context_length` being max_position_embeddings: exactly the config.json keys the HF
# path reads. Newer converters also write `{arch}.rope.scaling.type = longrope`, which adds nothing
# (without the factor tensors it is refused). Which set a row gets follows the HF path ([Note: LongRoPE switch] in rope.py), not
# llama.cpp, which picks the long set for every row when its context size exceeds the original one.


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
    if kind in ("none", "longrope"):  # LongRoPE's factors are tensors: `_longrope_keys`
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear, longrope)")


def model_type_of(reader: gguf.GGUFReader) -> str:
    """The HF model_type of a GGUF file: its architecture's, except that llama.cpp writes Mistral and
    Mixtral as `llama` (experts -> mixtral, else a sliding window -> mistral)."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        return SUPPORTED_ARCHITECTURES[arch]
    if field(reader, "llama.expert_count", 0):
        return "mixtral"
    return "mistral" if field(reader, "llama.attention.sliding_window", None) else "llama"


def _dense_layers(reader: gguf.GGUFReader) -> list[int]:
    """Layers of an MoE GGUF with a plain feed-forward (`blk.N.ffn_gate.weight`, no experts)."""
    names = {t.name for t in reader.tensors}
    return sorted(int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.endswith(".ffn_gate.weight"))


def _head_dim(d: dict[str, Any]) -> int:
    """head_dim of the common keys `d`: the file's key_length, else hidden / heads."""
    return d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]


def _query_scalar(model_type: str, d: dict[str, Any]) -> int:
    """llama.cpp's query_pre_attn_scalar of a Gemma 2 / 3 GGUF (see `_27B_LAYERS`)."""
    wide = d["num_hidden_layers"] == _27B_LAYERS[model_type]
    return d["hidden_size"] // d["num_attention_heads"] if wide else _head_dim(d)


def _family_keys(reader: gguf.GGUFReader, model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """config.json keys of one family, from `{arch}.*` metadata; `d` holds the common keys."""
    arch = field(reader, "general.architecture")

    def meta(key: str, default: Any = _MISSING) -> Any:
        return field(reader, f"{arch}.{key}", default)

    window = meta("attention.sliding_window", None)
    if model_type == "gemma2":
        out = {k.rpartition(".")[2]: _f32(meta(k, v)) for k, v in _GEMMA2_DEFAULTS.items()}
        out["sliding_window"] = int(out["sliding_window"])
        return out | {"head_dim": _head_dim(d), "query_pre_attn_scalar": _query_scalar(model_type, d)}
    if model_type == "gemma":
        return {"head_dim": _head_dim(d)}
    if model_type == "gemma3_text":
        return {"head_dim": _head_dim(d), "query_pre_attn_scalar": _query_scalar(model_type, d),
                "sliding_window": window or 4096,
                "sliding_window_pattern": _GEMMA3_SLIDING_PATTERN, "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
                "final_logit_softcapping": meta("final_logit_softcapping", None)}
    out: dict[str, Any] = {"sliding_window": window} if model_type in ("mistral", "mixtral", "phi3") else {}
    if model_type == "phi3":
        head_dim = _head_dim(d)
        out["partial_rotary_factor"] = meta("rope.dimension_count", head_dim) / head_dim
    if model_type == "mixtral":
        out |= {"num_local_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
                "intermediate_size": meta("expert_feed_forward_length", None) or d["intermediate_size"]}
    if model_type == "qwen3_moe":
        # llama.cpp renormalises the top-k weights of qwen3moe unless the file says otherwise.
        out |= {"num_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
                "moe_intermediate_size": meta("expert_feed_forward_length"),
                "norm_topk_prob": bool(meta("expert_weights_norm", True)), "decoder_sparse_step": 1,
                "mlp_only_layers": _dense_layers(reader)}
    return out


def hf_config_dict(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF `config.json` dict of a GGUF file's model, its RoPE factor tensors read into `rope_scaling`
    ([Note: GGUF RoPE factor tensors]). Raises ValueError (one line) when unsupported or malformed."""
    arch = field(reader, "general.architecture")
    full_names = {t.name for t in reader.tensors}
    names = {n.rpartition(".")[0] for n in full_names}

    def meta(key: str, default: Any = _MISSING) -> Any:
        return field(reader, f"{arch}.{key}", default)

    eos = [field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    model_type = model_type_of(reader)
    if model_type in _QWEN_TYPES and _QWEN_END_OF_TEXT in (tokens := field(reader, "tokenizer.ggml.tokens", [])):
        eos.append(tokens.index(_QWEN_END_OF_TEXT))
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    d: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": meta("vocab_size", None) or len(field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": meta("embedding_length"), "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"), "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv", None) or meta("attention.head_count"),
        "head_dim": meta("attention.key_length", 0),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta("rope.scaling.type", "none"), meta("rope.scaling.factor", 1.0)),
        "tie_word_embeddings": "output" not in names,
        "attention_bias": "blk.0.attn_q.bias" in full_names or "blk.0.attn_qkv.bias" in full_names,
        "max_position_embeddings": meta("context_length", 2048),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    d |= _family_keys(reader, model_type, d)
    if meta("rope.scaling.type", "none") == "longrope" or ROPE_FACTORS_LONG in full_names or \
            ROPE_FACTORS_SHORT in full_names:
        d |= _longrope_keys(reader, d)
    if ROPE_FREQS in full_names:
        d["rope_scaling"] = _rope_freqs_scaling(reader, d)
    return d


def _rope_factors(reader: gguf.GGUFReader, name: str, num_freqs: int) -> list[float]:
    """Values of RoPE factor tensor `name` of `reader` ([Note: GGUF RoPE factor tensors]). Raises
    ValueError (one line, naming the tensor) unless it is F32 [num_freqs] of finite values > 0."""
    t = next(t for t in reader.tensors if t.name == name)
    shape = [int(n) for n in t.shape]
    if t.tensor_type != gguf.GGMLQuantizationType.F32 or shape != [num_freqs]:
        raise ValueError(f"GGUF tensor {name!r} must be F32 [{num_freqs}] (one factor per rotary frequency), "
                         f"got {t.tensor_type.name} {shape}")
    values = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"GGUF tensor {name!r} must hold finite factors > 0, got min {values.min()}")
    return [float(v) for v in values]


def _num_freqs(d: dict[str, Any]) -> int:
    """Rotary frequencies per head (rotary_dim // 2) of config dict `d`."""
    head_dim = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
    return int(head_dim * d.get("partial_rotary_factor", 1.0)) // 2


def _longrope_keys(reader: gguf.GGUFReader, d: dict[str, Any]) -> dict[str, Any]:
    """config.json keys of a LongRoPE GGUF (Phi-3 128k, Phi-3.5, Phi-4-mini: [Note: GGUF RoPE factor
    tensors]): its rope_scaling and the top-level original_max_position_embeddings (phi3's own key).
    Raises ValueError (one line) for no factor tensors (rope.scaling.type `longrope` alone) or one without
    the other, a malformed one, or a missing original_context_length."""
    arch = field(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    if ROPE_FACTORS_LONG not in names and ROPE_FACTORS_SHORT not in names:
        raise ValueError(f"GGUF rope scaling type 'longrope' comes without its factor tensors {ROPE_FACTORS_LONG!r} "
                         f"and {ROPE_FACTORS_SHORT!r}")
    for have, lack in ((ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT), (ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG)):
        if have in names and lack not in names:
            raise ValueError(f"GGUF tensor {have!r} (LongRoPE) comes without {lack!r}")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    rope: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                            "short_factor": _rope_factors(reader, ROPE_FACTORS_SHORT, _num_freqs(d)),
                            "long_factor": _rope_factors(reader, ROPE_FACTORS_LONG, _num_freqs(d))}
    attn_factor = field(reader, f"{arch}.rope.scaling.attn_factor", None)
    if attn_factor is not None:
        rope["attention_factor"] = _f32(attn_factor)
    return {"rope_scaling": rope, "original_max_position_embeddings": original}


def _rope_freqs_scaling(reader: gguf.GGUFReader, d: dict[str, Any]) -> dict[str, Any]:
    """The `rope_scaling` of a GGUF carrying `rope_freqs` (Llama 3.x): LongRoPE with one factor set
    ([Note: GGUF RoPE factor tensors]). `d`: the config dict so far. Raises ValueError (one line) for
    a malformed tensor, or one combined with metadata scaling (llama.cpp's converter writes no such file)."""
    if d["rope_scaling"] is not None:
        raise ValueError(f"GGUF tensor {ROPE_FREQS!r} together with rope scaling type "
                         f"{d['rope_scaling']['rope_type']!r} is not supported")
    factors = _rope_factors(reader, ROPE_FREQS, _num_freqs(d))
    return {"rope_type": "longrope", "factor": 1.0, "attention_factor": 1.0, "short_factor": factors,
            "long_factor": factors, "original_max_position_embeddings": d["max_position_embeddings"]}


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """ModelConfig of a GGUF file (through `hf_config_dict`). Raises ValueError when unsupported."""
    return ModelConfig.from_hf_dict(hf_config_dict(reader))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """HF checkpoint name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'),
    in the decoder's own naming (Mixtral's `block_sparse_moe` names: `tensor_targets`).

    Raises ValueError for a tensor this converter does not know, or a stacked expert tensor.
    """
    layer_map = {"gemma2": _GEMMA3_LAYER_TENSORS, "gemma3": _GEMMA3_LAYER_TENSORS,
                 "phi3": _PHI3_LAYER_TENSORS}.get(arch, _LAYER_TENSORS)
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_map:
        return f"model.layers.{parts[1]}.{layer_map[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def tensor_targets(gguf_name: str, arch: str, config: ModelConfig) -> list[tuple[str, int | None]]:
    """(checkpoint name, expert index) of every HF tensor that GGUF tensor `gguf_name` holds: one
    (name, None) for a plain tensor; (name, e) for e in range(num_experts) for a stacked
    `blk.N.ffn_{gate,up,down}_exps` tensor, whose slice e is expert e; none for a RoPE factor tensor
    (ROPE_TENSORS: config, not weights). Names are the checkpoint's (`family_tensor_name`: Mixtral's
    `block_sparse_moe.experts.{e}.w1`). Raises ValueError as `hf_tensor_name` does."""
    if gguf_name in ROPE_TENSORS:  # RoPE settings, in config.json ([Note: GGUF RoPE factor tensors])
        return []
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _EXPERT_TENSORS:
        proj = _EXPERT_TENSORS[parts[2]]
        return [(family_tensor_name(f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{suffix}", config), e)
                for e in range(config.num_experts)]
    return [(family_tensor_name(hf_tensor_name(gguf_name, arch), config), None)]


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving. w: [num_heads * head_dim, in] or [num_heads * head_dim].

    See [Note: GGUF Q/K permutation] in gguf_import.py. Returns a new array of the same shape.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_blocks(tensor: Any, config: ModelConfig, arch: str, *, expert: int | None = None,
                     block_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
    """One GGUF tensor (with `expert`: slice `expert` of a stacked [num_experts, out, in] tensor)
    dequantised to float32 in HF layout ([out, in]; GGUF lists dims innermost first), Q/K
    un-permuted and norm shift removed where the converter applied them, yielded in blocks of whole
    rows of about `block_bytes` float32 bytes (so a 151936-row embedding never exists in full;
    un-permuted Q/K come whole: the permutation mixes rows)."""
    shape = tuple(reversed(tensor.shape.tolist()))
    # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles dequantise time.
    data = np.asarray(tensor.data)
    if expert is not None:
        data, shape = data[expert], shape[1:]
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
