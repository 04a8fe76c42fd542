"""Discrete-event simulator of the pipeline: the real engine, scheduler, ledger and verify under a cost model.

Owns simulated time, the stages as FIFO servers, the hops between them, and the acceptance process
that stands in for the model and the predictor. What runs when, what is drafted, verified,
committed and squashed is decided by the same `pipeline.engine.engine.Engine` (and through it the
scheduler, `pipeline.speculation.ledger.SequenceLedger` and `pipeline.speculation.verify`) that `launcher/coordinator/coordinator.py`
drives; stages drop stale items by the same rule as `StageExecutor.admit` (`admit_epochs`,
[Note: in-band squash]). The engine records a `pipeline.measure.timeline.Timeline`, so simulated runs give
the same fractions, traces and plots as measured ones. Pure: no processes, no wall clock.
Must not: copy scheduling policy.

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
from collections.abc import Sequence

import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Event, ExitPassed, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.row_budget import check_disable_by_batch_size
from pipeline.engine.stage_executor import admit_epochs
from pipeline.measure.cost_model import CostModel  # noqa: F401 - re-exported: the simulator's cost model
from pipeline.measure.sim_acceptance import Bernoulli, DraftsAt, FirpReplay, Replay  # noqa: F401 - re-exported
from pipeline.measure.timeline import StageTiming, Timeline
from pipeline.speculation.items import Item
from pipeline.speculation.predictors import Draft, ExitGuess
from pipeline.speculation.sampling import SamplingParams

SIM_VOCAB = 50_000


def true_token(seq_id: int, position: int) -> int:
    """The simulated model's token at `position` of sequence `seq_id`, in [3, SIM_VOCAB)."""
    return 3 + (seq_id * 1_000_003 + position * 7_919) % (SIM_VOCAB - 3)


class SimPredictor:
    """Exit-head-style predictor of the simulated model (see [Note: simulated model])."""

    name = "sim"
    needs_exit_head = True

    def __init__(self, acceptance: Bernoulli | Replay | DraftsAt, *, needs_exit_head: bool = True) -> None:
        self.acceptance = acceptance
        self.needs_exit_head = needs_exit_head  # False: drafts at send time, like the ngram predictor

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        seq_id = context[0] - SIM_VOCAB  # the simulator's prompts start with a per-sequence tag token
        truth = true_token(seq_id, len(context))
        if isinstance(self.acceptance, DraftsAt):  # only where the recorded run drafted
            right = self.acceptance.accept_at(seq_id, len(context))
            if right is None:
                return None
        else:
            right = self.acceptance.accept()
        return Draft(truth if right else (truth + 1 - 3) % (SIM_VOCAB - 3) + 3, 1.0, self.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run: `concurrency` sequences of `prompt_len` + `max_new_tokens` submitted at t=0.

    speculate: SPEED with the simulated predictor (exit at the end of stage `exit_stage`, or, with
    exit_head=False, drafting at send time as the ngram predictor does);
    max_inflight: per-sequence cap (0 = num_stages); firp_k / firp_alpha: FIRP chains whose every
    draft is right with probability firp_alpha (seeded); speculative_disable_by_batch_size: as
    RunConfig's, no new drafts while that many sequences or more run (None: never; the step's rule
    is the scheduler's, [Note: speculation under load] in pipeline/engine/row_budget.py; `speedpipe
    simulate` defaults it to stages + 1 as `--speculate auto` does). Raises ValueError on bad values.
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
    firp_k: int = 0  # FIRP chains of this many drafts (0 = off); their drafts right at `firp_alpha`
    firp_alpha: float = 0.0
    speculative_disable_by_batch_size: int | None = None  # None: speculate at any load

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
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0 (0 = num_stages), got {self.max_inflight}")
        if self.firp_k < 0 or not 0.0 <= self.firp_alpha <= 1.0:
            raise ValueError(f"firp_k must be >= 0 and firp_alpha in [0, 1], got {self.firp_k}, {self.firp_alpha}")
        check_disable_by_batch_size(self.speculative_disable_by_batch_size)
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
    spec_disabled_steps: int = 0  # micro-batches sent with speculation paused by load, as launch --json's

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


class Simulator:
    """Runs one SimConfig under a CostModel. See the module docstring."""

    def __init__(self, config: SimConfig, cost: CostModel, *, acceptance: Bernoulli | Replay | DraftsAt | None = None,
                 firp_replay: FirpReplay | None = None, max_events: int = 50_000_000,
                 record_timeline: bool = True) -> None:
        """acceptance: needed when config.speculate; firp_replay: FIRP chains replayed from a run
        (None: every draft right at config.firp_alpha); record_timeline: keep every stage slice
        (off: faster, for long sweeps that need only tokens/s). Raises ValueError on a mismatch."""
        if cost.num_stages != config.num_stages:
            raise ValueError(f"cost model has {cost.num_stages} stages, the run {config.num_stages}")
        if config.speculate and acceptance is None:
            raise ValueError("a speculating simulation needs an acceptance process")
        self.config, self.cost, self.max_events = config, cost, max_events
        predictor = SimPredictor(acceptance, needs_exit_head=config.exit_head) if config.speculate else None
        self.engine = Engine(SchedulerConfig(
            num_stages=config.num_stages, max_num_seqs=config.concurrency,
            max_model_len=max(config.prompt_lens) + config.max_new_tokens + 1, speculate=config.speculate,
            max_inflight=config.max_inflight, firp_k=config.firp_k,
            firp_min_prob=FirpReplay.MIN_PROB if firp_replay else 0.0,
            disable_by_batch_size=config.speculative_disable_by_batch_size or 0),
            predictor, record_timeline=record_timeline, max_slices=10_000_000, max_commits=None)
        self.now_ns = 0
        self._events: list = []
        self._order = itertools.count()
        self._queues: list[list] = [[] for _ in range(config.num_stages)]
        self._busy = [False] * config.num_stages
        self._coord_free_ns = 0
        self._stage_epochs: list[dict[int, int]] = [{} for _ in range(config.num_stages)]
        self._link_ns = [0] * config.num_stages  # last arrival on the link into stage i + 1 (FIFO)
        self._first: dict[int, int] = {}  # seq_id -> time of its first commit
        self._done: dict[int, int] = {}  # seq_id -> time of its last commit
        self._firp = Bernoulli(config.firp_alpha, seed=1)  # FIRP drafts' acceptance
        self._firp_replay = firp_replay

    @property
    def timeline(self) -> Timeline:
        return self.engine.timeline

    def _at(self, delay_s: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (self.now_ns + round(delay_s * 1e9), next(self._order), kind, payload))

    def run(self) -> SimResult:
        """Simulate until every sequence finished. Raises RuntimeError if it does not converge."""
        cfg = self.config
        submits = []
        for i, prompt_len in enumerate(cfg.prompt_lens):  # the tag token lets the predictor find the sequence
            prompt = [SIM_VOCAB + i] + [true_token(i, p) for p in range(1, prompt_len)]
            submits.append(Submit(seq_id=i, prompt_ids=tuple(prompt),
                                  params=SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)))
        self._step(submits)
        for _ in range(self.max_events):
            if not self._events:
                break
            self.now_ns = self._events[0][0]
            engine_events: list[Event] = []  # every engine event of this instant, in one step
            while self._events and self._events[0][0] == self.now_ns:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "arrive":
                    stage, timing, items = payload
                    self._queues[stage].append((timing, items))
                    self._start(stage)
                elif kind == "done":
                    self._finish(*payload)
                elif kind == "exit":
                    engine_events.append(ExitPassed(items=tuple(payload), guesses=(None,) * len(payload),
                                                    at_ns=self.now_ns))
                elif kind == "result":  # queue for the coordinator's one thread
                    self._coord_free_ns = max(self._coord_free_ns, self.now_ns) + round(self.cost.coordinator_s * 1e9)
                    heapq.heappush(self._events, (self._coord_free_ns, next(self._order), "verify", payload))
                elif kind == "verify":
                    engine_events.append(self._result(*payload))
            self._step(engine_events)
        else:
            raise RuntimeError(f"simulation did not finish within {self.max_events} events")
        return self._outcome()

    def _outcome(self) -> SimResult:
        cfg, done = self.config, self._done
        if len(done) != cfg.concurrency:
            raise RuntimeError(f"simulation stalled: {len(done)} of {cfg.concurrency} sequences finished")
        spec = self.engine.spec
        return SimResult(wall_s=max(done.values()) / 1e9, generated_tokens=len(self.engine.commit_log),
                         ttft_s=[self._first[i] / 1e9 for i in range(cfg.concurrency)],
                         e2e_s=[done[i] / 1e9 for i in range(cfg.concurrency)], commits=list(self.engine.commit_log),
                         timeline=self.timeline, drafted=spec.drafted_tokens, verified=spec.verified_drafts,
                         accepted=spec.accepted_tokens, spec_disabled_steps=spec.spec_disabled_steps)

    # -- coordinator side ------------------------------------------------------------------------
    def _step(self, events: list[Event]) -> None:
        """One engine step at the current instant: note commits, forget released sequences on every
        stage, and send the new micro-batches to stage 0 (token ids: latency only)."""
        out = self.engine.step(events, self.now_ns)
        for c in out.commits:
            self._first.setdefault(c.seq_id, self.now_ns)
            if c.finish_reason is not None:
                self._done[c.seq_id] = self.now_ns
        for release in out.releases:
            for epochs in self._stage_epochs:
                epochs.pop(release.seq_id, None)
        for batch in out.sends:
            self._at(self.cost.hop_s(0), "arrive", (0, [], list(batch)))

    def _result(self, timing: list[StageTiming], returned: list[Item]) -> Result:
        """The simulated model's result: the true next token after every result row of every returned
        item, and for FIRP items the chain drafts of each anchor row (the last `firp_anchors` rows):
        anchored at position a, draft j is for position a + 2 + j, right with probability firp_alpha,
        or, with a FirpReplay, one recorded chain per item for every anchor (probabilities 1 within
        its length, 0 after: the scheduler cuts the rest)."""
        tokens, firp, probs = [], [], []
        for it in returned:
            tokens += [true_token(it.seq_id, p + 1) for p in range(it.end - it.num_result_rows, it.end)]
            if not it.firp_k:
                continue
            length, accepted = self._firp_replay.next_chain(it.seq_id) if self._firp_replay else (it.firp_k, -1)
            for a in range(it.end - it.firp_anchors, it.end):
                for j in range(it.firp_k):
                    truth = true_token(it.seq_id, a + 2 + j)
                    right = j < accepted if accepted >= 0 else self._firp.accept()
                    firp.append(truth if right else (truth + 1 - 3) % (SIM_VOCAB - 3) + 3)
                    probs.append(1.0 if j < length else 0.0)
        return Result(items=tuple(returned), token_ids=torch.tensor(tokens, dtype=torch.int64), timing=tuple(timing),
                      at_ns=self.now_ns, firp_tokens=torch.tensor(firp, dtype=torch.int64) if firp else None,
                      firp_probs=torch.tensor(probs) if firp and self._firp_replay else None)

    # -- stages ----------------------------------------------------------------------------------
    def _start(self, stage: int) -> None:
        if self._busy[stage] or not self._queues[stage]:
            return
        timing, items = self._queues[stage].pop(0)
        keep = admit_epochs(self._stage_epochs[stage], items)  # as StageExecutor.admit
        kept = [it for it, k in zip(items, keep, strict=True) if k]
        n = sum(it.num_tokens for it in kept)
        cost = 0.0
        if kept:  # the exit head runs only on items that want it (StageExecutor)
            exit_rows = sum(it.wants_exit_guess for it in kept) if self._is_exit(stage) else 0
            pseudo = sum(it.num_pseudo for it in kept)
            cost = self.cost.stage_s(stage, n, num_pseudo=pseudo, exit_rows=exit_rows)
            cost *= 1.0 + self.cost.contention_at(n + pseudo, num_pseudo=pseudo) * sum(self._busy)
        self._busy[stage] = True
        self._at(cost, "done", (stage, timing, kept, self.now_ns))

    def _is_exit(self, stage: int) -> bool:
        return self.config.speculate and self.config.exit_head and stage == self.config.exit_stage

    def _finish(self, stage: int, timing: list[StageTiming], items: list[Item], start_ns: int) -> None:
        self._busy[stage] = False
        if items:
            timing.append(StageTiming(stage, start_ns, self.now_ns))
        n = sum(it.num_tokens for it in items)
        if self._is_exit(stage) and any(it.may_precede_draft for it in items):
            self._at(self.cost.exit_delay_s, "exit", items)  # as the exit stage's EXIT_GUESS (workers/stage_loop.py)
        if stage == self.config.num_stages - 1:
            self._at(self.cost.hop_s(0), "result", (timing, items))
        else:  # links are FIFO, as the data plane's channels: a message never overtakes the one before
            arrive_ns = max(self.now_ns + round(self.cost.hop_s(n) * 1e9), self._link_ns[stage])
            self._link_ns[stage] = arrive_ns
            heapq.heappush(self._events, (arrive_ns, next(self._order), "arrive", (stage + 1, timing, items)))
        self._start(stage)


def closed_form_speedup(*, num_stages: int, alpha: float, draft_lag: int = 1) -> float:
    """Expected speed-up of SPEED over plain pipeline decode for one sequence:
    S / (alpha * e + (1 - alpha) * S) (ARCHITECTURE.md §5)."""
    return num_stages / (alpha * draft_lag + (1 - alpha) * num_stages)
