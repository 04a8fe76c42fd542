"""Timeline records and metrics: per-item outcomes, per-stage fractions over a window, percentiles.

What breaks when these fail: `launch --json` / `bench` report wrong busy / useful / wasted / idle
(bubble) fractions, lose an item's sequence, positions, epoch, kind or outcome, or wrong TTFT /
TPOT / ITL percentiles.
"""

from __future__ import annotations

import pytest

from pipeline.measure.metrics import inter_token_gaps_s, latency_summary, percentile
from pipeline.measure.timeline import StageTiming, Timeline
from pipeline.measure.trace import chrome_trace
from pipeline.speculation.items import Item, ItemKind

MS = 1_000_000


def _items() -> list[Item]:
    return [Item(seq_id=3, slot=0, start=7, num_tokens=1, epoch=2, kind=ItemKind.DECODE),
            Item(seq_id=4, slot=1, start=9, num_tokens=1, epoch=0, kind=ItemKind.DRAFT)]


def test_each_item_keeps_sequence_positions_epoch_kind_and_outcome():
    tl = Timeline(1)
    tl.record([StageTiming(0, 0, 4 * MS)], _items(), 0.5, committed=[True, False])
    (s,) = tl.slices
    assert [it.to_json() for it in s.items] == [
        {"seq_id": 3, "positions": [7, 8], "epoch": 2, "kind": "decode", "outcome": "committed", "want_exit": True},
        {"seq_id": 4, "positions": [9, 10], "epoch": 0, "kind": "draft", "outcome": "squashed", "want_exit": True}]
    event = next(e for e in chrome_trace(tl)["traceEvents"] if e["ph"] == "X")
    assert event["args"]["items"] == [it.to_json() for it in s.items] and event["cat"] == "partly-squashed"


def test_fractions_split_busy_into_useful_and_wasted_and_the_rest_is_idle():
    tl = Timeline(2)
    tl.record([StageTiming(0, 0, 2 * MS), StageTiming(1, 2 * MS, 4 * MS)], _items()[:1], 1.0)  # committed
    tl.record([StageTiming(0, 4 * MS, 6 * MS), StageTiming(1, 6 * MS, 8 * MS)], _items()[1:], 0.0)  # squashed
    f0, f1 = tl.fractions(0, 10 * MS)
    assert (f0.busy, f0.useful, f0.wasted, f0.idle) == pytest.approx((0.4, 0.2, 0.2, 0.6))
    assert (f1.busy, f1.useful, f1.wasted, f1.idle) == pytest.approx((0.4, 0.2, 0.2, 0.6))
    clipped = tl.fractions(3 * MS, 5 * MS)  # slices are cut at the window
    assert [f.busy for f in clipped] == pytest.approx([0.5, 0.5])
    assert [s.batch for s in tl.slices] == [0, 0, 1, 1]


def test_percentiles_interpolate_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_latency_summary_reports_tokens_per_s_ttft_tpot_and_itl():
    gaps = inter_token_gaps_s([(0, 1, 5), (10 * MS, 1, 6), (30 * MS, 1, 7), (5 * MS, 2, 9)])
    assert gaps == pytest.approx([0.010, 0.020])
    out = latency_summary(num_tokens=[3, 1], ttft_s=[0.1, 0.2], e2e_s=[0.3, 0.2], wall_s=0.5, itl_s=gaps)
    assert out["generated_tokens"] == 4 and out["tokens_per_s"] == 8.0
    assert out["tpot_ms_p50"] == pytest.approx(100.0)  # (0.3 - 0.1) / 2; one-token requests have no TPOT
    assert out["ttft_ms_p50"] == pytest.approx(150.0) and out["itl_ms_p99"] == pytest.approx(19.9)
