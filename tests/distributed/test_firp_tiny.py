"""FIRP (and SPEED + FIRP) end to end on the tiny random model: real stage processes, gloo on loopback.

What breaks when these fail: FIRP chains change greedy output (pseudo rows leaking into a KV
cache, a chain committed past a rejected draft, a truncation that leaves a rejected draft's keys
behind, the wrong anchor's drafts used for the next pass), drafts past the token budget, pseudo
rows lost between stages, or SPEED run-ahead and FIRP chains disagreeing on what is committed.
The FIRP maps are untrained (identity plus noise, tests/tiny_model.py `write_firp_file`), so
drafts are sometimes right and often wrong: both accepted and rejected chains really happen.
The oracle is the single-process reference of tests/distributed/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.launch import run_launch
from launcher.session import PipelineSession, resolve
from pipeline.items import ItemKind
from pipeline.sampling import SamplingParams
from tests.distributed.conftest import full_model, reference_generate, session_options
from tests.tiny_model import write_firp_file

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

PROMPTS = ("Once upon a time", "def f(x):\n    return", "1, 2, 3, 5, 8,", "The quick brown fox")
BUDGETS = (24, 10, 17, 6)

# name -> (session overrides, FIRP layer). The FIRP layer's stage makes the pseudo rows.
SHAPES = {
    "1-stage-firp": (dict(num_stages=1, speculate="firp"), 1),
    "2-stage-firp-mid-stage-0": (dict(num_stages=2, layer_split="2,2", speculate="firp"), 0),
    "2-stage-speed+firp": (dict(num_stages=2, layer_split="2,2", speculate="speed+firp", predictor="logit-lens"), 1),
    "3-stage-firp-in-stage-1": (dict(num_stages=3, layer_split="1,1,2", speculate="firp"), 1),
    "3-stage-speed+firp": (dict(num_stages=3, layer_split="1,2,1", speculate="speed+firp", predictor="logit-lens"), 2),
}


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[str, list[int]]:
    model, tokenizer = full_model(tiny_model_dir)
    return {p: reference_generate(model, tokenizer.encode(p), SamplingParams(max_new_tokens=max(BUDGETS),
                                                                             ignore_eos=True)) for p in PROMPTS}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def firp_session(request, tiny_model_dir: Path, tmp_path_factory):
    overrides, layer = SHAPES[request.param]
    path = write_firp_file(tiny_model_dir, tmp_path_factory.mktemp("firp") / "firp.safetensors", layer=layer, k=3,
                           seed=len(request.param))
    options = session_options(tiny_model_dir, firp_file=str(path), **overrides)
    with PipelineSession(options, resolve(options)) as session:
        yield request.param, session


CONCURRENT_SHAPES = ("2-stage-speed+firp", "3-stage-firp-in-stage-1")  # 4 prompts at once: enough on two shapes


@pytest.mark.parametrize("num_prompts", [1, 4], ids=["1-prompt", "4-prompts"])
def test_greedy_with_firp_chains_equals_plain_decoding(firp_session, references, num_prompts):
    name, session = firp_session
    if num_prompts > 1 and name not in CONCURRENT_SHAPES:
        pytest.skip("concurrent prompts are checked on CONCURRENT_SHAPES")
    prompts = PROMPTS[:num_prompts]
    budgets = BUDGETS[:num_prompts] if num_prompts > 1 else (max(BUDGETS),)
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
    report = run_launch(session, list(prompts), params)
    for prompt, budget, out in zip(prompts, budgets, report["outputs"], strict=True):
        assert out["token_ids"] == references[prompt][:budget], f"{name}: FIRP changed greedy output of {prompt!r}"
        assert out["finish_reason"] == "length"
    stats = report["stats"]
    assert stats["firp_verified"] > 0, f"{name}: no FIRP draft was verified: {stats}"
    if num_prompts == 1:
        assert stats["firp_accepted"] < stats["firp_verified"], f"{name}: no FIRP draft was rejected: {stats}"
        assert stats["tokens_per_pass"] >= 1.0
        kinds = {k for s in session.coordinator.timeline.slices for k in s.kinds}
        assert ItemKind.FIRP in kinds, f"{name}: no FIRP item in the timeline ({kinds})"
