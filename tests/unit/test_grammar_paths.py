"""Structured outputs (SamplingParams.grammar) stay exact under every speculative path and stage count.

What breaks when these fail: a constrained request's tokens differ from plain masked decoding (a loop
that argmaxes, or samples, the grammar-masked logits of a one-stage model token by token) under
SPEED drafts (always wrong, mostly right), token trees, FIRP chains verified over several rows,
stage-local drafting, a replay after a stage restart, or on 2 / 3 stages, with grammar jump-forward items
(a forced run as one multi-row draft: on wherever grammar-aware drafting is) and without; typically because a verify
path takes the raw argmax (the mask silently dropped), a greedy constrained item ships no logits,
or the matcher is out of step with the committed prefix (a token consumed twice or not at all).
The tiny random model (tests/tiny_model.py, 256-byte tokenizer: every token is one byte) runs in
process for stages, SPEED and trees, where the tests also check the grammar changed the output and the
output is a valid document; the engine's fake pipelines (FIRP, stage-local, replay) read
`_random_logits`, whose raw argmax the grammar almost never allows, so a row verified unmasked shows.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import random
import re

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ReplayRunning, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.model.row_layout import Span
from pipeline.speculation.grammar import GrammarSpec, GrammarState, GrammarVocab
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import Draft
from pipeline.speculation.sampling import Sampler, SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, RandomTreePredictor, ReferenceTable
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer, write_tiny_model
from tests.unit import test_replay as replay
from tests.unit.test_local_draft import LocalFakePipeline
from tests.unit.test_logit_bias_paths import FirpFakePipeline, drive_replays
from tests.unit.test_speculation_scheduler import MAX_MODEL_LEN, _submits
from tests.unit.test_token_tree_pipeline import _stages

PROMPTS = [[72, 105, 33], [123, 34]]
MAX_NEW = 24
SPECS = {
    "json_object": GrammarSpec(kind="json_object"),
    "regex": GrammarSpec(kind="regex", text=r"[a-c]{2,5}-[0-9]{2}(x|yz)"),
    "choice": GrammarSpec.choice(["alpha", "beta", "gamma delta"]),
    "json_schema": GrammarSpec(kind="json_schema", text=json.dumps({
        "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}},
        "required": ["n", "s"], "additionalProperties": False})),
}
# `grammar` kind: GBNF (recursive: arithmetic; checked by Python's own parser) and Lark (checked by a regex of
# the same language): llguidance's grammar_from converts the one and reads the other.
GBNF = """root ::= "(" expr ")" ("+" | "-" | "*") expr
expr ::= term (("+" | "-") term)*
term ::= factor ("*" factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"
"""
LARK, LARK_REGEX = 'start: WORD ("," WORD)* "."\nWORD: /[a-d]{1,3}/', r"[a-d]{1,3}(,[a-d]{1,3})*\."
SPECS["gbnf"] = GrammarSpec(kind="grammar", text=GBNF)
SPECS["lark"] = GrammarSpec(kind="grammar", text=LARK)
# Structural tag: free text, each trigger opening `json_schema`'s JSON then ";". The triggers are bytes this tiny
# model writes early (greedy and seeded), so every reference output enters a tagged region.
TRIGGERS = ("\x0f", "G", "B", "e")
SPECS["structural_tag"] = GrammarSpec(kind="structural_tag", text=json.dumps({"triggers": list(TRIGGERS), "structures": [
    {"begin": t, "schema": json.loads(SPECS["json_schema"].text), "end": ";"} for t in TRIGGERS]}))
SETTINGS = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 7}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("grammar") / "model", seed=5)


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    return GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])


def _params(spec: GrammarSpec | None, setting: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, grammar=spec, **SETTINGS[setting])


def plain_masked_decoding(stages, prompt: list[int], params: SamplingParams, vocab: GrammarVocab) -> list[int]:
    """The reference: the whole context through a one-stage model per token, its last logits row masked
    by a fresh matcher fed the output so far, then argmax (greedy) or the seeded sampler's draw at that
    position; stops after EOS or the budget."""
    (model,) = stages
    sampler, out = Sampler(params), []
    state = GrammarState(params.grammar, vocab) if params.grammar is not None else None
    while len(out) < params.max_new_tokens:
        ids = [*prompt, *out]
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(ids))
        row = model(torch.tensor(ids, dtype=torch.int64), [Span(0, 0, len(ids))], kv)[-1].float()
        if state is not None:
            row = state.masked(row, out)
        out.append(sampler.sample(row, len(out)))
        if out[-1] == TINY_EOS_ID:
            break
    return out


def _text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t != TINY_EOS_ID).decode("latin-1")


def _check_valid(name: str, tokens: list[int]) -> None:
    """Complete outputs (ended by EOS) are whole documents; every output is a prefix of one."""
    text = _text(tokens)
    if name == "structural_tag":
        assert tagged_regions(bytes(t for t in tokens if t != TINY_EOS_ID).decode("utf-8", "replace")), text
        return
    if tokens[-1] != TINY_EOS_ID:
        return
    if name in ("json_object", "json_schema"):
        value = json.loads(text)
        assert isinstance(value, dict)
        if name == "json_schema":
            assert set(value) == {"n", "s"} and isinstance(value["n"], int) and len(value["s"]) <= 4, value
    elif name == "regex":
        assert re.fullmatch(SPECS["regex"].text, text), text
    elif name == "lark":
        assert re.fullmatch(LARK_REGEX, text), text
    elif name == "gbnf":
        assert is_arithmetic(text), text
    else:
        assert text in json.loads(SPECS["choice"].text), text


def is_arithmetic(text: str) -> bool:
    """True when Python parses `text` as one expression of integers, +, - and * (and parentheses): `GBNF`'s
    language, less the whitespace and unary signs Python also takes (GBNF allows neither)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return (re.fullmatch(r"[0-9()+*-]+", text) is not None and all(isinstance(n, allowed) for n in ast.walk(tree))
            and all(isinstance(n.value, int) for n in ast.walk(tree) if isinstance(n, ast.Constant)))


def tagged_regions(text: str) -> int:
    """The number of tagged regions in `text` under `SPECS["structural_tag"]`, each checked: free text runs to
    the first trigger, then one JSON document (Python's own decoder) with json_schema's keys and types, then
    ";". A region the text ends inside (the token budget) counts but is not checked."""
    count, i, decoder = 0, 0, json.JSONDecoder()
    while (i := min((j for j in (text.find(t, i) for t in TRIGGERS) if j >= 0), default=-1)) >= 0:
        count += 1
        try:
            value, end = decoder.raw_decode(text, i + 1)
        except ValueError:
            return count  # truncated inside the document
        assert set(value) == {"n", "s"} and isinstance(value["n"], int) and len(value["s"]) <= 4, value
        assert text[end:end + 1] in ("", ";"), text[end:]
        i = end + 1
    return count


@pytest.fixture(scope="module")
def references(tiny_dir, vocab):
    """{(grammar name, setting, prompt index): plain masked decoding's tokens}."""
    one = _stages(tiny_dir, 1, "none")
    return {(name, setting, i): plain_masked_decoding(one, p, _params(spec, setting), vocab)
            for name, spec in SPECS.items() for setting in SETTINGS for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_plain_pipeline_is_the_masked_reference_and_valid(tiny_dir, vocab, references, name, setting):
    """1, 2 and 3 stages without speculation give the plain masked tokens; the grammar changed them."""
    want = [references[name, setting, i] for i in range(len(PROMPTS))]
    for tokens in want:
        _check_valid(name, tokens)
    unconstrained = plain_masked_decoding(_stages(tiny_dir, 1, "none"), PROMPTS[0], _params(None, setting), vocab)
    assert unconstrained != want[0], "the grammar changed nothing"
    for num_stages in (1, 2, 3):
        pipe = InProcessPipeline(_stages(tiny_dir, num_stages, "none"), max_model_len=64, grammar_vocab=vocab)
        assert pipe.generate(PROMPTS, _params(SPECS[name], setting)) == want, f"{num_stages} stages"


class MostlyRightPredictor(RandomTreePredictor):
    """Drafts the reference's next token 60% of the time and a uniform random token otherwise (tree
    siblings random), so drafts are both accepted (multi-row verifies) and rejected."""

    name = "mostly-right"

    def __init__(self, table: ReferenceTable) -> None:
        super().__init__(seed=3, vocab_size=256)
        self.table = table

    def propose(self, context, guess) -> Draft:
        truth = self.table.true_next(context)
        if truth is not None and self.rng.random() < 0.6:
            return Draft(truth, 0.6, self.name)
        return Draft(self.rng.randrange(self.vocab_size), 0.1, self.name)


def _predictor(kind: str, table: ReferenceTable):
    if kind.startswith("always-wrong"):
        return AlwaysWrongPredictor(table, vocab_size=256)
    return MostlyRightPredictor(table)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("kind", "num_stages"), [("always-wrong", 2), ("always-wrong-unsteered", 2),
                                                  ("mostly-right", 2), ("mostly-right", 3), ("mostly-right-tree", 2),
                                                  ("mostly-right-tree", 3), ("mostly-right-tree-unsteered", 2),
                                                  ("mostly-right-nojump", 2)])
def test_speculation_commits_the_masked_plain_tokens(tiny_dir, vocab, references, name, setting, kind, num_stages):
    """SPEED drafts (always wrong, or `MostlyRightPredictor`'s, so that multi-row verifies happen) and
    token trees commit exactly plain masked decoding's tokens, with grammar-aware drafting
    ([Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py) and without it
    ("-unsteered": forbidden drafts reach the verifier, whose mask must reject them), with jump-forward
    items (json_schema's `"n": ` after `{` is one) and without ("-nojump": forced tokens one per item)."""
    want = [references[name, setting, i] for i in range(len(PROMPTS))]
    table = ReferenceTable(zip(PROMPTS, want, strict=True))
    stages, verified, accepted, jumped = _stages(tiny_dir, num_stages, "none"), 0, 0, 0
    for prompt, expected in zip(PROMPTS, want, strict=True):  # one at a time: a lone sequence leaves room to draft
        pipe = InProcessPipeline(stages, max_model_len=64, grammar_vocab=vocab, predictor=_predictor(
            kind, table), draft_tree=3 if "tree" in kind else 1, grammar_drafts="unsteered" not in kind,
            grammar_jump="nojump" not in kind)
        got = pipe.generate([prompt], _params(SPECS[name], setting))[0]
        assert got == expected, f"{kind} drafts on {num_stages} stages changed the constrained output"
        spec = pipe.engine.spec
        verified, accepted, jumped = verified + spec.verified_drafts, accepted + spec.accepted_tokens, jumped + spec.grammar_jump_tokens
        assert spec.jump_accepted == spec.jump_verified and spec.firp_verified == 0, spec
    assert verified > 0, "no draft was verified"
    if not kind.startswith("always-wrong"):
        assert accepted > 0, "no draft was accepted (multi-row verify untested)"
    if "unsteered" in kind or "nojump" in kind:
        assert jumped == 0
    elif name == "json_schema":
        assert jumped > 0, "no jump-forward item was sent"


# -- FIRP chains (several rows verified in one result) ----------------------------------------------------
@functools.lru_cache(maxsize=8192)
def _random_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fake model over the 256-byte vocabulary: N(0, 1) logits seeded by the whole prefix."""
    return torch.randn(256, generator=torch.Generator().manual_seed(hash(prefix) % 2**61))


def _raw_argmax(prefix) -> int:
    return int(torch.argmax(_random_logits(tuple(prefix))))


class ReferenceChains:
    """FIRP chain tokens (and SPEED drafts): the reference's next token 70% of the time, else random, so
    chains are accepted over several rows, where the grammar's mask decides the token, and rejected."""

    name, needs_exit_head = "reference-chains", False

    def __init__(self, table: ReferenceTable) -> None:
        self.table, self.rng = table, random.Random(5)

    def token(self, context) -> int:
        truth = self.table.true_next(context)
        return truth if truth is not None and self.rng.random() < 0.7 else self.rng.randrange(256)

    def propose(self, context, guess) -> Draft:
        return Draft(self.token(context), 0.7, self.name)


class RandomModelFirpPipeline(FirpFakePipeline):
    """tests/unit/test_logit_bias_paths.py's FirpFakePipeline on `_random_logits` (its last stage reads
    the 6-token fake model there), whose chains start after the anchor row's reference token."""

    def _with_firp(self, result: Result) -> Result:
        content, tokens, logits, firp = self.contents[self.num_stages - 1], [], [], []
        for it in result.items:
            seq = content[it.slot]
            for p in range(it.end - it.num_result_rows, it.end):
                tokens.append(_raw_argmax(seq[:p + 1]))
                logits += [_random_logits(tuple(seq[:p + 1]))] if it.want_logits else []
            for a in range(it.firp_anchors):
                chain = list(seq[:it.end - it.firp_anchors + a + 1])
                chain.append(self.proposer.table.true_next(chain) or 0)  # the anchor row's own token: a chain
                for _ in range(it.firp_k):                                # drafts the positions after it
                    chain.append(self.proposer.token(chain))
                    firp.append(chain[-1])
        return Result(items=result.items, token_ids=torch.tensor(tokens, dtype=torch.int64),
                      logits=torch.stack(logits) if logits else None, firp_tokens=torch.tensor(firp, dtype=torch.int64))


def _fake_masked_reference(prompt: list[int], params: SamplingParams, vocab: GrammarVocab) -> list[int]:
    sampler, state, out = Sampler(params), GrammarState(params.grammar, vocab), []
    while len(out) < params.max_new_tokens and (not out or out[-1] != TINY_EOS_ID):
        out.append(sampler.sample(state.masked(_random_logits(tuple(prompt + out)), out), len(out)))
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("num_stages", "speed"), [(1, False), (2, True)], ids=["firp-1", "speed+firp-2"])
@pytest.mark.parametrize("steered", [False, True], ids=["unsteered", "grammar-drafts"])
def test_firp_chains_commit_the_masked_plain_tokens(vocab, name, setting, num_stages, speed, steered):
    """FIRP chains (`firp_k` 3) verified over several rows of one result give plain masked decoding's
    tokens on a fake model whose raw argmax the grammar almost never allows (so a row verified unmasked
    shows), and some chain was accepted past its first row; without grammar-aware drafting some chain
    was rejected (the mask rejected a forbidden draft), with it forbidden chain drafts were cut (or,
    at a forced position, replaced)."""
    params = _params(SPECS[name], setting)
    want = [_fake_masked_reference(p, params, vocab) for p in PROMPTS]
    proposer = ReferenceChains(ReferenceTable(zip(PROMPTS, want, strict=True)))
    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                             eos_token_ids=(TINY_EOS_ID,), speculate=speed, firp_k=3, grammar_drafts=steered)
    engine = Engine(config, proposer if speed else None, grammar_vocab=vocab)
    fake = RandomModelFirpPipeline(engine, _submits(PROMPTS, params), next_fn=_raw_argmax, proposer=proposer,
                                   logits_fn=lambda prefix: _random_logits(tuple(prefix)))
    outputs = fake.run()
    assert [outputs[i] for i in range(len(PROMPTS))] == want, "FIRP chains changed the constrained output"
    assert engine.spec.firp_accepted > 0
    if steered:
        assert engine.spec.grammar_dropped + engine.spec.grammar_replaced > 0, "no forbidden FIRP draft was cut"
        # jump-forward rows beside FIRP chains (which take most forced runs: a run rides only on a real item
        # without a chain): always accepted, and never more verified than were sent
        assert engine.spec.jump_accepted == engine.spec.jump_verified <= engine.spec.grammar_jump_tokens
    else:
        assert engine.spec.firp_verified > engine.spec.firp_accepted and engine.spec.grammar_dropped == 0


# -- replay after a stage restart ---------------------------------------------------------------------------
def _ring_reference(prompt, params: SamplingParams, vocab: GrammarVocab) -> list[int]:
    """Plain masked decoding of the replay tests' ring model: `_random_logits` of the last 3 tokens."""
    sampler, state, out = Sampler(params), GrammarState(params.grammar, vocab), []
    while len(out) < params.max_new_tokens and (not out or out[-1] != TINY_EOS_ID):
        row = state.masked(_random_logits(tuple((list(prompt) + out)[-3:])), out)
        out.append(sampler.sample(row, len(out)))
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
def test_a_replay_after_a_stage_restart_keeps_the_masked_plain_tokens(monkeypatch, vocab, name, setting):
    """tests/unit/test_replay.py's FakeRing (3 stages as one FIFO) on `_random_logits` of the last 3 tokens:
    losing everything in flight at various ticks (each running sequence replayed as one prefill of its
    committed context) leaves the constrained output that of plain masked decoding, with and without drafts."""
    monkeypatch.setattr(replay, "_logits", lambda context: _random_logits(tuple(context)))
    monkeypatch.setattr(replay, "_next", lambda context: _raw_argmax(context[-3:]))
    params = _params(SPECS[name], setting)
    want = {i: _ring_reference(prompt, params, vocab) for i, prompt in enumerate(replay.PROMPTS)}
    table = ReferenceTable((p, want[i]) for i, p in enumerate(replay.PROMPTS))
    for speculate in (False, True):
        for replays in (set(), {4}, {2, 9}, {5, 6, 14}):
            engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=3, max_model_len=256, speculate=speculate,
                                            eos_token_ids=(TINY_EOS_ID,)),
                            ReferenceChains(table) if speculate else None, record_timeline=False, grammar_vocab=vocab)
            outputs, errors = drive_replays(engine, params, replays)
            assert not errors, errors
            assert outputs == want, (speculate, replays)
            if speculate and name == "json_schema":
                assert engine.spec.grammar_jump_tokens > 0, "no jump-forward item was sent"


# -- jump-forward: ledger and KV in step ---------------------------------------------------------------------
class CheckedRing(replay.FakeRing):
    """The replay test's FakeRing that checks, as each item of the coordinator's current epoch runs, what the
    coordinator believes: the slot holds exactly the sequence's context before the item (committed tokens,
    then the chain's drafts: none lost, duplicated or reordered), the item's tokens are the context's next
    ones, and a real item starts at the committed length - 1 (the KV then holds every committed token but
    the one it carries), a real item that carries a forced run too. jump_items: items carrying a forced run
    (a jump draft item, or a real item's riding run), by the ledger's `InFlight.jump`; riding: the latter."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine, self.checked, self.jump_items, self.riding = engine, 0, 0, 0

    def result(self) -> Result:
        for item in self.inflight[0] if self.inflight else ():
            seq = self.engine.scheduler.seqs.get(item.seq_id)
            if seq is None or seq.finished or item.epoch != seq.epoch:
                continue
            kv, context = self.kv.get(item.slot, []), seq.context()
            assert len(kv) >= item.start and kv[:item.start] == context[:item.start], (item, kv, context)
            assert context[item.start:item.end] == list(item.token_ids), (item, context)
            if item.kind in (ItemKind.DECODE, ItemKind.FIRP):
                assert item.start == seq.ledger.known_len - 1, (item, seq.ledger.known_len)
            self.checked += 1
            # a forced run: a jump draft item, or riding on a real item ([Note: grammar-aware drafting])
            jump = any(f.jump and f.position == item.start for f in seq.ledger.inflight)
            self.jump_items += jump
            self.riding += jump and item.kind == ItemKind.FIRP
        return super().result()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["json_schema", "choice", "json_object"])
@pytest.mark.parametrize("firp_k", [0, 2], ids=["speed", "speed+firp"])
def test_jump_items_keep_the_ledger_and_kv_in_step(monkeypatch, vocab, name, setting, firp_k):
    """3 stages as one FIFO (`CheckedRing`), SPEED drafts right 70% of the time, jump-forward items, with and
    without FIRP rows and across replays, the replay prompts plus two more choices of the first (n = 3: seed + i):
    at every result the ledger's chain is contiguous from the committed length, each current item finds the KV
    it assumes, and every output is plain masked decoding's."""
    monkeypatch.setattr(replay, "_logits", lambda context: _random_logits(tuple(context)))
    monkeypatch.setattr(replay, "_next", lambda context: _raw_argmax(context[-3:]))
    base = _params(SPECS[name], setting)
    prompts = [*replay.PROMPTS, replay.PROMPTS[0], replay.PROMPTS[0]]
    params = [base] * len(replay.PROMPTS) + [dataclasses.replace(base, seed=base.seed and base.seed + i) for i in (1, 2)]
    want = {i: _ring_reference(p, params[i], vocab) for i, p in enumerate(prompts)}
    table = ReferenceTable((p, want[i]) for i, p in enumerate(prompts) if i < len(replay.PROMPTS))
    for replays in (set(), {3, 8}):
        engine = Engine(SchedulerConfig(num_stages=3, max_num_seqs=3, max_model_len=256, speculate=True, firp_k=firp_k,
                                        eos_token_ids=(TINY_EOS_ID,)), ReferenceChains(table), record_timeline=False,
                        grammar_vocab=vocab)
        ring, outputs, tick = CheckedRing(engine), {i: [] for i in want}, 0
        out = engine.step([Submit(seq_id=i, prompt_ids=tuple(p), params=params[i]) for i, p in enumerate(prompts)])
        while True:
            ring.take(out)
            for c in out.commits:
                assert c.error is None, c.error
                outputs[c.seq_id].extend(c.token_ids)
            for seq in engine.scheduler.seqs.values():
                if not seq.finished:
                    ledger_in_step(seq)
            if not engine.has_unfinished:
                break
            tick += 1
            if tick in replays:
                ring.lose_everything()
                out = engine.step([ReplayRunning()])
            else:
                out = engine.step([ring.result()])
        assert outputs == want, replays
        assert ring.checked > 0 and (ring.jump_items > 0 or name != "json_schema")
        assert ring.riding > 0 or name != "json_schema", "no real item carried a forced run"
        assert engine.spec.firp_verified == 0 and engine.spec.jump_accepted == engine.spec.jump_verified


def ledger_in_step(seq) -> None:
    """Ledger invariants: committed length is prompt + output, the chain starts at the next real position
    and its items follow each other without a gap or an overlap, within the token budget."""
    ledger = seq.ledger
    assert ledger.known_len == len(seq.prompt_ids) + len(seq.output_ids)
    position = ledger.next_real_position
    for f in ledger.inflight:
        assert f.position == position and f.last_position <= ledger.last_item_position, (f, position)
        position = f.last_position + 1


# -- stage-local drafting -----------------------------------------------------------------------------------
class RandomModelLocalPipeline(LocalFakePipeline):
    """tests/unit/test_local_draft.py's LocalFakePipeline whose results carry `_random_logits` rows."""

    def _send(self, channel: str, event) -> None:
        if isinstance(event, Result) and any(it.want_logits for it in event.items):
            content = self.contents[self.num_stages - 1]
            rows = [_random_logits(tuple(content[it.slot][:it.end])) for it in event.items if it.want_logits]
            event = Result(items=event.items, token_ids=event.token_ids, logits=torch.stack(rows))
        super()._send(channel, event)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("steered", [False, True], ids=["unsteered", "grammar-drafts"])
def test_stage_made_drafts_commit_the_masked_plain_tokens(vocab, name, setting, steered):
    """Drafts the exit stage makes itself (`--draft-at stage`, 2 stages; the reference's tokens 70% of
    the time) are verified on the masked logits, also across a replay that drops them all. With
    grammar-aware drafting the coordinator drafts a constrained sequence itself: the stage makes none."""
    params = _params(SPECS[name], setting)
    for prompt in PROMPTS:
        want = _fake_masked_reference(prompt, params, vocab)
        for replay_at in (None, 9):
            proposer = ReferenceChains(ReferenceTable([(prompt, want)]))
            proposer.needs_exit_head = True
            engine = Engine(SchedulerConfig(num_stages=2, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, speculate=True,
                                            draft_at_stage=True, eos_token_ids=(TINY_EOS_ID,),
                                            grammar_drafts=steered), proposer,
                            grammar_vocab=vocab)
            fake = RandomModelLocalPipeline(engine, _submits([prompt], params), predictor=proposer, seed=1,
                                            max_delay=(2, 2), replay_at=replay_at)
            fake.next_fn = _raw_argmax
            assert fake.run().get(0, []) == want, f"stage-local drafts changed the output (replay at {replay_at})"
            if steered:
                assert fake.self_made == 0, "the stage drafted a constrained sequence"
                assert engine.spec.grammar_jump_tokens > 0 or name != "json_schema", "no jump-forward item was sent"
            else:
                assert fake.self_made > 0 or len(want) < 3, "the stage made no draft"


# -- a grammar that cannot go on fails its request -----------------------------------------------------------
class RecordingEngine(Engine):
    """An Engine that keeps every commit it makes (with its finish reason and error)."""

    def step(self, events=(), now_ns: int = 0):
        out = super().step(events, now_ns)
        self.commits = [*getattr(self, "commits", []), *out.commits]
        return out


def test_a_grammar_with_no_allowed_token_fails_its_request_with_the_reason(vocab, tmp_path):
    """The fake model's logits rows are 6 wide: ids 0-5, which json_object never allows first. The request
    ends with FinishReason.ERROR and the matcher's reason (never unconstrained text); a plain request beside
    it is untouched; the request handle raises a RequestError with that reason. An engine without a
    grammar tokenizer refuses a constrained request."""
    from launcher.coordinator.request_handle import RequestError, RequestHandle
    from pipeline.engine.records import FinishReason
    from pipeline.model.tokenizer import Tokenizer
    from tests.unit.test_speculation_scheduler import FakePipeline, fake_argmax, fake_logits

    constrained, plain = SamplingParams(max_new_tokens=6, grammar=SPECS["json_object"]), SamplingParams(max_new_tokens=6)
    engine = RecordingEngine(SchedulerConfig(num_stages=2, max_num_seqs=4, max_model_len=MAX_MODEL_LEN),
                             grammar_vocab=vocab)
    outputs = FakePipeline(engine, _submits([[1, 2], [3, 4]], [constrained, plain]), next_fn=fake_argmax,
                           logits_fn=fake_logits).run()
    [failed] = [c for c in engine.commits if c.seq_id == 0]
    assert failed.finish_reason is FinishReason.ERROR and failed.token_ids == ()
    assert "no token of the model's vocabulary continues the structured output" in failed.error
    assert outputs.get(0, []) == [] and len(outputs[1]) == 6
    detok = Tokenizer(write_tiny_model(tmp_path / "m")).detokenizer(prompt_ids=[1])
    handle = RequestHandle("r", "p", [1], constrained, detok)
    handle.emit(failed)
    with pytest.raises(RequestError, match="no token of the model's vocabulary"):
        handle.result(1)
    with pytest.raises(ValueError, match="no tokenizer for structured outputs"):
        Engine(SchedulerConfig(num_stages=1, max_num_seqs=1, max_model_len=64)).step(_submits([[1]], constrained))
