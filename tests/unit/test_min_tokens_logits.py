"""A greedy request with min_tokens ships logits rows only while the mask acts ([Note: token masks] in
pipeline/speculation/masks/token_masks.py; `SamplingParams.needs_logits_at`).

What breaks when these fail: the engine keeps asking the last stage for full-vocabulary logits rows after
min_tokens tokens are out (when a greedy step needs only the argmax), or stops too early (a row before
min_tokens verified on the raw argmax lets EOS or a stop id through), on plain decoding, SPEED drafts and
FIRP chains. The counting side records every item the engine sends and every logits row a result carries;
the output oracle is `reference` of tests/unit/test_token_masks_paths.py (token-by-token decoding with the
masks written out as vLLM defines them).
"""

from __future__ import annotations

import pytest

from pipeline.engine.engine import Engine
from pipeline.engine.events import Result
from pipeline.engine.records import SchedulerConfig
from pipeline.speculation.sampling import SamplingParams
from tests.unit.test_logit_bias_paths import FirpFakePipeline, Proposer
from tests.unit.test_speculation_scheduler import (
    MAX_MODEL_LEN,
    SAMPLING_VOCAB,
    FakePipeline,
    _submits,
    fake_argmax,
    fake_logits,
)
from tests.unit.test_token_masks_paths import EOS, PROMPTS, STOP, reference

MIN_TOKENS = 7


class Shipped:
    """Wraps `engine.step`: every item it sends, with the output token its first result row chooses, and the
    logits rows every result brings back (what the last stage shipped)."""

    def __init__(self, engine: Engine, prompts) -> None:
        self.items: list[tuple[int, bool]] = []  # (output token of the first result row, want_logits)
        self.rows_per_result: list[int] = []
        step, prompt_len = engine.step, {i: len(p) for i, p in enumerate(prompts)}

        def recording(events=()):
            for event in events:
                if isinstance(event, Result) and event.items:
                    self.rows_per_result.append(0 if event.logits is None else event.logits.shape[0])
            out = step(events)
            self.items += [(it.end - it.num_result_rows + 1 - prompt_len[it.seq_id], it.want_logits)
                           for batch in out.sends for it in batch]
            return out

        engine.step = recording


def _run(params: SamplingParams, mode: str) -> tuple[list[list[int]], Shipped]:
    proposer = Proposer("raw-argmax", banned=STOP, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax)
    config = SchedulerConfig(num_stages=2, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, eos_token_ids=(EOS,),
                             speculate=mode != "plain", firp_k=2 if mode == "firp" else 0)
    engine = Engine(config, None if mode == "plain" else proposer)
    shipped = Shipped(engine, PROMPTS)
    kinds = dict(next_fn=fake_argmax, logits_fn=fake_logits)
    fake = (FirpFakePipeline(engine, _submits(PROMPTS, params), proposer=proposer, **kinds) if mode == "firp"
            else FakePipeline(engine, _submits(PROMPTS, params), **kinds))
    outputs = fake.run()
    return [outputs.get(i, []) for i in range(len(PROMPTS))], shipped


@pytest.mark.parametrize("mode", ["plain", "speed", "firp"])
def test_a_greedy_min_tokens_request_ships_logits_rows_only_before_min_tokens(mode):
    """Items whose first result row chooses an output token before MIN_TOKENS ask for logits (the EOS and
    stop-id mask needs them), later ones do not, and their results carry no logits rows; the output is
    the masked token-by-token reference's."""
    params = SamplingParams(max_new_tokens=14, min_tokens=MIN_TOKENS, stop_token_ids=(STOP,))
    got, shipped = _run(params, mode)
    assert got == [reference(p, params) for p in PROMPTS]
    assert got != [reference(p, SamplingParams(max_new_tokens=14, stop_token_ids=(STOP,))) for p in PROMPTS], \
        "min_tokens changed nothing"
    late = [want for first, want in shipped.items if first >= MIN_TOKENS]
    early = [want for first, want in shipped.items if first < MIN_TOKENS]
    assert late and not any(late), f"{sum(late)} of {len(late)} items after min_tokens asked for logits rows"
    assert early and all(early), "an item before min_tokens shipped no logits rows"
    assert 0 in shipped.rows_per_result and 0 < sum(shipped.rows_per_result)


@pytest.mark.parametrize("extra", [dict(allowed_token_ids=(0, 1, 3, 4, 5)), dict(temperature=1.0, seed=3),
                                   dict(logprobs=1)], ids=["allowed-ids", "sampled", "logprobs"])
def test_other_settings_keep_shipping_logits_rows_after_min_tokens(extra):
    """A mask that acts at every position, sampling and logprobs need the logits of every row."""
    params = SamplingParams(max_new_tokens=14, min_tokens=MIN_TOKENS, stop_token_ids=(STOP,), **extra)
    _, shipped = _run(params, "speed")
    assert all(want for _, want in shipped.items) and 0 not in shipped.rows_per_result
    assert params.needs_logits_at(MIN_TOKENS + 5)
    assert not SamplingParams(max_new_tokens=14, min_tokens=MIN_TOKENS).needs_logits_at(MIN_TOKENS)
    assert SamplingParams(max_new_tokens=14, min_tokens=MIN_TOKENS).needs_logits_at(MIN_TOKENS - 1)
