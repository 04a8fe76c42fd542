"""vLLM's token masks (min_tokens, stop_token_ids, allowed_token_ids, bad_words) on every speculative path.

What breaks when these fail: a masked request's tokens differ from plain token-by-token decoding with the
same masks under SPEED drafts (always-wrong, mostly-right, adversarial and random predictors, 1-3 stages),
FIRP chains, stage-local drafting (`--draft-at stage`), token trees (tiny random model, whose plain
decoding is checked against the same token-by-token reference), a grammar's jump-forward items (a stop token
id inside a forced run) or a replay after a stage restart; typically because a verify path
masks a row with the wrong history (a bad word's prefix or min_tokens counted from the chain instead of
the row's own position), takes the raw argmax (a greedy masked item shipped no logits), commits past a
stop token id, or lets EOS / a stop id through before min_tokens.
The oracle is `reference`: the fake model of tests/unit/test_speculation_scheduler.py decoded token by token
with each mask written out from vLLM's definitions ([Note: token masks] in
pipeline/speculation/masks/token_masks.py), then greedy argmax or the seeded sampler's draw at that position.
Every test also checks that the masks changed the output (so a dropped mask is visible).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.records import SchedulerConfig
from pipeline.model.row_layout import Span
from pipeline.speculation.grammar import GrammarState, GrammarVocab
from pipeline.speculation.sampling import Sampler, SamplingParams
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    RandomPredictor,
    ReferenceTable,
    SometimesRightPredictor,
)
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer, write_tiny_model
from tests.unit import test_grammar_paths as grammar_paths
from tests.unit import test_replay as replay
from tests.unit.test_local_draft import LocalFakePipeline
from tests.unit.test_logit_bias import ConstantPredictor
from tests.unit.test_logit_bias_paths import (
    BiasedLocalPipeline,
    FirpFakePipeline,
    Proposer,
    _tiny_argmax,
    drive_replays,
)
from tests.unit.test_speculation_scheduler import (
    MAX_MODEL_LEN,
    SAMPLING_VOCAB,
    FakePipeline,
    _submits,
    fake_argmax,
    fake_logits,
)
from tests.unit.test_token_tree_pipeline import _stages

PROMPTS = [[1, 2, 3], [4, 4], [5]]
EOS = 2  # the fake model's EOS in these tests
STOP = 4  # a stop token id
MASKS = {
    "min-tokens+stop": dict(min_tokens=7, stop_token_ids=(STOP,)),
    "allowed": dict(allowed_token_ids=(0, 1, 3, 4, 5), stop_token_ids=(STOP,)),
    "bad-words": dict(bad_word_ids=((3,), (1, 5), (5, 0, 1)), min_tokens=3),
}
SETTINGS = [dict(), dict(temperature=1.0, seed=11)]
SETTING_IDS = ["greedy", "seeded"]


def _params(masks: dict, setting: dict, n: int = 14, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **masks, **setting, **extra)


def reference(prompt: list[int], params: SamplingParams, *, eos: tuple[int, ...] = (EOS,), logits_fn=fake_logits,
              grammar_vocab: GrammarVocab | None = None) -> list[int]:
    """Plain token-by-token decoding with the masks written out as vLLM defines them (then a grammar's, if any,
    from a fresh matcher fed the output so far)."""
    out: list[int] = []
    sampler = Sampler(params)
    state = GrammarState(params.grammar, grammar_vocab) if params.grammar is not None else None
    while len(out) < params.max_new_tokens:
        row = logits_fn(prompt + out).clone()
        if len(out) < params.min_tokens:  # MinTokensLogitsProcessor: every stop id and EOS
            for t in (*eos, *params.stop_token_ids):
                row[t] = float("-inf")
        if params.allowed_token_ids is not None:
            banned = [t for t in range(row.shape[0]) if t not in params.allowed_token_ids]
            row[banned] = float("-inf")
        for word in params.bad_word_ids:  # vllm/v1/sample/ops/bad_words.py, on the output only
            prefix = list(word[:-1])
            if len(word) <= len(out) + 1 and (not prefix or out[len(out) - len(prefix):] == prefix):
                row[word[-1]] = float("-inf")
        if state is not None:
            row = state.masked(row, out)
        token = int(torch.argmax(row)) if params.is_greedy else sampler.sample(row, len(out))
        out.append(token)
        if (token in eos and not params.ignore_eos) or token in params.stop_token_ids:
            break
    return out


def _unmasked(params: SamplingParams) -> SamplingParams:
    return SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed,
                          ignore_eos=params.ignore_eos)


def _run(params: SamplingParams, *, num_stages: int, predictor=None, prompts=PROMPTS) -> list[list[int]]:
    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                             eos_token_ids=(EOS,), speculate=predictor is not None)
    engine = Engine(config, predictor)
    outputs = FakePipeline(engine, _submits(prompts, params), next_fn=fake_argmax, logits_fn=fake_logits).run()
    return [outputs.get(i, []) for i in range(len(prompts))]


def _predictor(kind: str, prompts, want):
    table = ReferenceTable(zip(prompts, want, strict=True))
    return {"always-wrong": lambda: AlwaysWrongPredictor(table, vocab_size=SAMPLING_VOCAB),
            "mostly-right": lambda: SometimesRightPredictor(table, seed=5, vocab_size=SAMPLING_VOCAB, p_right=0.8),
            "stop-token": lambda: ConstantPredictor(STOP),  # drafts the stop id (masked before min_tokens)
            # the unmasked argmax: right wherever the masks change nothing, so chains run through stop ids
            "raw-argmax": lambda: Proposer("raw-argmax", banned=STOP, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax),
            "random": lambda: RandomPredictor(seed=3, vocab_size=SAMPLING_VOCAB)}[kind]()


def _check_oracle(params: SamplingParams, want: list[list[int]]) -> None:
    assert want != [reference(p, _unmasked(params)) for p in PROMPTS], "the masks changed nothing"
    for out in want:  # the reference really applies each mask
        assert all(t not in (EOS, *params.stop_token_ids) for t in out[:params.min_tokens])
        assert params.allowed_token_ids is None or set(out) <= set(params.allowed_token_ids)


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", ["always-wrong", "mostly-right", "stop-token", "raw-argmax", "random"])
@pytest.mark.parametrize("masks", list(MASKS))
@pytest.mark.parametrize(("num_stages", "num_seqs"), [(1, 3), (2, 1), (3, 1), (3, 3)])
def test_speed_drafts_commit_the_masked_plain_tokens(num_stages, num_seqs, masks, kind, setting):
    """SPEED drafts are verified on the masked logits at each row's own history; plain decoding is the oracle's."""
    params = _params(MASKS[masks], setting)
    prompts = PROMPTS[:num_seqs]
    want = [reference(p, params) for p in prompts]
    _check_oracle(params, [reference(p, params) for p in PROMPTS])
    assert _run(params, num_stages=num_stages, prompts=prompts) == want, "plain decoding does not mask as the oracle"
    got = _run(params, num_stages=num_stages, predictor=_predictor(kind, prompts, want), prompts=prompts)
    assert got == want, f"{kind} drafts changed the masked output"


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_a_stop_token_id_ends_generation_with_ignore_eos_and_eos_only_after_min_tokens(setting):
    """stop_token_ids end the request with ignore_eos too (vLLM's check_stop); EOS is ignored then, and
    neither is chosen before min_tokens (with ignore_eos as well: vLLM's all_stop_token_ids)."""
    for extra in (dict(ignore_eos=True), dict()):
        params = _params(dict(min_tokens=5, stop_token_ids=(STOP, 0)), setting, n=40, **extra)
        want = [reference(p, params) for p in PROMPTS]
        assert any(len(w) < 40 and w[-1] in (STOP, 0) for w in want), "no stop token ended a reference"
        assert all(len(w) >= 5 for w in want)
        for predictor in (None, ConstantPredictor(STOP), _predictor("raw-argmax", PROMPTS, want)):
            assert _run(params, num_stages=2, predictor=predictor) == want


# -- FIRP chains -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("masks", list(MASKS))
@pytest.mark.parametrize(("num_stages", "speed"), [(1, False), (2, True)], ids=["firp-1", "speed+firp-2"])
def test_firp_chains_commit_the_masked_plain_tokens(num_stages, speed, masks, setting):
    params = _params(MASKS[masks], setting)
    want = [reference(p, params) for p in PROMPTS]
    _check_oracle(params, want)
    proposer = Proposer("raw-argmax", banned=STOP, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax)
    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                             eos_token_ids=(EOS,), speculate=speed, firp_k=2)
    engine = Engine(config, proposer if speed else None)
    fake = FirpFakePipeline(engine, _submits(PROMPTS, params), next_fn=fake_argmax, logits_fn=fake_logits,
                            proposer=proposer)
    outputs = fake.run()
    assert [outputs.get(i, []) for i in range(len(PROMPTS))] == want, "FIRP chains changed the masked output"
    assert engine.spec.firp_verified > 0, "no FIRP draft was verified"


# -- stage-local drafting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("masks", list(MASKS))
def test_stage_made_drafts_commit_the_masked_plain_tokens(masks, setting):
    params, self_made = _params(MASKS[masks], setting), 0
    for prompt in PROMPTS:  # one at a time: a full pipeline leaves the stage no draft
        proposer = Proposer("raw-argmax", banned=STOP, vocab=SAMPLING_VOCAB, argmax_fn=fake_argmax, exit_driven=True)
        engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, eos_token_ids=(EOS,),
                                        speculate=True, draft_at_stage=True), proposer)
        fake = BiasedLocalPipeline(engine, _submits([prompt], params), predictor=proposer, seed=1, max_delay=(2, 2))
        fake.next_fn = fake_argmax
        assert fake.run().get(0, []) == reference(prompt, params), "stage-local drafts changed the masked output"
        assert isinstance(fake, LocalFakePipeline)
        self_made += fake.self_made
    assert self_made > 0, "the stage made no draft"


# -- token trees ------------------------------------------------------------------------------------------
TREE_PROMPTS = [[5, 17, 200, 33, 9], [44, 3, 12]]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4)


@pytest.fixture(scope="module")
def tiny_stages(tiny_folder):
    return _stages(tiny_folder, 2, "none")


def _tiny_logits_fn(folder):
    """The tiny model's final logits after a whole prefix: one stage, the prefix run afresh (no cache)."""
    (model,) = _stages(folder, 1, "none")

    @torch.inference_mode()
    def logits(prefix: list[int]) -> torch.Tensor:
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(prefix) + 1)
        return model(torch.tensor(prefix, dtype=torch.int64), [Span(0, 0, len(prefix))], kv)[-1].float()
    return logits


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_token_trees_commit_the_masked_plain_tokens(tiny_folder, tiny_stages, setting):
    """Tree drafts and their siblings (`--draft-tree 3`, tiny model, 2 stages) are verified on the masked
    logits: the output is plain decoding's with the same masks, which changed it."""
    unmasked = SamplingParams(max_new_tokens=10, ignore_eos=True, **setting)
    plain = InProcessPipeline(tiny_stages, max_model_len=64).generate(TREE_PROMPTS, unmasked)
    first, later = plain[0][0], plain[1][3]
    masks = dict(bad_word_ids=((first,), (plain[1][2], later)), stop_token_ids=(plain[0][4],), min_tokens=6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, **masks, **setting)
    want = [InProcessPipeline(tiny_stages, max_model_len=64).generate([p], params)[0] for p in TREE_PROMPTS]
    assert want != plain, "the masks changed nothing"
    logits_fn = _tiny_logits_fn(tiny_folder)
    assert want == [reference(p, params, eos=(TINY_EOS_ID,), logits_fn=logits_fn) for p in TREE_PROMPTS], \
        "plain decoding does not mask as the token-by-token reference"
    vocab = tiny_stages[0].config.vocab_size
    for kind in ("raw-argmax", "random"):
        predictor = Proposer(kind, banned=first, vocab=vocab, argmax_fn=_tiny_argmax(tiny_stages))
        for prompt, expected in zip(TREE_PROMPTS, want, strict=True):
            pipe = InProcessPipeline(tiny_stages, max_model_len=64, predictor=predictor, draft_tree=3)
            assert pipe.generate([prompt], params) == [expected], f"{kind} tree drafts changed the masked output"
            assert pipe.engine.tree.tree_verified > 0, "no tree draft was verified"


# -- with a grammar and its jump-forward items ------------------------------------------------------------
GRAMMAR_MASKS = {  # with json_schema: `"n": ` after `{` is one jump-forward item
    "stop-inside-a-jump": dict(min_tokens=3, stop_token_ids=(ord(":"),)),  # the run's ':' ends it: no ' ' after
    "bad-words-in-values": dict(min_tokens=3, bad_word_ids=((ord("5"),), (ord("9"), ord("9")), (ord("7"),))),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("masks", list(GRAMMAR_MASKS))
def test_masks_with_a_grammar_and_jump_forward_commit_the_masked_plain_tokens(tiny_folder, tiny_stages, masks,
                                                                               setting):
    """A JSON schema with token masks: mostly-right drafts (plain chains and token trees) and jump-forward
    items, also one whose forced run holds a stop token id (nothing after it is committed), give the
    token-by-token reference's output (token masks, then the grammar's), which the masks changed."""
    vocab = GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
    spec, prompts, logits_fn = grammar_paths.SPECS["json_schema"], grammar_paths.PROMPTS, _tiny_logits_fn(tiny_folder)
    params = SamplingParams(max_new_tokens=24, grammar=spec, **GRAMMAR_MASKS[masks], **setting)
    want = [reference(p, params, eos=(TINY_EOS_ID,), logits_fn=logits_fn, grammar_vocab=vocab) for p in prompts]
    unmasked = [reference(p, SamplingParams(max_new_tokens=24, grammar=spec, **setting), eos=(TINY_EOS_ID,),
                          logits_fn=logits_fn, grammar_vocab=vocab) for p in prompts]
    assert want != unmasked, "the masks changed nothing"
    assert masks != "stop-inside-a-jump" or all(w == list(b'{"n":') for w in want), want
    assert want == InProcessPipeline(tiny_stages, max_model_len=64, grammar_vocab=vocab).generate(prompts, params)
    table, jumped = ReferenceTable(zip(prompts, unmasked, strict=True)), 0  # right drafts run on past a stop id
    for tree in (1, 3):
        for prompt, expected in zip(prompts, want, strict=True):
            pipe = InProcessPipeline(tiny_stages, max_model_len=64, grammar_vocab=vocab, draft_tree=tree,
                                     predictor=grammar_paths.MostlyRightPredictor(table))
            assert pipe.generate([prompt], params) == [expected], f"draft tree {tree} changed the masked output"
            jumped += pipe.engine.spec.grammar_jump_tokens
    assert jumped > 0, "no jump-forward item was sent"


# -- replay after a stage restart ------------------------------------------------------------------------
@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("kind", [None, "raw-argmax", "random"])
def test_a_replay_after_a_stage_restart_keeps_the_masked_plain_tokens(kind, setting):
    """After a stage restart every running sequence is replayed as a prefill of its committed context; the
    masks still see each row's own output (min_tokens counted and bad-word prefixes matched from it)."""
    def logits_fn(prefix: list[int]) -> torch.Tensor:
        return replay._logits(prefix[-3:])

    unmasked = SamplingParams(max_new_tokens=12, ignore_eos=True, **setting)
    plain = {i: reference(p, unmasked, eos=(), logits_fn=logits_fn) for i, p in enumerate(replay.PROMPTS)}
    masks = dict(min_tokens=6, stop_token_ids=(plain[0][2],), allowed_token_ids=tuple(range(1, replay.VOCAB)),
                 bad_word_ids=((plain[1][1],), (plain[2][0], plain[2][1])))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **masks, **setting)
    want = {i: reference(p, params, eos=(), logits_fn=logits_fn) for i, p in enumerate(replay.PROMPTS)}
    assert want != plain, "the masks changed nothing"
    proposer = None if kind is None else Proposer(kind, banned=plain[1][1], vocab=replay.VOCAB,
                                                  argmax_fn=lambda c: replay._next(c[-3:]))
    for replays in (set(), {4}, {2, 9}, {5, 6, 14}):
        engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=3, max_model_len=256, speculate=proposer is not None),
                        proposer, record_timeline=False)
        assert drive_replays(engine, params, replays)[0] == want, (kind, replays)
