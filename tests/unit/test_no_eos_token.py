"""A tokenizer without an eos_token (neither special_tokens_map.json nor tokenizer_config.json names one): no primary
EOS, as vLLM.

vLLM passes the tokenizer's `eos_token_id` (None here) to `SamplingParams.update_from_generation_config`
(vllm/sampling_params.py): with None, every EOS id of the generation config goes into `stop_token_ids`
(unless ignore_eos) and into `_all_stop_token_ids` (min_tokens masks them, ignore_eos or not), and
`check_stop` (vllm/v1/core/sched/utils.py) matches no EOS: such an id ends a request as a stop token id
(finish "stop", the id as `stop_reason`, its text left out). Hugging Face's chat templates see no `eos_token`.
What breaks when these fail: the generation config's first id was taken as the primary EOS (finish "eos",
no stop_reason; gRPC EOS instead of STOP) and a chat template's `{{ eos_token }}` rendered it.
References: transformers' AutoTokenizer (eos_token_id None), GenerationConfig and apply_chat_template.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.request_handle import RequestHandle
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import coordinator_config
from launcher.serving.openai_protocol import render_chat
from pipeline.engine.engine import Engine
from pipeline.engine.records import Commit, FinishReason, SchedulerConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.masks.token_masks import apply_token_masks
from pipeline.speculation.sampling import SamplingParams
from tests.tiny_model import TINY_EOS_ID, byte_alphabet, write_tiny_model
from tests.unit.test_speculation_scheduler import MAX_MODEL_LEN, FakePipeline, _submits

pytestmark = pytest.mark.timeout(120)
FIRST, SECOND = 7, 9  # the fake model's generation-config EOS ids
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}|{% endfor %}"


@pytest.fixture()
def folder(tmp_path):
    """The tiny model without an eos_token; its generation config lists two EOS ids."""
    path = write_tiny_model(tmp_path / "m", eos_token=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ord("\n"), TINY_EOS_ID]}))
    return path


def test_the_tokenizer_has_no_primary_eos_and_every_generation_config_id(folder):
    tok = Tokenizer(folder)
    hf_eos = transformers.AutoTokenizer.from_pretrained(folder).eos_token_id
    hf_gen = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    assert hf_eos is None and tok.eos_token_id is None
    assert tok.eos_token_ids == tuple(hf_gen)


def _run(token_at_3: int, params: SamplingParams, *, primary_eos: bool):
    """One sequence through the fake pipeline whose model says 3, 4, 5, then `token_at_3`, then 6 forever."""
    def next_fn(prefix):
        n = len(prefix) - 2  # the prompt has 2 tokens
        return [3, 4, 5, token_at_3][n] if n < 4 else 6

    engine = Engine(SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
                                    eos_token_ids=(FIRST, SECOND), primary_eos=primary_eos))
    fake = FakePipeline(engine, _submits([[1, 2]], params), next_fn=next_fn)
    return fake.run()[0], fake.states[0].finish_reason


@pytest.mark.parametrize("token", [FIRST, SECOND])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_without_a_primary_every_eos_id_ends_as_a_stop_token_id(token, ignore_eos):
    """vLLM's update_from_generation_config(eos_token_id=None): all ids are stop_token_ids, none without ignore_eos."""
    out, reason = _run(token, SamplingParams(max_new_tokens=8, ignore_eos=ignore_eos), primary_eos=False)
    assert reason is (FinishReason.LENGTH if ignore_eos else FinishReason.STOP)
    assert out == ([3, 4, 5, token, 6, 6, 6, 6] if ignore_eos else [3, 4, 5, token])
    out, reason = _run(token, SamplingParams(max_new_tokens=8, ignore_eos=ignore_eos), primary_eos=True)
    if token == FIRST and not ignore_eos:  # with a primary (a tokenizer with an eos_token): EOS, as before
        assert reason is FinishReason.EOS


def test_the_stop_reason_is_the_id_and_its_text_is_left_out(folder):
    tok = Tokenizer(folder)
    out, reason = _run(FIRST, SamplingParams(max_new_tokens=8), primary_eos=False)
    handle = RequestHandle("r", "p", [1, 2], SamplingParams(max_new_tokens=8), tok.detokenizer(prompt_ids=[1, 2]))
    handle.emit(Commit(0, tuple(out), reason))
    result = handle.result(1)
    assert (result.finish_reason, handle.stop_reason) == ("stop", FIRST)
    assert result.text == tok.decode(out[:-1])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_still_masks_every_eos_id(ignore_eos):
    """vLLM's `_all_stop_token_ids` gets the generation config's ids whatever the primary."""
    params = SamplingParams(max_new_tokens=8, min_tokens=2, ignore_eos=ignore_eos)
    row = apply_token_masks(torch.zeros(16), params, history=[3], eos_token_ids=(FIRST, SECOND))
    assert torch.isinf(row[[FIRST, SECOND]]).all() and torch.isfinite(row[:FIRST]).all()


@pytest.mark.parametrize("eos_token", [False, True])
def test_the_session_tells_the_scheduler_whether_there_is_a_primary(tmp_path, eos_token):
    path = write_tiny_model(tmp_path / "m", eos_token=eos_token)
    options = PipelineOptions(num_stages=2, model=str(path), progress=False, max_model_len=64)
    config = coordinator_config(options, resolve(options), master_addr="127.0.0.1", master_port=1)
    has_eos = transformers.AutoTokenizer.from_pretrained(path).eos_token_id is not None
    assert config.scheduler.primary_eos is has_eos and config.scheduler.eos_token_ids == (TINY_EOS_ID,)


def test_a_chat_template_sees_no_eos_token(folder):
    """Hugging Face's apply_chat_template passes the tokenizer's special tokens: none named, `eos_token` is undefined."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert render_chat(messages, tokenizer=Tokenizer(folder), add_generation_prompt=False) == want == "hi|yo|"


@pytest.mark.parametrize("form", ["string", "added token"])
def test_an_eos_token_named_in_special_tokens_map_json_is_the_primary(tmp_path, form):
    """transformers' from_pretrained reads special_tokens_map.json too (over tokenizer_config.json): a folder whose
    eos_token is only there has one (Hugging Face's and so vLLM's primary EOS); it was read as none, so the
    generation config's id ended requests as a stop token id (stop_reason set) where vLLM gives an EOS."""
    path = write_tiny_model(tmp_path / "m", eos_token=False)
    eos_text = byte_alphabet()[TINY_EOS_ID]  # its spelling in tokenizer.json, as write_tiny_model names it
    value = eos_text if form == "string" else {"content": eos_text, "special": True}
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": value}))
    hf_eos = transformers.AutoTokenizer.from_pretrained(path).eos_token_id
    assert hf_eos is not None and Tokenizer(path).eos_token_id == hf_eos
    options = PipelineOptions(num_stages=2, model=str(path), progress=False, max_model_len=64)
    assert coordinator_config(options, resolve(options), master_addr="127.0.0.1", master_port=1).scheduler.primary_eos
    config = json.loads((path / "tokenizer_config.json").read_text())  # both files name one: special_tokens_map's
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos_text}))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": byte_alphabet()[ord("\n")]}))
    assert Tokenizer(path).eos_token_id == transformers.AutoTokenizer.from_pretrained(path).eos_token_id == ord("\n")


def test_a_chat_template_sees_eos_token_and_bos_token_undefined_as_hugging_face(folder):
    """Hugging Face passes only the special tokens a tokenizer has: `eos_token is defined` is false without one and
    `default(...)` applies. They were passed as "" (defined), so such a template rendered otherwise than in HF."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}[{{ 'D' if eos_token is defined else 'U' }}"
                "{{ eos_token | default('X') }}|{{ 'D' if bos_token is defined else 'U' }}]")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    messages = [{"role": "user", "content": "hi"}]
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert render_chat(messages, tokenizer=Tokenizer(folder), add_generation_prompt=False) == want
