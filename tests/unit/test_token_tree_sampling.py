"""Token trees with sampling ([Note: token trees] in pipeline/speculation/tree.py, sampling).

What breaks when these fail: a sampled sequence's tree draft changes the output distribution (the
token at a drafted position is accepted more often than p says because a sibling matched it, or a
rescued sibling's next token is drawn from the wrong row's logits, say the primary's); or the
sibling rows' logits do not come back, so no rescue can happen under sampling.
Reference: plain sampling in the same in-process stages, compared by chi-square homogeneity tests
(tests/chi_square.py). The tiny model is sharpened as in tests/distributed/test_speculation_tiny.py
([Note: sharp tiny model]) so temperature-1 sampling concentrates on a few tokens.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import pytest
from safetensors.torch import load_file, save_file

from pipeline.model.partition import LayerRange
from pipeline.speculation.predictors import Draft, ExitGuess
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.quant_load import load_stage_model
from tests.chi_square import CHI2_ALPHA, CHI2_CRITICAL, chi_square, top_k_counts
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_tiny_model

PROMPT = [5, 17, 200, 33, 9, 81, 140, 7, 99]
NUM_SAMPLES = 300
NORM_SCALE = 16.0


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * NORM_SCALE
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return [load_stage_model(str(folder), LayerRange(a, b), is_first=a == 0, is_last=b == 4, quantization="none")
            for a, b in ((0, 2), (2, 4))]


class FixedTree:
    """Drafts `primary` with the sibling `sibling` for the 2nd generated token, at send time."""

    name = "fixed-tree"
    needs_exit_head = False

    def __init__(self, primary: int, sibling: int) -> None:
        self.primary, self.sibling = primary, sibling

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        return Draft(self.primary, 1.0, self.name) if len(context) == len(PROMPT) + 1 else None

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        return [Draft(self.sibling, 0.5, self.name)]

    def observe(self, *args, **kwargs) -> None:
        pass


def _params(base: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=3, temperature=1.0, seed=base + i, ignore_eos=True)
            for i in range(NUM_SAMPLES)]


def test_tree_drafts_keep_the_sampled_distribution_and_rescue_from_the_siblings_row(stages):
    plain = InProcessPipeline(stages, max_model_len=32, max_num_seqs=1).generate([PROMPT] * NUM_SAMPLES, _params(0))
    second = collections.Counter(o[1] for o in plain).most_common(2)
    assert len(second) == 2 and second[1][1] >= NUM_SAMPLES // 20, second  # the sharp model has two likely 2nd tokens
    likely, runner_up = second[0][0], second[1][0]
    pipe = InProcessPipeline(stages, max_model_len=32, max_num_seqs=1, predictor=FixedTree(runner_up, likely),
                             draft_tree=2)
    spec = pipe.generate([PROMPT] * NUM_SAMPLES, _params(10**6))
    tree = pipe.engine.tree
    assert tree.tree_drafts >= NUM_SAMPLES // 2 and tree.rescues >= NUM_SAMPLES // 10, tree
    for position in (0, 1, 2):
        table, top = top_k_counts([o[position] for o in plain], [o[position] for o in spec])
        stat = chi_square(table)
        assert stat < CHI2_CRITICAL[5], (f"token {position + 1} is distributed differently with tree drafts: chi2 "
                                         f"{stat:.1f} >= {CHI2_CRITICAL[5]} (alpha {CHI2_ALPHA}); {table.tolist()} of {top}")
    # the 3rd token after a rescued 2nd one comes from the sibling's row: its distribution given
    # token 2 = the sibling must be plain sampling's given the same token
    after_plain = [o[2] for o in plain if o[1] == likely]
    after_spec = [o[2] for o in spec if o[1] == likely]
    assert len(after_spec) >= NUM_SAMPLES // 10
    table, top = top_k_counts(after_plain, after_spec)
    stat = chi_square(table)
    assert stat < CHI2_CRITICAL[5], f"token 3 after token 2 = {likely} differs: chi2 {stat:.1f}; {table.tolist()} of {top}"
