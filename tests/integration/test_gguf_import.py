"""Integration tests: the real SmolLM2-135M GGUF converted by pipeline.weights.gguf_import, checked against
transformers' own, independent GGUF loader (dequantisation, Q/K un-permutation, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights import file_memo, gguf_import
from pipeline.weights.checkpoint import CheckpointReader
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

# Varied text: digits, unicode, emoji (multi-byte, ZWJ-free modifiers, flags), leading and
# trailing spaces, newlines/tabs, code, contractions, and the chat special tokens.
TEXTS = [
    "Once upon a time",
    "In 2024, 12345 + 678 = 13023 and 3.14159 ≈ π.",
    "   leading spaces and trailing  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "Café naïve résumé — “quotes”",
    "你好，世界！日本語のテキスト 한국어",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 🤖",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment",
    "I'm sure they'll say it's fine, don't you?",
    "<|endoftext|><repo_name>a/b<file_sep>x<file_sha>",  # the last is a lookalike, not a token
]


@pytest.fixture(autouse=True, scope="module")
def _hub_offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def hf_gguf_tensors(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    """Every tensor as transformers loads the GGUF (HF names, float32).

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` calls exactly this function
    (`load_gguf_checkpoint`) but also insists on `accelerate`, which is not a test dependency.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_conversion_is_cached(smollm2_conversion, smollm2_cache, smollm2_gguf, monkeypatch):
    """A second resolve reuses the conversion without opening the GGUF and, through the sha256
    memo, without hashing its 98 MB again (asserted by what runs, not by timing it)."""
    model_dir, _convert_s = smollm2_conversion
    file_memo._sha256_cached.cache_clear()  # the in-process cache would hide a missing memo

    def refused(*args, **kwargs):
        raise AssertionError("the cached conversion was redone")

    monkeypatch.setattr(gguf_import, "open_gguf", refused)
    monkeypatch.setattr(file_memo, "_sha256_cached", refused)
    assert resolve_model(DEFAULT_MODEL, cache_dir=smollm2_cache, progress=False) == model_dir
    assert model_dir.parent.parent == smollm2_cache / "models" and model_dir.name.startswith("smollm2-135m-")
    source = json.loads((model_dir / "speedpipe_source.json").read_text())
    assert source["size_bytes"] == smollm2_gguf.stat().st_size and model_dir.name.endswith(source["sha256"][:12])


def test_config_is_smollm2_135m(smollm2_dir):
    config = ModelConfig.from_model_dir(smollm2_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert (config.rope_theta, config.rms_norm_eps, config.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert config.max_position_embeddings == 8192 and config.eos_token_ids == (2,)


def test_every_tensor_equals_transformers_gguf_loader(smollm2_dir, hf_gguf_tensors):
    reader = CheckpointReader(smollm2_dir)
    assert reader.tensor_names == set(hf_gguf_tensors)
    ours = reader.read(sorted(reader.tensor_names), dtype=torch.float32)
    for name, want in hf_gguf_tensors.items():
        assert ours[name].shape == want.shape, name
        assert torch.allclose(ours[name], want.float(), rtol=0, atol=1e-6), name
    assert sum(t.numel() for t in ours.values()) == 134_515_008


def test_converted_folder_generates_sensible_text(smollm2_dir, tok):
    """Independent of the oracle above: wrong Q/K rows or RoPE theta would break this greedy answer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.tensor([tok.encode("The capital of France is")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:].tolist()).startswith(" Paris")


def test_tokenizer_known_ids_and_specials(tok):
    assert tok.encode("Once upon a time") == [6403, 1980, 253, 655]
    assert tok.eos_token_ids == (2,) and tok.token_id("<|im_end|>") == 2 and tok.vocab_size == 49152
    assert tok.encode("<|im_start|>") == [1]
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers_gguf_tokenizer(tok, hf_tokenizer, text):
    ids = tok.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_detokenizer_equals_full_decode(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer(prompt_ids=tok.encode("Hello"))
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_pre_tokenizer_is_smollm2s_digits_then_byte_level(smollm2_dir, tok):
    """SmolLM2's own tokenizer.json (and llama.cpp's `smollm` regex) isolate every Unicode number
    character. transformers' GGUF tokenizer omits the Digits step, so the two differ on text like
    " ½" (category No); ours follows the model's tokenizer.json."""
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    assert spec == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert tok.encode(" ½") == [tok.token_id("Ġ"), tok.token_id("Â½")]
