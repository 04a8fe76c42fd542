"""Replays and FIRP terms of the calibrated simulator: SPEED drafts replayed where a run drafted
(`draft_positions`, `DraftsAt`), FIRP chains replayed from a recorded run (`firp_chains` in
pipeline/measure/calibrate.py, `FirpReplay` in pipeline/engine/simulator.py), and the measured
cost and contention of FIRP's pass shapes (`fit_pass_shapes`, `fit_contention_rows` in
pipeline/measure/calibrate_tables.py). What breaks when these fail: `simulate --calibrate`
predicts FIRP runs from a flat per-draft acceptance again, which cannot follow FIRP's chains (cut
by confidence, acceptance falling with depth: a 2-prompt FIRP run was over-predicted by 30 %), or
prices its multi-row passes from a table's ratios and a one-row contention (+11 %)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from launcher.bench.simulate import predict_run
from pipeline.engine.simulator import Bernoulli, CostModel, DraftsAt, FirpReplay, SimConfig, Simulator
from pipeline.measure.calibrate import calibrate, draft_positions, firp_chains
from pipeline.measure.calibrate_tables import fit_contention_rows, fit_pass_shapes

COST = CostModel(stage_base_s=(0.016, 0.017), stage_per_token_s=(1e-3, 1e-3), pseudo_row_s=(1e-3, 2e-3),
                 hop_latency_s=3e-4, coordinator_s=8e-4)


def _firp_run(concurrency: int, *, alpha: float = 0.5, replay: FirpReplay | None = None, k: int = 2,
              cost: CostModel = COST):
    cfg = SimConfig(num_stages=2, prompt_lens=tuple(12 + 5 * i for i in range(concurrency)), max_new_tokens=24,
                    firp_k=k, firp_alpha=alpha)
    res = Simulator(cfg, cost, firp_replay=replay).run()
    return res, res.timeline.to_json(0, round(res.wall_s * 1e9), commits=res.commits)


def _spans(timeline: dict, stage: int = 0) -> collections.Counter:
    return collections.Counter((it["kind"], it["positions"][1] - it["positions"][0])
                               for s in timeline["slices"] if s["stage"] == stage for it in s["items"])


@pytest.mark.parametrize("concurrency", [1, 2])
def test_replaying_a_runs_chains_reproduces_it(concurrency):
    recorded, timeline = _firp_run(concurrency)
    chains = firp_chains(timeline)
    pooled = [c for seq in chains for c in seq]
    assert len(chains) == concurrency and {a for _, a in pooled} >= {0, 1, 2}  # Bernoulli(0.5): mixed outcomes
    replayed, again = _firp_run(concurrency, alpha=0.0, replay=FirpReplay(chains))
    assert replayed.tokens_per_s == pytest.approx(recorded.tokens_per_s, rel=1e-9)
    assert _spans(again) == _spans(timeline)


def test_a_replayed_chain_is_cut_to_its_recorded_length_and_commits_its_accepted_drafts():
    res, timeline = _firp_run(1, replay=FirpReplay([[(1, 1)]]))  # maps for 2 drafts, the run sent 1, right
    spans = _spans(timeline)
    assert spans[("firp", 2)] > 0 and not spans[("firp", 3)] and spans[("decode", 1)] <= 1  # (1: the last token)
    assert res.accepted == res.verified > 0
    _, none = _firp_run(1, replay=FirpReplay([[(0, 0)]]))  # every chain cut: plain decode items
    assert not any(kind == "firp" for kind, _ in _spans(none))


def test_firp_chains_reads_lengths_and_acceptance_from_the_next_items_start():
    def item(kind, a, b, seq=0):
        return {"kind": kind, "positions": [a, b], "seq_id": seq, "epoch": 0}
    slices = [{"stage": 0, "start_ns": t, "end_ns": t + 1, "items": [it]} for t, it in enumerate(
        [item("prefill", 0, 10), item("firp", 10, 13), item("firp", 12, 15), item("decode", 15, 16),
         item("firp", 16, 19)])]
    slices.append({"stage": 1, "start_ns": 9, "end_ns": 10, "items": [item("firp", 10, 13)]})
    # [10, 13): 2 drafts, next starts at 12 -> 1 accepted; [12, 15): both -> next at 15; the decode:
    # (0, 0); the last item has no successor: its outcome needs the commits
    assert firp_chains({"num_stages": 2, "slices": slices}) == [[(2, 1), (2, 2), (0, 0)]]
    commits = [[t, 0, 7] for t in range(9)]  # 9 tokens after the 10-token prompt: the last at position 18
    assert firp_chains({"num_stages": 2, "slices": slices, "commits": commits}) == [[(2, 1), (2, 2), (0, 0), (2, 1)]]


def test_firp_replay_rejects_an_empty_or_impossible_record():
    with pytest.raises(ValueError, match="at least one"):
        FirpReplay([[], []])
    with pytest.raises(ValueError, match="accepted <= length"):
        FirpReplay([[(2, 3)]])


def test_predict_run_replays_a_firp_runs_chains():
    plain, plain_tl = _firp_run(1, k=0)
    recorded, timeline = _firp_run(2, alpha=0.6)
    chains = firp_chains(timeline)
    pooled = [c for seq in chains for c in seq]
    verified = sum(min(n, a + 1) for n, a in pooled)
    runs = [{"num_stages": 2, "speculate": "none", "concurrency": 1, "timeline": plain_tl},
            {"num_stages": 2, "speculate": "firp", "concurrency": 2, "timeline": timeline,
             "num_tokens": [24, 24], "stats": {"tokens_per_s": recorded.tokens_per_s, "firp_verified": verified,
                                               "firp_accepted": sum(a for _, a in pooled)}}]
    cal = calibrate(runs)
    assert predict_run(cal, runs[1]) == pytest.approx(recorded.tokens_per_s, rel=0.05)


# -- measured pass shapes and their contention -------------------------------------------------------
SHAPED = dataclasses.replace(COST, contention=0.02, contention_rows=((9, 0.15),),
                             pass_shapes=(((3, 6, 0.050),), ((3, 6, 0.055),)))


def test_a_measured_pass_shape_replaces_rows_plus_pseudo_rows_and_contention_follows_the_rows():
    assert SHAPED.stage_s(0, 3, num_pseudo=6) == 0.050 and SHAPED.stage_s(1, 3, num_pseudo=6, exit_rows=0) == 0.055
    assert SHAPED.stage_s(0, 3, num_pseudo=3) == pytest.approx(COST.stage_s(0, 3, num_pseudo=3))  # not measured
    assert SHAPED.contention_at(9, num_pseudo=6) == 0.15 and SHAPED.contention_at(40, num_pseudo=6) == 0.15
    assert SHAPED.contention_at(5, num_pseudo=2) == pytest.approx(0.02 + 0.13 / 2)
    assert SHAPED.contention_at(1) == SHAPED.contention_at(40) == 0.02  # no pseudo rows: the one-row contention
    assert SHAPED.scaled(2.0).stage_s(0, 3, num_pseudo=6) == pytest.approx(0.100)
    with pytest.raises(ValueError, match="row counts > 1"):
        dataclasses.replace(COST, contention_rows=((1, 0.1),))
    with pytest.raises(ValueError, match="pass_shapes"):
        dataclasses.replace(COST, pass_shapes=(((3, 6, 0.05),),))


def test_pass_shapes_and_their_contention_are_recovered_and_predict_the_runs():
    _, plain = _firp_run(1, k=0, cost=SHAPED)
    _, plain2 = _firp_run(2, k=0, cost=SHAPED)  # the one-row contention
    alone, alone_tl = _firp_run(1, cost=SHAPED)
    full, full_tl = _firp_run(2, cost=SHAPED)
    shapes = fit_pass_shapes([alone_tl], 2, loads=[1.0])
    assert [[(n, p, pytest.approx(t)) for n, p, t in st] for st in shapes] == [[(3, 6, 0.050)], [(3, 6, 0.055)]]
    assert fit_contention_rows([full_tl], [shapes], loads=[1.0]) == ((9, pytest.approx(0.15)),)
    runs = [{"num_stages": 2, "speculate": "none", "concurrency": c, "timeline": tl}
            for c, tl in ((1, plain), (2, plain2))]
    for res, tl, c in ((alone, alone_tl, 1), (full, full_tl, 2)):
        pooled = [x for seq in firp_chains(tl) for x in seq]
        runs.append({"num_stages": 2, "speculate": "firp", "concurrency": c, "timeline": tl, "num_tokens": [24] * c,
                     "stats": {"tokens_per_s": res.tokens_per_s, "firp_verified": sum(min(n, a + 1) for n, a in pooled),
                               "firp_accepted": sum(a for _, a in pooled)}})
    cal = calibrate(runs)
    assert cal.contention_rows == ((9, pytest.approx(0.15)),)
    for r in runs[2:]:  # (3 %: the prefills' pseudo rows are priced per row, fitted against the shape's 2x gap)
        assert predict_run(cal, r) == pytest.approx(r["stats"]["tokens_per_s"], rel=0.03)
    without = dataclasses.replace(cal, pass_shapes={}, contention_rows=())
    assert predict_run(without, runs[3]) > 1.04 * runs[3]["stats"]["tokens_per_s"]  # the terms matter


# -- SPEED drafts replayed where the run drafted ----------------------------------------------------
@pytest.mark.parametrize("num_stages,concurrency", [(2, 1), (3, 2)])  # (2 sequences fill 2 stages: no drafts)
def test_replaying_where_a_run_drafted_reproduces_it(num_stages, concurrency):
    cost = COST if num_stages == 2 else CostModel.uniform(num_stages=num_stages, stage_s=0.012, per_token_s=1e-3,
                                                          hop_latency_s=3e-4, coordinator_s=8e-4)
    cfg = SimConfig(num_stages=num_stages, prompt_lens=tuple(12 + 5 * i for i in range(concurrency)),
                    max_new_tokens=24, speculate=True)
    recorded = Simulator(cfg, cost, acceptance=Bernoulli(0.6, seed=3)).run()
    timeline = recorded.timeline.to_json(0, round(recorded.wall_s * 1e9), commits=recorded.commits)
    positions = draft_positions(timeline)
    assert len(positions) == concurrency and all(positions) and {True, False} <= {v for m in positions for v in m.values()}
    replayed = Simulator(cfg, cost, acceptance=DraftsAt(positions)).run()
    assert replayed.tokens_per_s == pytest.approx(recorded.tokens_per_s, rel=1e-9)
    assert (replayed.verified, replayed.accepted) == (recorded.verified, recorded.accepted)
    # a run that drafted nowhere replays as plain decoding
    none = Simulator(cfg, cost, acceptance=DraftsAt([{}] * concurrency)).run()
    plain = Simulator(dataclasses.replace(cfg, speculate=False), cost).run()
    assert none.verified == 0 and none.tokens_per_s == pytest.approx(plain.tokens_per_s, rel=0.05)
