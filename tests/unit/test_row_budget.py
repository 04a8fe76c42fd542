"""FIRP chain lengths chosen from a row-cost table and the measured acceptance (pipeline/engine/row_budget.py).

What breaks when these fail: with `--row-cost-file` the scheduler keeps sending long FIRP chains
where rows are expensive and drafts are mostly wrong (slower than no FIRP), or short ones where
rows are nearly free and drafts are often right; a chain length cut to zero never grows back; or
the default (no table) stops being the fixed `firp_k` chain.
"""

from __future__ import annotations

import pytest

from pipeline.engine.records import SchedulerConfig
from pipeline.engine.row_budget import EXPLORE_EVERY, RowBudget, next_firp_drafts
from pipeline.engine.scheduler import Scheduler
from pipeline.measure.row_cost import RowCostTable, best_firp_k, expected_tokens, firp_pass_rows
from pipeline.run_config import RunConfig
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.sampling import SamplingParams

# fake tables: rows nearly free (GPU-like), and rows that cost (CPU float32-like: 16 rows = 2.7x)
CHEAP = RowCostTable(mode="int4", num_rows=(1, 2, 4, 8, 16, 32), pass_s=(0.010, 0.0101, 0.0102, 0.0105, 0.011, 0.012))
COSTLY = RowCostTable(mode="fp32", num_rows=(1, 2, 4, 8, 16), pass_s=(0.050, 0.080, 0.095, 0.130, 0.160))


def test_the_rule_maximises_expected_tokens_per_second_over_the_table():
    for table in (CHEAP, COSTLY):
        for p in (0.1, 0.5, 0.9):
            probs = [p] * 4
            k = best_firp_k(table, probs, max_k=4)
            rates = [expected_tokens(probs, j) / table.cost_s(int(firp_pass_rows(j))) for j in range(5)]
            assert rates[k] == max(rates), (table.mode, p, k, rates)
    assert best_firp_k(CHEAP, [0.8] * 4, max_k=4) == 4  # nearly free rows: every likely draft pays
    assert best_firp_k(COSTLY, [0.3] * 4, max_k=4) == 0  # a 2-row pass costs 1.6x: 0.3 does not pay
    assert best_firp_k(COSTLY, [0.95] * 4, max_k=4) > 0
    assert best_firp_k(CHEAP, [0.9] * 4, max_k=2) == 2  # never past the maps the stages run


def test_pseudo_rows_that_run_fewer_layers_cost_less():
    assert firp_pass_rows(3) == 1 + 3 + 4 * 3
    assert firp_pass_rows(3, pseudo_weight=0.5) == 1 + 3 + 2 * 3
    probs = [0.75] * 4
    assert best_firp_k(COSTLY, probs, max_k=4, pseudo_weight=0.2) >= best_firp_k(COSTLY, probs, max_k=4)


def test_bad_rule_arguments_are_refused():
    with pytest.raises(ValueError, match="max_k"):
        best_firp_k(CHEAP, [0.5], max_k=-1)
    with pytest.raises(ValueError, match="acceptance"):
        best_firp_k(CHEAP, [1.5], max_k=1)
    with pytest.raises(ValueError, match="pseudo_weight"):
        best_firp_k(CHEAP, [0.5], max_k=1, pseudo_weight=0.0)


def test_without_a_table_every_item_gets_the_fixed_chain_cut_by_the_budget():
    budget = RowBudget(max_firp_k=3)
    for _ in range(2 * EXPLORE_EVERY):
        budget.record(verified=1, accepted=0)
        assert budget.firp_fields(last_item_position=100, first_anchor=10, num_anchors=2) == {
            "firp_k": 3, "firp_anchors": 2}
    assert budget.firp_fields(last_item_position=12, first_anchor=10, num_anchors=1) == {"firp_k": 1, "firp_anchors": 1}
    assert budget.firp_fields(last_item_position=11, first_anchor=10, num_anchors=1) == {}


def _asked_k(budget: RowBudget) -> int:
    """The chain length an item far from its token budget gets now (one ask: it counts towards exploring)."""
    return budget.firp_fields(last_item_position=1000, first_anchor=10, num_anchors=1).get("firp_k", 0)


def test_measured_rejections_shorten_the_chain_and_exploration_lets_it_grow_back():
    budget = RowBudget(max_firp_k=4, row_costs=COSTLY)
    assert _asked_k(budget) == best_firp_k(COSTLY, [0.5] * 4, max_k=4)  # the prior
    for _ in range(40):
        budget.record(verified=1, accepted=0)  # depth 1 always wrong
    assert _asked_k(budget) == 0
    asked = [budget.firp_fields(last_item_position=1000, first_anchor=10, num_anchors=1).get("firp_k", 0)
             for _ in range(2 * EXPLORE_EVERY)]
    assert asked.count(1) == 2 and asked.count(0) == 2 * EXPLORE_EVERY - 2  # depth 1 is still measured
    for _ in range(200):
        budget.record(verified=4, accepted=4)  # drafts turn right: every depth accepted
    assert _asked_k(budget) == 4
    assert budget.acceptance()[0] > 0.8


def test_record_counts_a_depth_only_when_every_shallower_draft_was_accepted():
    budget = RowBudget(max_firp_k=3, row_costs=CHEAP)
    budget.record(verified=3, accepted=1)  # depth 1 right, depth 2 wrong, depth 3 never verified
    assert budget.verified == [1, 1, 0] and budget.accepted == [1, 0, 0]
    budget.record(verified=2, accepted=2)  # a chain of 2 (budget cut), both right
    assert budget.verified == [2, 2, 0] and budget.accepted == [2, 1, 0]


def test_the_next_items_drafts_come_from_the_anchor_of_the_last_committed_token():
    # a FIRP verify item: real token + 2 drafts, each of its 3 rows anchoring a chain of 2
    item = Item(seq_id=0, slot=0, start=10, num_tokens=3, epoch=0, kind=ItemKind.FIRP, token_ids=(1, 2, 3),
                firp_k=2, firp_anchors=3)
    firp = [11, 12, 21, 22, 31, None]
    assert next_firp_drafts(item, 1, firp) == (11, 12)  # first draft rejected: the anchor is row 0
    assert next_firp_drafts(item, 3, firp) == (31,)  # all accepted: the last chain, cut at its None
    plain = Item(seq_id=0, slot=0, start=10, num_tokens=1, epoch=0, kind=ItemKind.DECODE, token_ids=(1,))
    assert next_firp_drafts(plain, 1, []) == ()


def test_the_scheduler_asks_the_row_budget_for_each_items_chain():
    for table, expect in ((None, 3), (COSTLY, best_firp_k(COSTLY, [0.5] * 3, max_k=3))):
        config = SchedulerConfig(num_stages=1, firp_k=3, row_costs=table)
        sched = Scheduler(config)
        sched.add(0, [5, 6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))
        (item,) = sched.next_batch(num_inflight=0).items
        assert item.kind == ItemKind.PREFILL and item.firp_k == (expect if expect else 0)


def test_run_config_names_the_row_cost_file_and_the_mode_of_its_table():
    with pytest.raises(ValueError, match="row_cost_file"):
        RunConfig(row_cost_file="costs.txt")
    assert RunConfig(row_cost_file="costs.json").row_cost_mode == "fp32"
    assert RunConfig(dtype="bfloat16").row_cost_mode == "bf16"
    assert RunConfig(quantization="auto").row_cost_mode == "auto"
