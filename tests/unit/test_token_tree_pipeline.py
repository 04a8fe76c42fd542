"""Token trees end to end in the in-process pipeline ([Note: token trees] in pipeline/speculation/tree.py).

What breaks when these fail: a rescued sibling commits a token plain greedy decoding would not
make (its row saw the primary's key, or the KV fix-up kept the wrong entry, so later tokens
drift); a rescue loses, duplicates or reorders a token; drafts after a rescued item run on the
primary's KV. Reference: the same stages with `--speculate none`. Predictors: always wrong (no
sibling ever right), random with random siblings, and one whose true token is always a sibling
(so the rescue path runs on nearly every token), in the exact int4 mode and float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.model.partition import LayerRange
from pipeline.speculation.predictors import Draft, LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.speculation.tree import TreeCounters
from pipeline.weights.checkpoint import CheckpointReader
from pipeline.weights.quant_load import load_stage_model
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    RandomTreePredictor,
    ReferenceTable,
    SiblingRescuePredictor,
)
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_tiny_model

PROMPTS = [[5, 17, 200, 33, 9, 81, 140, 7, 99], [44, 3, 12], [250, 1, 77, 77, 8, 91]]
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4)


def _stages(folder, num_stages: int, mode: str):
    n = CheckpointReader(folder).config.num_hidden_layers
    bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
    return [load_stage_model(str(folder), LayerRange(bounds[i], bounds[i + 1]), is_first=i == 0,
                             is_last=i == num_stages - 1, quantization=mode) for i in range(num_stages)]


class AlwaysWrongTree(AlwaysWrongPredictor):
    """Always wrong, and so are its siblings."""

    def alternatives(self, context, guess) -> list[Draft]:
        truth = self.table.true_next(context) or 0
        return [Draft((truth + k) % self.vocab_size, 0.5, self.name) for k in (1, 2, 3)]


def _predictor(kind: str, table: ReferenceTable, vocab: int):
    if kind == "logit-lens":  # the exit head's top-k (Item.exit_top_k) as siblings
        return LogitLensPredictor()
    if kind == "always-wrong":
        return AlwaysWrongTree(table, vocab_size=vocab)
    if kind == "random-tree":
        return RandomTreePredictor(seed=3, vocab_size=vocab)
    return SiblingRescuePredictor(table, vocab_size=vocab, seed=1, p_right=0.3)


# (the in-process exit head copies a dense LM head: logit-lens in float32 only)
KINDS = [(k, m) for k in ("always-wrong", "random-tree", "sibling-rescue") for m in ("int4", "none")]


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("kind,mode", [*KINDS, ("logit-lens", "none")])
def test_tree_drafts_give_the_plain_greedy_tokens(folder, mode, num_stages, kind):
    stages = _stages(folder, num_stages, mode)
    vocab = stages[0].config.vocab_size
    plain = [InProcessPipeline(stages, max_model_len=64).generate([p], PARAMS)[0] for p in PROMPTS]
    table = ReferenceTable(zip(PROMPTS, plain, strict=True))
    pipes = [InProcessPipeline(stages, max_model_len=64, predictor=_predictor(kind, table, vocab), draft_tree=3)
             for _ in range(len(PROMPTS) + 1)]
    for pipe, prompt, want in zip(pipes, PROMPTS, plain, strict=False):  # one at a time: a lone sequence drafts most
        assert pipe.generate([prompt], PARAMS) == [want]
    assert pipes[-1].generate(PROMPTS, PARAMS) == plain  # and all at once, sharing micro-batches
    tree = TreeCounters(*(sum(getattr(p.engine.tree, f.name) for p in pipes) for f in dataclasses.fields(TreeCounters)))
    assert tree.tree_drafts > 0 and tree.sibling_rows >= tree.tree_drafts and tree.tree_verified > 0
    if kind == "sibling-rescue":
        assert tree.rescues > 0.3 * tree.tree_verified, tree  # the rescue path ran on many tokens
        assert tree.tree_acceptance > 0.9, tree
    if kind == "always-wrong":
        assert tree.rescues == 0 and tree.tree_hits == 0, tree


def test_draft_tree_1_sends_no_sibling(folder):
    stages = _stages(folder, 2, "int4")
    plain = [InProcessPipeline(stages, max_model_len=64).generate([p], PARAMS)[0] for p in PROMPTS]
    table = ReferenceTable(zip(PROMPTS, plain, strict=True))
    pipe = InProcessPipeline(stages, max_model_len=64, predictor=SiblingRescuePredictor(table, vocab_size=256))
    assert pipe.generate(PROMPTS, PARAMS) == plain
    assert pipe.engine.tree.tree_drafts == 0 and pipe.engine.spec.accepted_tokens == 0
    assert all(ex.kv.num_scratch == 0 for ex in pipe.executors)  # no scratch grown either


def test_the_kv_scratch_grows_once_per_run_to_what_the_scheduler_can_use(folder, monkeypatch):
    """The first tree item grows every stage's scratch straight to (W - 1) * (max_inflight + 1)
    (`scratch_positions`), never again: no repeated buffer copies on the hot path."""
    from pipeline.model.kv_cache import KVCache
    from pipeline.speculation.tree import scratch_positions

    growths: list[tuple[int, int]] = []
    grow = KVCache.ensure_scratch

    def counting(kv, num_scratch):
        before = kv.num_scratch
        grow(kv, num_scratch)
        if kv.num_scratch != before:
            growths.append((id(kv), kv.num_scratch))
    monkeypatch.setattr(KVCache, "ensure_scratch", counting)
    stages = _stages(folder, 3, "int4")
    plain = [InProcessPipeline(stages, max_model_len=64).generate([p], PARAMS)[0] for p in PROMPTS]
    table = ReferenceTable(zip(PROMPTS, plain, strict=True))
    pipe = InProcessPipeline(stages, max_model_len=64, predictor=_predictor("sibling-rescue", table, 256),
                             draft_tree=3)
    assert pipe.generate(PROMPTS[:1], PARAMS) == plain[:1]  # a lone sequence drafts most
    assert pipe.engine.tree.tree_verified > 0
    want = scratch_positions(3, pipe.engine.scheduler.config.max_inflight)
    assert sorted(growths) == sorted((id(ex.kv), want) for ex in pipe.executors), growths


def test_sampled_sequences_send_siblings_and_get_their_logits_back(folder):
    """Trees under sampling ([Note: token trees], sampling; the distribution test is
    tests/unit/test_token_tree_sampling.py): the siblings go out, and their rows' logits come back."""
    stages = _stages(folder, 2, "int4")
    table = ReferenceTable([])
    pipe = InProcessPipeline(stages, max_model_len=64, predictor=SiblingRescuePredictor(table, vocab_size=256),
                             draft_tree=3)
    logit_rows = []
    take = pipe.engine.scheduler.on_result

    def spy(returned, token_ids, logits, *args, **kwargs):
        logit_rows.append((sum(it.num_result_rows for it in returned if it.want_logits),
                           0 if logits is None else logits.shape[0]))
        return take(returned, token_ids, logits, *args, **kwargs)
    pipe.engine.scheduler.on_result = spy
    out = pipe.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12, temperature=0.8, seed=1))
    assert len(out[0]) == 12 and pipe.engine.tree.tree_drafts > 0
    assert pipe.engine.tree.sibling_rows >= pipe.engine.tree.tree_drafts
    assert all(want == got for want, got in logit_rows) and max(want for want, _ in logit_rows) >= 2, logit_rows


def test_bad_draft_tree_exits_2_with_one_line(capsys):
    from launcher.cli.main import main

    for value in ("0", "9"):
        assert main(["launch", "--speculate", "speed", "--draft-tree", value, "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--draft-tree" in err and value in err
    assert main(["launch", "--speculate", "none", "--draft-tree", "2", "--prompt", "hi"]) == 2  # trees need SPEED drafts
    assert "speculate speed" in capsys.readouterr().err
    # dense bfloat16 is not batch-invariant: tree rows would change greedy output
    assert main(["launch", "--speculate", "speed", "--draft-tree", "2", "--dtype", "bfloat16", "--prompt", "hi"]) == 2
    assert "float32 or an int mode" in capsys.readouterr().err
    # stage-local drafting makes drafts without siblings: the combination is refused, not half-built
    assert main(["launch", "--speculate", "speed", "--draft-tree", "2", "--draft-at", "stage", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--draft-at coordinator" in err


def test_tree_items_cross_the_wire_with_their_columns():
    from pipeline.speculation.items import Item, ItemKind, items_from_wire, items_to_wire

    items = [Item(seq_id=3, slot=1, start=9, num_tokens=1, kind=ItemKind.DRAFT, token_ids=(5,), alt_token_ids=(7, 8),
                  tree_scratch=4, exit_top_k=3),
             Item(seq_id=4, slot=0, start=6, num_tokens=1, token_ids=(2,), keep_sibling=5)]
    assert items_from_wire(items_to_wire(items)) == items
    assert items[0].num_rows == 3 and items[0].input_ids == (5, 7, 8) and items[0].num_result_rows == 3
    with pytest.raises(ValueError, match="siblings need a one-token draft"):
        Item(seq_id=3, slot=1, start=9, num_tokens=1, token_ids=(5,), alt_token_ids=(7,))


class PoisonDrafts(AlwaysWrongPredictor):
    """Drafts (and tree siblings) the one token whose embedding row holds NaN."""

    def __init__(self, table: ReferenceTable, *, vocab_size: int, poison: int) -> None:
        super().__init__(table, vocab_size=vocab_size)
        self.poison = poison

    def propose(self, context, guess) -> Draft:
        return Draft(self.poison, 1.0, self.name)

    def alternatives(self, context, guess) -> list[Draft]:
        truth = self.table.true_next(context) or 0
        return [Draft(self.poison, 0.5, self.name), Draft((truth + 1) % self.vocab_size, 0.5, self.name)]


@pytest.mark.parametrize("draft_tree", [1, 3])
def test_drafts_of_a_token_with_nan_weights_leave_the_output_as_plain_decodings(folder, draft_tree):
    """End to end, as a control of [Note: non-finite logits]: a token whose embedding row is NaN
    makes every row at or after it non-finite. Plain decoding never makes that token here; drafts of
    it are always rejected, and their items squashed before their rows are read, so the output must
    be plain decoding's, not an error. (The rule for a non-finite row inside an item that is read,
    after a rejected FIRP draft, is tested at the scheduler: test_speculation_scheduler.py.)"""
    stages = _stages(folder, 2, "none")
    plain = [InProcessPipeline(stages, max_model_len=64).generate([p], PARAMS)[0] for p in PROMPTS]
    poison = next(t for t in range(stages[0].config.vocab_size) if all(t not in p + o for p, o in zip(PROMPTS, plain, strict=False)))
    table = ReferenceTable(zip(PROMPTS, plain, strict=True))
    with torch.no_grad():
        stages[0].embed_tokens.weight[poison] = float("nan")
    predictor = PoisonDrafts(table, vocab_size=stages[0].config.vocab_size, poison=poison)
    pipes = [InProcessPipeline(stages, max_model_len=64, draft_tree=draft_tree, predictor=predictor) for _ in PROMPTS]
    assert [pipe.generate([p], PARAMS)[0] for pipe, p in zip(pipes, PROMPTS, strict=False)] == plain  # alone: drafts run
    assert sum(p.engine.spec.verified_drafts for p in pipes) > 0
    assert sum(p.engine.spec.accepted_tokens for p in pipes) == 0
