"""Masks that leave no token later in generation, on a real 2-stage server (gloo on loopback, the tiny random
model, speculation `speed+firp`: n-gram drafts and untrained FIRP chains, so a dead end can fall inside a
verified chain). [Note: no token left] in pipeline/speculation/verify.py.

allowed_token_ids {"a", "b"} with bad_words "b" and "aaaaaa": "a" five times, then no token at output token 5.
What breaks when this fails: the request is an HTTP 500 / gRPC INTERNAL instead of a 400 naming the field /
the stream's error event / INVALID_ARGUMENT; the tokens before the dead end differ from plain decoding's (the
masks' own rule: only "a" is allowed until then); the pipeline is wedged afterwards (the next request hangs or
its output changes).

Greedy min_tokens (the same kind of server, and one on a tiny Mistral whose greedy output varies): items ship
logits rows only before min_tokens (`SamplingParams.needs_logits_at`). What breaks when these fail: the
boundary is off by one (a stop id the model chooses at output token min_tokens - 1 gets through, or one at
min_tokens is masked), against token-by-token decoding with vLLM's mask, streamed or not.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import grpc
import httpx
import pytest

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.serve import ServeOptions, ServingStack
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.tiny_model import write_firp_file, write_tiny_model
from tests.unit.test_grpc_error_details import _details

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

A, B = ord("a"), ord("b")  # the tiny byte tokenizer: token id == byte value
DEAD_END = {"allowed_token_ids": [A, B], "bad_words": ["b", "aaaaaa"]}
PLAIN = {"prompt": "The cat sat on the mat.", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}


@contextlib.contextmanager
def firp_server(model_dir: Path, firp_path: Path):
    """HTTP + gRPC on 2 real stages of `model_dir`, `speed+firp` with FIRP maps written to `firp_path`."""
    firp = write_firp_file(model_dir, firp_path, layer=1, k=3)
    options = PipelineOptions(num_stages=2, model=str(model_dir), progress=False, max_num_seqs=4, max_model_len=128,
                              stage_timeout_s=60, speculate="speed+firp", predictor="ngram", min_acceptance=0.0,
                              row_cost="none", firp_file=str(firp), layer_split="2,2")
    with PipelineSession(options, resolve(options)) as session:
        with ServingStack(session, ServeOptions(host="127.0.0.1", port=0, grpc_port=0, stats_interval_s=0)) as stack:
            yield stack


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny-dead-end"))
    with firp_server(tiny, tmp_path_factory.mktemp("firp") / "firp.safetensors") as stack:
        yield stack


def test_a_dead_end_is_bad_input_over_http_and_grpc_and_the_next_request_works(server):
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    before = httpx.post(url, json=PLAIN, timeout=120).json()["choices"][0]
    body = {**PLAIN, **DEAD_END}
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "allowed_token_ids" and "output token 5" in r.json()["error"]["message"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    streamed = [t for e in events if "choices" in e for c in e["choices"] for t in c.get("token_ids") or ()]
    assert streamed == [A] * 5  # the masks' rule: only "a" until the dead end
    assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["param"] == "allowed_token_ids"
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        chunks: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stub.Generate(pb.GenerateRequest(prompt=PLAIN["prompt"], max_new_tokens=12,
                                                          allowed_token_ids=[A, B], bad_words=["b", "aaaaaa"]),
                                       timeout=120):
                chunks.append(chunk)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert [v.field for v in _details(info.value)["BadRequest"].field_violations] == ["allowed_token_ids"]
        assert [t for c in chunks for t in c.token_ids] == [A] * 5
    after = httpx.post(url, json=PLAIN, timeout=120).json()["choices"][0]
    assert after["token_ids"] == before["token_ids"] and after["finish_reason"] == "length"


def test_launch_names_the_flags_of_a_dead_end_and_exits_2(tiny_model_dir, capsys):
    """`launch`: the dead end is the prompt's own input, so one line naming the flags, exit 2 (as bad input
    refused up front), after the text before it; with several prompts each failed one gets its line, the JSON
    its `error_param` (HTTP's `param`); an internal failure stays `request failed`, exit 1 (test_failures.py)."""
    from launcher.cli.main import main

    flags = ["--model", str(tiny_model_dir), "--stages", "2", "--max-new-tokens", "12", "--temperature", "0",
             "--allowed-token-ids", f"{A},{B}", "--no-progress"]
    assert main(["launch", *flags, "--bad-words", "b", "--bad-words", "aaaaaa", "--prompt", PLAIN["prompt"]]) == 2
    out, err = capsys.readouterr()
    assert out == PLAIN["prompt"] + "a" * 5 + "\n"
    assert err.strip().splitlines()[-1] == ("speedpipe launch: error: --allowed-token-ids, --bad-words leave no token "
                                            "to generate at output token 5 (every token is masked there)")
    assert main(["launch", *flags, "--regex", "c+", "--json", "--prompt", "ab", "--prompt", "cd"]) == 2
    out, err = capsys.readouterr()
    outputs = json.loads(out.strip().splitlines()[-1])["outputs"]
    assert [o.get("error_param") for o in outputs] == ["allowed_token_ids"] * 2
    assert [line.split(": ", 3)[1:] for line in err.strip().splitlines()[-2:]] == [
        ["error", f"prompt {i}", "--allowed-token-ids, --regex leave no token to generate at output token 0 (every "
                                 "token is masked there)"] for i in range(2)]


def test_greedy_min_tokens_over_http_equals_the_masked_token_by_token_reference(server):
    """A greedy request with min_tokens and a stop token id on the real 2-stage `speed+firp` server: its items
    ship logits rows only before min_tokens (`SamplingParams.needs_logits_at`; counted in
    tests/unit/test_min_tokens_logits.py), and the output is plain token-by-token decoding of the model with
    the EOS / stop-id mask written out as vLLM defines it (before min_tokens tokens only)."""
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    plain = httpx.post(url, json=PLAIN, timeout=120).json()["choices"][0]["token_ids"]
    stop, min_tokens = plain[1], 6  # the plain output's 2nd token: masked until min_tokens, then it may end it
    body = {**PLAIN, "min_tokens": min_tokens, "stop_token_ids": [stop]}
    got = httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
    want = _masked_reference(Path(server.session.options.model), PLAIN["prompt"], max_tokens=PLAIN["max_tokens"],
                             min_tokens=min_tokens, stop=stop, ignore_eos=True)
    assert got == want and want[1] != stop, (got, want)


@pytest.fixture(scope="module")
def varied_server(tmp_path_factory):
    """2 real stages, `speed+firp`, on the tiny Mistral of tests/family_models.py (its greedy output varies, where
    the tiny model's repeats one token) with window == max_model_len, so FIRP chains run through sliding layers."""
    from tests.family_models import write_family_model

    folder = write_family_model(tmp_path_factory.mktemp("mistral") / "model", "mistral", seed=3, sliding_window=128)
    with firp_server(folder, folder.parent / "firp.safetensors") as stack:
        yield stack


def _masked_reference(model_dir: Path, prompt: str, *, max_tokens: int, min_tokens: int, stop: int,
                      ignore_eos: bool = False) -> list[int]:
    """Token-by-token greedy decoding of the whole model with vLLM's min_tokens mask written out (every EOS id
    and the stop token id at output tokens before min_tokens; vLLM's MinTokensLogitsProcessor), ending at the
    stop id or, unless ignore_eos, at an EOS id."""
    import torch

    from pipeline.model.row_layout import Span
    from tests.distributed.conftest import full_model

    model, tokenizer = full_model(model_dir)
    prompt_ids, want = tokenizer.encode(prompt), []
    ends = (stop,) if ignore_eos else (stop, *tokenizer.eos_token_ids)
    while len(want) < max_tokens and not (want and want[-1] in ends):
        with torch.no_grad():
            row = model(torch.tensor(prompt_ids + want), [Span(0, 0, len(prompt_ids) + len(want))],
                        model.new_kv_cache(max_num_seqs=1, max_model_len=128))[0].clone()
        if len(want) < min_tokens:
            row[[*tokenizer.eos_token_ids, stop]] = float("-inf")
        want.append(int(row.argmax()))
    return want


def test_a_stop_id_chosen_just_before_at_and_after_min_tokens_streamed_and_not(varied_server):
    """The boundary where a greedy min_tokens request stops shipping logits rows: with the stop id the model
    chooses first at output token k, min_tokens k + 1 must mask it there (the row before min_tokens needs its
    logits), min_tokens k and k - 1 must let it end the output at k (rows from min_tokens on take the argmax).
    Non-streamed and streamed output both equal `_masked_reference`, on speed+firp over 2 real stages."""
    url = f"http://127.0.0.1:{varied_server.http_port}/v1/completions"
    base = {"prompt": "The cat sat on the mat.", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    plain = httpx.post(url, json={**base, "ignore_eos": True}, timeout=120).json()["choices"][0]["token_ids"]
    firsts = [k for k in range(2, 12) if plain[k] not in plain[:k]][:3]
    assert len(firsts) == 3, f"degenerate plain output {plain}"
    model_dir = Path(varied_server.session.options.model)
    for k in firsts:
        for min_tokens in (k + 1, k, k - 1):
            body = {**base, "min_tokens": min_tokens, "stop_token_ids": [plain[k]]}
            want = _masked_reference(model_dir, base["prompt"], max_tokens=16, min_tokens=min_tokens, stop=plain[k])
            assert (want == plain[:k + 1]) == (min_tokens <= k), (k, min_tokens, want, plain)
            got = httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            streamed = [t for e in events for c in e.get("choices", ()) for t in c.get("token_ids") or ()]
            assert got == want and streamed == want, (k, min_tokens, got, streamed, want)
