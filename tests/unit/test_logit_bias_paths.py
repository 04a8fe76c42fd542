"""OpenAI's logit_bias on every speculative path beyond coordinator-drafted SPEED
(tests/unit/test_logit_bias.py covers plain decoding and SPEED on the fake pipeline).

What breaks when these fail: a biased request's tokens differ from plain decoding with the same
bias under FIRP chains (`speculate firp`, `speed+firp`), token trees (`--draft-tree`), stage-local
drafting (`--draft-at stage`) or a replay after a stage restart; typically because some verify path
takes the raw argmax (the bias silently dropped) or a path ships no logits for a greedy biased item.
Each test runs greedy and seeded sampling, with predictors that propose the biased-away token, the
unbiased argmax, or random tokens; it checks the committed tokens against plain decoding with the
same bias, and that the bias changed them (so a dropped bias is visible).
Harnesses reused: tests/unit/test_speculation_scheduler.py's FakePipeline (FIRP chains added here
as the last stage's pseudo-row argmax), tests/unit/test_local_draft.py's LocalFakePipeline,
tests/in_process_pipeline.py on the tiny model (trees) and tests/unit/test_replay.py's FakeRing.
"""

from __future__ import annotations

import collections
import functools
import random
from collections.abc import Sequence

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ReplayRunning, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.speculation.predictors import Draft, ExitGuess
from pipeline.speculation.sampling import Sampler, SamplingParams
from tests.adversarial_predictors import RandomTreePredictor, ReferenceTable, SiblingRescuePredictor
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_tiny_model
from tests.unit import test_replay as replay
from tests.unit.test_local_draft import LocalFakePipeline
from tests.unit.test_logit_bias import BANNED, BIAS, PROMPTS, _reference
from tests.unit.test_speculation_scheduler import (
    MAX_MODEL_LEN,
    SAMPLING_VOCAB,
    FakePipeline,
    _submits,
    fake_argmax,
    fake_logits,
)
from tests.unit.test_token_tree_pipeline import _stages

SETTINGS = [dict(), dict(temperature=1.0, seed=11)]
SETTING_IDS = ["greedy", "seeded"]
KINDS = ["biased-away", "raw-argmax", "random"]


def _params(setting: dict, bias=BIAS, n: int = 12) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logit_bias=bias, **setting)


class Proposer:
    """A draft source for every path: the biased-away token, the unbiased argmax (`argmax_fn`), or
    a seeded random token; `alternatives` adds the other two as token-tree siblings."""

    name = "proposer"

    def __init__(self, kind: str, *, banned: int, vocab: int, argmax_fn, exit_driven: bool = False) -> None:
        self.kind, self.banned, self.vocab, self.argmax_fn = kind, banned, vocab, argmax_fn
        self.needs_exit_head = exit_driven
        self.rng = random.Random(3)

    def token(self, context: Sequence[int]) -> int:
        if self.kind == "biased-away":
            return self.banned
        return self.argmax_fn(list(context)) if self.kind == "raw-argmax" else self.rng.randrange(self.vocab)

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft:
        return Draft(self.token(context), 1.0, self.name)

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        return [Draft(t, 0.5, self.name) for t in (self.banned, self.argmax_fn(list(context)),
                                                   self.rng.randrange(self.vocab))]


# -- FIRP chains ---------------------------------------------------------------------------------------
class FirpFakePipeline(FakePipeline):
    """FakePipeline whose last stage returns every result row of an item (a FIRP chain verifies
    each of its drafts) and each item's FIRP pseudo-row drafts: from each of its last `firp_anchors`
    rows a chain of `firp_k` tokens made by `proposer`."""

    def __init__(self, *args, proposer: Proposer, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proposer = proposer

    def pump(self, events=()) -> None:
        super().pump([self._with_firp(e) if isinstance(e, Result) else e for e in events])

    def _with_firp(self, result: Result) -> Result:
        content, tokens, logits, firp = self.contents[self.num_stages - 1], [], [], []
        for it in result.items:
            seq = content[it.slot]
            for p in range(it.end - it.num_result_rows, it.end):
                tokens.append(fake_argmax(seq[:p + 1]))
                logits += [fake_logits(seq[:p + 1])] if it.want_logits else []
            for a in range(it.firp_anchors):
                chain = list(seq[:it.end - it.firp_anchors + a + 1])
                for _ in range(it.firp_k):
                    chain.append(self.proposer.token(chain))
                    firp.append(chain[-1])
        return Result(items=result.items, token_ids=torch.tensor(tokens, dtype=torch.int64),
                      logits=torch.stack(logits) if logits else None, firp_tokens=torch.tensor(firp, dtype=torch.int64))


def _run_firp(params: SamplingParams, *, num_stages: int, kind: str | None, speed: bool = False):
    """(tokens per prompt, engine): plain decoding when kind is None, else FIRP chains (+ SPEED)."""
    proposer = Proposer(kind or "random", banned=BANNED, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax)
    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                             speculate=speed, firp_k=0 if kind is None else 2)
    engine = Engine(config, proposer if speed else None)
    fake = FirpFakePipeline(engine, _submits(PROMPTS, params), next_fn=fake_argmax, logits_fn=fake_logits,
                            proposer=proposer)
    outputs = fake.run()
    return [outputs[i] for i in range(len(PROMPTS))], engine


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("num_stages", "speed"), [(1, False), (2, False), (2, True)], ids=["firp-1", "firp-2", "speed+firp-2"])
def test_firp_chains_commit_the_biased_plain_tokens(num_stages, speed, kind, setting):
    """FIRP drafts (and SPEED drafts beside them) are verified on the biased logits: the output is
    the biased plain decoding's, which the bias changed, and the chains were really verified."""
    params = _params(setting)
    want = [_reference(p, params) for p in PROMPTS]
    assert _run_firp(params, num_stages=num_stages, kind=None)[0] == want, "plain decoding is not the oracle"
    assert want != [_reference(p, _params(setting, bias={})) for p in PROMPTS], "the bias changed nothing"
    got, engine = _run_firp(params, num_stages=num_stages, kind=kind, speed=speed)
    assert got == want, f"FIRP chains ({kind}) changed the biased output"
    assert engine.spec.firp_verified > 0, "no FIRP draft was verified"


# -- stage-local drafting -------------------------------------------------------------------------------
class BiasedLocalPipeline(LocalFakePipeline):
    """LocalFakePipeline whose results carry the logits rows of items that want them (fake_logits)."""

    def _send(self, channel: str, event) -> None:
        if isinstance(event, Result) and any(it.want_logits for it in event.items):
            content = self.contents[self.num_stages - 1]
            rows = [fake_logits(content[it.slot][:it.end]) for it in event.items if it.want_logits]
            event = Result(items=event.items, token_ids=event.token_ids, logits=torch.stack(rows))
        super()._send(channel, event)


def _run_local(params: SamplingParams, *, num_stages: int, kind: str, replay_at: int | None = None):
    """(tokens per prompt, fake): each prompt alone (a full pipeline leaves the stage no draft)."""
    runs = [_run_local_one(prompt, params, num_stages=num_stages, kind=kind, replay_at=replay_at)
            for prompt in PROMPTS]
    return [tokens for tokens, _ in runs], sum(fake.self_made for _, fake in runs)


def _run_local_one(prompt: list[int], params: SamplingParams, *, num_stages: int, kind: str, replay_at: int | None):
    proposer = Proposer(kind, banned=BANNED, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax, exit_driven=True)
    engine = Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                                    speculate=True, draft_at_stage=True), proposer)
    fake = BiasedLocalPipeline(engine, _submits([prompt], params), predictor=proposer, seed=1, max_delay=(2, 2),
                               replay_at=replay_at)
    fake.next_fn = fake_argmax
    outputs = fake.run()
    return outputs.get(0, []), fake


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_stages", [2, 3])
def test_stage_made_drafts_commit_the_biased_plain_tokens(num_stages, kind, setting):
    """Drafts the exit stage makes itself (`--draft-at stage`) are verified on the biased logits,
    also across a replay after a stage restart that drops them all."""
    params = _params(setting)
    want = [_reference(p, params) for p in PROMPTS]
    assert want != [_reference(p, _params(setting, bias={})) for p in PROMPTS], "the bias changed nothing"
    got, self_made = _run_local(params, num_stages=num_stages, kind=kind)
    assert got == want, f"stage-local {kind} drafts changed the biased output"
    assert self_made > 0, "the stage made no draft"
    assert _run_local(params, num_stages=num_stages, kind=kind, replay_at=9)[0] == want, "a replay changed it"


# -- replay after a stage restart -------------------------------------------------------------------------
def _replay_reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """Plain decoding of test_replay's fake model with the bias written out per token."""
    out, sampler = [], Sampler(params)
    for position in range(params.max_new_tokens):
        row = replay._logits((prompt + out)[-3:])
        for t, b in params.logit_bias:
            row[t] += b
        out.append(int(torch.argmax(row)) if params.is_greedy else sampler.sample(row, position))
    return out


def _run_replay(params: SamplingParams, proposer: Proposer | None, replay_at: set[int]) -> dict[int, list[int]]:
    """test_replay._run with a chosen predictor: drive an engine over the FakeRing, losing everything
    in flight (a stage restart) at the ticks in `replay_at`."""
    engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=3, max_model_len=256, speculate=proposer is not None),
                    proposer, record_timeline=False)
    return drive_replays(engine, params, replay_at)[0]


def drive_replays(engine: Engine, params: SamplingParams, replay_at: set[int]) -> tuple[dict[int, list[int]], list[str]]:
    """Submit replay.PROMPTS to `engine` over a FakeRing until every sequence finishes, losing everything in
    flight (a stage restart) at the ticks in `replay_at`. Returns (seq_id -> committed tokens, commit errors)."""
    ring, outputs, errors = replay.FakeRing(), collections.defaultdict(list), []

    def step(events) -> None:
        out = engine.step(events)
        ring.take(out)
        for c in out.commits:
            outputs[c.seq_id].extend(c.token_ids)
            if c.error is not None:
                errors.append(c.error)

    step([Submit(seq_id=i, prompt_ids=tuple(p), params=params) for i, p in enumerate(replay.PROMPTS)])
    tick = 0
    while engine.has_unfinished:
        tick += 1
        if tick in replay_at:
            ring.lose_everything()
            step([ReplayRunning()])
        else:
            step([ring.result()])
    return dict(outputs), errors


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", [None, *KINDS])
def test_a_replay_after_a_stage_restart_keeps_the_biased_plain_tokens(kind, setting):
    """After a stage restart every running sequence is replayed as a prefill; its later tokens (and
    drafts verified after it) still go through the bias."""
    bias = {replay._next(p[-3:]): -100.0 for p in replay.PROMPTS} | {5: 2.5}
    params = _params(setting, bias=bias)
    want = {i: _replay_reference(p, params) for i, p in enumerate(replay.PROMPTS)}
    unbiased = {i: _replay_reference(p, _params(setting, bias={})) for i, p in enumerate(replay.PROMPTS)}
    assert want != unbiased, "the bias changed nothing"
    proposer = None if kind is None else Proposer(kind, banned=next(iter(bias)), vocab=replay.VOCAB,
                                                  argmax_fn=lambda c: replay._next(c[-3:]))
    for replays in (set(), {4}, {2, 9}, {5, 6, 14}):
        assert _run_replay(params, proposer, replays) == want, (kind, replays)


# -- token trees -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_stages(tmp_path_factory):
    return _stages(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4), 2, "none")


TREE_PROMPTS = [[5, 17, 200, 33, 9], [44, 3, 12]]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", [*KINDS, "random-tree", "sibling-rescue"])
def test_token_trees_commit_the_biased_plain_tokens(tiny_stages, kind, setting):
    """Tree drafts and their siblings (`--draft-tree 3`, tiny model, 2 stages) are verified on the
    biased logits, the sibling rescue included."""
    unbiased = InProcessPipeline(tiny_stages, max_model_len=64).generate(TREE_PROMPTS, _params(setting, bias={}))
    banned = unbiased[0][0]
    params = _params(setting, bias={banned: -100.0, unbiased[1][2]: -100.0, 7: 4.0})
    want = [InProcessPipeline(tiny_stages, max_model_len=64).generate([p], params)[0] for p in TREE_PROMPTS]
    assert want != unbiased, "the bias changed nothing"
    vocab = tiny_stages[0].config.vocab_size
    argmax = _tiny_argmax(tiny_stages)
    predictor = {"random-tree": lambda: RandomTreePredictor(seed=3, vocab_size=vocab),
                 "sibling-rescue": lambda: SiblingRescuePredictor(ReferenceTable(zip(TREE_PROMPTS, want, strict=True)),
                                                                  vocab_size=vocab, seed=1, p_right=0.3),
                 }.get(kind, lambda: Proposer(kind, banned=banned, vocab=vocab, argmax_fn=argmax))()
    for prompt, expected in zip(TREE_PROMPTS, want, strict=True):  # one at a time: a lone sequence drafts most
        pipe = InProcessPipeline(tiny_stages, max_model_len=64, predictor=predictor, draft_tree=3)
        assert pipe.generate([prompt], params) == [expected], f"{kind} tree drafts changed the biased output"
        assert pipe.engine.tree.tree_verified > 0, "no tree draft was verified"


def _tiny_argmax(stages):
    """The unbiased greedy next token of the tiny model after a context (a plain one-token run)."""
    @functools.cache
    def argmax(context: tuple[int, ...]) -> int:
        pipe = InProcessPipeline(stages, max_model_len=64)
        return pipe.generate([context], SamplingParams(max_new_tokens=1, ignore_eos=True))[0][0]
    return lambda context: argmax(tuple(context))
