"""Masks that leave no token later in generation ([Note: no token left] in pipeline/speculation/verify.py): the
engine's named outcome (Commit.error_fields), the coordinator's NoTokenLeftError, and the front ends' answers
(HTTP 400 naming the field / the in-stream error event with code 400, gRPC INVALID_ARGUMENT).

What breaks when these fail: a request whose allowed_token_ids and bad_words dead-end at output token 5 is an
HTTP 500 / gRPC INTERNAL (an internal error) instead of bad input naming the fields; the dead end is found at
another position under speculation than in plain decoding; the failing sequence wedges the engine (its slot or
in-flight items left behind) or changes its neighbour's output. Reference: plain decoding of the fake model's
logits masked by the library's own `apply_token_masks`.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch

from launcher.coordinator.request_handle import NoTokenLeftError, RequestHandle
from launcher.serving.formats.response_format import grammar_from_body, grammar_from_proto
from launcher.serving.formats.tools import tools_from_body
from pipeline.engine.records import Commit, FinishReason
from pipeline.speculation.grammar import GrammarError, GrammarState, GrammarVocab
from pipeline.speculation.masks.token_masks import apply_token_masks
from pipeline.speculation.sampling import Sampler, SamplingParams
from pipeline.speculation.verify import verify_result
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.tiny_model import NUM_BYTE_TOKENS, TINY_EOS_ID, byte_tokenizer
from tests.unit.test_grpc_error_details import _details
from tests.unit.test_serving_http import FakeCoordinator, _streamed_chunks, tokenizer  # noqa: F401 (the fixture)
from tests.unit.test_speculation_scheduler import MostlyArgmaxPredictor, _generate, fake_logits
from tests.unit.test_token_masks_serving import serve_http_and_grpc

pytestmark = pytest.mark.timeout(120)
PROMPTS = [[1, 2, 3], [4, 0, 5]]
# allowed {1, 2}; "2" banned alone and "1" after five 1s: token 1 five times, then nothing left at output token 5
DEAD_END = SamplingParams(max_new_tokens=12, allowed_token_ids=(1, 2), bad_word_ids=((2,), (1, 1, 1, 1, 1, 1)))
PLAIN = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _masked_reference(prompt: list[int], params: SamplingParams) -> tuple[list[int], bool]:
    """(plain greedy decoding of fake_logits under the token masks, whether it stopped at a row with no token)."""
    out: list[int] = []
    while len(out) < params.max_new_tokens:
        row = apply_token_masks(fake_logits(prompt + out), params, history=out, eos_token_ids=())
        if not bool(torch.isfinite(row).any()):
            return out, True
        out.append(int(torch.argmax(row)))
    return out, False


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("speculate", [False, True])
def test_a_dead_end_fails_its_request_naming_the_fields_at_the_plain_decoding_position(num_stages, speculate):
    want, dead = _masked_reference(PROMPTS[0], DEAD_END)
    assert dead and len(want) == 5
    predictor = MostlyArgmaxPredictor(seed=3) if speculate else None
    outputs, engine, fake = _generate(num_stages, PROMPTS, [DEAD_END, PLAIN], predictor=predictor,
                                      next_fn=lambda p: int(torch.argmax(fake_logits(p))), logits_fn=fake_logits)
    assert outputs[0] == want and fake.states[0].finish_reason is FinishReason.ERROR
    assert (engine.spec.drafted_tokens > 0) == speculate
    alone, _, _ = _generate(num_stages, PROMPTS[1:], [PLAIN], next_fn=lambda p: int(torch.argmax(fake_logits(p))),
                            logits_fn=fake_logits)
    assert outputs[1] == alone[0], "the failing neighbour changed a plain request's output"
    # (_generate checked that the engine forgot both sequences and holds nothing in flight)


def test_the_coordinators_handle_raises_no_token_left_naming_the_fields(tokenizer):  # noqa: F811
    handle = RequestHandle("r", "p", [104], DEAD_END, tokenizer.detokenizer(prompt_ids=[104]))
    handle.emit(Commit(0, (104, 105), None))
    handle.emit(Commit(0, (), FinishReason.ERROR, error="allowed_token_ids, bad_words leave no token",
                       error_fields=("allowed_token_ids", "bad_words")))
    with pytest.raises(NoTokenLeftError) as info:
        handle.result(1)
    assert info.value.param == "allowed_token_ids" and handle.token_ids == [104, 105]


class DeadEndCoordinator(FakeCoordinator):
    """FakeCoordinator (echoes the prompt's tokens) that commits two tokens, then ends the request as the engine
    does when its masks leave no token (FinishReason.ERROR with error_fields)."""

    def _run(self, h) -> None:
        h.emit(Commit(0, tuple(h.prompt_ids[:2]), None))
        h.emit(Commit(0, (), FinishReason.ERROR, error="bad_words, response_format leave no token to generate at "
                      "output token 2", error_fields=("bad_words", "response_format")))


@pytest.fixture()
def served(tokenizer):  # noqa: F811
    yield from serve_http_and_grpc(DeadEndCoordinator(tokenizer, step_s=0.0))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_over_http_a_dead_end_is_a_400_naming_the_field_or_the_streams_error_event(served, route):
    url, _ = served
    body = {"prompt": "Hi there", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "bad_words" and error["type"] == "invalid_request_error"
    assert "leave no token" in error["message"]
    chunks = _streamed_chunks(url, route, {**body, "stream": True})
    assert chunks[-1]["error"]["code"] == 400 and chunks[-1]["error"]["param"] == "bad_words", chunks[-1]
    assert httpx.post(url + route, json=body, timeout=30).status_code == 400  # the server keeps serving


def test_over_grpc_a_dead_end_is_invalid_argument_naming_the_proto_field(served):
    _, channel = served
    stub = pb_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt="Hi there", max_new_tokens=8), timeout=30))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "leave no token" in err.details()
    violations = _details(err)["BadRequest"].field_violations
    assert [v.field for v in violations] == ["bad_words"], violations



def _grpc_choice_request():
    req = pb.GenerateRequest()
    req.structured_output.choice.choices.append("a")
    return req


@pytest.mark.parametrize(("make_spec", "field"), [
    (lambda: grammar_from_body({"response_format": {"type": "json_object"}}), "response_format"),
    (lambda: grammar_from_body({"structured_outputs": {"choice": ["a"]}}), "structured_outputs"),
    (lambda: grammar_from_proto(_grpc_choice_request()), "structured_output"),
    (lambda: tools_from_body({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                              "tool_choice": "required"}, parser=None).grammar(), "tool_choice"),
])
def test_a_grammar_dead_end_names_the_field_that_asked_for_the_grammar(make_spec, field):
    """allowed_token_ids = {"b"} against a grammar that cannot start with "b": the dead end names the request's
    own grammar field (it named response_format whatever the request had used)."""
    spec = make_spec()
    state = GrammarState(spec, GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID]))
    params = SamplingParams(max_new_tokens=4, grammar=spec, allowed_token_ids=(ord("b"),))
    with pytest.raises(GrammarError, match=f"allowed_token_ids, {field} leave no token") as info:
        verify_result(argmax=[ord("b")], drafts=[], logits=torch.zeros(1, NUM_BYTE_TOKENS), sampler=Sampler(params),
                      eos_token_ids=(TINY_EOS_ID,), ignore_eos=False, budget_left=4, grammar=state)
    assert info.value.fields == ("allowed_token_ids", field)
