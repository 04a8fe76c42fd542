"""Property-based fuzzing of the OpenAI-compatible HTTP API over a fake coordinator (no model run).

The promise under test: whatever a client sends, the answer is never a 5xx and never a hang; every
non-2xx answer is OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with a
non-empty one-line message of at most MAX_MESSAGE_CHARS (a huge value it echoes is cut); a stream that is answered 200 ends with `data: [DONE]`; and a request
inside the documented ranges is answered 200.

Request bodies are drawn per route from the fields it reads, each with values of its documented
type (`st.fixed_dictionaries`, SCHEMAS below), then some fields are given NASTY values: a wrong
JSON type, huge integers, NaN / Infinity literals, lone surrogates, very long strings, unknown
fields; other bodies are not JSON objects or not JSON at all, or come with an odd Content-Type.
Why plain hypothesis rather than `hypothesis-jsonschema` over `app.openapi()` or schemathesis: the
routes read raw bodies (validation is launcher/serving/openai_protocol.py, so that a bad body gets
one line naming the field rather than pydantic's list), so FastAPI's OpenAPI document has no
request-body schemas to draw from (the app serves none: openapi_url=None), nor schemathesis a
schema to test against; and hypothesis-jsonschema 0.23.1, its latest release, fails with this
hypothesis (6.170) on a private `many.more()` that is gone.

Runs are deterministic (`derandomize=True`) and short (FUZZ_EXAMPLES per test). To fuzz longer
locally, raise FUZZ_EXAMPLES (e.g. to 5000) and set `derandomize=False` in FUZZ, then run
`python -m pytest -q tests/unit/test_http_fuzz.py`; hypothesis prints the failing request.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.serving.http_server import HttpServer
from launcher.serving.openai_protocol import TEMPLATE_TEXT_CHARS
from launcher.serving.serving_engine import ServingEngine
from pipeline.model.tokenizer import Tokenizer
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401  (module fixture)

pytestmark = pytest.mark.timeout(120)
FUZZ_EXAMPLES = 150
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_MODEL_LEN = 64
TIMEOUT_S = 20.0  # a hang fails the test with httpx.ReadTimeout instead of blocking CI
MAX_MESSAGE_CHARS = 1000  # an error message echoing a 20,000-character value was as long

_text = st.text(max_size=12)
_num = st.floats(-3, 3)
_MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(
            st.text(max_size=12),
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {}, optional={"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
                ),
                max_size=2,
            ),
        ),
    },
)
_TOOL_CALL = st.fixed_dictionaries({}, optional={
    "id": _text, "type": st.just("function"),
    "function": st.fixed_dictionaries({}, optional={"name": _text, "arguments": st.sampled_from(['{"a": 1}', "{", 5])}),
})
_MESSAGE = st.one_of(_MESSAGE, st.fixed_dictionaries(  # OpenAI's tool results and assistant tool calls
    {"role": st.sampled_from(["tool", "assistant"])},
    optional={"content": st.one_of(st.none(), _text), "tool_call_id": st.one_of(_text, st.integers()),
              "tool_calls": st.one_of(st.lists(_TOOL_CALL, max_size=2), _text)}))
_MESSAGES = st.lists(_MESSAGE, max_size=3)
_FUNCTION = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["f", "get_x", "bad name", "", "g" * 65]),
    "description": st.one_of(_text, st.integers()),
    "parameters": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"},
                                   {}, {"type": "object", "properties": {"a": {"type": "objekt"}}}, "{}"]),
    "strict": st.one_of(st.booleans(), _text),
})
_TOOLS = {  # launcher/serving/formats/tools.py; the fuzzed server has no tool-call parser ("auto" is a 400)
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]), "function": _FUNCTION}),
                      max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})})),
    "parallel_tool_calls": st.one_of(st.booleans(), _text),
}
_CHAT_OPTIONS = {
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["tools", "enable_thinking", "x"]),
        st.one_of(
            st.integers(),
            _text,
            st.booleans(),
            st.lists(st.one_of(_text, st.dictionaries(_text, _text)), max_size=2),
        ),
        max_size=2,
    ),
}
# Grammars (Lark, GBNF, neither, broken, empty, over the cap) and structural tags (valid, malformed, as JSON text).
GRAMMARS = ['start: "a" | "b"', 'root ::= [0-9]+', "start: undefined", 'root ::= "a" (', "::=", "", "x" * 262_145]
STRUCTURAL_TAGS = [{"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]},
                   {"structures": [{"begin": "<f=a>", "schema": {"type": 3}, "end": "</f>"}], "triggers": ["<g="]},
                   {"structures": [], "triggers": []}, {"structures": [{"begin": 1}], "triggers": [""]}, "{", "[]",
                   '{"structures": [{"begin": "x", "end": "y"}], "triggers": ["x"]}']
_SAMPLING = {
    "model": st.sampled_from(["tiny", "gpt-4", "", "two\nlines", "a\rb"]),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 70)),
    "max_completion_tokens": st.integers(0, 8),
    "temperature": _num,
    "top_p": _num,
    "top_k": st.integers(-2, 300),
    "min_p": _num,
    "seed": st.integers(-(2**64), 2**64),
    "n": st.integers(0, 20),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=6)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "presence_penalty": _num,
    "frequency_penalty": _num,
    "repetition_penalty": _num,
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(-2, 300).map(str), _text), st.one_of(st.floats(-150, 150), _text, st.none()), max_size=3
    ),
    "best_of": st.integers(0, 3),
    "user": _text,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml", "structural_tag"])}),
        st.sampled_from(STRUCTURAL_TAGS).filter(lambda t: isinstance(t, dict)).map(lambda t: {"type": "structural_tag", **t}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"schema": st.sampled_from([{"type": "object"}, {"type": 3}, {"type": "string", "pattern": "a("}])},
            optional={"name": st.one_of(_text, st.just("person")), "strict": st.booleans()})}),
    ),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "json_object", "grammar",
                                                           "structural_tag"]),
                                          st.one_of(_text, st.booleans(), st.lists(_text, max_size=3),
                                                    st.sampled_from(GRAMMARS), st.sampled_from(STRUCTURAL_TAGS)),
                                          max_size=2),
}
# The fields of each route, each with values of its documented type (mostly in range, some not).
SCHEMAS = {
    "/v1/completions": {
        **_SAMPLING,
        "echo": st.booleans(),
        "suffix": st.text(max_size=3),
        "prompt": st.one_of(
            st.text(max_size=40),
            st.lists(st.integers(-1, 300), max_size=3),
            st.lists(st.text(max_size=6), max_size=2),
        ),
        "logprobs": st.one_of(st.none(), st.booleans(), st.integers(-1, 21)),
    },
    "/v1/chat/completions": {
        **_SAMPLING,
        **_CHAT_OPTIONS,
        **_TOOLS,
        "messages": _MESSAGES,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21),
    },
    "/tokenize": {
        **_CHAT_OPTIONS,
        "model": st.sampled_from(["tiny", "other"]),
        "prompt": st.text(max_size=40),
        "messages": _MESSAGES,
        "add_special_tokens": st.booleans(),
        "return_token_strs": st.booleans(),
    },
    "/detokenize": {
        "model": st.sampled_from(["tiny", "other"]),
        "tokens": st.lists(st.integers(-2, 300), max_size=6),
    },
}
ROUTES = list(SCHEMAS)

# Values of the wrong type or out of every range, for any field (json.dumps writes NaN / Infinity
# literals, which Python's json.loads, and so the server, accepts).
NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**30, -(10**30), 10**400, 2**63, 0, -1]),
    st.floats(),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-320, -0.0]),
    _text,
    st.sampled_from(["", "\ud800", "a\ud800b", "x" * 20_000, "line\nbreak", "1", "true"]),
    st.lists(st.one_of(st.integers(), _text, st.none()), max_size=6),
    st.dictionaries(_text, st.one_of(st.integers(), _text, st.none()), max_size=3),
)
FIELDS = sorted(
    {name for fields in SCHEMAS.values() for name in fields}
    | {"stream_options", "chat_template_kwargs", "unknown_field", "tokens", "prompt", "messages"}
)


@st.composite
def _body(draw, route: str) -> dict:
    """A body of the route's fields, some of them then set to NASTY values."""
    body = draw(st.fixed_dictionaries({}, optional=SCHEMAS[route]))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        body[name] = draw(NASTY)
    return body


def _raw(body) -> bytes:
    return json.dumps(body).encode("utf-8", "surrogatepass")  # ensure_ascii: a lone surrogate is "\ud800"


RAW_BODIES = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"42",
            b'"s"',
            b"{",
            b'{"prompt": 1e400}',
            b'{"prompt": "hi", "temperature": ' + b"9" * 500 + b"}",
            b'{"prompt": "hi", "n": ' + b"9" * 5000 + b"}",
            b"[" * 5000 + b"]" * 5000,
            b'{"prompt": "\xff"}',
            b"\xef\xbb\xbf{}",
        ]
    ),
    NASTY.map(_raw),
)


# A chat template as real models' (Qwen2.5's shape): it lists `tools` from chat_template_kwargs and
# refuses an unknown role with raise_exception.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory, tokenizer) -> Tokenizer:  # noqa: F811
    """The tiny tokenizer with TOOLS_TEMPLATE as its chat template."""
    folder = tmp_path_factory.mktemp("tools")
    for f in tokenizer.model_dir.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOLS_TEMPLATE}))
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def client(tools_tokenizer):
    """An httpx client of a real server on loopback; room for many requests, so a good one is never 429."""
    coord = FakeCoordinator(tools_tokenizer, step_s=0.0)
    engine = ServingEngine(
        coord, model_name="tiny", max_num_seqs=32, max_queue=32, max_model_len=MAX_MODEL_LEN
    )
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    port = http.server.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S) as c:
        yield c
    http.stop()


def check_answer(r: httpx.Response, *, stream: bool = False) -> None:
    """The promise for any request: no 5xx; an error is OpenAI's shape with a short one-line message;
    a 200 stream ends with [DONE]."""
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 300:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        message = error["message"]
        assert isinstance(message, str) and message.strip() and message.splitlines() == [message], error
        assert len(message) <= MAX_MESSAGE_CHARS, f"{len(message)} characters: {message[:300]}"
        assert isinstance(error["type"], str) and error["type"], error
    elif stream and r.status_code == 200:
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
        assert '"error"' not in r.text, r.text[-300:]


@pytest.mark.parametrize("route", ROUTES)
@FUZZ
@given(data=st.data())
def test_schema_bodies_with_nasty_fields_never_get_a_5xx(client, route, data):
    body = data.draw(_body(route))
    r = client.post(route, content=_raw(body), headers={"content-type": "application/json"})
    check_answer(r, stream=body.get("stream") is True)


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    raw=RAW_BODIES,
    content_type=st.sampled_from(
        ["application/json", "text/plain", "", "application/json; charset=latin-1", "multipart/form-data"]
    ),
)
def test_raw_bodies_and_content_types_never_get_a_5xx(client, route, raw, content_type):
    check_answer(client.post(route, content=raw, headers={"content-type": content_type}))


@FUZZ
@given(
    path=st.one_of(
        st.sampled_from(
            [
                "/v1/models",
                "/health",
                "/ready",
                "/version",
                "/metrics",
                "/v1/models/tiny",
                "/v1/completions",
                "/tokenize",
                "/nope",
            ]
        ),
        st.text(max_size=20).map(lambda s: "/v1/models/" + quote(s, safe="/")),
    ),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
)
def test_any_path_and_method_never_get_a_5xx(client, path, method):
    check_answer(client.request(method, path))


GOOD_COMMON = st.fixed_dictionaries(
    {
        "max_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "n": st.integers(1, 3),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "seed": st.integers(0, 2**63 - 1),
    },
    optional={
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "top_k": st.integers(-1, 50),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 2),
        "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=4),
        "return_token_ids": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.just(True)},
                                                 optional={"continuous_usage_stats": st.booleans()}),
        "user": _text,
        "metadata": st.dictionaries(_text, _text, max_size=2),
    },
)
GOOD_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(
            st.text(max_size=6),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}), max_size=2
            ),
        ),
    }
)


@FUZZ
@given(
    common=GOOD_COMMON,
    chat=st.booleans(),
    prompt=st.text(min_size=1, max_size=12),
    messages=st.lists(GOOD_MESSAGE, min_size=1, max_size=1),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    echo=st.booleans(),
)
def test_a_request_inside_the_documented_ranges_gets_200(
    client, common, chat, prompt, messages, logprobs, echo
):
    body = dict(common)
    if not body["stream"]:
        body.pop("stream_options", None)
    if chat:
        body.update(messages=messages, logprobs=logprobs is not None, top_logprobs=logprobs)
    else:
        body.update(prompt=prompt, logprobs=logprobs, echo=echo)
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    check_answer(r, stream=body["stream"])


@FUZZ
@given(
    chat=st.booleans(),
    bias=st.dictionaries(
        st.one_of(st.integers(-1, 260).map(str), st.sampled_from(["x", "1.5", " 2", "", "0x1"])),
        st.one_of(st.floats(-101, 101, allow_nan=False), st.integers(-101, 101), st.sampled_from(["1", None, True])),
        max_size=4,
    ),
)
def test_logit_bias_is_200_when_every_entry_is_valid_else_400_naming_it(client, chat, bias):
    """The tiny tokenizer's vocabulary is 256 ids: an entry is valid iff its key is a decimal id in
    [0, 256) and its value a number (not a boolean) in [-100, 100]."""

    def valid(key: str, value) -> bool:
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
        return key.isdigit() and int(key) < 256 and number

    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    r = client.post("/v1/chat/completions" if chat else "/v1/completions",
                    json={**prompt, "max_tokens": 2, "logit_bias": bias})
    if all(valid(k, v) for k, v in bias.items()):
        assert r.status_code == 200, r.text[:500]
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text[:500]
    check_answer(r)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_chat_template_that_fails_on_the_request_is_400_naming_the_field(client, route):
    """A real template (Qwen2.5's) iterates `tools`; {"tools": 5} made it raise TypeError, a 500.
    raise_exception's own refusal keeps its message."""
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post(route, json={"messages": messages, "chat_template_kwargs": {"tools": 5}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == "chat_template_kwargs"
        and "the chat template cannot render this request" in error["message"]
    )
    assert "'int' object is not iterable" in error["message"]
    r = client.post(route, json={"messages": [{"role": "robot", "content": "Hi"}]})
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "chat template refused the messages: unknown role robot"
    )
    assert (
        client.post(
            route, json={"messages": messages, "chat_template_kwargs": {"tools": [{"name": "f"}]}}
        ).status_code
        == 200
    )


def test_a_chat_template_refusal_quoting_a_huge_value_is_cut(client):
    """TOOLS_TEMPLATE's raise_exception quotes the role: a 20,000-character role made a message as long;
    the template's text is cut after TEMPLATE_TEXT_CHARS (a real template's refusal is shorter)."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "r" * 20_000, "content": "Hi"}]})
    text = "unknown role " + "r" * (TEMPLATE_TEXT_CHARS - len("unknown role ")) + "… (20013 characters)"
    assert r.status_code == 400 and r.json()["error"]["message"] == "chat template refused the messages: " + text
