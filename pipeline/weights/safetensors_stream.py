"""Write a safetensors file one tensor at a time, so the whole checkpoint is never in memory.

Owns `write_streaming`: the header (names, dtypes, shapes, offsets) is computed from declared
shapes first, then each tensor is produced, written and dropped in turn. The layout is the
safetensors format (8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, then the raw little-endian data in header order), readable by `safe_open`.
Must not: know about models or GGUF.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def write_streaming(path: str | Path, entries: Sequence[tuple[str, tuple[int, ...]]],
                    produce: Callable[[int], Iterable[np.ndarray]], *, dtype: np.dtype = np.dtype(np.float32),
                    metadata: dict[str, str] | None = None, on_tensor: Callable[[], None] | None = None) -> None:
    """Write `entries` (name, shape) to `path`; `produce(i)` yields entry i's rows in blocks
    (arrays whose concatenation along dim 0 is the tensor).

    Only one block is alive at a time (each is dropped after writing). Raises ValueError when the
    produced blocks' shapes or dtype differ from what was declared, or for a dtype other than
    float32/float16. `on_tensor` is called after each tensor (for a progress bar).
    """
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"streaming safetensors writer supports float32/float16, not {dtype}")
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (name, shape) in enumerate(entries):
            rows = 0
            for block in produce(i):
                if tuple(block.shape[1:]) != tuple(shape[1:]) or block.dtype != dtype:
                    raise ValueError(f"tensor {name!r}: produced a {block.dtype}{tuple(block.shape)} block, "
                                     f"declared {dtype}{tuple(shape)}")
                rows += block.shape[0] if block.ndim else 1
                f.write(memoryview(np.ascontiguousarray(block.astype(block.dtype.newbyteorder("<"), copy=False))))
                del block
            if rows != (shape[0] if shape else 1):
                raise ValueError(f"tensor {name!r}: produced {rows} rows, declared {dtype}{tuple(shape)}")
            if on_tensor is not None:
                on_tensor()
