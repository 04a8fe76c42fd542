"""A complete Hugging Face-format folder for the tiny random model, for tests that need files.

Owns `write_tiny_model`, which writes everything a real model folder has (config.json, safetensors
weights, tokenizer.json, tokenizer_config.json, generation_config.json) for `tiny_config(**overrides)`
with `random_state_dict` weights, so loader, worker and end-to-end tests never need real weights.
Must not: download anything or depend on transformers.

Tokenizer: byte-level BPE with exactly 256 tokens, one per byte, and no merges: token id == byte
value (GPT-2's printable byte-to-unicode alphabet), so every id is < the tiny vocab size of 256 and
any text round-trips. EOS is id 2 (the byte 0x02), registered as a special token, so decoding skips it
by default. Note the consequence: the literal character that spells byte 0x02 in that alphabet
("\u0102", "Ă") encodes to EOS instead of its two UTF-8 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers

from pipeline.model.config import ModelConfig, tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import StageModel
from pipeline.model.tensor_names import checkpoint_name

TINY_EOS_ID = 2
NUM_BYTE_TOKENS = 256


def random_state_dict(config: ModelConfig, *, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """A full random checkpoint of `config` with Hugging Face names: {tensor name: float32 tensor}, norm
    weights around 1 (Gemma: around 0), the rest N(0, std²); seeded, so the same every call."""
    full = StageModel(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, param in full.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):  # layer norms, q/k norms, final norm: around 1 (Gemma: w + 1)
            t = 1.0 - config.norm_weight_offset + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            t = std * torch.randn(param.shape, generator=gen)
        out[checkpoint_name(name, config)] = t
    return out


def byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte value 0..255 (GPT-2's `bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(NUM_BYTE_TOKENS):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return [chars[b] for b in range(NUM_BYTE_TOKENS)]


def byte_tokenizer(*, eos_id: int = TINY_EOS_ID) -> tokenizers.Tokenizer:
    """Byte-level BPE, 256 byte tokens (id == byte value), no merges; `eos_id` is a special token."""
    alphabet = byte_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(alphabet[eos_id], special=True, normalized=False)])
    assert tok.get_vocab_size(with_added_tokens=True) == NUM_BYTE_TOKENS, "EOS must reuse its byte id"
    return tok


def _write_weights(path: Path, tensors: dict[str, Any], num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards {num_shards} is more than the checkpoint's {len(names)} tensors")
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n] for n in names[i * per_shard:(i + 1) * per_shard]}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tiny_model(path: str | Path, *, seed: int = 0, num_shards: int = 1, eos_token: bool = True,
                     **config_overrides: Any) -> Path:
    """Write a Hugging Face-format folder for `tiny_config(**config_overrides)` at `path`; return it.

    Weights are `random_state_dict(config, seed=seed)` (float32), in one `model.safetensors` or, when
    `num_shards` > 1, in that many shards listed by `model.safetensors.index.json`.
    The tokenizer is the 256-byte one of `byte_tokenizer`, so the config's vocab_size must be >= 256.
    Its tokenizer_config.json names TINY_EOS_ID's byte as eos_token, or none with `eos_token=False` (the
    generation config names TINY_EOS_ID either way).
    Raises ValueError for num_shards < 1 or a vocab smaller than the tokenizer.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    config: ModelConfig = tiny_config(**config_overrides)
    if config.vocab_size < NUM_BYTE_TOKENS:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the {NUM_BYTE_TOKENS}-token tokenizer")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    _write_weights(path, random_state_dict(config, seed=seed), num_shards)
    tok = byte_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    eos_text = byte_alphabet()[TINY_EOS_ID]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, **({"eos_token": eos_text} if eos_token else {}),
        "model_max_length": config.max_position_embeddings, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": TINY_EOS_ID}, indent=2))
    return path


def write_firp_file(model_dir: str | Path, path: str | Path, *, layer: int, k: int, seed: int = 0,
                    noise: float = 0.3) -> Path:
    """Write untrained FIRP maps for the model in `model_dir`: identity plus `noise`-scaled random
    matrices, so drafts are sometimes right and often wrong (tests need both)."""
    import torch

    from pipeline.speculation.firp import FirpMaps
    from pipeline.speculation.predictor_file import model_identity, save_predictor

    identity = model_identity(model_dir)
    maps = FirpMaps(identity.hidden_size, k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        maps.weight += noise * torch.randn(maps.weight.shape, generator=gen) / identity.hidden_size ** 0.5
    meta = {"kind": "firp", "model": identity.to_dict(), "exit_layer": layer, "k": k, "corpus": "none",
            "train_tokens": 0, "eval": {}}
    return save_predictor(path, maps.to_tensors(), meta, dtype=torch.float32)
