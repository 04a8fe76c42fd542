"""Whether an output path a user named can be written, checked before any work starts.

Owns two checks shared by the commands that write results (`launch --trace`, `bench sweep --out`,
`simulate --out`): an output *file* path must not be a directory nor sit under a regular file; an
output *folder* must not be a regular file nor sit under one. Both raise UsageError (exit 2, one line
naming the flag) so that a mistake costs nothing, instead of a traceback after a long run. Also
`dumps_strict`: the results' JSON as RFC 8259 allows it (no Infinity or NaN, which Python's json
writes by default and strict readers such as `jq` and browsers reject).
Must not: create, truncate or delete anything but its own probe file (the commands write their
outputs themselves).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from launcher.cli.parsing import UsageError


def _existing_ancestor(path: Path) -> Path:
    """The nearest of `path`'s parents (itself excluded) that exists; `.` at the latest."""
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def check_output_file(flag: str, path: str | Path) -> None:
    """Raise UsageError unless `path` can become a file: it is not a directory, and its nearest
    existing parent is a writable directory (missing parents are created when it is written)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory (give a file path)")
    _check_parent(flag, path, p)


def check_output_dir(flag: str, path: str | Path) -> None:
    """Raise UsageError unless `path` can be used as an output folder: it is a directory already, or
    it does not exist and its nearest existing parent is a writable directory; not empty (Path("")
    is the current folder: `--out ""` wrote results there without a word)."""
    if not str(path).strip():
        raise UsageError(f"{flag} is empty (give a folder; . for the current one)")
    p = Path(path)
    if p.is_dir():
        return
    if p.exists():
        raise UsageError(f"{flag} {path}: exists and is not a directory (give a folder)")
    _check_parent(flag, path, p)


def _check_parent(flag: str, path: str | Path, p: Path) -> None:
    """The nearest existing parent must be a directory that takes a new file: probed by creating
    and removing one, which also catches read-only and pseudo file systems (/sys, /proc) where the
    permission bits say yes (for root they always do)."""
    parent = _existing_ancestor(p)
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".speedpipe-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {parent} ({exc.strerror or exc})") from None


def _finite(value):
    """`value` with every non-finite float (inf, -inf, nan) inside it replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps_strict(obj, **kwargs) -> str:
    """json.dumps of `obj` as strict JSON: a non-finite float becomes null (callers document what
    null means for their field, e.g. "unlimited"); kwargs as json.dumps takes them."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)
