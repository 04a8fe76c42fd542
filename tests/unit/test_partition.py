"""Unit tests for pipeline.model.partition: balanced split, explicit splits and their error messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.model.partition import (
    HEAD_EFFICIENCY,
    LayerRange,
    balanced_split,
    head_cost_layers,
    parse_layer_split,
    split_from_sizes,
)


def _sizes(ranges: list[LayerRange]) -> list[int]:
    return [len(r) for r in ranges]


def test_balanced_split_30_layers_4_stages_is_8_8_7_7():
    ranges = balanced_split(30, 4)
    assert _sizes(ranges) == [8, 8, 7, 7]
    assert ranges == [LayerRange(0, 8), LayerRange(8, 16), LayerRange(16, 23), LayerRange(23, 30)]


def test_balanced_split_one_stage_holds_every_layer():
    assert balanced_split(30, 1) == [LayerRange(0, 30)]


def test_balanced_split_moves_a_layer_off_the_head_stage_when_that_lowers_the_max_cost():
    # Even split 2,2 costs 2 and 3 (head = 1 layer); 3,1 costs 3 and 2: no better, so it stays 2,2.
    assert _sizes(balanced_split(4, 2)) == [2, 2]
    # 3 layers on 2 stages: even 2,1 costs 2 and 2: already balanced.
    assert _sizes(balanced_split(3, 2)) == [2, 1]
    # 8 layers on 3 stages: even 3,3,2 costs 3,3,3: stays.
    assert _sizes(balanced_split(8, 3)) == [3, 3, 2]
    # 6 layers on 3 stages: even 2,2,2 costs 2,2,3 -> 3,2,1 would cost 3,2,2: not strictly lower.
    assert _sizes(balanced_split(6, 3)) == [2, 2, 2]


@given(data=st.data())
def test_balanced_split_is_contiguous_complete_non_empty_and_last_stage_no_larger(data):
    num_layers = data.draw(st.integers(1, 40), label="num_layers")
    num_stages = data.draw(st.integers(1, num_layers), label="num_stages")
    ranges = balanced_split(num_layers, num_stages)
    assert len(ranges) == num_stages
    assert ranges[0].start == 0, "first stage must start at layer 0"
    assert ranges[-1].stop == num_layers, "last stage must end at the last layer"
    for prev, nxt in zip(ranges, ranges[1:], strict=False):
        assert prev.stop == nxt.start, f"gap or overlap between {prev} and {nxt}"
    sizes = _sizes(ranges)
    assert min(sizes) >= 1, f"empty stage in {sizes}"
    assert sizes[-1] <= min(sizes), f"last stage (runs the LM head) is larger than another: {sizes}"
    # Balanced: no two stages differ by more than the head's extra cost allows (+1 for rounding).
    assert max(sizes) - min(sizes) <= 2, f"unbalanced split {sizes}"
    assert [layer for r in ranges for layer in r] == list(range(num_layers))


@pytest.mark.parametrize("num_stages", [0, -1])
def test_balanced_split_rejects_fewer_than_one_stage(num_stages):
    with pytest.raises(ValueError, match=rf"num_stages must be >= 1, got {num_stages}"):
        balanced_split(30, num_stages)


def test_balanced_split_rejects_more_stages_than_layers_naming_both():
    with pytest.raises(ValueError) as err:
        balanced_split(30, 31)
    assert "31" in str(err.value) and "30" in str(err.value)


def test_head_cost_is_its_streamed_bytes_over_a_layer_s_times_the_efficiency():
    """[Note: partition cost]: a head holding 12.8 layers' bytes (the default model's Q8_0 head over
    Q4_1 layers) costs 12.8 x HEAD_EFFICIENCY layers, whatever its weight count; no bytes is an error."""
    assert head_cost_layers(head_bytes=128, layer_bytes=10) == pytest.approx(12.8 * HEAD_EFFICIENCY)
    assert head_cost_layers(head_bytes=256, layer_bytes=10) == 2 * head_cost_layers(head_bytes=128, layer_bytes=10)
    with pytest.raises(ValueError, match="layer_bytes must be > 0, got 0"):
        head_cost_layers(head_bytes=128, layer_bytes=0)


def test_split_from_sizes_builds_half_open_contiguous_ranges():
    assert split_from_sizes([1, 2, 3], 6) == [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 6)]


def test_split_from_sizes_sum_mismatch_names_the_sum_and_the_layer_count():
    with pytest.raises(ValueError) as err:
        split_from_sizes([8, 8, 7, 6], 30)
    message = str(err.value)
    assert "29" in message and "30" in message and "8,8,7,6" in message


@pytest.mark.parametrize("sizes", [[8, 0, 7], [16, -1, 15]])
def test_split_from_sizes_rejects_a_stage_with_no_layers_naming_the_split(sizes):
    with pytest.raises(ValueError, match="at least 1 layer") as err:
        split_from_sizes(sizes, sum(sizes))
    assert ",".join(map(str, sizes)) in str(err.value)


def test_split_from_sizes_rejects_an_empty_split():
    with pytest.raises(ValueError, match="empty"):
        split_from_sizes([], 4)


def test_parse_layer_split_parses_comma_separated_counts():
    assert parse_layer_split("8,8,7,7") == [8, 8, 7, 7]
    assert parse_layer_split("30") == [30]


@pytest.mark.parametrize("text", ["8,x,7", "8,,7", "8;8", "", "1.5,2"])
def test_parse_layer_split_rejects_non_integers_naming_the_text(text):
    with pytest.raises(ValueError, match="comma-separated integers") as err:
        parse_layer_split(text)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize(("start", "stop"), [(-1, 3), (4, 3)])
def test_layer_range_rejects_negative_or_reversed_bounds(start, stop):
    with pytest.raises(ValueError, match=rf"\[{start}, {stop}\)"):
        LayerRange(start, stop)


def test_layer_range_is_half_open():
    r = LayerRange(2, 5)
    assert len(r) == 3 and list(r) == [2, 3, 4]
    assert 2 in r and 4 in r and 5 not in r and 1 not in r
    assert str(r) == "[2, 5)"
