"""The replay event (pipeline/engine/events.py `ReplayRunning`, [Note: replay] in pipeline/engine/engine.py).

What breaks when these fail: after a stage restart (launcher/coordinator/stage_failover.py) a running request
loses, repeats or reorders tokens, or continues from a KV cache that no stage holds any more.

The fake ring below stands in for the stages: a micro-batch comes back after the ones sent before
it (FIFO), each stage's epoch rule is the real one (`admit_epochs`), the "KV cache" of a slot is
the list of tokens written into it, and the "model" is a fixed function of the context. A replay
drops every micro-batch in flight and every slot's contents, as a restarted pipeline does. The
reference output is computed from the model function directly, not by the engine.
"""

from __future__ import annotations

import collections
import random
import zlib

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ReplayRunning, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.stage_executor import admit_epochs
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import NGramPredictor
from pipeline.speculation.sampling import Sampler, SamplingParams

VOCAB = 40


def _logits(context: list[int]) -> torch.Tensor:
    """[VOCAB] float32 logits: a fixed function of the context (the fake model)."""
    g = torch.Generator().manual_seed(zlib.crc32(bytes(str(context), "ascii")))
    return torch.randn(VOCAB, generator=g)


def _next(context: list[int]) -> int:
    """Greedy next token of the fake model; repetitive enough that n-gram drafts are often right."""
    return int(torch.argmax(_logits(context[-3:])))


class FakeRing:
    """The stages as one FIFO: KV slots as token lists, the stages' epoch rule, results on demand."""

    def __init__(self) -> None:
        self.inflight: collections.deque = collections.deque()
        self.kv: dict[int, list[int]] = {}
        self.epochs: dict[int, int] = {}

    def take(self, out) -> None:
        for r in out.releases:
            self.kv.pop(r.slot, None)
            self.epochs.pop(r.seq_id, None)
        self.inflight.extend(out.sends)

    def lose_everything(self) -> None:
        """A stage died: the work in flight and every KV cache are gone."""
        self.inflight.clear()
        self.kv.clear()
        self.epochs.clear()

    def result(self) -> Result:
        items = list(self.inflight.popleft())
        keep = admit_epochs(self.epochs, items)
        ran, tokens, logits = [], [], []
        for item, current in zip(items, keep, strict=True):
            if not current:
                continue
            kv = self.kv.setdefault(item.slot, [])
            del kv[item.start:]
            kv.extend(item.token_ids)
            rows = range(item.end - item.num_result_rows, item.end)
            tokens += [_next(kv[:p + 1]) for p in rows]
            if item.want_logits:
                logits += [_logits(kv[:p + 1][-3:]) for p in rows]
            ran.append(item)
        return Result(items=tuple(ran), token_ids=torch.tensor(tokens, dtype=torch.int64),
                      logits=torch.stack(logits) if logits else None)


def _run(prompts, params, *, speculate: bool, replay_at: set[int] = frozenset(), on_replay=None):
    """Drive an engine over the fake ring; returns {seq_id: committed tokens, in commit order}."""
    engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=3, max_model_len=256, speculate=speculate),
                    NGramPredictor() if speculate else None, record_timeline=False)
    ring, outputs = FakeRing(), collections.defaultdict(list)

    def step(events):
        out = engine.step(events)
        ring.take(out)
        for c in out.commits:
            outputs[c.seq_id].extend(c.token_ids)
        return out

    step([Submit(seq_id=i, prompt_ids=tuple(p), params=params) for i, p in enumerate(prompts)])
    tick = 0
    while engine.has_unfinished:
        tick += 1
        if tick in replay_at:
            ring.lose_everything()
            out = step([ReplayRunning()])
            if on_replay is not None:
                on_replay(engine, out, dict(outputs))
            continue
        assert ring.inflight, "the engine has unfinished sequences but nothing in flight"
        step([ring.result()])
    return dict(outputs)


def _reference(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(_next(prompt + out))
    return out


PROMPTS = [[5, 6, 7, 5, 6], [9, 1], [3, 3, 3, 8], [11, 12, 13, 14, 15, 16], [2]]


def test_replay_turns_every_running_sequence_into_a_prefill_of_its_committed_context():
    seen = []

    def check(engine, out, committed):
        sched = engine.scheduler
        running = {i for i, s in sched.seqs.items() if s.slot >= 0 and not s.finished}
        assert running, "the replay should find running sequences"
        assert engine.num_inflight == len(out.sends)  # the lost micro-batches are forgotten
        sent = {it.seq_id: it for batch in out.sends for it in batch}
        for seq_id in running:
            item, seq = sent[seq_id], sched.seqs[seq_id]
            assert item.kind == ItemKind.PREFILL and item.start == 0
            assert item.token_ids == tuple(PROMPTS[seq_id]) + tuple(committed.get(seq_id, ()))
            assert item.epoch == seq.epoch >= 1
        seen.append(True)

    _run(PROMPTS, SamplingParams(max_new_tokens=12), speculate=True, replay_at={6}, on_replay=check)
    assert seen


@pytest.mark.parametrize("speculate", [False, True])
def test_no_token_is_lost_repeated_or_reordered_across_replays(speculate):
    """Property, over random replay times: the committed stream equals the model's greedy output."""
    params = SamplingParams(max_new_tokens=15)
    expected = {i: _reference(p, 15) for i, p in enumerate(PROMPTS)}
    assert _run(PROMPTS, params, speculate=speculate) == expected
    rng = random.Random(1234)
    for _ in range(25):
        replays = {rng.randrange(1, 60) for _ in range(rng.randrange(1, 4))}
        assert _run(PROMPTS, params, speculate=speculate, replay_at=replays) == expected, replays


def test_a_seeded_sampled_request_gives_the_same_tokens_after_a_replay_without_speculation():
    """Each draw is keyed by the token's position ([Note: position-keyed draws] in
    pipeline/speculation/sampling.py), so a replay changes no sampled token."""
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)
    undisturbed = _run(PROMPTS[:3], params, speculate=False)
    assert undisturbed[0] != _run(PROMPTS[:3], SamplingParams(max_new_tokens=12, temperature=0.8, seed=8),
                                  speculate=False)[0]
    for replays in ({3}, {2, 9}, {5, 6, 14}):
        assert _run(PROMPTS[:3], params, speculate=False, replay_at=replays) == undisturbed, replays


def test_the_fake_model_is_the_sampler_input():
    """Guard: the fake returns logits for sampled items, so the sampled test really samples."""
    s = Sampler(SamplingParams(max_new_tokens=1, temperature=0.8, seed=1))
    assert s.probs(_logits([1, 2, 3])).max() < 1.0
