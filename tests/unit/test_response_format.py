"""Structured outputs at the front ends: OpenAI's response_format and vLLM's structured_outputs over HTTP,
GenerateRequest.structured_output over gRPC (launcher/serving/formats/response_format.py).

What breaks when these fail: an accepted form does not reach SamplingParams.grammar (the request runs
unconstrained), or text/null turn on a grammar; a bad type, an unknown kind, an invalid schema or regex,
or both fields set is accepted, or refused with a 500, several lines, or a `param` that names no field;
gRPC refusals lack the BadRequest naming the field. Requests go through the real parsers and servers
over the fake coordinator of tests/unit/test_serving_http.py (no model runs: the model end to end is
tests/distributed/test_structured_outputs_tiny.py).
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from launcher.serving.grpc_generate import request_params
from launcher.serving.openai_protocol import parse_chat, parse_completion
from launcher.serving.serving_engine import InvalidRequestError, ServingEngine
from pipeline.speculation.grammar import MAX_GRAMMAR_CHARS, GrammarSpec
from proto import speedpipe_pb2 as pb
from tests.unit.test_grpc_error_details import _details, _generate_error
from tests.unit.test_serving_grpc import grpc_server  # noqa: F401 (the fixture)
from tests.unit.test_serving_http import FakeCoordinator, served, tokenizer  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.timeout(60)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
LARK = 'start: "n=" NUM\nNUM: /[0-9]{1,3}/'
GBNF = 'root ::= "n=" [0-9] [0-9]?'
TAG = {"structures": [{"begin": "<f=add>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
ACCEPTED = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec(kind="json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, GrammarSpec(kind="regex", text="[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, GrammarSpec.choice(["yes", "no"])),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec(kind="json_object")),
    ({"structured_outputs": {"grammar": LARK}}, GrammarSpec(kind="grammar", text=LARK)),
    ({"structured_outputs": {"grammar": GBNF}}, GrammarSpec(kind="grammar", text=GBNF)),
    ({"structured_outputs": {"structural_tag": TAG}}, GrammarSpec(kind="structural_tag", text=json.dumps(TAG))),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, GrammarSpec(kind="structural_tag", text=json.dumps(TAG))),
    ({"response_format": {"type": "structural_tag", **TAG}}, GrammarSpec(kind="structural_tag", text=json.dumps(TAG))),
]
REFUSED = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": 5}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": "my schema"}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": "n" * 65}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: a"}}, "structured_outputs.grammar"),  # unknown rule (Lark)
    ({"structured_outputs": {"grammar": "root ::= a"}}, "structured_outputs.grammar"),  # unknown rule (GBNF)
    ({"structured_outputs": {"grammar": "hello"}}, "structured_outputs.grammar"),  # neither
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": ["start: a"]}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= " + "a" * MAX_GRAMMAR_CHARS}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": LARK, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "[" * 5000 + "]" * 5000}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": [TAG]}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": {**TAG, "triggers": ["<g="]}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": {**TAG, "triggers": []}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": {**TAG, "extra": 1}}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": 3}, "end": "</f>"}]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": []}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ({"structured_outputs": ["regex"]}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    ({"structured_outputs": {"grammar": LARK}, "ignore_eos": True}, "structured_outputs"),  # not response_format
    ({"response_format": {"type": "structural_tag", **TAG}, "ignore_eos": True}, "response_format"),
    ({"structured_outputs": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["abcd"] * (MAX_GRAMMAR_CHARS // 8 + 1)}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * MAX_GRAMMAR_CHARS]}}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize(("fields", "spec"), ACCEPTED)
def test_accepted_forms_reach_the_sampling_params_of_both_routes(tokenizer, fields, spec):  # noqa: F811
    completion = parse_completion({"prompt": "Hi", **fields}, tokenizer=tokenizer, model_name="tiny")
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], **fields}, tokenizer=tokenizer,
                      model_name="tiny", max_model_len=64)
    assert completion.params.grammar == spec and chat.params.grammar == spec


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refusals_name_the_field_in_one_line(tokenizer, fields, param):  # noqa: F811
    with pytest.raises(InvalidRequestError) as info:
        parse_completion({"prompt": "Hi", **fields}, tokenizer=tokenizer, model_name="tiny")
    assert info.value.param == param, info.value
    assert f"'{param}'" in str(info.value) and "\n" not in str(info.value), info.value


def test_http_answers_400_with_openai_error_shape(served):  # noqa: F811
    _, _, url = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "structured_outputs": {"regex": "a(b"}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "structured_outputs.regex", error
    assert error["type"] == "invalid_request_error" and "unclosed group" in error["message"], error
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3,
                                                   "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text


GRPC_REFUSED = [
    (pb.StructuredOutput(), "structured_output"),
    (pb.StructuredOutput(json_object=False), "structured_output.json_object"),
    (pb.StructuredOutput(regex="a(b"), "structured_output.regex"),
    (pb.StructuredOutput(json_schema="{x"), "structured_output.json_schema"),
    (pb.StructuredOutput(json_schema=""), "structured_output.json_schema"),
    (pb.StructuredOutput(choice=pb.Choices()), "structured_output.choice"),
    (pb.StructuredOutput(choice=pb.Choices(choices=["a", ""])), "structured_output.choice"),
    (pb.StructuredOutput(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "structured_output.regex"),
    (pb.StructuredOutput(grammar="start: a"), "structured_output.grammar"),
    (pb.StructuredOutput(grammar='root ::= "a" ('), "structured_output.grammar"),
    (pb.StructuredOutput(grammar=""), "structured_output.grammar"),
    (pb.StructuredOutput(structural_tag="{x"), "structured_output.structural_tag"),
    (pb.StructuredOutput(structural_tag="[]"), "structured_output.structural_tag"),
    (pb.StructuredOutput(structural_tag=json.dumps({**TAG, "triggers": ["<g="]})), "structured_output.structural_tag"),
]


def test_grpc_structured_output_reaches_the_sampling_params(tokenizer):  # noqa: F811
    engine = ServingEngine(FakeCoordinator(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    cases = [(pb.StructuredOutput(json_object=True), GrammarSpec(kind="json_object")),
             (pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
             (pb.StructuredOutput(regex="[ab]+"), GrammarSpec(kind="regex", text="[ab]+")),
             (pb.StructuredOutput(choice=pb.Choices(choices=["x", "y"])), GrammarSpec.choice(["x", "y"])),
             (pb.StructuredOutput(grammar=GBNF), GrammarSpec(kind="grammar", text=GBNF)),
             (pb.StructuredOutput(structural_tag=json.dumps(TAG)), GrammarSpec(kind="structural_tag", text=json.dumps(TAG)))]
    for so, spec in cases:
        _, params = request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, structured_output=so), engine)
        assert params.grammar == spec and params.needs_logits_at(0)
    assert request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3), engine)[1].grammar is None
    with pytest.raises(InvalidRequestError) as info:
        request_params(pb.GenerateRequest(prompt="Hi", max_new_tokens=3, ignore_eos=True,
                                          structured_output=pb.StructuredOutput(json_object=True)), engine)
    assert info.value.param == "structured_output" and "ignore_eos" in str(info.value)


@pytest.mark.parametrize(("so", "field"), GRPC_REFUSED)
def test_grpc_refusals_are_invalid_argument_with_a_bad_request_naming_the_field(grpc_server, so, field):  # noqa: F811
    _, _, channel = grpc_server
    err = _generate_error(channel, prompt="hi", max_new_tokens=2, structured_output=so)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "\n" not in err.details()
    [violation] = _details(err)["BadRequest"].field_violations
    assert (violation.field, violation.description) == (field, err.details())
