"""Measured cost of a stage pass by its number of rows, and how many draft rows that makes worth sending.

Owns `RowCostTable` (seconds of a decode-style pass with n real rows, optionally with FIRP pseudo
rows, measured on the machine in one numeric mode; JSON round trip), `measure_row_costs` (the short
calibration that fills it, also run by tests/benchmarks/row_cost.py), and `best_firp_k` / `best_run_ahead`,
the pure rule "send as many draft rows as maximise expected committed tokens per second" (for FIRP
chains whose pseudo rows ride along, and for SPEED's run-ahead depth). Must not: drive the scheduler
(it asks this module) or know about processes.

[Note: rows worth sending]
A pass of n rows verifies a chain of n - 1 drafts after one real token. With p_i the calibrated
probability that draft i is right given drafts 1..i-1 were, the expected tokens committed by the
pass are 1 + sum_{i=1}^{n-1} prod_{j<=i} p_j (the real token, then the accepted prefix). The best
n maximises that over cost(n) from the table. When extra rows are nearly free (AMX bf16, int4
kernels, GPUs) long chains pay even at low p; in float32 on CPU, where 8 rows cost ~2x one row,
they do not. Source: the speculative-decoding speed-up analysis of Leviathan et al. (arXiv
2211.17192 §3.3), with the measured cost curve in place of their constant c.

[Note: run-ahead depth]
SPEED keeps up to d items of one sequence in flight: the real item and d - 1 drafts behind it
(`max_inflight`). One revolution of the pipeline (S stage-steps of c = cost(1), the real item's
round trip) commits 1 + a + ... + a^(d-1) tokens on average at acceptance a (each draft counts
only while every draft before it was right; `expected_tokens`). Its costs: a rejection makes the
real token wait behind the stale item ahead of it (about one more stage-step: (1 - a^(d-1)) c per
revolution), and every draft row that shares a pass with `shared_rows` other rows lengthens that
pass on every stage by cost(r + 1) - cost(r) (S of them per draft). A draft alone in its pass runs
in stage time the real item leaves idle and costs no wall time beyond the squash. `best_run_ahead`
picks the d in 1..max_depth with the most expected tokens per second; with a = 0 or costly shared
rows it is 1, with a high a and cheap rows it is max_depth. d = 2 beats d = 1 alone in the pipeline
when a > 1 / (S + 1), close to 1 / S, the draft gate's break-even if a rejection cost one stage-step
([Note: adaptive drafting] in pipeline/speculation/draft_gate.py).

[Note: combining stage tables]
Each stage times its own passes at start-up (pipeline/measure/stage_calibration.py). The
pipeline's table is the per-row-count *sum* over stages: a speculating sequence's pass (a FIRP
chain, a draft chain) runs through every stage one after the other, so what its rows cost is the
whole pipeline's latency, not one stage's. The slowest stage (a max) bounds a full pipeline's
throughput, but a full pipeline sends no drafts ([Note: exit-head skipping] in
pipeline/engine/row_budget.py), so the sum is the cost the rules above trade against.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipeline.model.row_layout import Span


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowCostTable:
    """Median seconds of one pass by number of real rows (no pseudo rows), in one numeric `mode`.

    num_rows: ascending row counts measured, starting at 1; pass_s: seconds of each.
    Raises ValueError when empty, unsorted, not starting at 1, or with a non-positive time.
    """

    mode: str
    num_rows: tuple[int, ...]
    pass_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.num_rows or self.num_rows[0] != 1 or len(self.num_rows) != len(self.pass_s):
            raise ValueError(f"row-cost table needs times for 1, ... rows, got rows {self.num_rows}")
        if list(self.num_rows) != sorted(set(self.num_rows)) or min(self.pass_s) <= 0:
            raise ValueError(f"row-cost table rows must ascend and times be > 0: {self.num_rows}, {self.pass_s}")

    def cost_s(self, num_rows: int) -> float:
        """Seconds of a pass with `num_rows` (>= 1) rows: linear between measured points, and beyond
        the last one along the last segment's slope."""
        if num_rows < 1:
            raise ValueError(f"a pass has at least 1 row, got {num_rows}")
        rows, secs = self.num_rows, self.pass_s
        if len(rows) == 1:
            return secs[0] * num_rows
        for i in range(1, len(rows)):
            if num_rows <= rows[i] or i == len(rows) - 1:
                lo, hi = i - 1, i
                slope = (secs[hi] - secs[lo]) / (rows[hi] - rows[lo])
                return max(secs[0], secs[lo] + slope * (num_rows - rows[lo]))
        raise AssertionError("unreachable")

    def ratio(self, num_rows: int) -> float:
        """cost_s(num_rows) / cost_s(1)."""
        return self.cost_s(num_rows) / self.pass_s[0]

    def to_json(self) -> dict:
        return {"mode": self.mode, "num_rows": list(self.num_rows), "pass_s": list(self.pass_s)}

    @classmethod
    def from_json(cls, data: dict) -> RowCostTable:
        """Inverse of `to_json`. Raises ValueError for a malformed table."""
        try:
            return cls(mode=str(data["mode"]), num_rows=tuple(int(n) for n in data["num_rows"]),
                       pass_s=tuple(float(s) for s in data["pass_s"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed row-cost table: {err!r}") from None

    @classmethod
    def load(cls, path: str | Path, mode: str) -> RowCostTable:
        """The table of `mode` from a row_cost.py JSON report. Raises ValueError when it has none."""
        tables = json.loads(Path(path).read_text())["tables"]
        for t in tables:
            if t["mode"] == mode:
                return cls.from_json(t)
        raise ValueError(f"{path} has no row-cost table for mode {mode!r} (has {[t['mode'] for t in tables]})")


def numeric_mode_name(*, dtype: str, quantization: str, dense_layout: str = "reference") -> str:
    """A numeric mode's name in row-cost tables: fp32 / bf16 / fp16 for dense weights in that dtype
    ("float32", "bfloat16", "float16"), fp32-fast for float32 with `--dense-layout fast` (its
    passes cost differently: [Note: dense layout]), else the quantization (int8, int4, auto)."""
    if quantization != "none":
        return quantization
    name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{name}-fast" if dense_layout == "fast" else name


def ratio_line(table: RowCostTable, rows: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    """One line with the table's cost ratios to one row, e.g. "1/2/4/8 rows = 1.00/1.10/1.31/1.62x"."""
    shown = [n for n in rows if n <= table.num_rows[-1]]
    return (f"{'/'.join(map(str, shown))} rows = {'/'.join(f'{table.ratio(n):.2f}' for n in shown)}x one row "
            f"({table.pass_s[0] * 1e3:.2f} ms, {table.mode})")


def expected_tokens(probs: Sequence[float], num_drafts: int) -> float:
    """Expected committed tokens of a pass verifying the first `num_drafts` drafts of a chain whose
    conditional acceptance probabilities are `probs` ([Note: rows worth sending])."""
    total, alive = 1.0, 1.0
    for p in probs[:num_drafts]:
        alive *= p
        total += alive
    return total


def best_run_ahead(table: RowCostTable, alpha: float, *, num_stages: int, max_depth: int,
                   shared_rows: int = 0) -> int:
    """Items of one sequence to keep in flight (1 = no run-ahead draft) that maximise expected
    committed tokens per second ([Note: run-ahead depth]). alpha: measured draft acceptance in
    [0, 1]; shared_rows: rows of other items a draft's pass carries (0: the draft runs alone).
    Raises ValueError for alpha outside [0, 1], num_stages < 1 or max_depth < 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
    if num_stages < 1 or max_depth < 1:
        raise ValueError(f"num_stages and max_depth must be >= 1, got {num_stages}, {max_depth}")
    step = table.cost_s(1)
    row = table.cost_s(shared_rows + 1) - table.cost_s(shared_rows) if shared_rows else 0.0

    def rate(d: int) -> float:
        squash = (1.0 - alpha ** (d - 1)) * step
        return expected_tokens([alpha] * (d - 1), d - 1) / (num_stages * step + squash + (d - 1) * num_stages * row)

    return max(range(1, max_depth + 1), key=lambda d: (rate(d), -d))


def combine_stage_tables(tables: Sequence[RowCostTable]) -> RowCostTable:
    """The pipeline's table from every stage's own ([Note: combining stage tables]): per row count
    measured by all stages, the sum of their seconds. Raises ValueError for no tables, tables of
    different modes, or no common row counts."""
    if not tables:
        raise ValueError("combining row-cost tables needs at least one stage table")
    modes = {t.mode for t in tables}
    if len(modes) != 1:
        raise ValueError(f"stage row-cost tables disagree on the numeric mode: {sorted(modes)}")
    rows = sorted(set.intersection(*(set(t.num_rows) for t in tables)))
    secs = [sum(t.pass_s[t.num_rows.index(n)] for t in tables) for n in rows]
    return RowCostTable(mode=tables[0].mode, num_rows=tuple(rows), pass_s=tuple(secs))


def firp_pass_rows(k: int, *, pseudo_weight: float = 1.0) -> float:
    """Row-equivalents of a steady-state FIRP verify pass with chain length k: 1 + k real rows
    (the committed token and k drafts), each anchoring k pseudo rows, a pseudo row counting
    `pseudo_weight` of a real one (the share of the stage's layers it runs through)."""
    return 1 + k + pseudo_weight * (1 + k) * k


def best_firp_k(table: RowCostTable, probs: Sequence[float], *, max_k: int, pseudo_weight: float = 1.0) -> int:
    """FIRP chain length (0 = no chain) that maximises expected committed tokens per second of
    steady-state FIRP passes ([Note: rows worth sending]; rows from `firp_pass_rows`), at most
    `max_k` and len(probs). probs: conditional acceptance of draft depth 1, 2, ... Raises
    ValueError for max_k < 0, a p outside [0, 1] or pseudo_weight outside (0, 1]."""
    if max_k < 0:
        raise ValueError(f"max_k must be >= 0, got {max_k}")
    if any(not 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"acceptance probabilities must be in [0, 1], got {list(probs)}")
    if not 0.0 < pseudo_weight <= 1.0:
        raise ValueError(f"pseudo_weight must be in (0, 1], got {pseudo_weight}")

    def cost(k: int) -> float:  # cost_s takes whole rows: interpolate between the neighbours
        rows = firp_pass_rows(k, pseudo_weight=pseudo_weight)
        lo = int(rows)
        return table.cost_s(lo) + (rows - lo) * (table.cost_s(lo + 1) - table.cost_s(lo))

    rates = [expected_tokens(probs, k) / cost(k) for k in range(min(max_k, len(probs)) + 1)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def measure_row_costs(run_pass: Callable[[int, int], None], shapes: Sequence[tuple[int, int]], *,
                      repeats: int, clock: Callable[[], float] = time.perf_counter,
                      reduce: Callable[[list[float]], float] = statistics.median) -> dict[tuple[int, int], float]:
    """Median (or `reduce`, e.g. min) seconds of `run_pass(num_rows, firp_k)` per shape, shapes
    interleaved repeat by repeat (drift hits every shape alike); the first round warms up and is
    dropped. clock: wall time by default; `time.thread_time` (CPU seconds of this thread) on a
    machine shared with other jobs, where wall time mostly measures how long the thread waited for a core."""
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for r in range(repeats + 1):
        for shape in shapes:
            start = clock()
            run_pass(*shape)
            if r:
                times[shape].append(clock() - start)
    return {shape: reduce(ts) for shape, ts in times.items()}


def decode_pass(model, kv, *, context: int, make_pseudo=None, firp_layer: int | None = None,
                all_logits: bool = False, sync=None):
    """A `run_pass` for `measure_row_costs`: n rows after `context` cached positions of slot 0 of
    `kv` (the context must be cached already); k > 0 adds a FIRP chain of k pseudo rows to every row,
    made by `make_pseudo(anchor_hidden, k)` at `firp_layer`. A first stage gets token ids, any other
    random hidden states [n, hidden_size] in the dtype of its parameters (its activation dtype in
    every numeric mode: bfloat16 for int weights). all_logits: a last stage scores every row (a
    verify pass), not only the last; sync: called after the pass (e.g. torch.cuda.synchronize, so
    that the clock sees the device's work)."""
    weight = next(iter(model.parameters()))

    def run(num_rows: int, k: int) -> None:
        kv.set_length(0, context)
        if model.is_first:
            x = torch.arange(num_rows, device=weight.device) + 100
        else:
            x = torch.randn(num_rows, model.config.hidden_size, generator=torch.Generator().manual_seed(num_rows)
                            ).to(device=weight.device, dtype=weight.dtype)
        extra = {}
        if k:
            extra = {"firp_layer": firp_layer, "make_pseudo": lambda h: make_pseudo(h, k)}
        if all_logits and model.is_last:
            extra["logit_rows"] = torch.arange(num_rows, device=weight.device)
        span = Span(0, context, num_rows, num_anchors=num_rows if k else 0, chain_len=k)
        model.forward_rows(x, [span], kv, **extra)
        if sync is not None:
            sync()
    return run
