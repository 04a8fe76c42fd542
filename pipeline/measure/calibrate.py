"""Calibration: fit the simulator's cost model from measured stage timelines, and scale it.

Owns reading a measured run's timeline (the JSON of `launch`/`bench`: slices with stage, batch,
start/end ns, items) into costs: per stage, the compute time of a one-token micro-batch (median)
and the extra time per additional token row (least squares through that base); the hop latency
(median gap between a micro-batch leaving stage i and starting on stage i + 1 when that stage was
idle); the coordinator turnaround (median gap between a single sequence's result and its next
micro-batch starting on stage 0, less two hops); the exit head's cost (stage 0's one-token
time with speculation less without); and the contention between stages computing at once
(one-token time with every stage busy over the time alone). Stage costs come from one-sequence
runs where there are any, so they are uncontended. Also the recorded draft outcomes, for replayed acceptance.
Pure: dicts in, `CostModel`s out.

The table-driven terms of the cost model: [Note: table calibration] in pipeline/measure/calibrate_tables.py.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Iterable, Sequence

from pipeline.measure.calibrate_tables import num_tokens as _num_tokens
from pipeline.measure.calibrate_tables import with_tables
from pipeline.measure.cost_model import CostModel
from pipeline.measure.row_cost import RowCostTable


@dataclasses.dataclass(frozen=True)
class StageFit:
    """Compute time of one stage: base_s for one token row, per_token_s for each further row."""

    base_s: float
    per_token_s: float


def fit_stages(timelines: Iterable[dict], num_stages: int) -> list[StageFit]:
    """Per-stage fit over every slice of `timelines` (all with `num_stages` stages). Raises
    ValueError when a stage has no one-token slice (no decode was measured)."""
    by_stage: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
    for tl in timelines:
        for s in tl["slices"]:
            by_stage[s["stage"]].append((_num_tokens(s), (s["end_ns"] - s["start_ns"]) / 1e9))
    fits = []
    for stage in range(num_stages):
        points = by_stage.get(stage, [])
        ones = [d for n, d in points if n == 1]
        if not ones:
            raise ValueError(f"calibration: stage {stage} of {num_stages} has no one-token (decode) slice")
        base = statistics.median(ones)
        more = [(n - 1, d - base) for n, d in points if n > 1]
        den = sum(x * x for x, _ in more)
        per_token = max(0.0, sum(x * y for x, y in more) / den) if den else 0.0
        fits.append(StageFit(base, per_token))
    return fits


def hop_latency_s(timelines: Iterable[dict]) -> float | None:
    """Median stage i -> i + 1 hand-over gap of micro-batches that found stage i + 1 idle; None if
    there is no such hand-over (one-stage runs)."""
    gaps = []
    for tl in timelines:
        by_batch = collections.defaultdict(dict)
        last_end: dict[int, list[int]] = collections.defaultdict(list)
        for s in tl["slices"]:
            by_batch[s["batch"]][s["stage"]] = s
            last_end[s["stage"]].append(s["end_ns"])
        for stage_slices in by_batch.values():
            for stage, s in stage_slices.items():
                nxt = stage_slices.get(stage + 1)
                if nxt is None:
                    continue
                busy_until = max((e for e in last_end[stage + 1] if e <= nxt["start_ns"]), default=0)
                if busy_until <= s["end_ns"]:  # the next stage was idle when the hand-over began
                    gaps.append((nxt["start_ns"] - s["end_ns"]) / 1e9)
    return statistics.fmean(gaps) if gaps else None


def ring_turnaround_s(timelines: Iterable[dict]) -> float | None:
    """Median gap from a micro-batch's last-stage end to the next micro-batch's stage-0 start, in
    single-sequence runs without drafts (result -> coordinator -> next item); None if none."""
    gaps = []
    for tl in timelines:
        batches = collections.defaultdict(dict)
        for s in tl["slices"]:
            batches[s["batch"]][s["stage"]] = s
        seqs = {it["seq_id"] for b in batches.values() for s in b.values() for it in s["items"]}
        kinds = {it["kind"] for b in batches.values() for s in b.values() for it in s["items"]}
        if len(seqs) != 1 or "draft" in kinds:
            continue
        last = tl["num_stages"] - 1
        order = sorted(batches)
        for a, b in zip(order, order[1:], strict=False):
            if last in batches[a] and 0 in batches[b]:
                gaps.append((batches[b][0]["start_ns"] - batches[a][last]["end_ns"]) / 1e9)
    return statistics.fmean(gaps) if gaps else None


def draft_outcomes(timeline: dict) -> list[bool]:
    """Verified draft outcomes of a run, in order (True = accepted): per sequence and epoch, drafts
    in position order up to and including the first squashed one (later drafts of that epoch were
    squashed with it, unverified)."""
    drafts: dict[tuple[int, int, int], tuple[int, bool]] = {}
    for s in timeline["slices"]:
        for it in s["items"]:
            if it["kind"] == "draft":
                key = (it["seq_id"], it["epoch"], it["positions"][0])
                drafts.setdefault(key, (s["batch"], it["outcome"] == "committed"))
    chains: dict[tuple[int, int], list[tuple[int, int, bool]]] = collections.defaultdict(list)
    for (seq, epoch, pos), (batch, ok) in drafts.items():
        chains[(seq, epoch)].append((batch, pos, ok))
    out: list[tuple[int, bool]] = []
    for chain in chains.values():
        for batch, _, ok in sorted(chain, key=lambda c: c[1]):
            out.append((batch, ok))
            if not ok:
                break
    return [ok for _, ok in sorted(out)]


def draft_positions(timeline: dict) -> list[dict[int, bool]]:
    """Where a run drafted, per sequence (in sequence-id order): position -> whether a draft item
    there was committed (a draft squashed behind an earlier wrong one and drafted again in the
    next epoch counts as right if that one was). The record of
    `pipeline.measure.sim_acceptance.DraftsAt`."""
    out: dict[int, dict[int, bool]] = collections.defaultdict(dict)
    for s in timeline["slices"]:
        for it in s["items"]:
            if it["kind"] == "draft":
                here = out[it["seq_id"]]
                here[it["positions"][0]] = here.get(it["positions"][0], False) or it["outcome"] == "committed"
    seqs = sorted({it["seq_id"] for s in timeline["slices"] for it in s["items"]})
    return [out.get(seq, {}) for seq in seqs]


def firp_chains(timeline: dict) -> list[list[tuple[int, int]]]:
    """A FIRP run's recorded chains, per sequence (in sequence-id order), in position order: for
    every decode or FIRP item, (drafts it carried, drafts of it accepted), the accepted ones being
    those its successor starts after, or for the last item, those before the sequence's last token
    (from the timeline's commits; without them the last item is left out); a decode item: (0, 0).
    The replay record of `pipeline.engine.simulator.FirpReplay`: item i's pair says what item
    i - 1's result drafted. Valid for `--speculate firp` runs only: with SPEED drafts and squashes
    in between (speed+firp), an item's successor does not tell its accepted drafts."""
    firsts: dict[tuple[int, int, int], dict] = {}
    for s in timeline["slices"]:
        if s["stage"] == 0:
            for it in s["items"]:
                firsts.setdefault((it["seq_id"], it["epoch"], it["positions"][0]), it)
    by_seq: dict[int, list[tuple[int, dict]]] = collections.defaultdict(list)
    for (seq, _, start), it in firsts.items():
        by_seq[seq].append((start, it))
    generated = collections.Counter(seq for _, seq, _ in timeline.get("commits", ()))
    out = []
    for seq in sorted(by_seq):
        items = sorted(by_seq[seq], key=lambda x: x[0])
        prompt = next((it["positions"][1] for _, it in items if it["kind"] == "prefill"), None)
        last = prompt + generated[seq] - 1 if prompt is not None and generated[seq] else None  # last token's position
        nexts = [nxt for nxt, _ in items[1:]] + [last]
        chains = []
        for (start, it), nxt in zip(items, nexts, strict=True):
            if it["kind"] in ("decode", "firp") and nxt is not None:
                length = it["positions"][1] - start - 1 if it["kind"] == "firp" else 0
                chains.append((length, max(0, min(length, nxt - start - 1))))
        out.append(chains)
    return out


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Costs fitted from a measured sweep: stage fits per measured stage count, hop latency,
    coordinator turnaround and exit-head cost, all in seconds; with stage_tables, the terms of
    [Note: table calibration] (per measured stage count: a row-cost table and a pseudo-row cost per stage)."""

    stage_fits: dict[int, list[StageFit]]
    hop_latency_s: float
    coordinator_s: float
    predictor_s: float
    contention: float = 0.0
    stage_tables: dict[int, list[RowCostTable]] = dataclasses.field(default_factory=dict)
    pseudo_row_s: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    exit_row_s: float = 0.0
    exit_event_s: float | None = None
    contention_rows: tuple[tuple[int, float], ...] = ()
    pass_shapes: dict[int, tuple[tuple[tuple[int, int, float], ...], ...]] = dataclasses.field(default_factory=dict)

    def cost_model(self, num_stages: int) -> CostModel:
        """The measured stage costs for a measured stage count; otherwise scaled (see `scaled_fits`,
        `scaled_tables`) with no contention: the measured contention is between stages sharing this
        host's CPUs and memory, while an unmeasured stage count stands for one device per stage."""
        measured = num_stages in self.stage_fits
        fits = self.stage_fits[num_stages] if measured else scaled_fits(self.stage_fits, num_stages)
        tables, pseudo = (), ()
        if self.stage_tables:
            tables = tuple(self.stage_tables[num_stages] if measured else scaled_tables(self.stage_tables, num_stages))
            pseudo = tuple(self.pseudo_row_s.get(num_stages) or _spread(self.pseudo_row_s, num_stages))
        return CostModel(stage_base_s=tuple(max(0.0, f.base_s - f.per_token_s) for f in fits),
                         stage_per_token_s=tuple(f.per_token_s for f in fits), stage_tables=tables,
                         pseudo_row_s=pseudo, hop_latency_s=self.hop_latency_s, coordinator_s=self.coordinator_s,
                         predictor_s=self.predictor_s, exit_row_s=self.exit_row_s, exit_event_s=self.exit_event_s,
                         contention=self.contention if measured else 0.0,
                         contention_rows=self.contention_rows if measured else (),
                         pass_shapes=self.pass_shapes.get(num_stages, ()))

    def to_json(self) -> dict:
        return {"stage_fits": {str(k): [dataclasses.asdict(f) for f in v] for k, v in self.stage_fits.items()},
                "hop_latency_s": self.hop_latency_s, "coordinator_s": self.coordinator_s,
                "predictor_s": self.predictor_s, "contention": self.contention,
                "stage_tables": {str(k): [t.to_json() for t in v] for k, v in self.stage_tables.items()},
                "pseudo_row_s": {str(k): v for k, v in self.pseudo_row_s.items()},
                "exit_row_s": self.exit_row_s, "exit_event_s": self.exit_event_s,
                "contention_rows": [list(p) for p in self.contention_rows],
                "pass_shapes": {str(k): [[list(x) for x in st] for st in v] for k, v in self.pass_shapes.items()}}


def scaled_tables(tables: dict[int, list[RowCostTable]], num_stages: int) -> list[RowCostTable]:
    """Row-cost tables for an unmeasured stage count, as `scaled_fits`: at every row count, the
    smallest measured count's total split evenly, plus the per-stage overhead (slope of the 1-row
    totals over the measured counts, clamped at 0)."""
    counts = sorted(tables)
    rows = sorted({n for t in tables[counts[0]] for n in t.num_rows})
    one = {s: sum(t.cost_s(1) for t in tables[s]) for s in counts}
    overhead = max(0.0, (one[counts[-1]] - one[counts[0]]) / (counts[-1] - counts[0])) if len(counts) >= 2 else 0.0
    per_stage = [max(1e-9, (sum(t.cost_s(n) for t in tables[counts[0]]) - counts[0] * overhead) / num_stages + overhead)
                 for n in rows]
    return [RowCostTable(mode="fitted", num_rows=tuple(rows), pass_s=tuple(per_stage))] * num_stages


def _spread(per_count: dict[int, list[float]], num_stages: int) -> list[float]:
    """A per-stage cost of an unmeasured stage count: a measured count's total, split evenly."""
    if not per_count:
        return []
    measured = per_count[max(per_count)]
    return [sum(measured) / num_stages] * num_stages


def scaled_fits(stage_fits: dict[int, list[StageFit]], num_stages: int) -> list[StageFit]:
    """Stage costs for an unmeasured stage count: the model's total compute split evenly, plus a
    fixed per-stage overhead. With two or more measured counts the overhead is the slope of total
    one-token time over stages (clamped at 0); with one, there is none."""
    counts = sorted(stage_fits)
    totals = {s: sum(f.base_s for f in stage_fits[s]) for s in counts}
    per_tok = {s: sum(f.per_token_s for f in stage_fits[s]) for s in counts}
    overhead = 0.0
    if len(counts) >= 2:
        overhead = max(0.0, (totals[counts[-1]] - totals[counts[0]]) / (counts[-1] - counts[0]))
    compute = totals[counts[0]] - counts[0] * overhead
    return [StageFit(compute / num_stages + overhead, per_tok[counts[0]] / num_stages)] * num_stages


def calibrate(runs: Sequence[dict], *, row_shape: RowCostTable | None = None) -> Calibration:
    """Fit from measured runs: [{"num_stages", "speculate", "timeline", optional "concurrency" and
    "exit_head" (whether its predictor ran an exit head)}]. The exit head's cost comes from stage-0
    slices that ran while no other stage computed. row_shape: a measured row-cost table (row_cost.py,
    `--row-cost calibrate`) whose ratios price the row counts the runs did not measure
    ([Note: table calibration]). Raises ValueError if no run has decode slices."""
    if not runs:
        raise ValueError("calibration needs at least one measured run")
    plain = [r for r in runs if r["speculate"] == "none"] or list(runs)
    fits = {}
    for s in sorted({r["num_stages"] for r in plain}):
        mine = [r for r in plain if r["num_stages"] == s]
        alone = [r for r in mine if r.get("concurrency", 1) == 1] or mine  # uncontended compute if measured
        fits[s] = fit_stages([r["timeline"] for r in alone], s)
    contention = _contention(plain, fits)
    hop = hop_latency_s(r["timeline"] for r in plain) or 0.0
    ring = ring_turnaround_s(r["timeline"] for r in plain)
    coordinator = max(0.0, ring - 2 * hop) if ring is not None else 0.0
    extra = []
    for r in runs:
        if r["speculate"] != "none" and r.get("exit_head", True) and r["num_stages"] in fits:
            ones = [d for d, n, alone in _stage_slices(r["timeline"], 0) if n == 1 and alone]
            if ones:
                extra.append(statistics.median(ones) - fits[r["num_stages"]][0].base_s)
    cal = Calibration(fits, hop, coordinator, max(0.0, statistics.median(extra)) if extra else 0.0, contention)
    return with_tables(cal, runs, row_shape=row_shape)


def _stage_slices(timeline: dict, stage: int) -> list[tuple[float, int, bool]]:
    """(seconds, token rows, ran alone: no other stage computed during it) of each slice of `stage`."""
    others = sorted((s["start_ns"], s["end_ns"]) for s in timeline["slices"] if s["stage"] != stage)
    out = []
    for s in timeline["slices"]:
        if s["stage"] != stage:
            continue
        alone = not any(a < s["end_ns"] and b > s["start_ns"] for a, b in others)
        out.append(((s["end_ns"] - s["start_ns"]) / 1e9, _num_tokens(s), alone))
    return out


def _contention(plain: Sequence[dict], fits: dict[int, list[StageFit]]) -> float:
    """Slow-down per other busy stage: one-token stage time in runs with at least as many sequences
    as stages (all stages busy at once) over the fitted uncontended time, less 1, over (S - 1)."""
    values = []
    for r in plain:
        s = r["num_stages"]
        if s < 2 or r.get("concurrency", 1) < s:
            continue
        for stage in range(s):
            ones = [(x["end_ns"] - x["start_ns"]) / 1e9 for x in r["timeline"]["slices"]
                    if x["stage"] == stage and _num_tokens(x) == 1]
            if ones:
                values.append((statistics.median(ones) / fits[s][stage].base_s - 1) / (s - 1))
    return max(0.0, statistics.median(values)) if values else 0.0
