"""Chrome trace-event export of a pipeline timeline: tracks, slices, categories, ordering."""

from __future__ import annotations

import json

from pipeline.measure.timeline import StageTiming, Timeline
from pipeline.measure.trace import COMMIT_TID, chrome_trace
from pipeline.speculation.items import Item, ItemKind


def _item(seq_id: int, start: int, kind: ItemKind) -> Item:
    return Item(seq_id=seq_id, slot=seq_id, start=start, num_tokens=1, kind=kind)


def _timeline() -> Timeline:
    tl = Timeline(2)
    base = 1_000_000_000
    tl.record([StageTiming(0, base, base + 10_000), StageTiming(1, base + 11_000, base + 25_000)], [_item(0, 5, ItemKind.DECODE)], 1.0)
    tl.record([StageTiming(0, base + 12_000, base + 22_000), StageTiming(1, base + 26_000, base + 40_000)], [_item(0, 6, ItemKind.DRAFT)],
              0.0)
    return tl


def test_trace_has_one_named_track_per_stage_plus_commits():
    ev = chrome_trace(_timeline())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", COMMIT_TID: "commits"}


def test_slices_are_complete_events_in_microseconds_from_the_first_slice():
    ev = [e for e in chrome_trace(_timeline())["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in ev] == [(0, 0.0, 10.0), (1, 11.0, 14.0), (0, 12.0, 10.0),
                                                           (1, 26.0, 14.0)]
    assert [e["ts"] for e in ev] == sorted(e["ts"] for e in ev)


def test_slice_category_says_whether_work_was_committed_or_squashed():
    ev = [e for e in chrome_trace(_timeline())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"]) for e in ev] == [("decode", "committed"), ("decode", "committed"),
                                                   ("draft", "squashed"), ("draft", "squashed")]


def test_committed_tokens_are_instant_events_and_the_trace_is_json():
    trace = chrome_trace(_timeline(), commits=[(1_000_030_000, 0, 42)])
    inst = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert inst == [{"name": "commit seq 0", "cat": "commit", "ph": "i", "s": "t", "pid": 1, "tid": COMMIT_TID,
                     "ts": 30.0, "args": {"seq_id": 0, "token_id": 42}}]
    assert json.loads(json.dumps(trace)) == trace
