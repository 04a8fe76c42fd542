"""GGUF import: convert a llama.cpp GGUF file once into a Hugging Face-format model folder.

Owns the conversion (tensors streamed one at a time into model.safetensors, so no process ever
holds the whole float32 model), writing the folder's JSON files, and publishing it atomically.
Per-architecture metadata, tensor names and tensor fix-ups live in pipeline/weights/gguf_metadata/families.py;
the tokenizer (tokenizer.json and tokenizer_config.json from the GGUF vocabulary) in gguf_metadata/vocabulary.py.
Must not: run models, download anything, or import transformers (it is a test-only oracle).

[Note: GGUF Q/K permutation]
llama.cpp's `convert_hf_to_gguf.py` (LlamaModel.permute) reorders the rows of q_proj and k_proj
from HF's "rotate half" RoPE layout to GGML's interleaved-pairs layout:
    w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(out, in)
with n_head = num_attention_heads for Q and num_key_value_heads for K (biases alike). The inverse,
applied here, is the same reshape with the two middle axes the other way round:
    w.reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)
Only the `llama` architecture is permuted (so Mistral and Mixtral, which llama.cpp writes as `llama`);
Qwen2, Qwen3, Qwen3-MoE, Gemma (1, 2 and 3) and Phi-3 GGUFs keep HF's layout (Phi-3's fused qkv included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import gguf

from pipeline.model.config import ModelConfig
from pipeline.weights.checkpoint import SINGLE_FILE, all_tensor_names
from pipeline.weights.file_memo import INDEX_FILE, file_sha256, restamp_index, write_index
from pipeline.weights.gguf_metadata.families import (  # noqa: F401 (unpermute_qk, hf_tensor_name: re-exported)
    SUPPORTED_ARCHITECTURES,
    check_tensor_types,
    config_from_gguf,
    field,
    hf_tensor_blocks,
    hf_tensor_name,
    tensor_targets,
    unpermute_qk,
)
from pipeline.weights.gguf_metadata.vocabulary import special_token_ids, tokenizer_config, tokenizer_from_gguf
from pipeline.weights.model_chunks import path_lock, progress_bar
from pipeline.weights.safetensors_stream import write_streaming

CONVERTER_VERSION = 4  # 2: families, streamed tensors, qwen2 pre-tokenizer; 3: Qwen stops on <|endoftext|>;
# 4: a byte-level vocabulary's BOS (Llama 3.x) in tokenizer.json's post-processor, which the runtime now reads
SOURCE_FILE = "speedpipe_source.json"
OUTPUT_FILES = ("config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", INDEX_FILE, SOURCE_FILE)
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


def read_source(model_dir: str | Path) -> GgufSource | None:
    """The `speedpipe_source.json` of a converted folder, or None for a folder without one (a plain
    Hugging Face folder). Raises ValueError, one line naming the file and the problem, when it is not
    a JSON object with `path`, `size_bytes` and `sha256` of the right types: a folder speedpipe
    converted that was edited or damaged since (deleting it makes the next run convert the GGUF again)."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        problem = f"not valid JSON ({exc})"
    else:
        problem = _source_problem(d)
    if problem:
        raise ValueError(f"{path} is malformed: {problem}; it records the GGUF file this folder was converted "
                         "from: delete the folder and convert the GGUF again (or remove the file if the folder "
                         "is a Hugging Face model)")
    return GgufSource(**{k: d[k] for k in ("path", "size_bytes", "sha256", "converter_version") if k in d})


def _source_problem(d: Any) -> str:
    """What is wrong with a parsed speedpipe_source.json (GgufSource's fields), or "" when nothing."""
    if not isinstance(d, dict):
        return f"it holds a JSON {type(d).__name__}, not an object"
    types = {"path": str, "size_bytes": int, "sha256": str, "converter_version": int}
    missing = [k for k in ("path", "size_bytes", "sha256") if k not in d]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    for key, kind in types.items():
        if key in d and (not isinstance(d[key], kind) or isinstance(d[key], bool)):
            return f"{key!r} must be {'a string' if kind is str else 'an integer'}, got {d[key]!r}"
    return ""


def _check_gguf_file(path: Path) -> None:
    """Raises FileNotFoundError, or ValueError when `path` does not start with GGUF's magic."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")


def describe_source(gguf_path: str | Path, *, sha256_memo: Path | None = None) -> GgufSource:
    """Size and sha256 of a GGUF file (`sha256_memo`: see file_memo.file_sha256). Raises
    FileNotFoundError, or ValueError when not GGUF."""
    path = Path(gguf_path)
    _check_gguf_file(path)
    return GgufSource(path=str(path.resolve()), size_bytes=path.stat().st_size,
                      sha256=file_sha256(path, memo=sha256_memo))


def _whole_safetensors(path: Path) -> bool:
    """True when `path`'s size is what its safetensors header says (header only: cheap)."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size == 8 + header_len + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def _remove_stale_builds(out_dir: Path) -> None:
    """Remove the build folders of `out_dir` that a killed conversion left behind. Called with the
    lock held: no live process builds one then (builds only happen under the lock)."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):  # see `_publish`
        for stale in out_dir.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def is_converted(out_dir: Path, source: GgufSource) -> bool:
    """True when `out_dir` is a complete conversion of `source` by this converter version (a
    weights file cut short, e.g. by a full disk after the folder was published, is not: the
    next run converts again instead of failing on it, and so is one whose speedpipe_source.json
    `read_source` refuses: not JSON, not UTF-8, or fields missing or of the wrong type)."""
    if not all((out_dir / name).is_file() for name in OUTPUT_FILES) or not _whole_safetensors(out_dir / SINGLE_FILE):
        return False
    try:
        stored = read_source(out_dir)
    except ValueError:
        return False
    return stored is not None and stored.same_content(source)


def _repoint_source(out_dir: Path, source: GgufSource) -> None:
    """Record where the GGUF lives now when a folder converted from the same bytes names an older path
    (a re-created virtual environment or a moved file): `--quantization auto` reads its blocks from
    that path and would otherwise fall back to dense weights. Written atomically."""
    stored = read_source(out_dir)
    if stored is not None and stored.path == source.path:
        return
    tmp = out_dir / f".{SOURCE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(dataclasses.asdict(source), indent=2) + "\n")
    os.replace(tmp, out_dir / SOURCE_FILE)


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file. Raises FileNotFoundError, or ValueError naming the path when
    the file is not GGUF, is truncated or corrupt, or its architecture is not supported."""
    path = Path(gguf_path)
    _check_gguf_file(path)  # no hash: each stage opens the file, and it may be tens of GB
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read GGUF file {path} (truncated or corrupt?): {err}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"GGUF file {path} is truncated: tensor data ends at byte {end}")
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    check_tensor_types(reader, f"GGUF file {path}")
    return reader


def _tensor_plan(reader: gguf.GGUFReader,
                 config: ModelConfig) -> list[tuple[str, tuple[int, ...], Any, int | None]]:
    """(HF name, HF shape, GGUF tensor, expert index or None) for every HF tensor (a stacked expert
    tensor gives one entry per expert), checked against `config`'s names.

    Raises ValueError for unknown tensors or when the names differ from what `config` implies.
    """
    arch = field(reader, "general.architecture")
    plan = []
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        plan += [(name, shape if e is None else shape[1:], t, e) for name, e in tensor_targets(t.name, arch, config)]
    got, expected = {p[0] for p in plan}, set(all_tensor_names(config))
    if got != expected:
        raise ValueError(f"GGUF tensors do not match the config: missing {sorted(expected - got)[:3]}, "
                         f"unexpected {sorted(got - expected)[:3]}")
    return plan


def write_tensors(reader: gguf.GGUFReader, config: ModelConfig, path: Path, *, progress: bool = True) -> None:
    """Stream every GGUF tensor, dequantised to float32 under its HF name, into safetensors `path`.

    One tensor (one expert) is dequantised at a time (peak memory: the largest tensor, not the
    model). Raises ValueError as `_tensor_plan` does.
    """
    arch = field(reader, "general.architecture")
    plan = _tensor_plan(reader, config)
    source = Path(getattr(reader.data, "filename", "") or "").name
    bar = progress_bar(total=len(plan), desc=f"converting GGUF {source}".rstrip(), progress=progress,
                       unit="tensor")
    with bar:
        write_streaming(path, [(name, shape) for name, shape, _, _ in plan],
                        lambda i: hf_tensor_blocks(plan[i][2], config, arch, expert=plan[i][3]),
                        metadata={"format": "pt"}, on_tensor=lambda: bar.update(1))


def _generation_config(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, Any]:
    ids = special_token_ids(reader)
    d: dict[str, Any] = {"bos_token_id": ids.get("bos"), "pad_token_id": ids.get("pad")}
    if config.eos_token_ids:
        eos = config.eos_token_ids
        d["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    return {k: v for k, v in d.items() if v is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_folder(reader: gguf.GGUFReader, folder: Path, source: GgufSource, progress: bool) -> None:
    try:
        config = config_from_gguf(reader)
        tokenizer = tokenizer_from_gguf(reader)
    except ValueError as exc:
        raise ValueError(f"GGUF file {source.path}: {exc}") from None
    write_tensors(reader, config, folder / SINGLE_FILE, progress=progress)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "config.json", config.to_hf_dict())
    _write_json(folder / "tokenizer_config.json", tokenizer_config(reader, config))
    _write_json(folder / "generation_config.json", _generation_config(reader, config))
    write_index(reader, source.path, folder, field(reader, "general.architecture"))
    _write_json(folder / SOURCE_FILE, dataclasses.asdict(source))  # last: marks the folder complete


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` folder to `out_dir` with `os.replace`, first moving aside a stale one."""
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out_dir)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True,
                 sha256_memo: Path | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face folder at `out_dir` and return `out_dir`.

    Writes config.json, model.safetensors (float32, HF names and [out, in] layout, Q/K
    un-permuted, no lm_head when tied), tokenizer.json, tokenizer_config.json,
    generation_config.json and speedpipe_source.json (source path, size, sha256, converter
    version). Reuses `out_dir` when it already holds a complete conversion of the same bytes.
    The folder is built next to `out_dir` and renamed into place, so concurrent processes never
    see it half-written. `progress` shows a tqdm bar over tensors (on a TTY). `sha256_memo`: a
    file remembering the GGUF's sha256 per (size, mtime, inode), so a later run need not read it all.
    Raises FileNotFoundError (missing file), ValueError (not GGUF, truncated, unsupported
    architecture/tokenizer, or `out_dir` is an existing folder that is not a speedpipe conversion).
    """
    out_dir = Path(out_dir)
    source = describe_source(gguf_path, sha256_memo=sha256_memo)
    if is_converted(out_dir, source):
        _repoint_source(out_dir, source)
        restamp_index(out_dir, source.path)  # the same bytes (sha256 checked), maybe a new mtime
        return out_dir
    if out_dir.exists() and not (out_dir / SOURCE_FILE).is_file() and any(out_dir.iterdir()):
        raise ValueError(f"refusing to overwrite {out_dir}: it is not a speedpipe GGUF conversion")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with path_lock(out_dir):  # the atomic rename in `_publish` keeps readers safe
        if is_converted(out_dir, source):  # another process finished while we waited
            return out_dir
        _remove_stale_builds(out_dir)
        reader = open_gguf(gguf_path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            _write_folder(reader, tmp, source, progress)
            _publish(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
