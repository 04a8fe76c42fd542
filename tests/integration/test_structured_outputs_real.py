"""Structured outputs on the real default model (SmolLM2-135M-Instruct, float32): valid documents, exact
under speculation.

What breaks when these fail: json_object / json_schema output that `json.loads` rejects or that does
not validate against its schema, regex output that does not match it whole, a choice that is none of
the choices, or generation that does not end (EOS) once the document is complete; or a constrained
request whose tokens differ between plain masked decoding (a one-stage loop, token by token) and the
engine on 2 stages with SPEED drafts (always wrong, and the reference's own tokens). In-process
(tests/in_process_pipeline.py): the multi-process paths are tests/distributed/test_structured_outputs_tiny.py.
"""

from __future__ import annotations

import datetime
import json
import re

import jsonschema
import pytest

from launcher.serving.openai_protocol import render_chat
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.grammar import GrammarSpec, GrammarVocab
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.in_process_pipeline import InProcessPipeline
from tests.unit.test_grammar_paths import MostlyRightPredictor, plain_masked_decoding
from tests.unit.test_token_tree_pipeline import _stages

pytestmark = pytest.mark.timeout(900)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["yes", "no"]
GBNF_DATE = 'root ::= year "-" month "-" day\nyear ::= [12] [0-9] [0-9] [0-9]\nmonth ::= "0" [1-9] | "1" [0-2]\n' \
            'day ::= "0" [1-9] | [12] [0-9] | "3" [01]\n'  # GBNF (llama.cpp's grammar format)
CASES = {  # name: (user message, spec)
    "json_object": ("Give me a person as JSON: name Alice, age 30.", GrammarSpec(kind="json_object")),
    "json_schema": ("Give me a person: name Bob, age 41.", GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    "regex": ("The date of the first moon landing, as YYYY-MM-DD:", GrammarSpec(kind="regex", text=REGEX)),
    "choice": ("Is the sky blue? Answer yes or no.", GrammarSpec.choice(CHOICES)),
    "grammar": ("The date of the first moon landing, as YYYY-MM-DD:", GrammarSpec(kind="grammar", text=GBNF_DATE)),
}
MAX_NEW = 48


@pytest.fixture(scope="module")
def model(smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)
    return tokenizer, GrammarVocab.of(tokenizer), _stages(smollm2_dir, 1, "none"), _stages(smollm2_dir, 2, "none")


def _prompt(tokenizer: Tokenizer, message: str) -> list[int]:
    return tokenizer.encode(render_chat([{"role": "user", "content": message}], tokenizer=tokenizer))


@pytest.mark.parametrize("name", list(CASES))
def test_constrained_output_is_valid_and_exact_under_speculation(model, name):
    tokenizer, vocab, one, two = model
    message, spec = CASES[name]
    prompt, params = _prompt(tokenizer, message), SamplingParams(max_new_tokens=MAX_NEW, grammar=spec)
    want = plain_masked_decoding(one, prompt, params, vocab)
    assert want[-1] in tokenizer.eos_token_ids, f"no EOS within {MAX_NEW} tokens: {tokenizer.decode(want)!r}"
    text = tokenizer.decode(want)
    if name == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "grammar":  # the GBNF's language, by the regex and calendar of Python's own date parser
        assert re.fullmatch(REGEX, text) and datetime.date.fromisoformat(text), text
    else:
        assert text in CHOICES, text
    table = ReferenceTable([(prompt, want)])
    for predictor in (None, AlwaysWrongPredictor(table, vocab_size=tokenizer.vocab_size), MostlyRightPredictor(table)):
        pipe = InProcessPipeline(two, max_model_len=512, predictor=predictor, grammar_vocab=vocab)
        got = pipe.generate([prompt], params)[0]
        assert got == want, f"{type(predictor).__name__}: {tokenizer.decode(got)!r} != {text!r}"
