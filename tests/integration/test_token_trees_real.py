"""Token trees on the real default model (SmolLM2-135M-Instruct), 2 stages, `--draft-tree 3`.

What breaks when these fail: sibling rows, the exit head's top-k or the KV fix-up of a rescued
sibling are wrong on the real model (30 layers, GQA, float32), so tree speculation changes greedy
output. Reference: the same model with `--speculate none` (which test_real_model.py checks against
transformers). Predictors: the default hybrid (n-gram + trained exit head, its top-k as siblings)
and one whose true token is always a sibling (the rescue path on nearly every token).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli.launch import run_launch
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.predictors import make_predictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import ReferenceTable, SiblingRescuePredictor, SwitchablePredictor
from tests.integration.test_real_model import PROMPTS  # prompts without greedy near-ties (see there)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
CHOSEN = (0, 2, 6)  # story, question, chat-templated


def _options(model_dir: Path, **kw) -> PipelineOptions:
    return PipelineOptions(num_stages=2, model=str(model_dir), progress=False, max_model_len=512, max_num_seqs=4,
                           threads_per_stage=1, min_acceptance=0.0, **kw)


def test_tree_speculation_on_the_real_model_gives_the_plain_greedy_tokens(smollm2_dir: Path):
    ids = [Tokenizer(smollm2_dir).encode(PROMPTS[i]) for i in CHOSEN]
    plain_opts = _options(smollm2_dir, speculate="none")
    with PipelineSession(plain_opts, resolve(plain_opts)) as s:
        plain = [run_launch(s, [p], [GREEDY])["outputs"][0]["token_ids"] for p in ids]
    tree_opts = _options(smollm2_dir, speculate="speed", predictor="hybrid", draft_tree=3)
    switch = SwitchablePredictor(make_predictor("hybrid"))
    table = ReferenceTable(zip(ids, plain, strict=True))
    with PipelineSession(tree_opts, resolve(tree_opts), predictor=switch) as s:
        for predictor in (make_predictor("hybrid"), SiblingRescuePredictor(table, vocab_size=49152, seed=3)):
            switch.use(predictor)
            rescues = 0
            for prompt, want in zip(ids, plain, strict=True):
                report = run_launch(s, [prompt], [GREEDY])
                assert report["outputs"][0]["token_ids"] == want, f"{predictor.name}: trees changed the output"
                assert report["stats"]["tree_drafts"] > 0, report["stats"]
                rescues += report["stats"]["rescues"]
            if predictor.name == "sibling-rescue":
                assert rescues > 10, rescues
