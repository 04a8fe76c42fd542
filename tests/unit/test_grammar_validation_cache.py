"""llguidance's validation of a GrammarSpec, remembered per grammar text (pipeline/speculation/grammar.py
`_grammar_problem`).

What breaks when these fail: a spec renamed after the field that asked for it (`GrammarSpec.asked_by`) is
validated by llguidance a second time; the remembered results pin the grammars' texts (each up to
MAX_GRAMMAR_CHARS characters, 1 MiB as Python keeps a text with an emoji) in the serving process; an
invalid grammar seen before is accepted, or a valid one refused. Reference: llguidance's own
`validate_grammar_with_warnings`, counted.
"""

from __future__ import annotations

import gc
import json
import tracemalloc

import llguidance
import pytest

from pipeline.speculation.grammar import MAX_GRAMMAR_CHARS, GrammarSpec


def _schema(i: int, length: int) -> str:
    """A valid JSON schema text of about `length` characters, distinct for each i, with an emoji."""
    head = json.dumps({"type": "object", "title": f"schema {i}", "description": ""})
    return head[:-2] + "\U0001f600" * (length - len(head)) + '"}'


def test_asked_by_and_a_second_spec_of_the_same_grammar_are_not_validated_again(monkeypatch):
    calls = []
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings",
                        lambda grammar: calls.append(grammar) or validate(grammar))
    spec = GrammarSpec(kind="json_schema", text=_schema(-1, 200)).asked_by("structured_outputs")
    assert spec.field == "structured_outputs" and len(calls) == 1
    assert GrammarSpec(kind="json_schema", text=_schema(-1, 200)) == spec and len(calls) == 1
    for _ in range(2):  # an invalid one is refused each time, with llguidance's reason
        with pytest.raises(ValueError, match="invalid regex"):
            GrammarSpec(kind="regex", text="(unclosed")
    assert len(calls) == 2
    is_error, _ = validate(GrammarSpec(kind="regex", text="[0-9]+").grammar)
    assert not is_error


def test_remembered_validations_do_not_keep_the_grammars_texts():
    """16 schemas of MAX_GRAMMAR_CHARS characters (~1 MiB each as Python stores them), then dropped: what stays
    allocated is far less than one of them (the results were kept keyed by the whole text: ~16 MiB here, up
    to 64 MiB for the 64 remembered)."""
    texts = [_schema(i, MAX_GRAMMAR_CHARS) for i in range(16)]
    assert all(len(t) == MAX_GRAMMAR_CHARS for t in texts)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        specs = [GrammarSpec(kind="json_schema", text=t).asked_by("response_format") for t in texts]
        del specs, texts
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2**20, f"{kept / 2**20:.1f} MiB kept after the specs were dropped"
