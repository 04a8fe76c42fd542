"""Handoff latency from the timeline ([Note: handoff latency] in pipeline/measure/handoffs.py).

What breaks when these fail: `launch --json`'s `handoffs` (and the summary line's "handoff p50 ...,
ring return ...") blame the message path for time a stage spent waiting for upstream compute, or
miss the time it did cost.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.measure.handoffs import handoff_latency, plain_decode_estimate
from pipeline.measure.timeline import StageTiming, Timeline
from pipeline.speculation.items import Item, ItemKind

MS = 1_000_000


def _item(seq: int, start: int, kind: ItemKind = ItemKind.DECODE, n: int = 1) -> Item:
    return Item(seq_id=seq, slot=seq, start=start, num_tokens=n, epoch=0, kind=kind)


def _record(tl: Timeline, items: list[Item], *spans: tuple[int, int]) -> None:
    """One micro-batch: stage i ran it over spans[i] (ms)."""
    tl.record([StageTiming(i, a * MS, b * MS) for i, (a, b) in enumerate(spans)], items, 1.0)


def test_single_stream_handoffs_are_the_gaps_between_a_finished_input_and_the_next_start():
    tl = Timeline(2)
    _record(tl, [_item(0, 0, ItemKind.PREFILL, n=5)], (0, 10), (12, 20))  # link 2 ms; a prefill has no input
    _record(tl, [_item(0, 5)], (23, 33), (34, 40))  # ring return 23 - 20 = 3 ms, link 1 ms
    _record(tl, [_item(0, 6)], (44, 54), (54, 60))  # ring return 4 ms, link 0
    h = handoff_latency(tl.slices, 2)
    assert h["stage_handoff"] == [{"p50_ms": 1.0, "mean_ms": 1.0, "count": 3}]
    assert h["ring_return"] == {"p50_ms": 3.5, "mean_ms": 3.5, "count": 2}


def test_a_busy_stage_is_queueing_not_handoff_and_drafts_have_no_ring_return():
    tl = Timeline(2)
    _record(tl, [_item(0, 3)], (0, 10), (11, 30))
    _record(tl, [_item(0, 4, ItemKind.DRAFT)], (10, 20), (31, 40))  # waited on stage 1's own work: 1 ms after it
    _record(tl, [_item(0, 4)], (35, 45), (45, 50))  # input: the first batch's result at 30; stage 0 free at 20
    h = handoff_latency(tl.slices, 2)
    assert h["stage_handoff"][0]["count"] == 3 and h["stage_handoff"][0]["mean_ms"] == pytest.approx(2 / 3, abs=1e-3)
    assert h["ring_return"] == {"p50_ms": 5.0, "mean_ms": 5.0, "count": 1}  # 35 - max(30, 20); the draft not counted


def test_a_micro_batch_of_two_sequences_waits_for_the_later_input():
    tl = Timeline(1)
    _record(tl, [_item(0, 4)], (0, 10))
    _record(tl, [_item(1, 8)], (10, 18))
    _record(tl, [_item(0, 5), _item(1, 9)], (21, 30))  # inputs at 10 and 18, stage free at 18: 3 ms
    h = handoff_latency(tl.slices, 1)
    assert h["stage_handoff"] == []
    assert h["ring_return"] == {"p50_ms": 3.0, "mean_ms": 3.0, "count": 1}


def test_an_empty_timeline_reports_zero_counts_and_a_bad_stage_count_raises():
    assert handoff_latency([], 3) == {"stage_handoff": [{"p50_ms": 0.0, "mean_ms": 0.0, "count": 0}] * 2,
                                      "ring_return": {"p50_ms": 0.0, "mean_ms": 0.0, "count": 0}}
    with pytest.raises(ValueError, match="num_stages"):
        handoff_latency([], 0)


def test_plain_decode_estimate_is_the_sum_of_one_row_slices_handoffs_and_ring_return():
    """[Note: plain decode estimate]: on a plain single-stream timeline the estimate is its own time
    per token (medians: stage 0 10 ms + stage 1 6 ms + link 1 ms + ring return 3.5 ms)."""
    tl = Timeline(2)
    _record(tl, [_item(0, 0, ItemKind.PREFILL, n=5)], (0, 10), (12, 20))
    _record(tl, [_item(0, 5)], (23, 33), (34, 40))
    _record(tl, [_item(0, 6)], (44, 54), (54, 60))
    assert plain_decode_estimate(tl.slices, 2, exit_stage=None) == {"plain_tpot_ms": 20.5, "exit_head_included": False}


def test_the_estimate_leaves_out_the_exit_head_and_passes_of_more_rows():
    """Only one-row passes of one item count (no second item, token-tree sibling or FIRP pseudo row),
    and the exit stage's passes without the exit head where there are MIN_HEAD_FREE_SLICES of them."""
    tl = Timeline(2)
    t = 0
    for pos, (head, s0, s1) in enumerate([(True, 14, 6), (False, 10, 6), (False, 10, 6), (False, 10, 6)]):
        _record(tl, [dataclasses.replace(_item(0, 5 + pos), want_exit=head)], (t, t + s0), (t + s0, t + s0 + s1))
        t += s0 + s1
    more_rows = [
        [_item(0, 9, ItemKind.DRAFT), _item(0, 10, ItemKind.DRAFT)],  # two items
        [dataclasses.replace(_item(0, 9, ItemKind.DRAFT), alt_token_ids=(7, 8))],  # a tree draft: 3 rows
        [dataclasses.replace(_item(0, 9), firp_k=2, firp_anchors=1)],  # FIRP pseudo rows
    ]
    for items in more_rows:
        _record(tl, items, (t, t + 40), (t + 40, t + 70))
        t += 70
    est = plain_decode_estimate(tl.slices, 2, exit_stage=0)
    assert est == {"plain_tpot_ms": pytest.approx(10 + 6), "exit_head_included": False}  # no waits here


def test_too_few_passes_without_the_head_keep_it_in_or_take_its_measured_cost_off():
    tl = Timeline(2)
    _record(tl, [_item(0, 5)], (0, 14), (14, 20))  # want_exit: the head ran (14 ms on stage 0)
    _record(tl, [dataclasses.replace(_item(0, 6), want_exit=False)], (20, 30), (30, 36))  # one without: too few
    assert plain_decode_estimate(tl.slices, 2, exit_stage=0) == {"plain_tpot_ms": 18.0, "exit_head_included": True}
    off = plain_decode_estimate(tl.slices, 2, exit_stage=0, exit_head_ms=3.0)  # median(14, 10) - 3
    assert off == {"plain_tpot_ms": 15.0, "exit_head_included": False}
    multi = Timeline(2)
    _record(multi, [_item(0, 7, ItemKind.DRAFT), _item(0, 8, ItemKind.DRAFT)], (0, 20), (20, 30))
    assert plain_decode_estimate(multi.slices, 2, exit_stage=0) is None  # nothing of the plain shape
