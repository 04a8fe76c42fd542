"""The next-layer drafter (`--exit-predictor FILE` of arch next-layer) end to end: real stage
processes, gloo on loopback.

What breaks when these fail: a next-layer file that the coordinator or a stage refuses, a stage
that builds its KV cache before the draft layer (an index error at the draft layer), or guesses
that change committed tokens. The oracle is the single-process reference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.config import ModelConfig
from pipeline.speculation.drafting.drafter import DrafterMap
from pipeline.speculation.drafting.layer_drafter import file_tensors
from pipeline.speculation.predictor_file import model_identity, save_predictor
from pipeline.speculation.sampling import SamplingParams
from tests.distributed.conftest import full_model, reference_generate, session_options

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PROMPTS = ("Once upon a time", "1, 2, 3, 5, 8,", "The quick brown fox")
BUDGETS = (20, 9, 14)
SHAPES = {"2-stage": dict(num_stages=2, layer_split="2,2"), "3-stage": dict(num_stages=3, layer_split="2,1,1")}
EXIT_LAYER = 1  # the last layer of stage 0 in both shapes


@pytest.fixture(scope="module")
def next_layer_file(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A next-layer drafter: the tiny model's layer 2, nudged, + an identity swiglu map."""
    model, _ = full_model(tiny_model_dir)
    layer = copy.deepcopy(model.layers[str(EXIT_LAYER + 1)])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.02 * torch.randn_like(p))
    config = ModelConfig.from_model_dir(tiny_model_dir)
    meta = {"kind": "early-exit", "model": model_identity(tiny_model_dir).to_dict(), "exit_layer": EXIT_LAYER,
            "arch": "next-layer", "corpus": "test", "train_tokens": 0}
    return save_predictor(tmp_path_factory.mktemp("next_layer") / "next.safetensors",
                          file_tensors(layer, DrafterMap(config.hidden_size, mlp_size=16)), meta)


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[str, list[int]]:
    model, tokenizer = full_model(tiny_model_dir)
    return {p: reference_generate(model, tokenizer.encode(p), SamplingParams(max_new_tokens=max(BUDGETS),
                                                                              ignore_eos=True)) for p in PROMPTS}


@pytest.mark.parametrize("mode", ["coordinator", "stage", "tree"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_next_layer_drafter_keeps_greedy_output(tiny_model_dir: Path, next_layer_file: Path, references,
                                                    shape: str, mode: str):
    """Drafted by the coordinator, by the exit stage itself, or as token trees (siblings write the
    draft layer's keys to scratch too, and a rescue copies them on every layer)."""
    extra = {"draft_at": "stage"} if mode == "stage" else {"draft_tree": 3} if mode == "tree" else {}
    options = session_options(tiny_model_dir, speculate="speed", predictor="hybrid",
                              exit_predictor=str(next_layer_file), **extra, **SHAPES[shape])
    with PipelineSession(options, resolve(options)) as session:
        for prompts, budgets in ((PROMPTS[:1], BUDGETS[:1]), (PROMPTS, BUDGETS)):
            params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
            report = run_launch(session, list(prompts), params)
            for prompt, b, out in zip(prompts, budgets, report["outputs"], strict=True):
                assert out["token_ids"] == references[prompt][:b], f"{shape}/{mode}: output of {prompt!r} changed"
            if len(prompts) == 1:  # one sequence leaves the pipeline idle slots on every step: drafts must run.
                # Three sequences on 2-3 stages fill it; whether the short tail after two finish verifies a
                # draft depends on timing (a CI run under load verified none), so there only the output is checked.
                assert report["stats"]["verified_drafts"] > 0, report["stats"]
