"""OpenAI's logit_bias in the scheduler, plain and under speculation (fake in-process pipeline).

What breaks when these fail: a biased request's token differs between `--speculate` on and off (the
verify of a draft takes the raw argmax, or the last stage returns no logits for a greedy biased
request, so the bias is silently dropped); the bias is applied after the penalties instead of
before (vLLM's order); -100 does not ban a token or +100 does not force one; logprobs report the
biased instead of the raw distribution; bad logit_bias values are accepted or refused without
naming the field.
The pipeline is tests/unit/test_speculation_scheduler.py's FakePipeline (S lock-step stages, the real
engine, scheduler and StageExecutor.admit), whose last stage returns `fake_logits(prefix)` (vocabulary
SAMPLING_VOCAB = 6, logits in {0, 1, 2, 3}).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pytest
import tokenizers
import torch

from launcher.coordinator.request_handle import encode_prompt
from pipeline.engine.engine import Engine
from pipeline.engine.records import SchedulerConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.logprobs import processed_logits
from pipeline.speculation.predictors import Draft, ExitGuess
from pipeline.speculation.sampling import (
    MAX_LOGIT_BIAS_ENTRIES,
    Sampler,
    SamplingParamError,
    SamplingParams,
)
from tests.adversarial_predictors import AlwaysWrongPredictor, RandomPredictor, ReferenceTable
from tests.tiny_model import NUM_BYTE_TOKENS, byte_tokenizer
from tests.unit.test_logprobs_penalties import _reference_penalised
from tests.unit.test_speculation_scheduler import (
    MAX_MODEL_LEN,
    SAMPLING_VOCAB,
    FakePipeline,
    _submits,
    fake_argmax,
    fake_logits,
)

PROMPTS = [[1, 2, 3], [4, 4], [5]]
BANNED = 3  # the biased-away token (-100): a frequent raw argmax of fake_logits
BIAS = {BANNED: -100.0, 1: 1.5, 4: -0.5}


class ConstantPredictor:
    """Always drafts `token` (the biased-away token: every draft must be rejected)."""

    name, needs_exit_head = "constant", False

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        return Draft(self.token, 1.0, self.name)


class RawArgmaxPredictor:
    """Drafts the unbiased model's argmax: right exactly where the bias does not change the token."""

    name, needs_exit_head = "raw-argmax", False

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        return Draft(fake_argmax(context), 1.0, self.name)


def _reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """Sequential decoding of the fake model with the bias written out per token, then the penalties
    (vLLM's order), then greedy argmax or the seeded sampler's draw at that position."""
    out: list[int] = []
    sampler = Sampler(params)
    for position in range(params.max_new_tokens):
        x = fake_logits(prompt + out).tolist()
        for t, b in params.logit_bias:
            x[t] += b
        row = _reference_penalised(torch.tensor(x), params, prompt, out)
        out.append(int(torch.argmax(row)) if params.is_greedy else sampler.sample(row, position))
    return out


def _run(params: SamplingParams, *, num_stages: int, predictor=None, prompts: list[list[int]] = PROMPTS):
    """(tokens per seq, logprobs per seq, speculation counters) through the fake pipeline."""
    logprobs: dict[int, list] = {i: [] for i in range(len(prompts))}

    def sink(commit) -> bool:
        logprobs[commit.seq_id].extend(commit.logprobs or ())
        return False

    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                             speculate=predictor is not None)
    engine = Engine(config, predictor, commit_sink=sink)
    outputs = FakePipeline(engine, _submits(prompts, params), next_fn=fake_argmax, logits_fn=fake_logits).run()
    return [outputs[i] for i in range(len(prompts))], [logprobs[i] for i in range(len(prompts))], engine.spec


def _predictor(kind: str, prompts: list[list[int]], references: list[list[int]], seed: int):
    if kind == "always-wrong":
        table = ReferenceTable(zip(prompts, references, strict=True))
        return AlwaysWrongPredictor(table, vocab_size=SAMPLING_VOCAB)
    if kind == "random":
        return RandomPredictor(seed=seed, vocab_size=SAMPLING_VOCAB)
    return ConstantPredictor(BANNED) if kind == "biased-away" else RawArgmaxPredictor()


SETTINGS = [dict(), dict(temperature=1.0, seed=11), dict(temperature=0.7, seed=5, top_p=0.9),
            dict(repetition_penalty=1.5, frequency_penalty=0.3)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["greedy", "seeded", "seeded-top-p", "greedy-penalties"])
@pytest.mark.parametrize("kind", ["always-wrong", "random", "biased-away", "raw-argmax"])
@pytest.mark.parametrize(("num_stages", "num_seqs"), [(1, 3), (2, 1), (2, 3)])
def test_biased_tokens_are_identical_with_and_without_speculation(num_stages, num_seqs, kind, setting):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=BIAS, **setting)
    prompts = PROMPTS[:num_seqs]
    references = [_reference(p, params) for p in prompts]
    plain, _, _ = _run(params, num_stages=num_stages, prompts=prompts)
    assert plain == references, "plain decoding does not apply the bias (then the penalties) as the oracle"
    spec, _, counters = _run(params, num_stages=num_stages, prompts=prompts,
                             predictor=_predictor(kind, prompts, references, seed=3))
    assert spec == plain, f"{kind} predictor changed the biased output"
    if num_stages > 1 and num_seqs == 1:  # a lone sequence leaves a stage idle for drafts
        assert counters.verified_drafts > 0, "speculation never verified a draft"
    if params.is_greedy:
        assert all(BANNED not in out for out in spec), "a -100 token was chosen by greedy decoding"


@pytest.mark.parametrize("num_stages", [1, 2])
def test_minus_100_bans_the_greedy_token_and_plus_100_forces_a_token(num_stages):
    base = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = _run(base, num_stages=num_stages)[0]
    first = plain[0][0]
    banned = _run(SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias={first: -100}),
                  num_stages=num_stages, predictor=RawArgmaxPredictor())[0]
    assert banned[0][0] != first and all(first not in out for out in banned), "-100 did not ban the greedy token"
    forced_token = 5
    for setting in (dict(), dict(temperature=1.0, seed=2)):
        forced = _run(SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias={forced_token: 100}, **setting),
                      num_stages=num_stages, predictor=RawArgmaxPredictor())[0]
        assert forced == [[forced_token] * 10] * len(PROMPTS), f"+100 did not force the token ({setting})"


def test_logprobs_are_the_raw_models_and_report_the_committed_token():
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias=BIAS, logprobs=2)
    tokens, logprobs, _ = _run(params, num_stages=2, predictor=RawArgmaxPredictor(), prompts=PROMPTS[:1])
    for prompt, out, entries in zip(PROMPTS[:1], tokens, logprobs, strict=True):
        assert [e.token_id for e in entries] == out
        for j, e in enumerate(entries):
            raw = torch.log_softmax(fake_logits(prompt + out[:j]), dim=-1)
            assert e.logprob == pytest.approx(float(raw[e.token_id]), abs=1e-6), "logprob is not the raw model's"


def test_a_greedy_biased_request_asks_the_last_stage_for_logits():
    assert SamplingParams(logit_bias={1: 0.5}).needs_logits_at(0)
    assert not SamplingParams(logit_bias={}).needs_logits_at(0)
    # a bias of 0 changes nothing: such a greedy request ships no logits from the last stage
    assert not SamplingParams(logit_bias={"50256": 0, 3: -0.0}).needs_logits_at(0)


def test_logit_bias_is_kept_as_sorted_pairs_from_a_mapping_or_openai_json():
    assert SamplingParams(logit_bias={7: -100, 2: 3}).logit_bias == ((2, 3.0), (7, -100.0))
    assert SamplingParams(logit_bias={"50256": -100, "0": 100}).logit_bias == ((0, 100.0), (50256, -100.0))
    params = SamplingParams(logit_bias={5: 1})
    assert dataclasses.replace(params, seed=3).logit_bias == params.logit_bias


@pytest.mark.parametrize(("value", "match"), [
    ({1: 100.5}, r"logit_bias of token 1 must be a number in \[-100, 100\], got 100.5"),
    ({1: float("nan")}, "got nan"), ({1: "5"}, "must be a number"), ({1: True}, "must be a number"),
    ({"2": "x" * 1000}, r"got 'xxx.*… \(1000 characters\)$"),
    ({-1: 1}, r"keys must be token ids \(integers >= 0\), got -1"), ({"-1": 1}, "got '-1'"),
    ({"abc": 1}, "got 'abc'"), ({"1.5": 1}, "got '1.5'"), ({" 1": 1}, "got ' 1'"), ({1.0: 1}, "got 1.0"),
    ({"1": 1, "01": 2}, "sets token 1 twice"),
    ({i: 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, f"301 entries; at most {MAX_LOGIT_BIAS_ENTRIES}"),
    ([1, 2], "must be an object of token id -> bias, got list"), ("x", "got str"), (None, "got NoneType"),
])
def test_bad_logit_bias_values_are_refused_naming_the_field(value, match):
    with pytest.raises(SamplingParamError, match=match) as info:
        SamplingParams(logit_bias=value)
    assert info.value.param == "logit_bias" and str(info.value).startswith("logit_bias")


def test_token_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={5: 1.0, 9: -1.0})
    params.check_vocab(10)
    with pytest.raises(SamplingParamError, match=r"logit_bias token id 9 is outside the vocabulary \[0, 9\)"):
        params.check_vocab(9)


def test_the_bias_comes_before_the_repetition_penalty_as_in_vllm():
    params = SamplingParams(logit_bias={1: -2.0}, repetition_penalty=2.0)
    got = processed_logits(torch.tensor([1.0, 0.0, 3.0]), params, prompt_ids=[0, 1], output_ids=[])
    assert got.tolist() == [0.5, -4.0, 3.0]  # penalty first would give -2.0 for token 1


def test_an_added_token_past_the_models_logits_is_refused_not_a_crash(tmp_path):
    """A tokenizer may know an added token past config.json's vocab_size (the logits' rows: Gemma 3
    1B's tokenizer is reported to hold 262145 ids for 262144 rows). A logit_bias on it passed the
    vocabulary check and then raised IndexError where the coordinator biases the logits row."""
    tok = byte_tokenizer()
    tok.add_special_tokens([tokenizers.AddedToken("<extra>", special=True)])  # id NUM_BYTE_TOKENS
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": NUM_BYTE_TOKENS}))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.vocab_size == NUM_BYTE_TOKENS, "an id with no logits row is inside the vocabulary"
    params = SamplingParams(logit_bias={str(NUM_BYTE_TOKENS): -100})
    with pytest.raises(SamplingParamError, match="outside the vocabulary"):
        encode_prompt(tokenizer, [1, 2], params, max_model_len=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # nor may a prompt embed it
        encode_prompt(tokenizer, [1, NUM_BYTE_TOKENS], SamplingParams(), max_model_len=64)
