"""GGUF import: convert a llama.cpp GGUF file once into a Hugging Face-format model folder.

Owns the mapping from GGUF metadata and tensor names to `config.json` / HF tensor names, the
dequantisation (through the `gguf` package), undoing llama.cpp's Q/K row permutation, rebuilding
`tokenizer.json` from the GGUF vocabulary, and publishing the folder atomically.
Must not: run models, download anything, or import transformers (it is a test-only oracle).

[Note: GGUF Q/K permutation]
llama.cpp's `convert_hf_to_gguf.py` (LlamaModel.permute) reorders the rows of q_proj and k_proj
from HF's "rotate half" RoPE layout to GGML's interleaved-pairs layout:
    w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(out, in)
with n_head = num_attention_heads for Q and num_key_value_heads for K (biases alike). The inverse,
applied here, is the same reshape with the two middle axes the other way round:
    w.reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)
Only the `llama` architecture is permuted; Qwen2 GGUFs keep HF's layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from pipeline.config import ModelConfig, RopeScaling
from pipeline.weights import SINGLE_FILE, all_tensor_names

CONVERTER_VERSION = 1
SOURCE_FILE = "speedpipe_source.json"
OUTPUT_FILES = ("config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", SOURCE_FILE)
# GGUF general.architecture -> HF model_type; only llama's Q/K rows are permuted.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tokenizer.ggml.pre -> pre-tokenizer of the model's own tokenizer.json. The smollm family (also
# StarCoder, Refact) isolates every digit, then applies GPT-2's byte-level regex to the rest.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_GPT2 = ("gpt2", "default")
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class GgufSource:
    """Identity of a converted GGUF file, stored as `speedpipe_source.json` in the folder."""

    path: str
    size_bytes: int
    sha256: str
    converter_version: int = CONVERTER_VERSION

    def same_content(self, other: GgufSource) -> bool:
        """True when both describe the same bytes converted by the same converter version."""
        return (self.size_bytes, self.sha256, self.converter_version) == (
            other.size_bytes, other.sha256, other.converter_version)


@functools.lru_cache(maxsize=16)
def _sha256_cached(path: str, size_bytes: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (about 0.1 s per 100 MB); cached per (path, size, mtime) in-process."""
    st = Path(path).stat()
    return _sha256_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def describe_source(gguf_path: str | Path) -> GgufSource:
    """Size and sha256 of a GGUF file. Raises FileNotFoundError, or ValueError when not GGUF."""
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return GgufSource(path=str(path.resolve()), size_bytes=path.stat().st_size, sha256=file_sha256(path))


def is_converted(out_dir: Path, source: GgufSource) -> bool:
    """True when `out_dir` is a complete conversion of `source` by this converter version."""
    if not all((out_dir / name).is_file() for name in OUTPUT_FILES):
        return False
    try:
        stored = GgufSource(**json.loads((out_dir / SOURCE_FILE).read_text()))
    except (json.JSONDecodeError, TypeError):
        return False
    return stored.same_content(source)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving. w: [num_heads * head_dim, in] or [num_heads * head_dim].

    See [Note: GGUF Q/K permutation]. Returns a new array of the same shape.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file. Raises FileNotFoundError, or ValueError naming the path when
    the file is not GGUF, is truncated or corrupt, or its architecture is not supported."""
    path = Path(gguf_path)
    describe_source(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read GGUF file {path} (truncated or corrupt?): {err}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"GGUF file {path} is truncated: tensor data ends at byte {end}")
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return reader


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (int, float, str or list). Raises ValueError when required and absent."""
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stored (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF `{arch}.*` and tokenizer metadata. Raises ValueError when unsupported."""
    arch = _field(reader, "general.architecture")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported yet")

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    eos_ids = [_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return ModelConfig(
        model_type=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=meta("vocab_size", None) or len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv", None) or meta("attention.head_count"),
        head_dim=meta("attention.key_length", 0),
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta("rope.scaling.type", "none"), meta("rope.scaling.factor", 1.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=meta("context_length", 2048),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
    )


def _rope_scaling(kind: str, factor: float) -> RopeScaling | None:
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=_f32(factor))
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear)")


def hf_tensor_name(gguf_name: str) -> str:
    """HF checkpoint name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight').

    Raises ValueError for a tensor this converter does not know.
    """
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def _hf_tensor(tensor: Any, config: ModelConfig, permuted: bool) -> np.ndarray:
    """Dequantised float32 tensor in HF layout ([out, in]; GGUF lists dims innermost first)."""
    # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles dequantise time.
    w = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32, copy=False)
    w = w.reshape(tuple(reversed(tensor.shape.tolist())))
    if permuted and ".attn_q." in tensor.name:
        w = unpermute_qk(w, config.num_attention_heads)
    elif permuted and ".attn_k." in tensor.name:
        w = unpermute_qk(w, config.num_key_value_heads)
    # F32 tensors come back as read-only views of the memory map: copy those.
    return np.ascontiguousarray(w) if w.flags.writeable else np.array(w, order="C")


def convert_tensors(reader: gguf.GGUFReader, config: ModelConfig, *,
                    progress: bool = True) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantised to float32 under its HF name (no lm_head when tied).

    Raises ValueError for unknown tensors or when the names differ from what `config` implies.
    """
    permuted = _field(reader, "general.architecture") in _PERMUTED_ARCHITECTURES
    tensors = {}
    bar = tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=None if progress else True)
    for tensor in bar:
        tensors[hf_tensor_name(tensor.name)] = torch.from_numpy(_hf_tensor(tensor, config, permuted))
    expected = set(all_tensor_names(config))
    if set(tensors) != expected:
        raise ValueError(f"GGUF tensors do not match the config: missing {sorted(expected - set(tensors))[:3]}, "
                         f"unexpected {sorted(set(tensors) - expected)[:3]}")
    return tensors


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported yet "
                     f"(supported: {', '.join(_DIGITS_THEN_GPT2 + _GPT2)})")


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """Byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary, merges and token types.

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
    tokens. Raises ValueError for a non-BPE (e.g. SentencePiece) vocabulary or unknown pre-tokenizer.
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in typed if kind == _TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in typed if kind == _TOKEN_TYPE_USER_DEFINED])
    return tok


def _special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    ids = {name: _field(reader, f"tokenizer.ggml.{key}", None) for name, key in keys.items()}
    return {name: i for name, i in ids.items() if i is not None}


def _tokenizer_config(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    d: dict[str, Any] = {f"{name}_token": tokens[i] for name, i in _special_token_ids(reader).items()}
    d.update(
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template", None),
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    return d


def _generation_config(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, Any]:
    ids = _special_token_ids(reader)
    d: dict[str, Any] = {"bos_token_id": ids.get("bos"), "pad_token_id": ids.get("pad")}
    if config.eos_token_ids:
        eos = config.eos_token_ids
        d["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    return {k: v for k, v in d.items() if v is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_folder(reader: gguf.GGUFReader, folder: Path, source: GgufSource, progress: bool) -> None:
    config = config_from_gguf(reader)
    tokenizer = tokenizer_from_gguf(reader)
    save_file(convert_tensors(reader, config, progress=progress), str(folder / SINGLE_FILE),
              metadata={"format": "pt"})
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "config.json", config.to_hf_dict())
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(reader, config))
    _write_json(folder / "generation_config.json", _generation_config(reader, config))
    _write_json(folder / SOURCE_FILE, dataclasses.asdict(source))  # last: marks the folder complete


@contextlib.contextmanager
def _conversion_lock(out_dir: Path) -> Iterator[None]:
    """Serialise conversions of one folder across processes (saves duplicate work only: the
    atomic rename in `_publish` is what keeps readers from seeing a half-written folder)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: duplicate work is possible but still safe
        yield
        return
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` folder to `out_dir` with `os.replace`, first moving aside a stale one."""
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out_dir)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face folder at `out_dir` and return `out_dir`.

    Writes config.json, model.safetensors (float32, HF names and [out, in] layout, Q/K
    un-permuted, no lm_head when tied), tokenizer.json, tokenizer_config.json,
    generation_config.json and speedpipe_source.json (source path, size, sha256, converter
    version). Reuses `out_dir` when it already holds a complete conversion of the same bytes.
    The folder is built next to `out_dir` and renamed into place, so concurrent processes never
    see it half-written. `progress` shows a tqdm bar over tensors (on a TTY).
    Raises FileNotFoundError (missing file), ValueError (not GGUF, truncated, unsupported
    architecture/tokenizer, or `out_dir` is an existing folder that is not a speedpipe conversion).
    """
    out_dir = Path(out_dir)
    source = describe_source(gguf_path)
    if is_converted(out_dir, source):
        return out_dir
    if out_dir.exists() and not (out_dir / SOURCE_FILE).is_file() and any(out_dir.iterdir()):
        raise ValueError(f"refusing to overwrite {out_dir}: it is not a speedpipe GGUF conversion")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(out_dir):
        if is_converted(out_dir, source):  # another process finished while we waited
            return out_dir
        reader = open_gguf(gguf_path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            _write_folder(reader, tmp, source, progress)
            _publish(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
