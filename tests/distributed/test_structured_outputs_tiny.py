"""Structured outputs end to end: `speedpipe serve` (2 real stage processes, gloo on loopback, the tiny
random model) answers response_format / structured_outputs over HTTP and structured_output over gRPC
with exactly the tokens of plain masked decoding, under `--speculate none`, `speed` and `speed+firp`
(untrained FIRP maps: chains of several rows verified in one result, accepted and rejected).

What breaks when these fail: a constrained request is unconstrained somewhere between the front end and
the verify pass (the coordinator's engine has no grammar tokenizer, the stages ship no logits rows for a
greedy constrained item, a FIRP chain's later rows are verified on unmasked logits), or the matcher
drifts from the committed tokens across results. The reference is tests/unit/test_grammar_paths.py's
`plain_masked_decoding` on a one-stage copy of the same model (float32).
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest

from pipeline.speculation.grammar import GrammarSpec, GrammarVocab
from pipeline.speculation.sampling import SamplingParams
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.distributed.test_openai_features_tiny import PROMPT, server, tiny_dir  # noqa: F401 (fixtures)
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer
from tests.unit.test_grammar_paths import (
    GBNF,
    LARK,
    LARK_REGEX,
    SPECS,
    is_arithmetic,
    plain_masked_decoding,
    tagged_regions,
)
from tests.unit.test_token_tree_pipeline import _stages

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

MAX_TOKENS = 20
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3}},
          "required": ["n", "s"], "additionalProperties": False}
# (HTTP fields, gRPC StructuredOutput, the spec both mean)
FORMS = {
    "json_object": ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True),
                    GrammarSpec(kind="json_object")),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                    pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
                    GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    "regex": ({"structured_outputs": {"regex": "[a-d]{2,6}-[0-9]{1,3}!"}}, pb.StructuredOutput(regex="[a-d]{2,6}-[0-9]{1,3}!"),
              GrammarSpec(kind="regex", text="[a-d]{2,6}-[0-9]{1,3}!")),
    "choice": ({"structured_outputs": {"choice": ["north", "south", "east-west"]}},
               pb.StructuredOutput(choice=pb.Choices(choices=["north", "south", "east-west"])),
               GrammarSpec.choice(["north", "south", "east-west"])),
    "gbnf": ({"structured_outputs": {"grammar": GBNF}}, pb.StructuredOutput(grammar=GBNF), GrammarSpec(kind="grammar", text=GBNF)),
    "lark": ({"structured_outputs": {"grammar": LARK}}, pb.StructuredOutput(grammar=LARK), GrammarSpec(kind="grammar", text=LARK)),
    "structural_tag": ({"response_format": {"type": "structural_tag", **json.loads(SPECS["structural_tag"].text)}},
                       pb.StructuredOutput(structural_tag=SPECS["structural_tag"].text), SPECS["structural_tag"]),
}
VALID = {"gbnf": is_arithmetic, "lark": lambda text: re.fullmatch(LARK_REGEX, text) is not None,
         "structural_tag": lambda text: tagged_regions(text) > 0}


@pytest.fixture(scope="module")
def reference(tiny_dir):  # noqa: F811 (the fixture imported above)
    """{form: plain masked greedy tokens of PROMPT} on a one-stage copy of the served model."""
    one, vocab = _stages(tiny_dir, 1, "none"), GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
    prompt = list(PROMPT.encode())  # the byte tokenizer: one token per byte, no BOS
    return {name: plain_masked_decoding(one, prompt, SamplingParams(max_new_tokens=MAX_TOKENS, grammar=spec), vocab)
            for name, (_, _, spec) in FORMS.items()}


@pytest.mark.parametrize("name", list(FORMS))
def test_http_and_grpc_give_the_plain_masked_tokens(server, reference, name):  # noqa: F811
    fields, so, _ = FORMS[name]
    want = reference[name]
    assert server.engine.tokenizer.encode(PROMPT) == list(PROMPT.encode())
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want, f"HTTP {name} differs from plain masked decoding"
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        chunks = list(pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
            prompt=PROMPT, max_new_tokens=MAX_TOKENS, structured_output=so), timeout=120))
    assert [t for c in chunks for t in c.token_ids] == want, f"gRPC {name} differs from plain masked decoding"
    if want[-1] == TINY_EOS_ID:  # complete: a whole document of the grammar
        text = bytes(want[:-1]).decode("latin-1")
        if name in VALID:
            assert VALID[name](text), text
        elif name == "regex":
            assert text.endswith("!") and "-" in text
        elif name == "choice":
            assert text in ("north", "south", "east-west")
        else:
            assert isinstance(json.loads(text), dict)


def test_n_seeded_choices_each_follow_their_own_grammar_state(server, tiny_dir):  # noqa: F811
    """`n` = 2 sampled choices of one constrained request are two sequences, each with its own matcher and
    seed + i: each equals plain masked sampling with that seed (a shared matcher would mix them)."""
    one, vocab = _stages(tiny_dir, 1, "none"), GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
    fields, _, spec = FORMS["json_schema"]
    want = [plain_masked_decoding(one, list(PROMPT.encode()), SamplingParams(
        max_new_tokens=MAX_TOKENS, temperature=1.0, seed=3 + i, grammar=spec), vocab) for i in range(2)]
    assert want[0] != want[1], "the seeds gave the same output: the test could not tell the choices apart"
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3, "n": 2, "return_token_ids": True,
        **fields})
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == want


@pytest.mark.parametrize("name", ["gbnf", "lark", "structural_tag"])
def test_chat_with_a_grammar_gives_the_plain_masked_tokens(server, tiny_dir, name):  # noqa: F811
    """/v1/chat/completions with `structured_outputs.grammar` or a structural tag `response_format`: plain masked
    decoding of the chat template's prompt, seeded sampling (the greedy GBNF output of the tiny model runs past
    the budget), and a complete output is a sentence of the grammar by a reference parser (Python's for
    arithmetic, a regex for the Lark word list); the structural tag's output enters a tagged region (JSON
    checked by Python's decoder where it is complete)."""
    from launcher.serving.openai_protocol import render_chat

    fields, _, spec = FORMS[name]
    messages = [{"role": "user", "content": "Say something."}]
    tokenizer = server.engine.tokenizer
    prompt = tokenizer.encode(render_chat(messages, tokenizer=tokenizer))
    one, vocab = _stages(tiny_dir, 1, "none"), GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])
    params = SamplingParams(max_new_tokens=MAX_TOKENS * 2, temperature=1.0, seed=11, grammar=spec)
    want = plain_masked_decoding(one, prompt, params, vocab)
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": MAX_TOKENS * 2, "temperature": 1.0, "seed": 11, "return_token_ids": True,
        **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want, f"chat {name} differs from plain masked decoding"
    if want[-1] == TINY_EOS_ID or name == "structural_tag":
        assert VALID[name](choice["message"]["content"]), choice
        assert choice["finish_reason"] == ("stop" if want[-1] == TINY_EOS_ID else "length"), choice
