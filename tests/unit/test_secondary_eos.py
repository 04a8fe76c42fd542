"""Secondary EOS ids: a generation config with several eos ids ([Note: token masks] in
pipeline/speculation/masks/token_masks.py, "EOS ids"), as vLLM's `SamplingParams.update_from_generation_config`.

What breaks when these fail: the tokenizer's own eos_token is not the primary EOS (not first, or missing when
the generation config lists other ids); a secondary EOS id ends a request as EOS (no stop_reason) instead of as
a stop token id (finish "stop", the id as stop_reason / gRPC STOP with stop_token_id); ignore_eos does not
disable the secondary ids (vLLM adds them to stop_token_ids only without ignore_eos); min_tokens lets one
through. References: transformers' AutoTokenizer (eos_token_id) and GenerationConfig (eos_token_id).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from launcher.coordinator.request_handle import RequestHandle
from pipeline.engine.engine import Engine
from pipeline.engine.records import Commit, FinishReason, SchedulerConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.masks.token_masks import apply_token_masks
from pipeline.speculation.sampling import SamplingParams
from tests.tiny_model import TINY_EOS_ID, write_tiny_model
from tests.unit.test_speculation_scheduler import MAX_MODEL_LEN, FakePipeline, _submits

pytestmark = pytest.mark.timeout(120)
PRIMARY, SECONDARY = 7, 9  # the fake model's EOS ids (the engine's eos_token_ids: primary first)


def test_the_tokenizers_eos_token_is_the_primary_and_the_generation_configs_others_follow(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ord("\n"), TINY_EOS_ID, ord(";")]}))
    tok = Tokenizer(folder)
    hf_eos = transformers.AutoTokenizer.from_pretrained(folder).eos_token_id
    hf_gen = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    assert tok.eos_token_id == hf_eos and tok.eos_token_ids[0] == hf_eos
    assert set(tok.eos_token_ids) == {hf_eos, *hf_gen} and len(tok.eos_token_ids) == len({hf_eos, *hf_gen})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ord("\n")]}))  # eos_token not listed
    assert Tokenizer(folder).eos_token_ids == (hf_eos, ord("\n"))  # vLLM stops at the tokenizer's eos_token too


def test_a_generation_configs_eos_ids_replace_config_jsons_as_in_transformers_generate(tmp_path):
    """config.json names another EOS id than generation_config.json: transformers' generate stops on the
    generation config's alone (the model's `generation_config`), and so does vLLM; config.json's counts only
    without a generation_config.json. (The two files' ids were merged: "!" ended a request here.)"""
    folder = write_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": ord("!")}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ord("\n")]}))
    hf_eos = transformers.AutoTokenizer.from_pretrained(folder).eos_token_id
    hf_gen = transformers.AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
    assert Tokenizer(folder).eos_token_ids == (hf_eos, *([hf_gen] if isinstance(hf_gen, int) else hf_gen))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))  # names no EOS: none from it
    hf_gen = transformers.AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
    assert Tokenizer(folder).eos_token_ids == (hf_eos,) and hf_gen is None  # (vLLM: the tokenizer's eos_token)
    (folder / "generation_config.json").unlink()  # no generation config: the model config's
    hf_gen = transformers.AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
    assert Tokenizer(folder).eos_token_ids == (hf_eos, ord("!")) and hf_gen in (ord("!"), [ord("!")])


def _run(token_at_3: int, params: SamplingParams, *, speculate: bool = False):
    """One sequence through the fake pipeline whose model says 3, 4, 5, then `token_at_3`, then 6 forever."""
    def next_fn(prefix):
        n = len(prefix) - 2  # the prompt has 2 tokens
        return [3, 4, 5, token_at_3][n] if n < 4 else 6

    engine = Engine(SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
                                    eos_token_ids=(PRIMARY, SECONDARY)))
    fake = FakePipeline(engine, _submits([[1, 2]], params), next_fn=next_fn)
    return fake.run()[0], fake.states[0].finish_reason


@pytest.mark.parametrize(("token", "ignore_eos", "want"), [
    (PRIMARY, False, FinishReason.EOS), (SECONDARY, False, FinishReason.STOP),
    (PRIMARY, True, FinishReason.LENGTH), (SECONDARY, True, FinishReason.LENGTH)])
def test_a_secondary_eos_id_ends_as_a_stop_token_id_and_ignore_eos_disables_it(token, ignore_eos, want):
    out, reason = _run(token, SamplingParams(max_new_tokens=8, ignore_eos=ignore_eos))
    assert reason is want
    assert out == ([3, 4, 5, token] if want is not FinishReason.LENGTH else [3, 4, 5, token, 6, 6, 6, 6])


def test_a_secondary_eos_id_listed_in_stop_token_ids_ends_with_ignore_eos_too():
    out, reason = _run(SECONDARY, SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=(SECONDARY,)))
    assert (out, reason) == ([3, 4, 5, SECONDARY], FinishReason.STOP)


def test_its_id_is_the_stop_reason_and_its_text_is_left_out(tmp_path):
    tok = Tokenizer(write_tiny_model(tmp_path / "m"))
    out, reason = _run(SECONDARY, SamplingParams(max_new_tokens=8))
    handle = RequestHandle("r", "p", [1, 2], SamplingParams(max_new_tokens=8), tok.detokenizer(prompt_ids=[1, 2]))
    handle.emit(Commit(0, tuple(out), reason))
    result = handle.result(1)
    assert (result.finish_reason, handle.stop_reason) == ("stop", SECONDARY)
    assert result.text == tok.decode(out[:-1])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_every_eos_id_ignore_eos_or_not(ignore_eos):
    """vLLM's `_all_stop_token_ids` holds the secondary ids with ignore_eos too."""
    params = SamplingParams(max_new_tokens=8, min_tokens=2, ignore_eos=ignore_eos)
    row = apply_token_masks(torch.zeros(16), params, history=[3], eos_token_ids=(PRIMARY, SECONDARY))
    assert torch.isinf(row[[PRIMARY, SECONDARY]]).all() and torch.isfinite(row[:PRIMARY]).all()
