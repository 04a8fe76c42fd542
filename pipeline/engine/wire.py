"""Data-plane message format: a msgpack header, then the raw bytes of its tensors.

Owns `Message`, its encoding into frames and the validation of everything read off the wire.
Pure: no torch.distributed (workers/channel.py moves the bytes). Nothing is ever unpickled.

[Note: frame layout]
Every message starts with one fixed-size uint8 frame of `frame_bytes` (default 16 KiB):
    bytes 0..3   magic b"SPD1"
    bytes 4..7   header length H (uint32, little endian)
    bytes 8..8+H msgpack header, every field named and typed (`HEADER_SCHEMA`):
                 {"kind", "items": {column: [...]}, "tensors": [[name, dtype, shape], ...],
                 "payload_bytes", "inline", "on_device", "timing": {column: [...]} or nil,
                 "releases": {column: [...]}}
    then         the payload (tensor bytes in header order) if "inline" is true and it fits.
Otherwise the payload follows as a second message of exactly payload_bytes bytes, or, when
"on_device" is true (hidden states between CUDA stages, sent over NCCL), as one device tensor per
entry. The receiver parses and validates the header before it posts any
payload receive, so a size disagreement is an error, never a hang. One frame per hop is the common
case for decode: a point-to-point message costs ~0.2 ms on gloo loopback, more than the bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from pipeline.measure.timeline import StageTiming
from pipeline.model.config import MODEL_DTYPES
from pipeline.speculation.items import Item, SlotRelease, items_from_wire, items_to_wire

MAGIC = b"SPD2"
# Every header field and its msgpack type (nil allowed only where noted).
HEADER_SCHEMA: dict[str, type] = {
    "kind": int,  # MessageKind
    "items": dict,  # item columns, [Note: item wire form] in pipeline/speculation/items.py
    "tensors": list,  # [[name, dtype name, shape], ...] in payload order
    "payload_bytes": int,  # sum of the tensors' sizes
    "inline": bool,  # the payload follows the header inside the first frame
    "on_device": bool,  # the payload follows as one device tensor per spec (NCCL)
    "timing": dict,  # StageTiming columns, or nil: stages record their compute only when not nil
    "releases": dict,  # SlotRelease columns (RELEASE messages; empty columns otherwise)
}
_TYPE_NAMES = {int: "an int", bool: "a bool", dict: "a map", list: "a list"}
PREFIX = struct.Struct("<4sI")
DEFAULT_FRAME_BYTES = 16 * 1024

# Tensors on the wire: activations in any model dtype, plus the int types of token ids and masks.
DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# A RESULT's prompt logprobs (OpenAI echo, vLLM's prompt_logprobs), `reduce_prompt_rows` in
# pipeline/speculation/logprobs.py: [P] float32, [P, k] int64, [P, k] float32, [P] int64 (each prompt token's
# rank). A FORWARD carries their rows' next prompt tokens as "prompt_next" ([P] int64) from the coordinator to
# the last stage.
PROMPT_LOGPROB_TENSORS = ("prompt_logprob", "prompt_top_ids", "prompt_top_logprobs", "prompt_rank")


class MessageKind(enum.IntEnum):
    """Data-plane message kinds. FORWARD goes stage to stage; RESULT from the last stage to the
    coordinator; EXIT_GUESS from the exit stage to the coordinator (its items passed the exit
    layer, with the exit head's guesses); the rest are control, forwarded along the ring in order
    with the work (RELEASE frees KV slots: `Message.releases`), except CREDIT, which stage 0
    consumes (its items carry stage-local drafting grants: pipeline/engine/local_draft.py), and
    WITHDRAWN, from the exit stage to the coordinator: drafts it made itself and stopped, because
    a squash made them stale before they were sent on (local_draft.py, note 6)."""

    FORWARD = 0
    RESULT = 1
    EXIT_GUESS = 2
    KEEPALIVE = 3
    RELEASE = 4
    SHUTDOWN = 5
    CREDIT = 6
    WITHDRAWN = 7


class WireError(ValueError):
    """A message off the wire is malformed or disagrees with the limits of this stage."""


@dataclasses.dataclass
class Message:
    """One data-plane message: kind, items, named tensors, stage timings and slot releases.

    timing: None = stages do not time this FORWARD; a list = each stage appends its
    `StageTiming` (the coordinator records a timeline). releases: the slots a RELEASE frees."""

    kind: MessageKind
    items: list[Item] = dataclasses.field(default_factory=list)
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    timing: list[StageTiming] | None = None
    releases: list[SlotRelease] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor in a message."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed, validated header: what the payload that follows must contain."""

    kind: MessageKind
    items: list[Item]
    specs: list[TensorSpec]
    payload_bytes: int
    inline: bool
    on_device: bool
    timing: list[StageTiming] | None
    releases: list[SlotRelease]


def encode_header(msg: Message, *, frame_bytes: int) -> tuple[bytearray, bool]:
    """Build the first frame of `msg`: [frame_bytes] bytes; returns (frame, payload_is_inline).

    Tensors on an accelerator are never inlined: they follow as device tensors ("on_device").

    Raises WireError if the header alone does not fit in the frame.
    """
    specs = [[name, DTYPE_NAMES[t.dtype], list(t.shape)] for name, t in msg.tensors.items()]
    payload_bytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
    on_device = any(t.device.type != "cpu" for t in msg.tensors.values())
    timing = None if msg.timing is None else records_to_wire(msg.timing, StageTiming)
    fields = {"kind": int(msg.kind), "items": items_to_wire(msg.items), "tensors": specs,
              "payload_bytes": payload_bytes, "inline": not on_device, "on_device": on_device, "timing": timing,
              "releases": records_to_wire(msg.releases, SlotRelease)}
    header = msgpack.packb(fields)  # packed once when the payload fits (every decode message): a msgpack
    header_len = len(header)        # bool is one byte either way, so the length does not depend on `inline`
    if PREFIX.size + header_len > frame_bytes:
        raise WireError(f"message header of {header_len} bytes does not fit the {frame_bytes}-byte frame")
    inline = not on_device and PREFIX.size + header_len + payload_bytes <= frame_bytes
    if inline != fields["inline"]:
        header = msgpack.packb({**fields, "inline": inline})
    frame = bytearray(frame_bytes)
    PREFIX.pack_into(frame, 0, MAGIC, len(header))
    frame[PREFIX.size:PREFIX.size + len(header)] = header
    if inline and payload_bytes:
        offset = PREFIX.size + len(header)
        for t in msg.tensors.values():
            raw = _tensor_bytes(t)
            frame[offset:offset + len(raw)] = raw
            offset += len(raw)
    return frame, inline


def decode_header(frame: bytes | bytearray | memoryview, *, max_payload_bytes: int) -> Header:
    """Parse and validate the first frame. Raises WireError naming what is wrong."""
    if len(frame) < PREFIX.size:
        raise WireError("frame shorter than its prefix")
    magic, length = PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (expected {MAGIC!r}): peer speaks another protocol version")
    if PREFIX.size + length > len(frame):
        raise WireError(f"header length {length} exceeds the {len(frame)}-byte frame")
    try:
        raw = msgpack.unpackb(bytes(frame[PREFIX.size:PREFIX.size + length]), strict_map_key=True)
    except Exception as exc:  # msgpack raises several types
        raise WireError(f"undecodable header: {exc}") from None
    if type(raw) is not dict or raw.keys() != HEADER_SCHEMA.keys():
        raise WireError("header has missing or unknown keys")
    for name, kind in HEADER_SCHEMA.items():
        if type(raw[name]) is not kind and not (name == "timing" and raw[name] is None):
            raise WireError(f"header field {name} is not {_TYPE_NAMES[kind]}")
    try:
        kind = MessageKind(raw["kind"])
    except ValueError:
        raise WireError(f"unknown message kind {raw['kind']!r}") from None
    try:
        items = items_from_wire(raw["items"])
        timing = None if raw["timing"] is None else records_from_wire(raw["timing"], StageTiming)
        releases = records_from_wire(raw["releases"], SlotRelease)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    specs = [_spec(s) for s in raw["tensors"]]
    payload = raw["payload_bytes"]
    if payload != sum(s.nbytes for s in specs):
        raise WireError(f"payload_bytes {payload!r} disagrees with the tensor specs")
    if payload > max_payload_bytes:
        raise WireError(f"payload of {payload} bytes exceeds this stage's limit of {max_payload_bytes}")
    inline = raw["inline"]
    if inline and PREFIX.size + length + payload > len(frame):
        raise WireError("inline payload does not fit the frame")
    if inline and raw["on_device"]:
        raise WireError("header on_device flag is malformed")
    return Header(kind, items, specs, payload, inline, raw["on_device"], timing, releases)


def inline_tensors(frame: bytes | bytearray | memoryview, header_len_end: int, header: Header) -> dict[str, torch.Tensor]:
    """Tensors of an inline payload starting at byte `header_len_end` of the frame (copies)."""
    return split_payload(memoryview(frame)[header_len_end:header_len_end + header.payload_bytes], header.specs)


def header_end(frame: bytes | bytearray | memoryview) -> int:
    """Offset of the first payload byte in a frame."""
    _, length = PREFIX.unpack_from(frame, 0)
    return PREFIX.size + length


def split_payload(payload: bytes | bytearray | memoryview, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Cut a contiguous payload into named tensors (each a copy owning its memory)."""
    out, offset = {}, 0
    for spec in specs:
        chunk = bytearray(payload[offset:offset + spec.nbytes])
        t = torch.frombuffer(chunk, dtype=spec.dtype) if spec.nbytes else torch.empty(0, dtype=spec.dtype)
        out[spec.name] = t.reshape(spec.shape)
        offset += spec.nbytes
    return out


def payload_bytes_of(tensors: dict[str, torch.Tensor]) -> bytes:
    """The concatenated raw bytes of `tensors`, in order."""
    return b"".join(_tensor_bytes(t) for t in tensors.values())


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def records_to_wire(records: list, cls: type) -> dict[str, list[int]]:
    """Columns {field: [int per record]} of `records`, frozen dataclasses of int fields (`cls`)."""
    return {name: [getattr(r, name) for r in records] for name in _field_names(cls)}


def records_from_wire(raw: Any, cls: type) -> list:
    """Parse the columns of `cls` records (int fields only). Raises ValueError if malformed."""
    names = _field_names(cls)
    if type(raw) is not dict or raw.keys() != set(names):
        raise ValueError(f"malformed {cls.__name__} columns: expected {names}")
    cols = [raw[n] for n in names]
    if any(not isinstance(c, list) or any(type(v) is not int for v in c) for c in cols) or len(set(map(len, cols))) > 1:
        raise ValueError(f"malformed {cls.__name__} columns: not int lists of one length")
    return [cls(*row) for row in zip(*cols, strict=True)]


def _spec(raw: Any) -> TensorSpec:
    if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str) and isinstance(raw[1], str) and raw[1] in DTYPES
            and isinstance(raw[2], list) and all(type(d) is int and d >= 0 for d in raw[2])):
        raise WireError(f"malformed tensor spec {raw!r}")
    return TensorSpec(raw[0], DTYPES[raw[1]], tuple(raw[2]))


# [Note: ranks] The data plane has S + 1 ranks: 0 is the coordinator, stage i is rank i + 1.
COORDINATOR_RANK = 0


def forward_tensors(batch: Sequence[Item]) -> dict[str, torch.Tensor]:
    """The tensors of a micro-batch's FORWARD to stage 0: "x", every item's input token ids, and,
    when an item wants prompt logprobs, "prompt_next": the prompt token after each of its prompt
    rows (`Item.num_prompt_rows`), which the stages pass on to the last one."""
    tensors = {"x": torch.tensor([t for it in batch for t in it.input_ids], dtype=torch.int64)}
    if any(it.num_prompt_rows for it in batch):
        tensors["prompt_next"] = torch.tensor([t for it in batch if it.num_prompt_rows for t in it.token_ids[1:]],
                                              dtype=torch.int64)
    return tensors


def rank_of_stage(stage_index: int) -> int:
    """Data-plane rank of stage `stage_index` (see [Note: ranks])."""
    return stage_index + 1


def world_size(num_stages: int) -> int:
    """Data-plane ranks of a pipeline of `num_stages` stages: the coordinator and every stage."""
    return rank_of_stage(num_stages - 1) + 1


def rank_name(rank: int) -> str:
    """Human name of a rank: 'coordinator' or 'stage i'."""
    return "coordinator" if rank == COORDINATOR_RANK else f"stage {rank - rank_of_stage(0)}"
