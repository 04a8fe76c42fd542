"""Structured outputs stay exact when one result verifies several rows on a real model.

What breaks when this fails: a FIRP chain accepted past its first row commits a later row's token without
the grammar's mask (or with the mask of the wrong prefix), on real StageModels in process
(tests/in_process_pipeline.py) rather than the fake pipelines of tests/unit/test_grammar_paths.py. The
chains draft plain masked decoding's own tokens (`OracleFirpPipeline`): allowed by the grammar but often
not the raw argmax of the tiny random model, so a row chosen unmasked commits a different token.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.in_process_pipeline import InProcessPipeline
from tests.unit import test_grammar_paths as paths
from tests.unit.test_grammar_paths import PROMPTS, SETTINGS, SPECS, _params
from tests.unit.test_token_tree_pipeline import _stages

tiny_dir, vocab, references = paths.tiny_dir, paths.vocab, paths.references  # that module's fixtures

FIRP_K = 3


class OracleFirpPipeline(InProcessPipeline):
    """FIRP chains that draft `outputs[seq_id]` (prompt + reference output) after each anchor row 80% of the
    time (a random byte otherwise): chains are accepted over several rows and also rejected."""

    def __init__(self, *args, outputs: dict[int, list[int]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refs, self.rng = outputs, random.Random(11)

    def firp_drafts(self, items, firp_tokens: torch.Tensor) -> torch.Tensor:
        out = []
        for it in items:
            ref = self.refs[it.seq_id]
            for a in range(it.firp_anchors if it.firp_k else 0):
                anchor = it.end - it.firp_anchors + a  # the chain drafts the positions after this row's token
                for p in range(anchor + 2, anchor + 2 + it.firp_k):
                    good = p < len(ref) and self.rng.random() < 0.8
                    out.append(ref[p] if good else self.rng.randrange(256))
        assert len(out) == len(firp_tokens), (len(out), len(firp_tokens))
        return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("steered", [False, True], ids=["unsteered", "grammar-drafts"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_real_model_firp_chains_commit_the_masked_plain_tokens(tiny_dir, vocab, references, name, setting, steered):
    """2 stages, FIRP chains of 3 rows on the tiny model: plain masked decoding's tokens, with some chain
    accepted past its first row (a multi-row verify where the mask decides later rows). Unsteered (grammar-aware
    drafting off), the chains' forbidden random drafts reach the verifier and some chain is rejected; with
    grammar-aware drafting they are cut before they are sent ([Note: grammar-aware drafting])."""
    want = [references[name, setting, i] for i in range(len(PROMPTS))]
    stages = _stages(tiny_dir, 2, "none")
    pipe = OracleFirpPipeline(stages, max_model_len=64, grammar_vocab=vocab, firp_k=FIRP_K, grammar_drafts=steered,
                              outputs={i: [*p, *w] for i, (p, w) in enumerate(zip(PROMPTS, want, strict=True))})
    assert pipe.generate(PROMPTS, _params(SPECS[name], setting)) == want, "FIRP chains changed the constrained output"
    spec = pipe.engine.spec
    assert spec.firp_accepted >= 2, (spec.firp_accepted, spec.firp_verified)
    if not steered:
        assert spec.firp_verified > spec.firp_accepted, (spec.firp_accepted, spec.firp_verified)


@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "one-per-item"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["json_schema", "choice"])
def test_real_model_speed_firp_with_jump_items_commits_the_masked_plain_tokens(tiny_dir, vocab, references, name,
                                                                                setting, jump):
    """SPEED+FIRP on 2 stages of the tiny model: run-ahead drafts (`MostlyRightPredictor`), FIRP chains of 3 rows
    and grammar jump-forward items (a forced run as one multi-row draft, verified as a chain on the real
    model) give plain masked decoding's tokens; the jump rows, all accepted, never count as FIRP drafts."""
    want = [references[name, setting, i] for i in range(len(PROMPTS))]
    outputs = {i: [*p, *w] for i, (p, w) in enumerate(zip(PROMPTS, want, strict=True))}
    table = paths.ReferenceTable(zip(PROMPTS, want, strict=True))
    for i, prompt in enumerate(PROMPTS):  # one at a time: a lone sequence leaves room to draft
        pipe = OracleFirpPipeline(_stages(tiny_dir, 2, "none"), max_model_len=64, grammar_vocab=vocab, firp_k=FIRP_K,
                                  predictor=paths.MostlyRightPredictor(table), grammar_jump=jump,
                                  outputs={0: outputs[i]})
        assert pipe.generate([prompt], _params(SPECS[name], setting)) == [want[i]], "jump items changed the output"
        spec = pipe.engine.spec
        assert spec.jump_accepted == spec.jump_verified and (jump or spec.grammar_jump_tokens == 0), spec
        assert sum(pipe.engine.scheduler.rows.verified) <= spec.firp_verified, "jump rows in RowBudget's depth table"
