"""sha256 of large files (GGUF models, safetensors), computed once per file content.

Owns `file_sha256`: an in-process cache keyed by (path, size, mtime, inode), and optionally a memo
file on disk with the same key, so a launch of a model it has seen does not read the whole file
again (1.1 GB takes about 1 s; a 40 GB GGUF would take a minute, before every launch).
Must not: trust a memo entry whose size, mtime or inode differ from the file's (a file replaced or
rewritten is hashed again), or fail a run because the memo cannot be read or written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

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
