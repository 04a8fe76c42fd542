"""Unit tests for pipeline.engine.wire: message round trips and the validation of every header off the wire.

What breaks when these fail: tensors arriving changed (dtype, shape, bytes), or a malformed or hostile
frame getting past `decode_header` (or crashing it with something other than WireError), which on the
real data plane means a hang or a crash instead of a clear error.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.engine.wire as wire_module
from pipeline.engine.wire import (
    COORDINATOR_RANK,
    DEFAULT_FRAME_BYTES,
    DTYPE_NAMES,
    MAGIC,
    PREFIX,
    Header,
    Message,
    MessageKind,
    WireError,
    decode_header,
    encode_header,
    header_end,
    inline_tensors,
    payload_bytes_of,
    rank_name,
    rank_of_stage,
    split_payload,
    world_size,
)
from pipeline.measure.timeline import StageTiming
from pipeline.speculation.items import (
    ITEM_WIRE_SCHEMA,
    MAX_DRAFT_TREE,
    MAX_FEED_STOP,
    Item,
    ItemKind,
    SlotRelease,
    items_to_wire,
)

FRAME = 4096
LIMIT = 1 << 20


def _round_trip(msg: Message, *, frame_bytes: int = FRAME) -> tuple[Message, bool]:
    """Encode `msg` and decode it the way workers/channel.py does; returns (decoded, inline)."""
    frame, inline = encode_header(msg, frame_bytes=frame_bytes)
    assert len(frame) == frame_bytes
    header = decode_header(memoryview(bytes(frame)), max_payload_bytes=LIMIT)
    assert header.inline == inline
    if inline:
        tensors = inline_tensors(bytes(frame), header_end(frame), header)
    else:
        tensors = split_payload(payload_bytes_of(msg.tensors), header.specs)
    return Message(header.kind, header.items, tensors, header.timing, header.releases), inline


def _assert_same(got: Message, want: Message) -> None:
    assert got.kind == want.kind
    assert got.items == want.items
    assert got.timing == want.timing and got.releases == want.releases
    assert list(got.tensors) == list(want.tensors), "tensor names or order changed"
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g, t), name


def _items() -> list[Item]:
    return [
        Item(seq_id=7, slot=1, start=0, num_tokens=3, epoch=0, kind=ItemKind.PREFILL, token_ids=(5, 6, 7),
             want_logits=True),
        Item(seq_id=9, slot=0, start=12, num_tokens=1, epoch=4, kind=ItemKind.DRAFT, want_exit=False),
        Item(seq_id=3, slot=2, start=20, num_tokens=3, epoch=1, kind=ItemKind.FIRP, firp_k=2, firp_anchors=3),
    ]


def _tensors(num_rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_rows)
    hidden = torch.randn(num_rows, 8, generator=gen)
    return {
        "hidden_f32": hidden,
        "hidden_bf16": hidden.to(torch.bfloat16),
        "hidden_f16": hidden.to(torch.float16),
        "ids_i64": torch.randint(-(2**40), 2**40, (num_rows,), generator=gen),
        "ids_i32": torch.randint(-(2**30), 2**30, (num_rows, 2), generator=gen, dtype=torch.int32),
        "mask_u8": torch.randint(0, 256, (num_rows,), generator=gen, dtype=torch.uint8),
    }


# -- round trips ------------------------------------------------------------------------------------

def test_small_message_round_trips_inline_in_one_frame():
    msg = Message(MessageKind.FORWARD, _items(), _tensors(4), [StageTiming(0, 10, 25), StageTiming(1, 30, 2**62)])
    got, inline = _round_trip(msg)
    assert inline, "a small message must travel in the first frame"
    _assert_same(got, msg)


def test_large_message_round_trips_with_a_separate_payload():
    msg = Message(MessageKind.RESULT, _items(), _tensors(200), [])
    got, inline = _round_trip(msg)
    assert not inline, "a payload larger than the frame must not be inlined"
    _assert_same(got, msg)


def test_non_contiguous_tensor_round_trips_as_its_values():
    t = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # [6, 4], not contiguous
    msg = Message(MessageKind.FORWARD, tensors={"t": t})
    got, _ = _round_trip(msg)
    assert torch.equal(got.tensors["t"], t)


@pytest.mark.parametrize("shape", [(0,), (0, 576), (3, 0, 2)])
@pytest.mark.parametrize("inline_payload", [True, False])
def test_zero_size_tensors_round_trip(shape, inline_payload):
    msg = Message(MessageKind.FORWARD, tensors={"empty": torch.empty(shape, dtype=torch.bfloat16),
                                                 "ids": torch.tensor([1, 2], dtype=torch.int64)})
    # A frame that holds the header but not the 16 payload bytes forces a separate payload.
    frame_bytes = FRAME if inline_payload else header_end(encode_header(msg, frame_bytes=FRAME)[0]) + 8
    got, inline = _round_trip(msg, frame_bytes=frame_bytes)
    assert inline == inline_payload
    _assert_same(got, msg)


def test_message_without_tensors_or_items_round_trips():
    msg = Message(MessageKind.KEEPALIVE)
    got, inline = _round_trip(msg)
    assert inline and got.timing is None, "no timing list: stages must not time it"
    _assert_same(got, msg)


def test_release_round_trips_its_typed_slot_records():
    msg = Message(MessageKind.RELEASE, releases=[SlotRelease(4, 0), SlotRelease(9, 3)])
    got, _ = _round_trip(msg)
    _assert_same(got, msg)
    assert got.releases[1].seq_id == 9 and got.releases[1].slot == 3


def test_bfloat16_bytes_are_preserved_exactly():
    t = torch.tensor([1.0, -2.5, 3.0e38, float("inf"), float("-inf"), 1e-40], dtype=torch.bfloat16)
    got, _ = _round_trip(Message(MessageKind.FORWARD, tensors={"b": t}))
    assert torch.equal(got.tensors["b"].view(torch.int16), t.view(torch.int16))


def test_zero_dim_scalar_tensor_round_trips():
    msg = Message(MessageKind.FORWARD, tensors={"scalar": torch.tensor(3.5), "n": torch.tensor(7)})
    got, _ = _round_trip(msg)
    _assert_same(got, msg)


def test_header_too_big_for_the_frame_is_a_wire_error():
    items = [Item(seq_id=i, slot=0, start=0, num_tokens=1) for i in range(200)]
    with pytest.raises(WireError, match="does not fit the 256-byte frame"):
        encode_header(Message(MessageKind.FORWARD, items), frame_bytes=256)


def test_default_frame_holds_a_decode_micro_batch_of_one_hidden_row_inline():
    msg = Message(MessageKind.FORWARD, _items()[:1], {"hidden": torch.zeros(1, 576, dtype=torch.bfloat16)})
    _, inline = encode_header(msg, frame_bytes=DEFAULT_FRAME_BYTES)
    assert inline


@pytest.mark.parametrize("num_rows", [4, 200])  # inline, and a separate payload
def test_the_header_is_packed_once_for_an_inline_message_and_is_the_header_of_its_fields(monkeypatch, num_rows):
    # The reference: msgpack of the message's fields with `inline` as the frame decides it.
    msg = Message(MessageKind.RESULT, _items(), _tensors(num_rows), [StageTiming(0, 10, 25)])
    packs, packb = [], msgpack.packb
    monkeypatch.setattr(wire_module.msgpack, "packb", lambda obj: packs.append(obj) or packb(obj))
    frame, inline = encode_header(msg, frame_bytes=FRAME)
    assert len(packs) == (1 if inline else 2)  # the decode path's messages are inline: one pack
    payload = sum(t.numel() * t.element_size() for t in msg.tensors.values())
    fields = {"kind": int(msg.kind), "items": items_to_wire(msg.items),
              "tensors": [[n, DTYPE_NAMES[t.dtype], list(t.shape)] for n, t in msg.tensors.items()],
              "payload_bytes": payload, "inline": inline, "on_device": False,
              "timing": {"stage": [0], "start_ns": [10], "end_ns": [25]}, "releases": {"seq_id": [], "slot": []}}
    header = msgpack.packb(fields)
    assert bytes(frame[:header_end(frame)]) == bytes(_frame(fields)[:PREFIX.size + len(header)])
    assert inline == (PREFIX.size + len(header) + payload <= FRAME)


# -- decode_header rejects ----------------------------------------------------------------------------

def _valid_fields(**overrides: Any) -> dict[str, Any]:
    fields = {"kind": int(MessageKind.FORWARD), "items": items_to_wire(_items()),
              "tensors": [["hidden", "float32", [2, 4]], ["ids", "int64", [2]]],
              "payload_bytes": 2 * 4 * 4 + 2 * 8, "inline": False, "on_device": False,
              "timing": {"stage": [0], "start_ns": [5], "end_ns": [9]}, "releases": {"seq_id": [], "slot": []}}
    fields.update(overrides)
    return fields


def _frame(fields: Any, *, frame_bytes: int = FRAME, raw_header: bytes | None = None) -> bytes:
    header = msgpack.packb(fields) if raw_header is None else raw_header
    frame = bytearray(frame_bytes)
    PREFIX.pack_into(frame, 0, MAGIC, len(header))
    frame[PREFIX.size:PREFIX.size + len(header)] = header
    return bytes(frame)


def _rejects(frame: bytes, match: str, *, limit: int = LIMIT) -> None:
    with pytest.raises(WireError, match=match):
        decode_header(frame, max_payload_bytes=limit)


def test_hand_built_valid_header_is_accepted():
    header = decode_header(_frame(_valid_fields()), max_payload_bytes=LIMIT)
    assert isinstance(header, Header)
    assert header.items == _items() and header.payload_bytes == 48
    assert header.timing == [StageTiming(0, 5, 9)] and header.releases == []
    assert [(s.name, s.dtype, s.shape) for s in header.specs] == [("hidden", torch.float32, (2, 4)),
                                                                    ("ids", torch.int64, (2,))]


def test_rejects_bad_magic_naming_it():
    frame = bytearray(_frame(_valid_fields()))
    frame[:4] = b"SPD0"
    _rejects(bytes(frame), r"bad magic b'SPD0'")


def test_rejects_a_frame_shorter_than_its_prefix():
    _rejects(MAGIC + b"\x01", "shorter than its prefix")


def test_rejects_a_header_length_past_the_frame():
    frame = bytearray(_frame(_valid_fields(), frame_bytes=512))
    struct.pack_into("<I", frame, 4, 509)
    _rejects(bytes(frame), r"header length 509 exceeds the 512-byte frame")


def test_rejects_a_truncated_header():
    header = msgpack.packb(_valid_fields())
    _rejects(_frame(None, raw_header=header[:-5]), "undecodable header")


@pytest.mark.parametrize("garbage", [b"\xc1", b"\xc1\xc1\xc1\xc1", b"\x92\x01"])
def test_rejects_garbage_msgpack(garbage):
    _rejects(_frame(None, raw_header=garbage), "undecodable header")


@pytest.mark.parametrize("value", [[1, 2], "header", 5, None])
def test_rejects_a_header_that_is_not_a_map(value):
    _rejects(_frame(value), "missing or unknown keys")


def test_rejects_non_string_map_keys():
    _rejects(_frame(None, raw_header=msgpack.packb({1: 2})), "undecodable header")


def test_rejects_an_unknown_header_key():
    _rejects(_frame(_valid_fields(extra=1)), "missing or unknown keys")


def test_rejects_a_missing_header_key():
    fields = _valid_fields()
    del fields["timing"]
    _rejects(_frame(fields), "missing or unknown keys")


@pytest.mark.parametrize("kind", [99, -1])
def test_rejects_an_unknown_message_kind_naming_it(kind):
    _rejects(_frame(_valid_fields(kind=kind)), re.escape(f"unknown message kind {kind!r}"))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("kind", "FORWARD", "kind is not an int"), ("kind", None, "kind is not an int"),
    ("items", [1], "items is not a map"), ("items", 3, "items is not a map"),
    ("timing", [1], "timing is not a map"), ("releases", None, "releases is not a map"),
])
def test_rejects_a_header_field_of_the_wrong_type_naming_it(field, value, match):
    _rejects(_frame(_valid_fields(**{field: value})), match)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("timing", {"stage": [0], "start_ns": [1]}, "malformed StageTiming columns"),
    ("timing", {"stage": [0], "start_ns": [1], "end_ns": [2, 3]}, "one length"),
    ("timing", {"stage": ["0"], "start_ns": [1], "end_ns": [2]}, "not int lists"),
    ("releases", {"seq_id": [1], "slot": [None]}, "not int lists"),
    ("releases", {"seq_id": [1], "slot": [0], "x": [1]}, "malformed SlotRelease columns"),
])
def test_rejects_malformed_timing_or_release_records(field, value, match):
    _rejects(_frame(_valid_fields(**{field: value})), match)


def _item_wire(**overrides: Any) -> dict[str, list[Any]]:
    """The item columns of one item (see [Note: item wire form]), with `overrides` as its values."""
    base = dict(seq_id=1, slot=0, start=4, num_tokens=2, epoch=0, kind=1, token_ids=[3, 4], want_logits=False,
                firp_k=0, firp_anchors=0, want_exit=True, want_prompt_logits=False,
                draft_upto=0, draft_cap=0, draft_gate=0, draft_with=0, self_made=False,
                draft_logits_upto=0, alt_token_ids=[], tree_scratch=0, exit_top_k=1, keep_sibling=-1, feed_upto=0, feed_stop=[])
    base.update(overrides)
    return {name: [value] for name, value in base.items()}


@pytest.mark.parametrize(("raw", "match"), [
    (_item_wire(seq_id="1"), "seq_id is not an int"),
    (_item_wire(slot=1.0), "slot is not an int"),
    (_item_wire(start=True), "start is not an int"),
    (_item_wire(want_logits=1), "want_logits is not a bool"),
    (_item_wire(token_ids=[1, "2"]), "token_ids is not a list of ints"),
    (_item_wire(token_ids=3), "token_ids is not a list"),
    (_item_wire(kind=7), "unknown kind 7"),
    (_item_wire(start=-1), "negative start"),
    (_item_wire(slot=-2), "negative start/slot/epoch"),
    (_item_wire(epoch=-1), "negative start/slot/epoch"),
    (_item_wire(num_tokens=0), "num_tokens 0 < 1"),
    (_item_wire(token_ids=[3, 4, 5]), "carries 3 token ids for 2 positions"),
    (_item_wire(firp_k=-1), "firp_k -1"),
    (_item_wire(firp_anchors=3), "firp_anchors 3 outside"),
    (_item_wire(firp_k=1.0), "firp_k is not an int"),
    (_item_wire(want_exit=0), "want_exit is not a bool"),
    (_item_wire(kind=2, num_tokens=1, token_ids=[3], exit_top_k=10**9), "exit_top_k 1000000000"),
    (_item_wire(exit_top_k=MAX_DRAFT_TREE + 1), f"exit_top_k {MAX_DRAFT_TREE + 1}"),
    (_item_wire(kind=2, num_tokens=1, token_ids=[3], alt_token_ids=list(range(MAX_DRAFT_TREE))),
     f"{MAX_DRAFT_TREE} siblings outside"),
    (_item_wire(kind=2, num_tokens=1, token_ids=[3], alt_token_ids=[4], tree_scratch=10**9), "tree_scratch 1000000000"),
    (_item_wire(keep_sibling=10**12), "keep_sibling 1000000000000"),
    (_item_wire(keep_sibling=-2), "keep_sibling -2"),
    (_item_wire(draft_upto=-5), "draft_upto -5"),
    (_item_wire(draft_upto=7, draft_cap=8), "draft_cap 8 / draft_upto 7"),
    (_item_wire(draft_cap=-1), "draft_cap -1"),
    (_item_wire(draft_with=256), "draft_with 256"),
    (_item_wire(draft_with=-1), "draft_with -1"),
    (_item_wire(draft_gate=-1), "draft_gate -1"),
    (_item_wire(draft_logits_upto=-3), "draft_logits_upto -3 < 0"),
    (_item_wire(feed_upto=-1), "feed_upto -1 < 0"),
    (_item_wire(feed_stop=[2] * (MAX_FEED_STOP + 1)), f"{MAX_FEED_STOP + 1} feed_stop ids"),
    (_item_wire(feed_stop=[2, "3"]), "feed_stop is not a list of ints"),
    ({k: v for k, v in _item_wire().items() if k != "want_exit"}, "expected the columns"),
    ({**_item_wire(), "draft_token": [-1]}, "expected the columns"),
    ({**_item_wire(), "slot": [0, 1]}, "columns are not lists of one length"),
    ({**_item_wire(), "slot": 0}, "columns are not lists of one length"),
])
def test_rejects_a_malformed_item_naming_the_problem(raw, match):
    _rejects(_frame(_valid_fields(items=raw)), match)


@pytest.mark.parametrize("spec", [
    ["x", "float64", [2]],          # dtype not on the wire
    ["x", "complex64", [2]],
    ["x", 5, [2]],
    [5, "float32", [2]],            # name not a string
    ["x", "float32", [-1]],         # negative dim
    ["x", "float32", [2.0]],        # float dim
    ["x", "float32", 2],            # shape not a list
    ["x", "float32"],               # too short
])
def test_rejects_a_malformed_tensor_spec_naming_it(spec):
    _rejects(_frame(_valid_fields(tensors=[spec], payload_bytes=8)), "malformed tensor spec")


@pytest.mark.parametrize("dtype", [["float32"], {"a": 1}])
def test_rejects_an_unhashable_dtype_in_a_tensor_spec(dtype):
    _rejects(_frame(_valid_fields(tensors=[["x", dtype, [2]]], payload_bytes=8)), "malformed tensor spec")


def test_rejects_a_tensor_list_that_is_not_a_list():
    _rejects(_frame(_valid_fields(tensors={"x": 1}, payload_bytes=0)), "tensors is not a list")


@pytest.mark.parametrize("payload", [47, 49, 0])
def test_rejects_payload_bytes_disagreeing_with_the_specs(payload):
    _rejects(_frame(_valid_fields(payload_bytes=payload)), rf"payload_bytes {payload!r} disagrees")


@pytest.mark.parametrize("payload", ["48", 48.0, None])
def test_rejects_payload_bytes_that_are_not_an_int(payload):
    _rejects(_frame(_valid_fields(payload_bytes=payload)), "payload_bytes is not an int")


def test_rejects_a_payload_over_the_stage_limit_naming_both_sizes():
    _rejects(_frame(_valid_fields()), r"payload of 48 bytes exceeds this stage's limit of 47", limit=47)
    decode_header(_frame(_valid_fields()), max_payload_bytes=48)  # exactly at the limit is fine


def test_rejects_a_huge_declared_shape_before_any_receive():
    huge = 2**40
    fields = _valid_fields(tensors=[["x", "uint8", [huge]]], payload_bytes=huge)
    _rejects(_frame(fields), rf"payload of {huge} bytes exceeds")


def test_rejects_an_inline_payload_that_does_not_fit_the_frame():
    fields = _valid_fields(tensors=[["x", "uint8", [200]]], payload_bytes=200, inline=True)
    _rejects(_frame(fields, frame_bytes=256), "inline payload does not fit")


@pytest.mark.parametrize("inline", [1, "yes", None])
def test_rejects_a_non_bool_inline_flag(inline):
    _rejects(_frame(_valid_fields(inline=inline)), "inline is not a bool")


@pytest.mark.parametrize(("inline", "on_device", "match"), [(False, 1, "on_device is not a bool"),
                                                             (False, None, "on_device is not a bool"),
                                                             (True, True, "on_device flag is malformed")])
def test_rejects_a_malformed_or_contradictory_on_device_flag(inline, on_device, match):
    _rejects(_frame(_valid_fields(inline=inline, on_device=on_device)), match)


# -- fuzzing ----------------------------------------------------------------------------------------

def _decode_or_wire_error(frame: bytes) -> None:
    try:
        header = decode_header(frame, max_payload_bytes=LIMIT)
    except WireError:
        return
    assert isinstance(header, Header)
    assert header.payload_bytes == sum(s.nbytes for s in header.specs) <= LIMIT


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_decode_or_raise_wire_error(frame):
    _decode_or_wire_error(frame)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.binary(max_size=200), extra=st.integers(0, 64))
def test_fuzz_random_header_bytes_after_a_valid_prefix_decode_or_raise_wire_error(header, extra):
    _decode_or_wire_error(_frame(None, raw_header=header, frame_bytes=PREFIX.size + len(header) + extra))


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                     st.text(max_size=8), st.binary(max_size=8))
# Lists and string-keyed maps only: lists are what msgpack decodes arrays to, so a value here can be
# unhashable exactly where a hostile peer can make it so.
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(_valid_fields())), value=_values)
def test_fuzz_one_header_field_replaced_by_any_value_decodes_or_raises_wire_error(field, value):
    _decode_or_wire_error(_frame(_valid_fields(**{field: value})))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(ITEM_WIRE_SCHEMA)), value=_values, whole_column=st.booleans())
def test_fuzz_one_item_field_replaced_by_any_value_decodes_or_raises_wire_error(field, value, whole_column):
    raw = _item_wire()
    raw[field] = value if whole_column else [value]
    _decode_or_wire_error(_frame(_valid_fields(items=raw)))


# -- ranks ----------------------------------------------------------------------------------------------

def test_ranks_put_the_coordinator_first_and_every_stage_after_it():
    assert COORDINATOR_RANK == 0 and world_size(4) == 5
    assert [rank_of_stage(i) for i in range(4)] == [1, 2, 3, 4]
    assert [rank_name(r) for r in range(world_size(2))] == ["coordinator", "stage 0", "stage 1"]


def test_a_gloo_failure_is_reported_by_its_reason_alone():
    """Error messages (logs, HTTP 503 bodies) carry gloo's reason, not its source path and advice."""
    from workers.channel import _gloo_reason

    raw = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
           "[127.0.0.1]:12451. This is typically caused by a remote worker crashing. Check the logs of the remote "
           "worker before reporting an error. GLHF!\nsecond line")
    assert _gloo_reason(raw) == "Connection closed by peer [127.0.0.1]:12451"
    assert _gloo_reason("Connection reset by peer") == "Connection reset by peer"
    assert _gloo_reason("") == "unknown error"
