"""Logits rows of stage-made drafts ([Note: stage-local drafting] 1-2 in pipeline/engine/local_draft.py).

What breaks when these fail: a draft the exit stage makes copies its parent's `want_logits`, so a chain
of them that starts before min_tokens is reached on a greedy request keeps asking the last stage for a
float32 [vocab] logits row (and shipping it to the coordinator) past the position where the coordinator
itself stops asking (`SequenceState.wants_logits`, `SamplingParams.needs_logits_at`); or the bound that
prevents it cuts stage drafting where want_logits never changes.

The fake pipeline is tests/unit/test_local_draft.py's (stage 0 runs the real `StageDrafter`), with the
last stage returning a logits row (peaked at the fake model's greedy token) for every item that wants one.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.scheduler import Scheduler
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.unit.test_local_draft import LocalFakePipeline, _config
from tests.unit.test_speculation_scheduler import VOCAB, greedy_reference

PROMPT = [5, 9, 11]
BUDGET = 24


class LogitsFakePipeline(LocalFakePipeline):
    """LocalFakePipeline whose last stage returns logits rows, and records every item it returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.returned = []  # every item of every result, in order

    def _send(self, channel: str, event) -> None:
        if isinstance(event, Result):
            self.returned.extend(event.items)
            content = self.contents[self.num_stages - 1]
            rows = [torch.nn.functional.one_hot(torch.tensor(self.next_fn(content[it.slot][:it.end])), VOCAB).float()
                    for it in event.items if it.want_logits]
            event = Result(items=event.items, token_ids=event.token_ids, logits=torch.stack(rows) if rows else None)
        super()._send(channel, event)


def _run(num_stages: int, params: SamplingParams) -> tuple[Engine, LogitsFakePipeline]:
    predictor = LogitLensPredictor()  # a perfect exit head (lens_offset 0): the stage makes every draft it may
    engine = Engine(_config(num_stages), predictor)
    fake = LogitsFakePipeline(engine, [Submit(seq_id=0, prompt_ids=tuple(PROMPT), params=params)], predictor=predictor)
    outputs = fake.run()
    assert outputs[0] == greedy_reference(PROMPT, BUDGET), "stage-local drafting changed greedy output"
    assert engine.num_inflight == 0 and not engine._early, "a self-made micro-batch was never matched"
    return engine, fake


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("min_tokens", [1, 2, 5, 12, BUDGET])
def test_stage_made_drafts_ask_for_logits_rows_exactly_where_the_coordinator_would(num_stages, min_tokens):
    """A greedy request with min_tokens: the rows choosing output tokens 0 .. min_tokens - 1 need their logits (the
    mask acts there), later ones not. Every item the last stage returned, stage-made drafts included, asked for
    logits exactly where the coordinator's rule does; stage drafts are made on both sides of the boundary."""
    params = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True, min_tokens=min_tokens)
    engine, fake = _run(num_stages, params)
    wrong = [(it.start, it.want_logits, it.self_made) for it in fake.returned if it.kind != ItemKind.PREFILL
             and it.want_logits != params.needs_logits_at(it.start + 1 - len(PROMPT))]
    assert not wrong, f"(start, want_logits, self_made) of items whose logits rows the coordinator decides otherwise: {wrong}"
    made = [it for it in fake.returned if it.self_made]
    assert any(not it.want_logits for it in made) or min_tokens == BUDGET, "no stage draft after min_tokens"
    assert any(it.want_logits for it in made) or min_tokens <= 2, "no stage draft before min_tokens"
    assert engine.spec.accepted_tokens == engine.spec.verified_drafts > 0


@pytest.mark.parametrize("logprobs", [None, 0], ids=["greedy", "logprobs"])
def test_stage_made_drafts_ask_for_logits_rows_throughout_or_never_without_min_tokens(logprobs):
    """No min_tokens: want_logits never changes (off for plain greedy, on with logprobs). The stage makes every draft
    (a perfect exit head), and each asks for logits rows as the coordinator's own items do."""
    params = SamplingParams(max_new_tokens=BUDGET, ignore_eos=True, logprobs=logprobs)
    engine, fake = _run(2, params)
    assert fake.self_made == engine.spec.drafted_tokens > 0, "drafts came from the coordinator"
    assert {it.want_logits for it in fake.returned if it.kind != ItemKind.PREFILL} == {logprobs is not None}


@pytest.mark.parametrize("prompt_len", [1, 3])
@pytest.mark.parametrize("settings", [{}, {"logprobs": 2}, {"temperature": 0.7}, {"repetition_penalty": 1.1},
                                      {"logit_bias": {4: 1.0}}, {"allowed_token_ids": (4, 5)}, {"bad_word_ids": ((4, 5),)}])
@pytest.mark.parametrize("min_tokens", [0, 1, 3, 8])
def test_logits_upto_is_where_the_coordinators_wants_logits_falls(prompt_len, settings, min_tokens):
    """`SequenceState.logits_upto` (what stage-made drafts ask by) against `wants_logits` (what the coordinator
    asks by) at every position an item can hold: True exactly below it."""
    params = SamplingParams(max_new_tokens=8, min_tokens=min_tokens, **settings)
    seq = Scheduler(SchedulerConfig(num_stages=1)).add(0, list(range(3, 3 + prompt_len)), params)
    upto = seq.logits_upto()
    positions = range(prompt_len - 1, prompt_len + params.max_new_tokens - 1)
    assert [seq.wants_logits(q) for q in positions] == [q < upto for q in positions]
