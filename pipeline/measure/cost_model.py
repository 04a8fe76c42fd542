"""The simulator's cost model: what a stage pass, a hop, the coordinator and the exit head cost.

Owns `CostModel` (pure data and the arithmetic of one stage pass): the simulator
(pipeline/engine/simulator.py) asks it how long things take, the calibration
(pipeline/measure/calibrate.py) fills it from measured timelines. Must not: simulate or fit.

[Note: stage pass cost]
A stage's pass over a micro-batch costs, on stage i,
    rows(i, n) + pseudo_row_s[i] * p + exit_row_s * x (exit stage only) + predictor_s (exit stage, x > 0)
times (1 + c(n + p) * other stages computing when it starts), where n is its real token rows,
p its FIRP pseudo rows and x the items that want the exit head's guess (`Item.wants_exit_guess`).
rows(i, n) is the stage's measured row-cost table at n (`stage_tables[i]`, interpolated:
pipeline/measure/row_cost.py `RowCostTable.cost_s`) when there is one: on a CPU a 2-row pass can
cost 1.7x a 1-row pass while 8 rows cost 1.8x (the matmul kernels change with the shape), which a
line through the 1-row cost and a per-token slope fitted on prefills cannot follow. Without a
table it is the linear stage_base_s[i] + n * stage_per_token_s[i]. A pass shape (n, p) that a
calibration measured on stage i (`pass_shapes[i]`: FIRP's 3 real + 6 pseudo rows) costs what it
measured, in place of rows(i, n) + pseudo_row_s[i] * p. c(w) is the contention of a FIRP pass of w
rows (`contention_at`): at the row counts a calibration measured, their own (here a pass of 3 real
+ 6 pseudo rows slows by ~14 % with the other stage busy, a 1-row pass by ~2 %), linear from
`contention` at one row, flat beyond; a pass without pseudo rows keeps `contention`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from pipeline.measure.row_cost import RowCostTable


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Simulated costs, all in seconds ([Note: stage pass cost]).

    stage_base_s / stage_per_token_s: compute time of stage i on a micro-batch of n token rows is
        stage_base_s[i] + n * stage_per_token_s[i] (one entry per stage), unless stage_tables is given.
    stage_tables: per stage, the measured seconds of a pass by its number of real rows (replaces
        the linear model); () = none.
    pseudo_row_s: per stage, the extra seconds of each FIRP pseudo row it carries; () = free.
    hop_latency_s, hop_bandwidth_bytes_per_s, bytes_per_token: each hop (coordinator -> stage 0,
        stage i -> i + 1, last stage -> coordinator, exit stage -> coordinator) takes the latency;
        hops between stages, which carry n rows of hidden state, also n * bytes_per_token / bandwidth.
    coordinator_s: the coordinator's turnaround per result (verify, commit, next send); the
        coordinator is one thread, so results queue for it.
    predictor_s: extra compute on the exit stage for a micro-batch with non-prefill items that want
        the exit head (`Item.want_exit`) when speculating; exit_row_s: more per such item.
    exit_event_s: from the exit stage finishing an item to the engine seeing its exit event (the
        EXIT_GUESS hop and the coordinator's handling, the measured draft round trip less the send
        hop); None = one hop_s(0).
    contention: slow-down of a stage's compute per other stage computing when it starts (shared
        memory bandwidth or CPUs): time x (1 + contention * others busy), for a one-row pass.
    contention_rows: ((rows, contention), ...) sorted by rows > 1: the slow-down of passes of that
        many rows (real + pseudo), where measured; () = `contention` for every pass.
    pass_shapes: per stage, ((real rows, pseudo rows, seconds), ...): measured pass shapes; () = none.
    Raises ValueError on negative costs or mismatched lengths.
    """

    stage_base_s: tuple[float, ...]
    stage_per_token_s: tuple[float, ...]
    stage_tables: tuple[RowCostTable, ...] = ()
    pseudo_row_s: tuple[float, ...] = ()
    hop_latency_s: float = 0.0
    hop_bandwidth_bytes_per_s: float = math.inf
    bytes_per_token: int = 0
    coordinator_s: float = 0.0
    predictor_s: float = 0.0
    exit_row_s: float = 0.0
    exit_event_s: float | None = None
    contention: float = 0.0
    contention_rows: tuple[tuple[int, float], ...] = ()
    pass_shapes: tuple[tuple[tuple[int, int, float], ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.stage_base_s or len(self.stage_base_s) != len(self.stage_per_token_s):
            raise ValueError(f"cost model: {len(self.stage_base_s)} base costs for {len(self.stage_per_token_s)} "
                             "per-token costs (need one of each per stage, at least one stage)")
        for name in ("stage_tables", "pseudo_row_s", "pass_shapes"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.stage_base_s):
                raise ValueError(f"cost model: {len(getattr(self, name))} {name} for {len(self.stage_base_s)} stages")
        values = (*self.stage_base_s, *self.stage_per_token_s, *self.pseudo_row_s, self.hop_latency_s,
                  self.coordinator_s, self.predictor_s, self.exit_row_s, self.bytes_per_token, self.contention,
                  0.0 if self.exit_event_s is None else self.exit_event_s, *(c for _, c in self.contention_rows),
                  *(t for shapes in self.pass_shapes for _, _, t in shapes))
        rows = [w for w, _ in self.contention_rows]
        if rows != sorted(set(rows)) or (rows and rows[0] < 2):
            raise ValueError(f"cost model: contention_rows must be sorted by distinct row counts > 1, got {rows}")
        if any(v < 0 for v in values) or self.hop_bandwidth_bytes_per_s <= 0:
            raise ValueError("cost model: costs must be >= 0 and bandwidth > 0")

    @property
    def num_stages(self) -> int:
        return len(self.stage_base_s)

    @classmethod
    def uniform(cls, *, num_stages: int, stage_s: float, per_token_s: float = 0.0, **kwargs) -> CostModel:
        """Every stage costs stage_s + n * per_token_s."""
        return cls(stage_base_s=(stage_s,) * num_stages, stage_per_token_s=(per_token_s,) * num_stages, **kwargs)

    def stage_s(self, stage: int, num_tokens: int, *, num_pseudo: int = 0, exit_rows: int = 0) -> float:
        """Seconds of stage `stage` on a pass of num_tokens real rows, num_pseudo FIRP pseudo rows and
        exit_rows items wanting the exit head (counted only by a caller on the exit stage), before
        contention ([Note: stage pass cost])."""
        exit_head = (self.predictor_s + exit_rows * self.exit_row_s) if exit_rows else 0.0
        for n, p, seconds in self.pass_shapes[stage] if self.pass_shapes else ():
            if (n, p) == (num_tokens, num_pseudo):
                return seconds + exit_head
        if self.stage_tables:
            rows = self.stage_tables[stage].cost_s(max(1, num_tokens))
        else:
            rows = self.stage_base_s[stage] + num_tokens * self.stage_per_token_s[stage]
        pseudo = num_pseudo * self.pseudo_row_s[stage] if self.pseudo_row_s else 0.0
        return rows + pseudo + exit_head

    def contention_at(self, rows: int, *, num_pseudo: int = 0) -> float:
        """Slow-down per busy neighbour of a pass of `rows` rows, `num_pseudo` of them FIRP pseudo
        rows ([Note: stage pass cost]): `contention_rows` is measured on FIRP passes only, so a
        pass without pseudo rows (a prefill, a multi-sequence decode) keeps `contention`."""
        if not num_pseudo:
            return self.contention
        points = ((1, self.contention), *self.contention_rows)
        for (w0, c0), (w1, c1) in itertools.pairwise(points):
            if rows <= w1:
                return c0 + (c1 - c0) * max(0, rows - w0) / (w1 - w0)
        return points[-1][1]

    def scaled(self, factor: float) -> CostModel:
        """Every compute cost (stage passes, pseudo rows, the exit head) times `factor` > 0 (a run's
        measured load, pipeline/measure/calibrate.py `run_load_factor`); hops, the coordinator and
        the exit event unchanged."""
        if factor <= 0:
            raise ValueError(f"cost model scale must be > 0, got {factor}")
        tables = tuple(RowCostTable(mode=t.mode, num_rows=t.num_rows, pass_s=tuple(x * factor for x in t.pass_s))
                       for t in self.stage_tables)
        return dataclasses.replace(
            self, stage_base_s=tuple(x * factor for x in self.stage_base_s), stage_tables=tables,
            stage_per_token_s=tuple(x * factor for x in self.stage_per_token_s),
            pseudo_row_s=tuple(x * factor for x in self.pseudo_row_s), predictor_s=self.predictor_s * factor,
            pass_shapes=tuple(tuple((n, p, t * factor) for n, p, t in shapes) for shapes in self.pass_shapes),
            exit_row_s=self.exit_row_s * factor)

    def hop_s(self, num_tokens: int) -> float:
        return self.hop_latency_s + num_tokens * self.bytes_per_token / self.hop_bandwidth_bytes_per_s

    @property
    def exit_delay_s(self) -> float:
        """From the exit stage finishing an item to the engine seeing its exit event."""
        return self.hop_s(0) if self.exit_event_s is None else self.exit_event_s
