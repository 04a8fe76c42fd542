"""Token trees end to end: real stage processes, gloo on loopback, `--draft-tree 3`.

What breaks when these fail: sibling rows or the KV fix-up go wrong across processes (the item
columns alt_token_ids / tree_scratch / keep_sibling / exit_top_k lost or misread on the wire, the
exit head's top-k not reaching the coordinator, a stage that does not apply the fix-up in its
in-band squash step), so tree speculation changes greedy output; or the launch report lacks the
tree counters. Oracle: the single-process reference (what `--speculate none` produces,
tests/distributed/test_pipeline_tiny.py). Predictors: always wrong with wrong siblings, random
with random siblings, one whose true token is always a sibling (the rescue path on nearly every
token), and the logit lens (the exit head's top-k as siblings).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.predictors import Draft, LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    RandomTreePredictor,
    ReferenceTable,
    SiblingRescuePredictor,
    SwitchablePredictor,
)
from tests.distributed.conftest import full_model, reference_generate, session_options, sharpen_weights
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

VOCAB = 256
PROMPTS = ("Once upon a time", "1, 2, 3, 5, 8,", "The quick brown fox")
NUM_NEW_TOKENS = 20
SHAPES = {
    "2-stage": dict(num_stages=2, layer_split="3,3"),
    "3-stage-exit-in-stage-1": dict(num_stages=3, layer_split="1,2,3", exit_layer=1),
    "5-stage": dict(num_stages=5, layer_split="1,1,1,1,2"),
}
KINDS = ("always-wrong", "random-tree", "sibling-rescue", "logit-lens")


class AlwaysWrongTree(AlwaysWrongPredictor):
    """Always wrong, and so are its siblings."""

    def alternatives(self, context, guess) -> list[Draft]:
        truth = self.table.true_next(context) or 0
        return [Draft((truth + k) % self.vocab_size, 0.5, self.name) for k in (1, 2, 3)]


@dataclasses.dataclass
class Refs:
    ids: dict[str, list[int]]
    greedy: dict[str, list[int]]
    table: ReferenceTable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 6-layer sharpened tiny model (5 stages need more than the usual 4 layers)."""
    return sharpen_weights(write_tiny_model(tmp_path_factory.mktemp("tiny6") / "model", num_hidden_layers=6))


@pytest.fixture(scope="module")
def refs(model_dir: Path) -> Refs:
    model, tokenizer = full_model(model_dir)
    ids = {p: tokenizer.encode(p) for p in PROMPTS}
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    out = {p: reference_generate(model, ids[p], params) for p in PROMPTS}
    return Refs(ids, out, ReferenceTable((ids[p], out[p]) for p in PROMPTS))


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def session(request, model_dir: Path):
    options = session_options(model_dir, speculate="speed", predictor="logit-lens", draft_tree=3,
                              **SHAPES[request.param])
    switch = SwitchablePredictor(LogitLensPredictor())
    with PipelineSession(options, resolve(options), predictor=switch) as s:
        yield s, switch


def _predictor(kind: str, refs: Refs):
    if kind == "always-wrong":
        return AlwaysWrongTree(refs.table, vocab_size=VOCAB)
    if kind == "random-tree":
        return RandomTreePredictor(seed=5, vocab_size=VOCAB)
    if kind == "sibling-rescue":
        return SiblingRescuePredictor(refs.table, vocab_size=VOCAB, seed=2, p_right=0.3)
    return LogitLensPredictor()


@pytest.mark.parametrize("num_prompts", [1, 3], ids=["1-prompt", "3-prompts"])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_speculation_gives_the_plain_greedy_tokens(session, refs: Refs, kind: str, num_prompts: int):
    s, switch = session
    switch.use(_predictor(kind, refs))
    prompts = list(PROMPTS[:num_prompts])
    params = [SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)] * len(prompts)
    report = run_launch(s, [refs.ids[p] for p in prompts], params)
    for prompt, out in zip(prompts, report["outputs"], strict=True):
        assert out["token_ids"] == refs.greedy[prompt], f"{kind}: token trees changed the greedy output of {prompt!r}"
    stats = report["stats"]
    for key in ("tree_drafts", "sibling_rows", "tree_verified", "tree_hits", "rescues", "tree_acceptance"):
        assert key in stats, sorted(stats)
    if num_prompts == 1:
        assert stats["tree_drafts"] > 0 and stats["tree_verified"] > 0, stats
    if kind == "sibling-rescue" and num_prompts == 1:
        assert stats["rescues"] > 0.3 * stats["tree_verified"], stats
    if kind == "always-wrong":
        assert stats["rescues"] == 0 and stats["accepted_tokens"] == 0, stats


def test_sampled_tree_drafts_cross_the_wire_with_their_siblings_logits(session, refs: Refs, model_dir: Path):
    """Sampling ([Note: token trees], sampling): the last stage process returns the sibling rows'
    logits and the coordinator rescues from them (the distribution test against plain sampling is
    tests/unit/test_token_tree_sampling.py). Each draw is keyed by (seed, position) ([Note:
    position-keyed draws] in pipeline/speculation/sampling.py), so the output is the single-process
    sampled reference, and the predictor puts that reference's next token among the siblings."""
    s, switch = session
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
    want = reference_generate(full_model(model_dir)[0], refs.ids[prompt], params)
    assert want != refs.greedy[prompt]  # really sampled
    switch.use(SiblingRescuePredictor(ReferenceTable([(refs.ids[prompt], want)]), vocab_size=VOCAB, seed=2))
    report = run_launch(s, [refs.ids[prompt]], [params])
    stats = report["stats"]
    assert report["outputs"][0]["token_ids"] == want
    assert stats["tree_drafts"] > 0 and stats["rescues"] > 0, stats
