"""vLLM's answers to two things a vLLM user meets, through `speedpipe serve` and the official openai client.

One 2-stage server (real stage processes, gloo on loopback) on the tiny random model (float32) whose
tokenizer_config.json names no eos_token ([Note: token masks] in pipeline/speculation/masks/token_masks.py) and
whose generation config's EOS is the token the model greedily emits at index k (the [Note: EOS remap] of
tests/distributed/test_pipeline_tiny.py, so that it is reached; weights sharpened as [Note: sharpened tiny model]).
- An unknown `model` is vLLM's 404, which the openai client raises as `openai.NotFoundError`
  (launcher/serving/formats/model_field.py).
- Without an eos_token there is no primary EOS: the generation config's id ends the request where
  transformers' `generate` stops, as a stop token id (finish "stop", the id as `stop_reason`, its text left
  out), over HTTP and in the coordinator `launch` drives; ignore_eos goes on to max_tokens.
What breaks when these fail: a wrong model name reads as a 400 BadRequestError; the generation config's first
id is taken as the primary EOS (finish "eos" offline, no stop_reason), or generation does not stop where
transformers' does.
"""

from __future__ import annotations

import json

import pytest
import torch

from launcher.cli.launch import run_launch
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.serve import ServeOptions, ServingStack
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from tests.distributed.conftest import sharpen_weights
from tests.tiny_model import write_tiny_model

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PROMPT = "Once upon a time"
NUM_TOKENS = 16


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model after `ids`, no EOS."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(torch.argmax(model(torch.tensor([ids + out])).logits[0, -1])))
    return out


@pytest.fixture(scope="module")
def no_eos_dir(tmp_path_factory):
    """(folder, its EOS id, transformers' greedy tokens without EOS, transformers' generate's tokens)."""
    path = sharpen_weights(write_tiny_model(tmp_path_factory.mktemp("tiny-no-eos-token") / "m", eos_token=False))
    ids = Tokenizer(path).encode(PROMPT)
    full = _greedy(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, NUM_TOKENS)
    k = next(i for i in range(2, NUM_TOKENS) if full[i] not in full[:i])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": full[k]}))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert transformers.AutoTokenizer.from_pretrained(path).eos_token_id is None
    stopped = model.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    return path, full[k], full, stopped[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def server(no_eos_dir):
    options = PipelineOptions(num_stages=2, model=str(no_eos_dir[0]), progress=False, max_num_seqs=4,
                              max_model_len=128, stage_timeout_s=60, speculate="none")
    with PipelineSession(options, resolve(options)) as session:
        with ServingStack(session, ServeOptions(host="127.0.0.1", port=0, grpc_port=-1, stats_interval_s=0)) as stack:
            yield stack


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_an_unknown_model_is_the_openai_clients_not_found_error(client):
    served = client.models.list().data[0].id
    for call in (lambda: client.completions.create(model="other", prompt=PROMPT, max_tokens=2),
                 lambda: client.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=2),
                 lambda: client.models.retrieve("other")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": 404}
    assert client.completions.create(model=served, prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"


def test_without_an_eos_token_the_request_stops_where_transformers_does_as_a_stop_token_id(client, no_eos_dir):
    path, eos, full, stopped = no_eos_dir
    assert stopped[-1] == eos and len(stopped) < NUM_TOKENS  # transformers stops at the generation config's EOS
    served = client.models.list().data[0].id
    choice = client.completions.create(model=served, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0]
    assert choice.token_ids == stopped and choice.finish_reason == "stop" and choice.stop_reason == eos
    assert choice.text == Tokenizer(path).decode(stopped[:-1])
    choice = client.completions.create(model=served, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert choice.token_ids == full and choice.finish_reason == "length"


def test_offline_launch_stops_there_too_as_a_stop_token_id(server, no_eos_dir):
    """`launch`'s run (launcher/cli/launch.py run_launch) on the same session, and its coordinator's own reason
    (it was "eos": the generation config's id taken as the primary)."""
    _, _, _, stopped = no_eos_dir
    report = run_launch(server.session, [PROMPT], [SamplingParams(max_new_tokens=NUM_TOKENS)])
    assert report["outputs"][0]["token_ids"] == stopped and report["outputs"][0]["finish_reason"] == "stop"
    result = server.session.coordinator.submit(PROMPT, SamplingParams(max_new_tokens=NUM_TOKENS)).result(120)
    assert result.token_ids == stopped and result.finish_reason == "stop"
