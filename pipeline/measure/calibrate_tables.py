"""Calibration of the table-driven terms of the simulator's cost model from measured timelines.

Owns what `pipeline.measure.calibrate.calibrate` adds on top of its linear fit (`with_tables`):
per-stage row-cost tables, the exit head per item, FIRP pseudo rows, the exit event's delay and a
run's own load. Pure: dicts in, numbers and `RowCostTable`s out. Must not: simulate.

[Note: table calibration]
On top of its linear fit (base + per-token slope), `calibrate` (pipeline/measure/calibrate.py)
fits the terms of [Note: stage pass cost] (pipeline/measure/cost_model.py), which the cost models
it returns use:
- per stage, a row-cost table from the plain runs' slices by their number of real rows
  (`fit_stage_tables`), so 2-row decode steps of two-prompt runs and prompt-length prefills price
  multi-row passes as measured; row counts no run measured (a FIRP pass's 3 rows) take their
  ratio to one row from a measured row-cost table when one is given (`shaped`: `simulate
  --row-cost file:PATH`, a tests/benchmarks/row_cost.py report);
- the exit head per item that wants a guess (`want_exit` in the timeline): the median over
  stage-0 slices of (slice time less the table's) / those items (replaces the per-batch
  `predictor_s`);
- per stage, the cost of a FIRP pseudo row, the same way over the FIRP runs' pseudo rows;
- the exit event's delay: median gap from stage 0 finishing a chain end to it starting the draft
  after it, in exit-head runs, when stage 0 stayed idle and no result came back in between (a
  result could have been what freed room for the draft), less the send hop;
- per stage, the time of each FIRP pass shape (real rows, pseudo rows) measured often enough
  (`fit_pass_shapes`), from one-sequence runs if there are any: a 3-row point taken from the
  row-cost table's ratios is off by ~5 %, which the pseudo-row cost cannot absorb on every stage;
- the contention of those shapes (`fit_contention_rows`), from the runs that keep every stage busy:
  a 9-row FIRP pass slowed by ~14 % with the other stage busy, where a 1-row pass slows by ~2 %;
- per run, its load (`run_load_factor`): on a machine shared with other jobs one repeat of a
  configuration can run 3x slower than the next, so every fit above divides each run's times by
  it, and `simulate --calibrate` reports the prediction of each run both at the fitted costs and
  at its own load (the costs `scaled` by it): the second tests the model of the pipeline, the
  first also how steady the machine was.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

from pipeline.measure.row_cost import RowCostTable


def num_tokens(slice_: dict) -> int:
    """Real token rows of a recorded slice (the sum of its items' position spans)."""
    return sum(it["positions"][1] - it["positions"][0] for it in slice_["items"])



def with_tables(cal, runs: Sequence[dict], *, row_shape: RowCostTable | None = None):
    """`cal` (a pipeline.measure.calibrate.Calibration) with the terms of [Note: table calibration]
    fitted from `runs` (its per-batch predictor_s then 0: the exit head is priced per item);
    row_shape: see `shaped`."""
    c = cal.contention
    plain = [r for r in runs if r["speculate"] == "none"] or list(runs)
    tables = {}
    for s in cal.stage_fits:  # one-sequence runs first: their passes are uncontended
        mine = sorted((r for r in plain if r["num_stages"] == s), key=lambda r: r.get("concurrency", 1) > 1)
        tls, primary = [r["timeline"] for r in mine], [r.get("concurrency", 1) == 1 for r in mine]
        first = fit_stage_tables(tls, s, contention=c, primary=primary)  # again with each run's load divided out
        first = [shaped(t, row_shape) for t in first]
        tables[s] = [shaped(t, row_shape) for t in fit_stage_tables(
            tls, s, contention=c, primary=primary, loads=[run_load_factor(t, first) for t in tls])]
    load = {id(r): run_load_factor(r["timeline"], tables[r["num_stages"]], contention=c)
            for r in runs if r["num_stages"] in tables}
    pseudo = {}
    for s, ts in tables.items():
        firp = [r for r in runs if r["num_stages"] == s and "firp" in r["speculate"]]
        pseudo[s] = [_through_origin([pt for r in firp for pt in _residuals(
            r["timeline"], stage, t, c, lambda it: it.get("num_pseudo", 0), load=load[id(r)])])
            for stage, t in enumerate(ts)]
    heads = [r for r in runs if r["speculate"] != "none" and r.get("exit_head", True) and r["num_stages"] in tables]
    points = []
    for r in heads:
        legacy = not any("want_exit" in it for sl in r["timeline"]["slices"] for it in sl["items"])
        points += _residuals(r["timeline"], 0, tables[r["num_stages"]][0], c, load=load[id(r)],
                             count=lambda it, legacy=legacy: it.get("want_exit", legacy and it["kind"] in ("decode", "draft")))
    gaps = [g for r in heads for g in draft_round_trips_s(r["timeline"])]
    exit_event = max(0.0, statistics.fmean(gaps) - cal.hop_latency_s) if gaps else None
    shapes = {}
    for s in tables:  # FIRP pass shapes, from one-sequence runs if any: their passes are uncontended
        firp = [r for r in runs if r["num_stages"] == s and "firp" in r["speculate"]]
        alone = [r for r in firp if r.get("concurrency", 1) == 1] or firp
        shapes[s] = fit_pass_shapes([r["timeline"] for r in alone], s, loads=[load[id(r)] for r in alone])
    full = [r for r in runs if r["num_stages"] in shapes and 2 <= r["num_stages"] <= r.get("concurrency", 1)]
    rows = fit_contention_rows([r["timeline"] for r in full], [shapes[r["num_stages"]] for r in full],
                               loads=[load[id(r)] for r in full])
    return dataclasses.replace(cal, predictor_s=0.0 if points else cal.predictor_s, stage_tables=tables,
                               pseudo_row_s=pseudo, exit_row_s=_through_origin(points), exit_event_s=exit_event,
                               pass_shapes={s: v for s, v in shapes.items() if any(v)}, contention_rows=rows)


MIN_SHAPE_SLICES = 5  # uncontended passes of one (real, pseudo) shape on one stage, for its own cost
MIN_CONTENTION_SLICES = 8  # contended passes of one row count, for its own contention


def _shape(slice_: dict) -> tuple[int, int]:
    return num_tokens(slice_), sum(it.get("num_pseudo", 0) for it in slice_["items"])


def fit_pass_shapes(timelines: Sequence[dict], num_stages: int, *,
                    loads: Sequence[float]) -> tuple[tuple[tuple[int, int, float], ...], ...]:
    """Per stage, ((real rows, pseudo rows, seconds), ...): the median time / load of the passes
    with FIRP pseudo rows and no exit-head item that started while no other stage computed, per
    shape with at least MIN_SHAPE_SLICES of them ([Note: stage pass cost])."""
    times: dict[tuple[int, int, int], list[float]] = collections.defaultdict(list)
    for tl, load in zip(timelines, loads, strict=True):
        for s, others in zip(tl["slices"], _busy_others(tl), strict=True):
            n, p = _shape(s)
            if p and not others and not any(it.get("want_exit") for it in s["items"]):
                times[(s["stage"], n, p)].append((s["end_ns"] - s["start_ns"]) / 1e9 / load)
    return tuple(tuple((n, p, statistics.median(v)) for (st, n, p), v in sorted(times.items())
                       if st == stage and len(v) >= MIN_SHAPE_SLICES) for stage in range(num_stages))


def fit_contention_rows(timelines: Sequence[dict], shapes: Sequence[tuple], *,
                        loads: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """Contention of the measured multi-row pass shapes ([Note: stage pass cost]): over the passes
    of a shape of `shapes` (per timeline, `fit_pass_shapes` of its stage count) that started while
    other stages computed, in runs that keep every stage busy, (time / load / the shape's
    uncontended time - 1) / the stages computing; per rows = real + pseudo with at least
    MIN_CONTENTION_SLICES of them, the median, clamped at 0."""
    by_rows: dict[int, list[float]] = collections.defaultdict(list)
    for tl, per_stage, load in zip(timelines, shapes, loads, strict=True):
        known = {(stage, n, p): t for stage, st in enumerate(per_stage) for n, p, t in st}
        for s, others in zip(tl["slices"], _busy_others(tl), strict=True):
            n, p = _shape(s)
            alone = known.get((s["stage"], n, p))
            if others and alone and not any(it.get("want_exit") for it in s["items"]):
                by_rows[n + p].append(((s["end_ns"] - s["start_ns"]) / 1e9 / load / alone - 1) / others)
    return tuple((w, max(0.0, statistics.median(v))) for w, v in sorted(by_rows.items())
                 if w > 1 and len(v) >= MIN_CONTENTION_SLICES)


def _busy_others(timeline: dict) -> list[int]:
    """Per slice of `timeline`, how many other stages were computing when it started."""
    spans = [(s["stage"], s["start_ns"], s["end_ns"]) for s in timeline["slices"]]
    return [sum(1 for st, a, b in spans if st != stage and a <= start < b) for stage, start, _ in spans]


MIN_LOAD_SLICES = 3  # alone slices a run needs for its own load factor
MIN_CONTENDED_LOAD_SLICES = 16  # or slices in all, de-contended (a FIRP run's few plain ones are too noisy)
LINE_FROM_ROWS = 16  # above this many rows (prefills) a table's points come from a line fitted through them


def fit_stage_tables(timelines: Sequence[dict], num_stages: int, *, contention: float,
                     loads: Sequence[float] | None = None, primary: Sequence[bool] | None = None) -> list[RowCostTable]:
    """Per stage, the time by number of real rows of the slices without FIRP pseudo rows or
    exit-head items: per row count up to LINE_FROM_ROWS, the median of the `primary` timelines'
    slices of that count if they have any (one-sequence runs), else of the others'; of the slices
    that ran while no other stage computed, or if there are none, of all of them, each divided by
    (1 + contention x others computing at its start). Above it (prefills: few samples, one per
    prompt length), points on the least-squares line through those, so that extrapolation follows
    the trend, not the last two samples. loads: per timeline, a factor its times are divided by
    (`run_load_factor`). Raises ValueError when a stage has no one-row slice."""
    points: dict[int, dict[int, list[tuple[float, int]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for tl, load, first in zip(timelines, loads or [1.0] * len(timelines), primary or [True] * len(timelines),
                               strict=True):
        for s, others in zip(tl["slices"], _busy_others(tl), strict=True):
            if any(it.get("num_pseudo", 0) or it.get("want_exit") for it in s["items"]):
                continue
            points[s["stage"]][num_tokens(s)].append(((s["end_ns"] - s["start_ns"]) / 1e9 / load, others, first))
    tables = []
    for stage in range(num_stages):
        by_rows = points.get(stage, {})
        if 1 not in by_rows:
            raise ValueError(f"calibration: stage {stage} of {num_stages} has no one-token (decode) slice")
        small = {}
        for n, samples in by_rows.items():
            samples = [x for x in samples if x[2]] or samples
            alone = [d for d, others, _ in samples if not others]
            small[n] = statistics.median(alone or [d / (1 + contention * others) for d, others, _ in samples])
        large = sorted((n, d) for n, d in small.items() if n > LINE_FROM_ROWS)
        small = {n: d for n, d in small.items() if n <= LINE_FROM_ROWS}
        if large:
            top = max(small)
            slope, icpt = _line([(n, d) for n, d in large] + [(top, small[top])])
            for n in {large[0][0], large[-1][0]}:
                small[n] = max(small[top], icpt + slope * n)
        rows = sorted(small)
        tables.append(RowCostTable(mode="fitted", num_rows=tuple(rows), pass_s=tuple(max(1e-9, small[n]) for n in rows)))
    return tables


def shaped(table: RowCostTable, shape: RowCostTable | None) -> RowCostTable:
    """`table` (fitted from timelines) with a point at every row count of `shape` up to
    LINE_FROM_ROWS that it lacks, at its own 1-row cost x shape.ratio(n): decode runs measure 1
    row (and 2 with two prompts on one stage) and prefills, so a 3-row FIRP pass would otherwise be
    priced on the line from 1 row to a 50-row prefill, where a CPU's kernels say 1.9x, not 1.05x."""
    if shape is None:
        return table
    have = dict(zip(table.num_rows, table.pass_s, strict=True))
    for n in shape.num_rows:
        if n <= LINE_FROM_ROWS and n not in have:
            have[n] = table.pass_s[0] * shape.ratio(n)
    rows = sorted(have)
    return RowCostTable(mode=table.mode, num_rows=tuple(rows), pass_s=tuple(have[n] for n in rows))


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of (x, y) points; slope clamped at 0; a flat line through
    the mean if all x are equal."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / den) if den else 0.0
    return slope, my - slope * mx


def _residuals(timeline: dict, stage: int, table: RowCostTable, contention: float, count, *,
               load: float = 1.0) -> list[tuple[float, float]]:
    """(count of `count(item)` over the slice's items, its time / `load` less the table's for its
    real rows) for every slice of `stage` with a count > 0 that ran while no other stage computed,
    or, if there is none, for all of them, de-contended as in `fit_stage_tables`."""
    alone, contended = [], []
    for s, others in zip(timeline["slices"], _busy_others(timeline), strict=True):
        x = sum(int(count(it)) for it in s["items"])
        if s["stage"] == stage and x > 0:
            d = (s["end_ns"] - s["start_ns"]) / 1e9 / (1 + contention * others) / load
            (contended if others else alone).append((float(x), d - table.cost_s(max(1, num_tokens(s)))))
    return alone or contended


def run_load_factor(timeline: dict, tables: Sequence[RowCostTable], *, exit_stage: int = 0,
                    contention: float | None = None) -> float:
    """How much slower than `tables` one run's plain passes ran (other jobs on the machine): the
    median, over its slices without FIRP pseudo rows or (on `exit_stage`) exit-head items that ran
    while no other stage computed at all, of time / the table's cost at their real rows. With
    fewer than MIN_LOAD_SLICES of them (a full pipeline's stages always overlap) and `contention`
    given: over all such slices if there are MIN_CONTENDED_LOAD_SLICES, each de-contended as in
    `fit_stage_tables` (time / (1 + contention x others computing at its start)); else 1.0.
    A cost model `scaled` by it predicts that run under its own load ([Note: table calibration])."""
    spans = [(s["stage"], s["start_ns"], s["end_ns"]) for s in timeline["slices"]]
    alone, contended = [], []
    for s, others in zip(timeline["slices"], _busy_others(timeline), strict=True):
        extra = any(it.get("num_pseudo", 0) or (s["stage"] == exit_stage and it.get("want_exit")) for it in s["items"])
        if extra or s["stage"] >= len(tables):
            continue
        ratio = (s["end_ns"] - s["start_ns"]) / 1e9 / tables[s["stage"]].cost_s(max(1, num_tokens(s)))
        if any(st != s["stage"] and a < s["end_ns"] and b > s["start_ns"] for st, a, b in spans):
            contended.append(ratio / (1 + (contention or 0.0) * others))
        else:
            alone.append(ratio)
    if len(alone) >= MIN_LOAD_SLICES:
        return statistics.median(alone)
    if contention is not None and len(alone) + len(contended) >= MIN_CONTENDED_LOAD_SLICES:
        return statistics.median(alone + contended)
    return 1.0


def _through_origin(points: Sequence[tuple[float, float]]) -> float:
    """Slope through the origin of (x > 0, y) points: the median of y / x (robust to the slow
    passes of a loaded machine, which a least-squares fit follows), clamped at 0 (0 for none)."""
    return max(0.0, statistics.median(y / x for x, y in points)) if points else 0.0


def draft_round_trips_s(timeline: dict, exit_stage: int = 0) -> list[float]:
    """Gaps from `exit_stage` finishing an item to stage 0 starting the draft that follows it (same
    sequence and epoch, the draft's first position = the item's end), where stage 0 started
    nothing and no result of that sequence came back in between ([Note: table calibration])."""
    last = timeline["num_stages"] - 1
    ends, starts0, results = {}, [], collections.defaultdict(list)
    for s in timeline["slices"]:
        for it in s["items"]:
            if s["stage"] == exit_stage:
                ends[(it["seq_id"], it["epoch"], it["positions"][1])] = s["end_ns"]
            if s["stage"] == last:
                results[it["seq_id"]].append(s["end_ns"])
        if s["stage"] == 0:
            starts0.append(s["start_ns"])
    gaps = []
    for s in timeline["slices"]:
        if s["stage"] != 0:
            continue
        for it in s["items"]:
            end = ends.get((it["seq_id"], it["epoch"], it["positions"][0])) if it["kind"] == "draft" else None
            if end is None or end > s["start_ns"]:
                continue
            busy = any(end < t < s["start_ns"] for t in starts0)
            freed = any(end < t <= s["start_ns"] for t in results[it["seq_id"]])
            if not busy and not freed:
                gaps.append((s["start_ns"] - end) / 1e9)
    return gaps
