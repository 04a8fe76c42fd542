"""A request naming a model this server does not serve: vLLM's 404 on every route that reads `model`.

vLLM's OpenAI server (vllm/entrypoints/openai/engine/serving.py `OpenAIServing._check_model`) answers such a
request with HTTP 404 and {"error": {"message": "The model `NAME` does not exist.", "type": "NotFoundError",
"param": "model", "code": 404}}, before it reads any other field; an absent, null or empty `model` is the
served model (`_is_model_supported`). The openai client raises `openai.NotFoundError` for it.
What breaks when these fail: a client that tells a wrong model name from a bad request by the status (the
openai client's NotFoundError) saw a 400 BadRequestError; a route answered an unknown model differently from
the others or from GET /v1/models/{id}; a chat request with an unknown model got a 400 about its messages.
Over the fake coordinator of tests/unit/test_serving_http.py (no model run).
"""

from __future__ import annotations

import httpx
import pytest

from launcher.serving.formats.model_field import ModelNotFoundError, check_model
from launcher.serving.openai_protocol import parse_chat, parse_completion
from launcher.serving.serving_engine import InvalidRequestError
from tests.unit.test_serving_http import served, tokenizer  # noqa: F401  (fixtures)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "user", "content": "Hi"}]
# vLLM's body of this answer (`_check_model`'s create_error_response: message, err_type, status, param)
VLLM_NOT_FOUND = {"message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model",
                  "code": 404}
BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [72, 105]},
}


@pytest.mark.parametrize("route", list(BODIES))
def test_every_route_that_reads_model_answers_another_model_with_vllms_404(served, route):  # noqa: F811
    _, _, url = served
    r = httpx.post(url + route, json={**BODIES[route], "model": "other"})
    assert r.status_code == 404 and r.json() == {"error": VLLM_NOT_FOUND}, r.text


def test_get_model_by_id_answers_an_unknown_id_with_the_same_404(served):  # noqa: F811
    _, _, url = served
    r = httpx.get(url + "/v1/models/other")
    assert r.status_code == 404 and r.json() == {"error": VLLM_NOT_FOUND}, r.text
    assert httpx.get(url + "/v1/models/tiny").json()["id"] == "tiny"


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("model", [None, "", "tiny"])
def test_no_name_an_empty_one_or_the_served_one_is_served(served, route, model):  # noqa: F811
    """vLLM's `_is_model_supported`: a falsy name is the served model."""
    _, _, url = served
    body = BODIES[route] if model is None else {**BODIES[route], "model": model}
    assert httpx.post(url + route, json=body).status_code == 200


def test_the_model_is_checked_before_any_other_field(tokenizer):  # noqa: F811
    """vLLM checks the model before any field's value: another model with a temperature of 9 is its 404 too. (Its
    pydantic request models check JSON types before that, so messages that are not a list are vLLM's 400; here the
    model is checked before those as well: the 404.)"""
    with pytest.raises(ModelNotFoundError):
        parse_chat({"model": "other", "messages": "not a list"}, tokenizer=tokenizer, model_name="tiny",
                   max_model_len=64)
    with pytest.raises(ModelNotFoundError):
        parse_completion({"model": "other", "prompt": "Hi", "temperature": 9}, tokenizer=tokenizer, model_name="tiny")


@pytest.mark.parametrize("value", [5, ["tiny"], {"id": "tiny"}, True])
def test_a_model_that_is_not_a_string_is_a_400_naming_it(value):
    """vLLM's request models type `model` as a string: another JSON type is bad input, not an unknown model."""
    with pytest.raises(InvalidRequestError) as info:
        check_model({"model": value}, "tiny", error=InvalidRequestError)
    assert info.value.param == "model" and not isinstance(info.value, ModelNotFoundError)


def test_the_openai_client_raises_not_found(served):  # noqa: F811
    _, _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    for call in (lambda: client.completions.create(model="other", prompt="Hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2),
                 lambda: client.models.retrieve("other")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.status_code == 404 and info.value.body == VLLM_NOT_FOUND
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
