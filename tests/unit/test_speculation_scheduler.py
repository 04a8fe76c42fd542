"""The real engine and scheduler with speculation on, driven by a fake in-process pipeline of S stages.

What breaks when these fail: SPEED changes greedy output (a wrong draft committed, a token lost or
repeated after a squash, a slot reused with stale work), drafts that follow a prefill or run past
EOS / the token budget, drafts that delay real work of other sequences, a single speculating
sequence that stops filling the pipeline, wrong speculation counters, or sampling with drafts that
is no longer distributed like plain sampling (ARCHITECTURE.md §5).

The fake pipeline: S stages joined by FIFO queues (one micro-batch per stage per step, so an item
moves one stage per step); each stage applies the real `StageExecutor.admit` (epochs, KV
truncation) and keeps a model of its KV contents (the token at each position). The last stage's
"model" computes the next token from the KV contents it attends to, `fake_next(prefix)`, so any
stale key/value left behind by a squash changes the output. After the exit stage the fake feeds
the one `pipeline.engine.engine.Engine` an `ExitPassed` event, after the last stage a `Result`, one
`Engine.step` per event, and carries out its sends and releases, like launcher/coordinator/coordinator.py. Whether the exit event of the chain's end or the
head's result of the same step reaches the scheduler first is a parameter: in the real runtime
they come from two different stages and race.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import random
from collections.abc import Sequence

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ExitPassed, Result, Submit
from pipeline.engine.records import NON_FINITE_TOKEN, FinishReason, SchedulerConfig, SpecCounters
from pipeline.engine.stage_executor import StageExecutor
from pipeline.model.kv_cache import KVCache
from pipeline.model.partition import LayerRange
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import Draft, ExitGuess, LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    PerfectPredictor,
    RandomPredictor,
    ReferenceTable,
    SometimesRightPredictor,
)

VOCAB = 64
EOS = 7
MAX_MODEL_LEN = 128
PROMPTS = [[5, 9, 11], [20, 4], [33, 33, 33, 33, 33], [8]]


def fake_next(prefix: Sequence[int]) -> int:
    """The fake model's greedy next token after `prefix`: a hash of the whole prefix, in [3, 53)."""
    h = 0
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return 3 + (h >> 7) % 50


def greedy_reference(prompt: Sequence[int], max_new_tokens: int, *, eos: int | None = None) -> list[int]:
    """Sequential greedy decoding with `fake_next` (the oracle every pipeline run must match)."""
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(fake_next([*prompt, *out]))
        if out[-1] == eos:
            break
    return out


class AdmitOnlyModel:
    """Stands in for the StageModel: `StageExecutor.admit` touches only epochs and the KV cache
    (a real StageModel, even on the meta device, costs seconds of torch start-up here)."""

    layer_range = LayerRange(0, 1)


def _admit_only_model() -> AdmitOnlyModel:
    return AdmitOnlyModel()


@dataclasses.dataclass
class Stats:
    """What the fake pipeline observed."""

    steps: int = 0
    busy_per_step: list[int] = dataclasses.field(default_factory=list)  # stages that ran an item, per step
    drafts_sent: list[Item] = dataclasses.field(default_factory=list)
    policy_violations: list[str] = dataclasses.field(default_factory=list)
    dropped_items: int = 0


class FakePipeline:
    """S lock-step stages with FIFO queues around a real Scheduler. See the module docstring.

    logits_fn(prefix) -> [vocab] float32 logits, for items that want logits (sampling); the greedy
    token of every item is `next_fn(prefix)`. The exit head's guess for an item is
    `next_fn(prefix) + lens_offset` (0: a perfect logit lens), and None for an item without
    `want_exit` (the exit stage skips its head, pipeline/engine/stage_executor.py).
    """

    def __init__(self, engine: Engine, submits: list[Submit], *, exit_stage: int = 0, exit_first: bool = False,
                 next_fn=fake_next, logits_fn=None, lens_offset: int = 0) -> None:
        self.engine = engine
        self.sched = engine.scheduler  # inspection only: the fake drives the engine
        self.num_stages = self.sched.config.num_stages
        self.exit_stage, self.exit_first = exit_stage, exit_first
        self.next_fn, self.logits_fn = next_fn, logits_fn
        self.lens_offset = lens_offset  # the exit head guesses next_fn(prefix) + lens_offset
        self.submits = submits
        self.states: dict[int, object] = {}  # every SequenceState (the engine forgets released ones)
        self.exit_passed: set[tuple[int, int, int]] = set()  # (seq_id, position, epoch) past the exit stage
        self.queues: list[collections.deque] = [collections.deque() for _ in range(self.num_stages)]
        cfg = self.sched.config
        self.executors = [StageExecutor(_admit_only_model(), KVCache(
            num_layers=1, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, num_kv_heads=1,
            head_dim=1, dtype=torch.float32)) for _ in range(self.num_stages)]
        self.contents: list[dict[int, list[int]]] = [collections.defaultdict(list) for _ in range(self.num_stages)]
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)
        self.active = {s.seq_id for s in submits}
        self.stats = Stats()

    # -- coordinator side ---------------------------------------------------------------------------
    def pump(self, events=()) -> None:
        """One engine step: carry out its releases (in-band, to stage 0) and micro-batches, and
        record its commits. Drafts must never delay real work: a micro-batch with drafts holds
        only drafts, and no real item is left waiting after it."""
        out = self.engine.step(events)
        self.states.update(self.sched.seqs)
        if out.releases:
            self.queues[0].append(("release", [(r.seq_id, r.slot) for r in out.releases]))
        for commit in out.commits:
            self.outputs[commit.seq_id].extend(commit.token_ids)
            if commit.finish_reason is not None:
                self.active.discard(commit.seq_id)
        for batch in out.sends:
            drafts = [it for it in batch if it.kind == ItemKind.DRAFT]
            if drafts:
                self.stats.drafts_sent.extend(drafts)
                waiting = self._real_pending()
                if len(drafts) != len(batch) or waiting:
                    self.stats.policy_violations.append(
                        f"draft batch {[(it.seq_id, it.kind.name) for it in batch]} sent while real items of "
                        f"{sorted(waiting)} were ready")
            self.queues[0].append(("batch", batch, list(batch)))

    def _real_pending(self) -> set[int]:
        """Unfinished sequences whose next item is a real (non-draft) one, ready to be sent."""
        seqs = (self.sched.seqs[i] for i in self.active if i in self.sched.seqs)
        return {s.seq_id for s in seqs if s.pending is not None and s.pending.kind != ItemKind.DRAFT}

    # -- stages ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """Every stage runs the oldest entry of its input queue; then exit and result events."""
        events, busy = [], 0
        for j in reversed(range(self.num_stages)):
            if not self.queues[j]:
                continue
            entry = self.queues[j].popleft()
            if entry[0] == "release":
                seq_ids, slots = zip(*entry[1], strict=True)
                self.executors[j].release(list(seq_ids), list(slots))
                for slot in slots:
                    self.contents[j][slot] = []
                if j + 1 < self.num_stages:
                    self.queues[j + 1].append(entry)
                continue
            _, sent, items = entry
            kept = self._run_stage(j, items)
            busy += bool(kept)
            if j == self.exit_stage and kept:  # (the stage loop skips all-prefill batches; we do not)
                guesses = [None if it.kind == ItemKind.PREFILL or not it.want_exit else  # as StageExecutor
                           ExitGuess((self.next_fn(self.contents[j][it.slot][:it.end]) + self.lens_offset) % VOCAB, 0.9)
                           for it in kept]
                self.exit_passed.update((it.seq_id, it.end - 1, it.epoch) for it in kept)
                events.append(("exit", j, (kept, guesses)))
            if j + 1 < self.num_stages:
                self.queues[j + 1].append(("batch", sent, kept))
            else:
                content = self.contents[j]
                tokens = [self.next_fn(content[it.slot][:it.end]) for it in kept]
                want = [self.logits_fn(content[it.slot][:it.end]) for it in kept if it.want_logits]
                events.append(("result", j, (sent, kept, tokens, torch.stack(want) if want else None)))
        self.stats.steps += 1
        self.stats.busy_per_step.append(busy)
        # `events` holds the result (last stage) before the exit event of an earlier stage, and a
        # stage's exit event before its own result (the stage sends EXIT_GUESS before forwarding).
        # Between different stages the order is the race under test.
        if self.exit_first:
            events.sort(key=lambda e: e[0] != "exit")
        for kind, _, payload in events:
            if kind == "exit":
                items, guesses = payload
                self.pump([ExitPassed(items=tuple(items), guesses=tuple(guesses))])
            else:
                _, kept, tokens, logits = payload
                self.pump([Result(items=tuple(kept), token_ids=torch.tensor(tokens, dtype=torch.int64), logits=logits)])

    def _run_stage(self, j: int, items: list[Item]) -> list[Item]:
        executor, content = self.executors[j], self.contents[j]
        keep = executor.admit(items)
        self.stats.dropped_items += keep.count(False)
        kept = [it for it, k in zip(items, keep, strict=True) if k]
        for it in kept:  # like StageModel.forward_rows: every write is checked before any is done
            executor.kv.check_write(it.slot, it.start, it.num_tokens)  # raises on a gap
        for it in kept:
            tokens = list(it.token_ids)
            assert len(tokens) == it.num_tokens, "the fake keeps token ids on every stage"
            content[it.slot] = content[it.slot][:it.start] + tokens
            executor.kv.set_length(it.slot, it.end)
        return kept

    def run(self, *, max_steps: int = 20_000) -> dict[int, list[int]]:
        self.pump(self.submits)
        for _ in range(max_steps):
            if not self.engine.has_unfinished and not any(self.queues):
                return dict(self.outputs)
            self.step()
        raise AssertionError(f"the fake pipeline did not finish in {max_steps} steps")


# -- helpers ------------------------------------------------------------------------------------------
def _engine(num_stages: int, *, speculate: bool, predictor=None, max_num_seqs: int = 8,
            eos: bool = False, max_inflight: int = 0) -> Engine:
    return Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                  eos_token_ids=(EOS,) if eos else (), speculate=speculate,
                                  max_inflight=max_inflight), predictor)


def _submits(prompts, params: SamplingParams | list[SamplingParams], first: int = 0) -> list[Submit]:
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    return [Submit(seq_id=first + i, prompt_ids=tuple(p), params=sp)
            for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))]


def _generate(num_stages: int, prompts, params: SamplingParams | list[SamplingParams], *, predictor=None,
              exit_first: bool = False, exit_stage: int = 0, max_num_seqs: int = 8, eos: bool = False,
              **fake_kwargs) -> tuple[list[list[int]], Engine, FakePipeline]:
    """Run `prompts` (params: one for all, or one per prompt) through a fake pipeline."""
    engine = _engine(num_stages, speculate=predictor is not None, predictor=predictor,
                     max_num_seqs=max_num_seqs, eos=eos)
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    fake = FakePipeline(engine, _submits(prompts, per_prompt), exit_stage=exit_stage, exit_first=exit_first,
                        **fake_kwargs)
    outputs = fake.run()
    for i in range(len(prompts)):
        assert outputs.get(i, []) == fake.states[i].output_ids, "streamed commits differ from the sequence's output"
    assert engine.num_sequences == 0 and engine.num_inflight == 0, "finished sequences must be forgotten"
    for d in fake.stats.drafts_sent:  # the first draft follows the first decode item, never the prefill
        n, budget = len(prompts[d.seq_id]), per_prompt[d.seq_id].max_new_tokens
        assert d.start >= n + 1, f"draft at {d.start} right after the prefill of a {n}-token prompt: {d}"
        assert d.start <= n + budget - 2, f"draft at {d.start}: its result would pass the budget {budget}: {d}"
        if predictor is not None and predictor.needs_exit_head:  # exit-driven: only after the exit event
            assert (d.seq_id, d.start - 1, d.epoch) in fake.exit_passed, f"draft before its exit event: {d}"
    assert not fake.stats.policy_violations, fake.stats.policy_violations[:3]  # drafts never delay real work
    return [outputs.get(i, []) for i in range(len(prompts))], engine, fake


def _predictor(kind: str, prompts, references, *, seed: int = 0):
    """kind: always-wrong, always-wrong@exit (drafts only after exit events), random,
    sometimes-right, perfect, or logit-lens (the real predictor; the fake's exit head is perfect
    unless the fake is given a lens_offset)."""
    table = ReferenceTable(zip(prompts, references, strict=True))
    if kind == "logit-lens":
        return LogitLensPredictor()
    if kind.startswith("always-wrong"):
        return AlwaysWrongPredictor(table, vocab_size=VOCAB, needs_exit_head=kind.endswith("@exit"))
    if kind == "random":
        return RandomPredictor(seed=seed, vocab_size=VOCAB)
    if kind == "sometimes-right":
        return SometimesRightPredictor(table, seed=seed, vocab_size=VOCAB)
    assert kind == "perfect"
    return PerfectPredictor(table)


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
# Different budgets, so that sequences finish one by one and the pipeline has idle slots that
# drafts fill even when there are at least as many sequences as stages.
BUDGETS = [24, 10, 17, 5]


# -- greedy equality ----------------------------------------------------------------------------------
@pytest.mark.parametrize("exit_first", [False, True], ids=["result-first", "exit-first"])
@pytest.mark.parametrize("kind", ["always-wrong", "always-wrong@exit", "random", "sometimes-right", "perfect",
                                  "logit-lens"])
@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("num_stages", [2, 3, 4, 5])
def test_speculative_greedy_commits_equal_plain_decoding(num_stages, num_seqs, kind, exit_first):
    prompts = PROMPTS[:num_seqs]
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS[:num_seqs]]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(prompts, params, strict=True)]
    plain, plain_sched, _ = _generate(num_stages, prompts, params)
    assert plain == references, "plain pipeline decoding differs from sequential greedy decoding"
    assert plain_sched.spec.drafted_tokens == 0
    spec, sched, fake = _generate(num_stages, prompts, params, predictor=_predictor(kind, prompts, references),
                                  exit_first=exit_first)
    assert spec == plain, f"{kind} predictor changed greedy output"
    assert all(s.finish_reason == FinishReason.LENGTH for s in fake.states.values())
    assert sched.spec.drafted_tokens > 0, "no draft was ever sent: the test did not exercise speculation"
    assert not fake.stats.policy_violations, fake.stats.policy_violations[:3]
    assert fake.stats.dropped_items == 0, "FIFO stages never see an item older than one they ran"
    assert sched.num_inflight == 0 and sched.num_sequences == 0


@pytest.mark.parametrize("num_stages", [2, 3, 4, 5])
def test_always_wrong_predictor_has_zero_acceptance_and_squashes(num_stages):
    references = [greedy_reference(p, GREEDY.max_new_tokens) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(PROMPTS, params, strict=True)]
    _, sched, _ = _generate(num_stages, PROMPTS, params, predictor=_predictor("always-wrong", PROMPTS, references))
    spec = sched.spec
    assert spec.accepted_tokens == 0 and spec.acceptance_rate == 0.0
    assert spec.verified_drafts > 0 and spec.squashed_items >= spec.verified_drafts
    assert spec.drafted_tokens >= spec.verified_drafts


@pytest.mark.parametrize("num_stages", [2, 3, 4, 5])
def test_sometimes_right_predictor_both_accepts_and_squashes(num_stages):
    references = [greedy_reference(p, GREEDY.max_new_tokens) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(PROMPTS, params, strict=True)]
    _, sched, _ = _generate(num_stages, PROMPTS, params,
                            predictor=_predictor("sometimes-right", PROMPTS, references, seed=num_stages))
    spec = sched.spec
    assert spec.accepted_tokens > 0 and spec.squashed_items > 0, spec
    assert 0.0 < spec.acceptance_rate < 1.0


@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("num_stages", [2, 3, 4, 5])
def test_perfect_predictor_accepts_every_draft_and_squashes_nothing(num_stages, num_seqs):
    prompts = PROMPTS[:num_seqs]
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS[:num_seqs]]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(prompts, params, strict=True)]
    _, sched, _ = _generate(num_stages, prompts, params, predictor=_predictor("perfect", prompts, references))
    spec = sched.spec
    assert spec.verified_drafts > 0 and spec.accepted_tokens == spec.verified_drafts
    assert spec.acceptance_rate == 1.0 and spec.squashed_items == 0


@pytest.mark.parametrize("exit_stage", [0, 1])
@pytest.mark.parametrize("num_stages", [3, 5])
def test_logit_lens_drafts_use_the_exit_guess_of_the_chain_end(num_stages, exit_stage):
    """A perfect exit head makes every logit-lens draft right, a wrong one every draft wrong: the
    scheduler must draft from the guess of the item at the chain's end (not a stale one)."""
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(PROMPTS, params, strict=True)]
    for lens_offset, rate in ((0, 1.0), (1, 0.0)):
        out, sched, _ = _generate(num_stages, PROMPTS, params, predictor=LogitLensPredictor(), exit_stage=exit_stage,
                                  lens_offset=lens_offset)
        assert out == references
        assert sched.spec.verified_drafts > 0 and sched.spec.acceptance_rate == rate, (lens_offset, sched.spec)


def last_token_next(prefix: Sequence[int]) -> int:
    """A fake model whose next token depends on the last token only (see the test below)."""
    return 3 + (prefix[-1] * 7 + 5) % 50


class LastTokenOracle:
    """Always right for `last_token_next`, whatever else the context holds."""

    name = "last-token-oracle"
    needs_exit_head = False

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        return Draft(last_token_next(context), 1.0, self.name)


@pytest.mark.parametrize("exit_first", [False, True], ids=["result-first", "exit-first"])
@pytest.mark.parametrize("num_stages", [2, 3, 4, 5])
def test_perfect_predictor_keeps_every_stage_busy_for_a_single_sequence(num_stages, exit_first):
    """With α = 1 a single sequence fills the pipeline: one token per step after warm-up
    (speed-up S over plain decode, ARCHITECTURE.md §5), whichever event arrives first. (When the
    chain end's exit event comes first, the per-sequence cap refuses its draft; the scheduler must
    retry once the head's result frees the place, or the chain drains to empty.)

    The fake model's next token depends only on the last token, so the oracle predictor is right
    even if the context it is given were wrong (that is tested separately below)."""
    max_new = 32
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out, sched, fake = _generate(num_stages, [[5, 9]], params, predictor=LastTokenOracle(), exit_first=exit_first,
                                 next_fn=last_token_next)
    assert sched.spec.acceptance_rate == 1.0
    busy = fake.stats.busy_per_step
    assert max(busy) == num_stages, f"never {num_stages} items in flight: {busy}"
    # Prefill (S steps) gives token 1, the first decode item (S steps) token 2, then one token per step.
    ideal = 2 * num_stages + max_new - 2
    steps = max(i for i, b in enumerate(busy) if b) + 1
    assert steps == ideal, f"{steps} steps for {max_new} tokens (full pipeline: {ideal}); busy per step {busy}"
    full_steps = sum(b == num_stages for b in busy)
    assert full_steps >= max_new - 2 * num_stages, f"only {full_steps} steps with every stage busy: {busy}"


class RecordingPerfectPredictor(PerfectPredictor):
    """PerfectPredictor that records every context it is given."""

    def __init__(self, table: ReferenceTable) -> None:
        super().__init__(table)
        self.contexts: list[tuple[int, ...]] = []

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        self.contexts.append(tuple(context))
        return super().propose(context, guess)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_predictor_context_is_the_true_prefix_up_to_the_chain_end(num_stages):
    """With only right drafts, the context of every proposal (prompt + committed + uncommitted
    drafts up to the chain's end) is a prefix of the true sequence, of length chain end + 1."""
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = greedy_reference(prompt, params.max_new_tokens)
    predictor = RecordingPerfectPredictor(ReferenceTable([(prompt, reference)]))
    out, sched, fake = _generate(num_stages, [prompt], params, predictor=predictor)
    assert out == [reference]
    truth = [*prompt, *reference]
    bad = [c for c in predictor.contexts if list(c) != truth[:len(c)]]
    assert not bad, f"{len(bad)} of {len(predictor.contexts)} contexts are not true prefixes, e.g. {bad[0]} vs {truth}"
    assert sched.spec.drafted_tokens >= params.max_new_tokens - 2 * num_stages


def test_plain_decoding_of_one_sequence_keeps_one_item_in_flight():
    """The baseline the speed-up is measured against: without speculation one stage is busy per step."""
    _, _, fake = _generate(4, [PROMPTS[0]], GREEDY)
    assert max(fake.stats.busy_per_step) == 1


# -- stop conditions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["always-wrong", "sometimes-right", "perfect"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_no_commit_past_eos_or_the_token_budget(num_stages, kind):
    prompts = [[p, p + 1] for p in range(3, 43)]  # 40 prompts: some hit EOS early, some never do
    params = SamplingParams(max_new_tokens=12)
    references = [greedy_reference(p, params.max_new_tokens, eos=EOS) for p in prompts]
    assert any(EOS in r for r in references) and any(EOS not in r for r in references), "pick other prompts"
    slots = num_stages - 1  # fewer running sequences than stages: drafts fill the idle places
    plain, _, _ = _generate(num_stages, prompts, params, eos=True, max_num_seqs=slots)
    spec, sched, fake = _generate(num_stages, prompts, params, predictor=_predictor(kind, prompts, references),
                                  eos=True, max_num_seqs=slots)
    assert plain == references and spec == references
    for i, out in enumerate(spec):
        assert len(out) <= params.max_new_tokens
        assert EOS not in out[:-1], f"seq {i} committed tokens after EOS: {out}"
        expected = FinishReason.EOS if out[-1] == EOS else FinishReason.LENGTH
        assert fake.states[i].finish_reason == expected
    assert fake.stats.drafts_sent, "no drafts: nothing was tested"  # their positions: see _generate


@pytest.mark.parametrize("kind", ["always-wrong", "perfect", "random"])
def test_a_non_finite_result_with_drafts_in_flight_ends_only_its_sequence(kind):
    """[Note: non-finite logits]: from output token 5 on, sequence 4's rows come back NON_FINITE_TOKEN
    (as NaN in its KV cache would make them); it ends with ERROR after exactly the 5 tokens before, its
    drafts are dropped, and every other sequence is exactly the greedy reference."""
    prompts = [[p, p + 1] for p in range(3, 11)]
    params = SamplingParams(max_new_tokens=12)
    references = [greedy_reference(p, params.max_new_tokens) for p in prompts]

    def next_fn(prefix):
        return NON_FINITE_TOKEN if prefix[0] == prompts[4][0] and len(prefix) >= 2 + 5 else fake_next(prefix)

    out, _, fake = _generate(3, prompts, params, predictor=_predictor(kind, prompts, references),
                             max_num_seqs=2, next_fn=next_fn)  # fewer slots than stages: drafts run
    assert out[4] == references[4][:5] and fake.states[4].finish_reason is FinishReason.ERROR
    assert [o for i, o in enumerate(out) if i != 4] == [r for i, r in enumerate(references) if i != 4]
    assert fake.stats.drafts_sent, "no drafts: nothing was tested"


@pytest.mark.parametrize(("rows", "want"), [
    ((11, NON_FINITE_TOKEN, NON_FINITE_TOKEN), ((11,), None)),  # FIRP draft 20 rejected: rows 1, 2 never read
    ((20, 21, NON_FINITE_TOKEN), ((20, 21), FinishReason.ERROR)),  # both accepted: row 2 is read
    ((NON_FINITE_TOKEN, 21, 5), ((), FinishReason.ERROR)),
])
def test_a_non_finite_row_of_a_firp_item_fails_the_sequence_only_where_plain_decoding_reads_it(rows, want):
    """[Note: non-finite logits]: an item carrying FIRP drafts [real, 20, 21] returns one row per
    token. Rows after a rejected draft saw a context plain decoding never computes, so a non-finite
    one must not fail the sequence; where the drafts before it were accepted, those tokens commit
    first, then the error."""
    engine = Engine(SchedulerConfig(num_stages=1, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, firp_k=2))
    [[prefill]] = engine.step([Submit(seq_id=0, prompt_ids=(5, 6, 7), params=SamplingParams(max_new_tokens=8))]).sends
    out = engine.step([Result(items=(prefill,), token_ids=torch.tensor([10]), firp_tokens=torch.tensor([20, 21]))])
    [[item]] = out.sends
    assert item.token_ids == (10, 20, 21) and item.num_result_rows == 3  # the FIRP chain rides along
    [commit] = engine.step([Result(items=(item,), token_ids=torch.tensor(rows), firp_tokens=torch.tensor([20, 21] * 3))]).commits
    assert (commit.token_ids, commit.finish_reason) == want


def test_more_sequences_than_kv_slots_reuse_slots_without_stale_work():
    """Finished sequences free their slot in-band; a new sequence in the slot never sees the old
    sequence's squashed drafts (which are still in flight when it ends on EOS)."""
    prompts = [[p, 2 * p % 50 + 3] for p in range(3, 27)]
    params = SamplingParams(max_new_tokens=10)
    references = [greedy_reference(p, params.max_new_tokens, eos=EOS) for p in prompts]
    out, sched, _ = _generate(3, prompts, params, predictor=_predictor("always-wrong", prompts, references),
                              eos=True, max_num_seqs=2)
    assert out == references
    assert sched.spec.squashed_items > 0


@pytest.mark.parametrize("kind", ["always-wrong", "sometimes-right"])
def test_finished_sequences_can_be_forgotten_while_their_drafts_are_still_queued(kind):
    """A server must forget finished sequences (the engine pops them once their slot is released),
    also those that ended on EOS while a draft of theirs was still waiting to be sent."""
    prompts = [[p, p + 1] for p in range(3, 43)]
    params = SamplingParams(max_new_tokens=12)
    references = [greedy_reference(p, params.max_new_tokens, eos=EOS) for p in prompts]
    engine = _engine(4, speculate=True, predictor=_predictor(kind, prompts, references), max_num_seqs=3, eos=True)
    fake = FakePipeline(engine, _submits(prompts, params))
    outputs = fake.run()
    assert [outputs[i] for i in range(len(prompts))] == references
    assert engine.num_sequences == 0 and len(fake.states) == len(prompts)


@pytest.mark.parametrize("exit_stage", [1, 2])
def test_exit_layer_in_a_later_stage_keeps_greedy_output(exit_stage):
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    references = [greedy_reference(p, sp.max_new_tokens) for p, sp in zip(PROMPTS, params, strict=True)]
    for kind in ("always-wrong", "sometimes-right", "perfect"):
        out, sched, _ = _generate(3, PROMPTS, params, predictor=_predictor(kind, PROMPTS, references),
                                  exit_stage=exit_stage)
        assert out == references, f"{kind}, exit stage {exit_stage}"
        assert sched.spec.drafted_tokens > 0


def test_drafts_wait_while_real_items_of_other_sequences_are_ready():
    """Several sequences, a 2-stage pipeline: drafts only ever go out in batches of their own, when no
    real item is ready (the fake records any violation; see `FakePipeline.pump`)."""
    prompts = [[p, p + 5, p + 9] for p in range(3, 12)]
    references = [greedy_reference(p, GREEDY.max_new_tokens) for p in prompts]
    for kind in ("always-wrong", "perfect", "sometimes-right"):
        out, sched, fake = _generate(2, prompts, GREEDY, predictor=_predictor(kind, prompts, references),
                                     max_num_seqs=4)
        assert out == references
        assert fake.stats.drafts_sent, f"{kind}: no drafts were sent"
        assert not fake.stats.policy_violations, fake.stats.policy_violations[:3]


# -- sampling: distribution exactness -----------------------------------------------------------------
SAMPLING_VOCAB = 6
SAMPLING_PROMPT = [1, 4, 2]
# Chi-square upper-tail critical values at alpha = 0.001: chi2.ppf(0.999, df) for df = 35 (6 x 6 joint
# cells - 1) and df = 5 (6 cells - 1); `test_chi_square_critical_values_match_alpha` rechecks them.
CHI2_ALPHA = 0.001
CHI2_CRITICAL = {35: 66.619, 5: 20.515}


def fake_logits(prefix: Sequence[int]) -> torch.Tensor:
    """[SAMPLING_VOCAB] float32 logits that depend on the whole prefix (peaked, never degenerate)."""
    return _fake_logits(tuple(prefix)).clone()


@functools.lru_cache(maxsize=4096)
def _fake_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    h = 0
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return torch.tensor([1.0 * ((h >> (3 * k + 5)) % 4) for k in range(SAMPLING_VOCAB)], dtype=torch.float32)


@functools.lru_cache(maxsize=4096)
def _fake_argmax(prefix: tuple[int, ...]) -> int:
    return int(torch.argmax(_fake_logits(prefix)))


def fake_argmax(prefix: Sequence[int]) -> int:
    return _fake_argmax(tuple(prefix))


class MostlyArgmaxPredictor:
    """Drafts the fake model's argmax half of the time and a uniform token otherwise, so under
    sampling drafts are both accepted and rejected often."""

    name = "mostly-argmax"
    needs_exit_head = False

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        token = fake_argmax(context) if self.rng.random() < 0.5 else self.rng.randrange(SAMPLING_VOCAB)
        return Draft(token, 0.5, self.name)


def _chi_square_homogeneity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square statistic and df for two count vectors over the same cells (empty cells dropped)."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    table = torch.stack([a, b])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def _sample_tokens(num_seqs: int, *, seed0: int, predictor, chunk: int = 50) -> tuple[list[list[int]], SpecCounters]:
    """Outputs of `num_seqs` sampled sequences of one prompt (seeds seed0, seed0 + 1, ...), run in
    chunks of `chunk` sequences per scheduler (the scheduler's per-batch cost grows with the number
    of sequences it has seen)."""
    outputs, totals = [], SpecCounters()
    for first in range(0, num_seqs, chunk):
        # 5 stages, 3 KV slots: real work never fills the pipeline, so drafts run in the idle slots.
        sched = _engine(5, speculate=predictor is not None, predictor=predictor, max_num_seqs=3)
        ids = range(first, min(first + chunk, num_seqs))
        submits = [Submit(seq_id=i, prompt_ids=tuple(SAMPLING_PROMPT),
                          params=SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed0 + i)) for i in ids]
        out = FakePipeline(sched, submits, next_fn=fake_argmax, logits_fn=fake_logits).run()
        outputs.extend(out[i] for i in ids)
        for field in dataclasses.fields(SpecCounters):
            setattr(totals, field.name, getattr(totals, field.name) + getattr(sched.spec, field.name))
    return outputs, totals


def test_chi_square_critical_values_match_alpha():
    for df, critical in CHI2_CRITICAL.items():
        tail = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(critical / 2, dtype=torch.float64)))
        assert math.isclose(tail, CHI2_ALPHA, rel_tol=0.01), (df, tail)


def test_sampling_with_drafts_keeps_the_distribution_of_later_tokens():
    """Tokens 2 and 3 (verified against drafts, or computed after an accepted one) and token 4 have
    the same distribution with and without speculation, and match the model's exact distribution."""
    num_seqs = 2000
    plain, _ = _sample_tokens(num_seqs, seed0=0, predictor=None)
    spec, counters = _sample_tokens(num_seqs, seed0=10**6, predictor=MostlyArgmaxPredictor(seed=5))
    rejected = counters.verified_drafts - counters.accepted_tokens
    assert counters.accepted_tokens > num_seqs // 5 and rejected > num_seqs // 5, counters
    v = SAMPLING_VOCAB

    def joint23(outs):
        counts = torch.zeros(v * v, dtype=torch.int64)
        for o in outs:
            counts[o[1] * v + o[2]] += 1
        return counts

    def marginal4(outs):
        return torch.bincount(torch.tensor([o[3] for o in outs]), minlength=v)

    # Exact P(token 2, token 3) for the fixed prompt, summed over token 1.
    prompt = SAMPLING_PROMPT
    exact = torch.zeros(v * v, dtype=torch.float64)
    p1 = torch.softmax(fake_logits(prompt).double(), -1)
    for t1 in range(v):
        p2 = torch.softmax(fake_logits([*prompt, t1]).double(), -1)
        for t2 in range(v):
            p3 = torch.softmax(fake_logits([*prompt, t1, t2]).double(), -1)
            exact[t2 * v:(t2 + 1) * v] += p1[t1] * p2[t2] * p3
    for name, counts in (("plain", joint23(plain)), ("speculative", joint23(spec))):
        expected = exact * num_seqs
        stat = float(((counts.double() - expected) ** 2 / expected).sum())
        assert stat < CHI2_CRITICAL[35], f"{name} (token 2, token 3) does not fit the model: chi2 {stat:.1f}"
    stat, df = _chi_square_homogeneity(joint23(plain), joint23(spec))
    assert df == 35 and stat < CHI2_CRITICAL[35], f"(token 2, token 3) differ with drafts: chi2 {stat:.1f}, df {df}"
    stat, df = _chi_square_homogeneity(marginal4(plain), marginal4(spec))
    assert df == 5 and stat < CHI2_CRITICAL[5], f"token 4 differs with drafts: chi2 {stat:.1f}, df {df}"
