"""Discrete-event simulator of the pipeline: the real Scheduler, ledger and verify under a cost model.

Owns simulated time, the stages as FIFO servers, the hops between them, and the acceptance process
that stands in for the model and the predictor. What runs when, what is drafted, verified,
committed and squashed is decided by the same `pipeline.scheduler.Scheduler` (and through it
`pipeline.ledger.SequenceLedger` and the sampler's verify) that `launcher/coordinator.py` drives;
stages drop stale items by the same rule as `StageExecutor.admit` ([Note: in-band squash]). The
simulator records a `pipeline.timeline.Timeline`, so its runs give the same fractions, traces and
plots as measured ones. Pure: no processes, no wall clock. Must not: copy scheduling policy.

[Note: simulated model]
The "model" is a truth table: the real next token after position p of sequence i is
`true_token(i, p + 1)` (never an EOS, so sequences run to their budget). The simulated predictor
drafts after an exit event like an exit-head predictor (exit at the end of stage `exit_stage`, so
the draft lag e = exit_stage + 1 stage-steps) and proposes the true token when the acceptance
process says "accept", a different token otherwise. Expected speed-up over plain decode of one
sequence: S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5; SPEED, arXiv 2310.12072 §3).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Sequence

import torch

from pipeline.items import Item, ItemKind
from pipeline.predictors import Draft, ExitGuess
from pipeline.sampling import SamplingParams
from pipeline.scheduler import Scheduler
from pipeline.scheduler_types import SchedulerConfig
from pipeline.timeline import Timeline

SIM_VOCAB = 50_000


def true_token(seq_id: int, position: int) -> int:
    """The simulated model's token at `position` of sequence `seq_id`, in [3, SIM_VOCAB)."""
    return 3 + (seq_id * 1_000_003 + position * 7_919) % (SIM_VOCAB - 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Simulated costs, all in seconds.

    stage_base_s / stage_per_token_s: compute time of stage i on a micro-batch of n token rows is
        stage_base_s[i] + n * stage_per_token_s[i] (one entry per stage).
    hop_latency_s, hop_bandwidth_bytes_per_s, bytes_per_token: each hop (coordinator -> stage 0,
        stage i -> i + 1, last stage -> coordinator, exit stage -> coordinator) takes the latency;
        hops between stages, which carry n rows of hidden state, also n * bytes_per_token / bandwidth.
    coordinator_s: the coordinator's turnaround per result (verify, commit, next send); the
        coordinator is one thread, so results queue for it.
    predictor_s: extra compute on the exit stage for a micro-batch with non-prefill items that want
        the exit head (`Item.want_exit`) when speculating.
    contention: slow-down of a stage's compute per other stage computing when it starts (shared
        memory bandwidth or CPUs): time x (1 + contention * others busy).
    Raises ValueError on negative costs or mismatched lengths.
    """

    stage_base_s: tuple[float, ...]
    stage_per_token_s: tuple[float, ...]
    hop_latency_s: float = 0.0
    hop_bandwidth_bytes_per_s: float = math.inf
    bytes_per_token: int = 0
    coordinator_s: float = 0.0
    predictor_s: float = 0.0
    contention: float = 0.0

    def __post_init__(self) -> None:
        if not self.stage_base_s or len(self.stage_base_s) != len(self.stage_per_token_s):
            raise ValueError(f"cost model: {len(self.stage_base_s)} base costs for {len(self.stage_per_token_s)} "
                             "per-token costs (need one of each per stage, at least one stage)")
        values = (*self.stage_base_s, *self.stage_per_token_s, self.hop_latency_s, self.coordinator_s,
                  self.predictor_s, self.bytes_per_token, self.contention)
        if any(v < 0 for v in values) or self.hop_bandwidth_bytes_per_s <= 0:
            raise ValueError("cost model: costs must be >= 0 and bandwidth > 0")

    @property
    def num_stages(self) -> int:
        return len(self.stage_base_s)

    @classmethod
    def uniform(cls, *, num_stages: int, stage_s: float, per_token_s: float = 0.0, **kwargs) -> CostModel:
        """Every stage costs stage_s + n * per_token_s."""
        return cls(stage_base_s=(stage_s,) * num_stages, stage_per_token_s=(per_token_s,) * num_stages, **kwargs)

    def stage_s(self, stage: int, num_tokens: int) -> float:
        return self.stage_base_s[stage] + num_tokens * self.stage_per_token_s[stage]

    def hop_s(self, num_tokens: int) -> float:
        return self.hop_latency_s + num_tokens * self.bytes_per_token / self.hop_bandwidth_bytes_per_s


class Bernoulli:
    """Acceptance process: each draft is right with probability `alpha`, independently (seeded)."""

    def __init__(self, alpha: float, *, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"acceptance alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._rng = random.Random(seed)

    def accept(self) -> bool:
        return self._rng.random() < self.alpha


class Replay:
    """Acceptance process replaying recorded draft outcomes (True = accepted) in order, cyclically,
    one per proposal. A draft squashed before it is verified (a rejection earlier in its chain)
    also uses up an outcome, so with more than one draft in flight per sequence the verified
    acceptance can differ from the record's. Raises ValueError for an empty record."""

    def __init__(self, outcomes: Sequence[bool]) -> None:
        if not outcomes:
            raise ValueError("replayed acceptance needs at least one recorded draft outcome")
        self.outcomes = list(outcomes)
        self.alpha = sum(self.outcomes) / len(self.outcomes)
        self._next = itertools.cycle(self.outcomes)

    def accept(self) -> bool:
        return next(self._next)


class SimPredictor:
    """Exit-head-style predictor of the simulated model (see [Note: simulated model])."""

    name = "sim"
    needs_exit_head = True

    def __init__(self, acceptance: Bernoulli | Replay, *, needs_exit_head: bool = True) -> None:
        self.acceptance = acceptance
        self.needs_exit_head = needs_exit_head  # False: drafts at send time, like the ngram predictor

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        seq_id = context[0] - SIM_VOCAB  # the simulator's prompts start with a per-sequence tag token
        truth = true_token(seq_id, len(context))
        token = truth if self.acceptance.accept() else (truth + 1 - 3) % (SIM_VOCAB - 3) + 3
        return Draft(token, 1.0, self.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run: `concurrency` sequences of `prompt_len` + `max_new_tokens` submitted at t=0.

    speculate: SPEED with the simulated predictor (exit at the end of stage `exit_stage`, or, with
    exit_head=False, drafting at send time as the ngram predictor does);
    max_inflight: per-sequence cap (0 = num_stages). Raises ValueError on bad values.
    """

    num_stages: int
    concurrency: int = 1
    prompt_len: int = 16
    max_new_tokens: int = 64
    speculate: bool = False
    exit_stage: int = 0
    exit_head: bool = True  # False: a context-only predictor (ngram) that drafts at send time, no exit event
    max_inflight: int = 0
    prompt_lens: tuple[int, ...] = ()  # per sequence (overrides prompt_len and concurrency)

    def __post_init__(self) -> None:
        if self.prompt_lens:
            if min(self.prompt_lens) < 1:
                raise ValueError(f"prompt lengths must be >= 1, got {self.prompt_lens}")
            object.__setattr__(self, "concurrency", len(self.prompt_lens))
        else:
            object.__setattr__(self, "prompt_lens", (self.prompt_len,) * max(1, self.concurrency))
        if self.num_stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.num_stages}")
        if self.concurrency < 1 or self.prompt_len < 1 or self.max_new_tokens < 1:
            raise ValueError("concurrency, prompt length and max new tokens must be >= 1")
        if self.speculate and not 0 <= self.exit_stage < self.num_stages - 1:
            raise ValueError(f"exit stage {self.exit_stage} must be before the last of {self.num_stages} stages "
                             "(speculation needs >= 2 stages)")


@dataclasses.dataclass
class SimResult:
    """Outcome of a simulated run; times in simulated seconds."""

    wall_s: float
    generated_tokens: int
    ttft_s: list[float]
    e2e_s: list[float]
    commits: list[tuple[int, int, int]]  # (time_ns, seq_id, token)
    timeline: Timeline
    drafted: int
    verified: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    def steady_tokens_per_s(self) -> float:
        """Committed tokens per second once decode runs: commits after each sequence's first two
        (the prefill's and the first decode's, which is never speculative), (n - 1) / time span."""
        seen: dict[int, int] = {}
        times = []
        for time_ns, seq_id, _ in sorted(self.commits):
            seen[seq_id] = seen.get(seq_id, 0) + 1
            if seen[seq_id] > 2:
                times.append(time_ns)
        if len(times) < 2 or times[-1] == times[0]:
            return 0.0
        return (len(times) - 1) / ((times[-1] - times[0]) / 1e9)

    def decode_tokens_per_s(self) -> float:
        """Committed tokens per second between each sequence's first and last commit (no prefill),
        summed over sequences that ran concurrently: (sum of tokens - 1) / (last - first commit)."""
        first = min(c[0] for c in self.commits)
        last = max(c[0] for c in self.commits)
        n = len(self.commits) - len({c[1] for c in self.commits})
        return n / ((last - first) / 1e9) if last > first else 0.0


class Simulator:
    """Runs one SimConfig under a CostModel. See the module docstring."""

    def __init__(self, config: SimConfig, cost: CostModel, *, acceptance: Bernoulli | Replay | None = None,
                 max_events: int = 50_000_000, record_timeline: bool = True) -> None:
        """acceptance: needed when config.speculate; record_timeline: keep every stage slice (off:
        faster, for long sweeps that need only tokens/s). Raises ValueError on a mismatch."""
        if cost.num_stages != config.num_stages:
            raise ValueError(f"cost model has {cost.num_stages} stages, the run {config.num_stages}")
        if config.speculate and acceptance is None:
            raise ValueError("a speculating simulation needs an acceptance process")
        self.config, self.cost, self.max_events = config, cost, max_events
        predictor = SimPredictor(acceptance, needs_exit_head=config.exit_head) if config.speculate else None
        self.scheduler = Scheduler(SchedulerConfig(
            num_stages=config.num_stages, max_num_seqs=config.concurrency,
            max_model_len=max(config.prompt_lens) + config.max_new_tokens + 1, speculate=config.speculate,
            max_inflight=config.max_inflight), predictor)
        self.timeline = Timeline(config.num_stages, max_slices=10_000_000)
        self.record_timeline = record_timeline
        self.now_ns = 0
        self._events: list = []
        self._order = itertools.count()
        self._queues: list[list] = [[] for _ in range(config.num_stages)]
        self._busy = [False] * config.num_stages
        self._coord_free_ns = 0
        self._stage_epochs: list[dict[int, int]] = [{} for _ in range(config.num_stages)]

    def _at(self, delay_s: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (self.now_ns + round(delay_s * 1e9), next(self._order), kind, payload))

    def run(self) -> SimResult:
        """Simulate until every sequence finished. Raises RuntimeError if it does not converge."""
        cfg = self.config
        for i, prompt_len in enumerate(cfg.prompt_lens):  # the tag token lets the predictor find the sequence
            prompt = [SIM_VOCAB + i] + [true_token(i, p) for p in range(1, prompt_len)]
            self.scheduler.add(i, prompt, SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True))
        commits: list[tuple[int, int, int]] = []
        first: dict[int, int] = {}
        done: dict[int, int] = {}
        self._pump()
        for _ in range(self.max_events):
            if not self._events:
                break
            self.now_ns = self._events[0][0]
            while self._events and self._events[0][0] == self.now_ns:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "arrive":
                    stage, batch, items = payload
                    self._queues[stage].append((batch, items))
                    self._start(stage)
                elif kind == "done":
                    self._finish(*payload)
                elif kind == "exit":
                    self.scheduler.on_exit(payload, [None] * len(payload), self.now_ns)
                elif kind == "result":  # queue for the coordinator's one thread
                    self._coord_free_ns = max(self._coord_free_ns, self.now_ns) + round(self.cost.coordinator_s * 1e9)
                    heapq.heappush(self._events, (self._coord_free_ns, next(self._order), "verify", payload))
                elif kind == "verify":
                    batch, returned, timing = payload
                    for c in self._on_result(batch, returned, timing):
                        for t in c.token_ids:
                            commits.append((self.now_ns, c.seq_id, t))
                        first.setdefault(c.seq_id, self.now_ns)
                        if c.finish_reason is not None:
                            done[c.seq_id] = self.now_ns
            self._pump()
        else:
            raise RuntimeError(f"simulation did not finish within {self.max_events} events")
        if len(done) != cfg.concurrency:
            raise RuntimeError(f"simulation stalled: {len(done)} of {cfg.concurrency} sequences finished")
        spec = self.scheduler.spec
        return SimResult(wall_s=max(done.values()) / 1e9, generated_tokens=len(commits),
                         ttft_s=[first[i] / 1e9 for i in range(cfg.concurrency)],
                         e2e_s=[done[i] / 1e9 for i in range(cfg.concurrency)], commits=commits,
                         timeline=self.timeline, drafted=spec.drafted_tokens, verified=spec.verified_drafts,
                         accepted=spec.accepted_tokens)

    # -- coordinator side ------------------------------------------------------------------------
    def _pump(self) -> None:
        for seq_id, _ in self.scheduler.take_releases():
            self.scheduler.pop(seq_id)
            for epochs in self._stage_epochs:
                epochs.pop(seq_id, None)
        while (batch := self.scheduler.next_batch(self.now_ns)) is not None:
            self._at(self.cost.hop_s(0), "arrive", (0, (batch, []), batch))  # token ids: latency only

    def _on_result(self, batch: tuple[list[Item], list], returned: list[Item], timing: list):
        sent, _ = batch
        token_ids = torch.tensor([true_token(it.seq_id, it.end) for it in returned], dtype=torch.int64)
        commits = self.scheduler.on_result(sent, returned, token_ids, None, self.now_ns)
        committed_seqs = {c.seq_id for c in commits}
        ran = {(it.seq_id, it.start, it.epoch) for it in returned}
        committed = [it.seq_id in committed_seqs and (it.seq_id, it.start, it.epoch) in ran for it in sent]
        if self.record_timeline:
            self.timeline.record(timing, sent, sum(committed) / len(sent), committed=committed)
        return commits

    # -- stages ----------------------------------------------------------------------------------
    def _start(self, stage: int) -> None:
        if self._busy[stage] or not self._queues[stage]:
            return
        batch, items = self._queues[stage].pop(0)
        epochs = self._stage_epochs[stage]
        kept = []
        for it in items:  # StageExecutor.admit: drop items older than the newest epoch seen
            if it.epoch >= epochs.get(it.seq_id, -1):
                epochs[it.seq_id] = it.epoch
                kept.append(it)
        n = sum(it.num_tokens for it in kept)
        cost = 0.0
        if kept:
            cost = self.cost.stage_s(stage, n)
            if self._is_exit(stage, kept) and any(it.want_exit for it in kept if it.kind != ItemKind.PREFILL):
                cost += self.cost.predictor_s  # the exit head runs only on items that want it (StageExecutor)
            cost *= 1.0 + self.cost.contention * sum(self._busy)
        self._busy[stage] = True
        self._at(cost, "done", (stage, batch, kept, self.now_ns))

    def _is_exit(self, stage: int, items: list[Item]) -> bool:
        return (self.config.speculate and self.config.exit_head and stage == self.config.exit_stage
                and any(it.kind != ItemKind.PREFILL for it in items))

    def _finish(self, stage: int, batch: tuple[list[Item], list], items: list[Item], start_ns: int) -> None:
        self._busy[stage] = False
        if items:
            batch[1].append([stage, start_ns, self.now_ns])
        n = sum(it.num_tokens for it in items)
        if items and self._is_exit(stage, items):
            self._at(self.cost.hop_s(0), "exit", items)
        if stage == self.config.num_stages - 1:
            self._at(self.cost.hop_s(0), "result", (batch, items, batch[1]))
        else:
            self._at(self.cost.hop_s(n), "arrive", (stage + 1, batch, items))
        self._start(stage)


def closed_form_speedup(*, num_stages: int, alpha: float, draft_lag: int = 1) -> float:
    """Expected speed-up of SPEED over plain pipeline decode for one sequence:
    S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5)."""
    return num_stages / (alpha * draft_lag + (1 - alpha) * num_stages)
