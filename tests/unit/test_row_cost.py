"""The row-cost table and its JSON and calibration (pipeline/measure/row_cost.py; the rows-worth-sending rules: test_row_budget.py).

What breaks when these fail: the scheduler sends long draft chains where extra rows are expensive
(float32 on CPU) or short ones where they are nearly free (int4, bf16 AMX, GPU), or a saved table
does not load back.
"""

from __future__ import annotations

import pytest

from pipeline.measure.row_cost import RowCostTable, expected_tokens, measure_row_costs

CHEAP = RowCostTable(mode="int4", num_rows=(1, 2, 4, 8), pass_s=(0.010, 0.0102, 0.0106, 0.0115))
COSTLY = RowCostTable(mode="fp32", num_rows=(1, 2, 4, 8), pass_s=(0.050, 0.058, 0.085, 0.104))


def test_costs_interpolate_between_and_extrapolate_past_the_measured_rows():
    assert COSTLY.cost_s(1) == 0.050 and COSTLY.cost_s(4) == 0.085
    assert COSTLY.cost_s(3) == pytest.approx((0.058 + 0.085) / 2)
    assert COSTLY.cost_s(12) == pytest.approx(0.104 + 4 * (0.104 - 0.085) / 4)
    assert CHEAP.ratio(8) == pytest.approx(1.15)


def test_expected_tokens_count_the_real_token_and_the_accepted_prefix():
    assert expected_tokens([], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_bad_tables_and_arguments_are_named():
    with pytest.raises(ValueError, match="needs times for 1"):
        RowCostTable(mode="x", num_rows=(2, 4), pass_s=(1.0, 2.0))
    with pytest.raises(ValueError, match="must ascend"):
        RowCostTable(mode="x", num_rows=(1, 4, 2), pass_s=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="malformed"):
        RowCostTable.from_json({"mode": "x"})


def test_a_table_round_trips_through_json_and_a_report_file(tmp_path):
    assert RowCostTable.from_json(CHEAP.to_json()) == CHEAP
    path = tmp_path / "row_cost.json"
    import json
    path.write_text(json.dumps({"tables": [COSTLY.to_json(), CHEAP.to_json()]}))
    assert RowCostTable.load(path, "int4") == CHEAP
    with pytest.raises(ValueError, match="no row-cost table for mode 'bf16'"):
        RowCostTable.load(path, "bf16")


def test_measurement_interleaves_shapes_and_drops_the_warm_up_round():
    calls = []
    medians = measure_row_costs(lambda n, k: calls.append((n, k)), [(1, 0), (4, 3)], repeats=3)
    assert calls == [(1, 0), (4, 3)] * 4
    assert set(medians) == {(1, 0), (4, 3)} and all(v >= 0 for v in medians.values())
