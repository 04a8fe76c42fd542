"""What speedpipe remembers about large model files, so that a run does not read them again.

Owns two memos, each trusted only while the file keeps the size and mtime it had (the sha256 memo
checks its inode too):
- `file_sha256`: a file's sha256, cached in-process and, when given a memo file, on disk, so a launch
  of a model it has seen does not hash the whole GGUF again (1.1 GB takes about 1 s; a 40 GB file a
  minute).
- the tensor table of a GGUF file, saved in its converted folder: `gguf.GGUFReader` parses every
  metadata field when it opens a file, the vocabulary and merges included (2.8 s for SmolLM2's 49k
  tokens, 6.5 s for Qwen2.5-Coder's 151k, measured here), in every stage process and once more in
  the coordinator under `--quantization auto`. The conversion (pipeline/weights/gguf_import.py) has a
  reader open already, so it writes the table once (`write_index`: each tensor's name, GGML type,
  GGUF shape, byte offset, and the numpy dtype and shape of its data); `load_index` gives the same
  tensors back over a memory map of the file, else None (the caller then parses the file);
  `restamp_index` records a new mtime once the file's bytes were checked equal.
Must not: parse GGUF metadata itself (gguf's reader writes the table), trust an entry whose file
changed, or fail a run because a memo cannot be read or written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np

MEMO_FILE = ".sha256-memo.json"  # in the cache's models/ folder (pipeline/weights/registry.py)


@functools.lru_cache(maxsize=16)
def _sha256_cached(path: str, size_bytes: int, mtime_ns: int, inode: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str | Path, *, memo: Path | None = None) -> str:
    """Hex sha256 of a file (about 0.1 s per 100 MB). Cached in-process per (path, size, mtime,
    inode), and in the JSON file `memo` when given (entries of other files are kept; an unreadable
    or unwritable memo only costs the hash). Raises FileNotFoundError when the file is missing."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    key = [st.st_size, st.st_mtime_ns, st.st_ino]
    entries = _read_memo(memo) if memo is not None else {}
    entry = entries.get(str(resolved))
    if isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = _sha256_cached(str(resolved), *key)
    if memo is not None:
        _write_memo(memo, entries | {str(resolved): {"key": key, "sha256": digest}})
    return digest


def _read_memo(memo: Path) -> dict:
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_memo(memo: Path, entries: dict) -> None:
    """Atomic (a temporary file renamed into place): a concurrent writer may win, never corrupt it."""
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, memo)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


INDEX_FILE = "gguf_tensors.json"


@dataclasses.dataclass(frozen=True)
class IndexedTensor:
    """One tensor of the table, with the attributes of gguf's ReaderTensor that the block reader
    uses: `shape` in GGUF order (innermost first), `data` a read-only view of its bytes in the file
    (dtype and shape as gguf's reader gives them: uint8 [rows, row_bytes] for block types)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


def write_index(reader: gguf.GGUFReader, gguf_path: str | Path, folder: Path, architecture: str) -> None:
    """Write `folder/gguf_tensors.json` from an open reader of `gguf_path`."""
    st = Path(gguf_path).stat()
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
               for t in reader.tensors]
    (folder / INDEX_FILE).write_text(json.dumps({"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                 "architecture": architecture, "tensors": tensors}) + "\n")


def load_index(model_dir: str | Path, gguf_path: str | Path) -> tuple[str, list[IndexedTensor]] | None:
    """(architecture, tensors) of `gguf_path` from `model_dir`'s table, or None when there is none,
    it cannot be read, or the file's size or mtime differ from the table's."""
    try:
        table = json.loads((Path(model_dir) / INDEX_FILE).read_text())
        st = Path(gguf_path).stat()
        if (table["size_bytes"], table["mtime_ns"]) != (st.st_size, st.st_mtime_ns):
            return None
        raw = np.memmap(gguf_path, dtype=np.uint8, mode="r")
        tensors = []
        for t in table["tensors"]:
            dtype = np.dtype(t["dtype"])
            size = int(np.prod(t["data_shape"], dtype=np.int64)) * dtype.itemsize
            data = raw[t["offset"]:t["offset"] + size].view(dtype).reshape(t["data_shape"])
            tensors.append(IndexedTensor(t["name"], gguf.GGMLQuantizationType(t["type"]),
                                         np.array(t["shape"], dtype=np.uint64), data))
        return table["architecture"], tensors
    except (OSError, ValueError, KeyError, TypeError):
        return None


def restamp_index(model_dir: Path, gguf_path: str | Path) -> None:
    """Record `gguf_path`'s current size and mtime in the table (after its bytes were checked to be
    the ones converted, e.g. a re-created virtual environment installed the same file again)."""
    index = model_dir / INDEX_FILE
    try:
        table = json.loads(index.read_text())
        st = Path(gguf_path).stat()
        if (table.get("size_bytes"), table.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
            return
        table["size_bytes"], table["mtime_ns"] = st.st_size, st.st_mtime_ns
        tmp = index.with_name(f".{INDEX_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table) + "\n")
        os.replace(tmp, index)
    except (OSError, ValueError):
        return
