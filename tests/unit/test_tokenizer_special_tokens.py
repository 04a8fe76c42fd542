"""BOS/EOS of a prompt: tokenizer.json's post-processor decides, as in transformers 5 ([Note: BOS/EOS]).

Each folder is the tiny byte tokenizer (id == byte value; BOS is byte 1, EOS byte 2, both special) with
one post-processor and one set of tokenizer_config.json flags; `Tokenizer.encode` must give
transformers' `AutoTokenizer(...)(text).input_ids`, with and without `add_special_tokens`, and the ids
the post-processor adds, whatever the flags say (Llama 3 folders carry BOS only in the post-processor;
transformers 5 drops the flags of a folder with a tokenizer.json). The last test generates with a
tiny Llama whose folder adds BOS only by its post-processor, against transformers' `generate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import processors

from pipeline.model.tokenizer import Tokenizer
from tests.tiny_model import TINY_EOS_ID, byte_alphabet, byte_tokenizer, write_tiny_model

transformers = pytest.importorskip("transformers")

BOS_ID, EOS_ID = 1, TINY_EOS_ID
BOS, EOS = byte_alphabet()[BOS_ID], byte_alphabet()[EOS_ID]
TEXTS = ["hello world", "a", " two  spaces", "日本語 🦀", f"{BOS}spelled bos"]


def _template(*, bos: bool, eos: bool) -> processors.TemplateProcessing:
    """BOS and/or EOS around $A (and, for pairs, around $B, which `encode` never uses)."""
    single = " ".join([BOS] * bos + ["$A"] + [EOS] * eos)
    pair = f"{single} " + " ".join([f"{BOS}:1"] * bos + ["$B:1"] + [f"{EOS}:1"] * eos)
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(BOS, BOS_ID)] * bos + [(EOS, EOS_ID)] * eos)


POST_PROCESSORS = {  # name -> (post-processor, ids added before the text, after it)
    "none": (None, [], []),
    "byte-level": (processors.ByteLevel(trim_offsets=False), [], []),  # SmolLM2, Qwen: nothing added
    "llama3-bos": (processors.Sequence([processors.ByteLevel(trim_offsets=False), _template(bos=True, eos=False)]),
                   [BOS_ID], []),
    "bos-eos": (_template(bos=True, eos=True), [BOS_ID], [EOS_ID]),
    "eos-only": (_template(bos=False, eos=True), [], [EOS_ID]),
    "roberta": (processors.RobertaProcessing((EOS, EOS_ID), (BOS, BOS_ID)), [BOS_ID], [EOS_ID]),
}
FLAGS = {"no-flags": {}, "bos-true": {"add_bos_token": True}, "bos-false": {"add_bos_token": False},
         "bos-eos-true": {"add_bos_token": True, "add_eos_token": True},
         "bos-false-eos-false": {"add_bos_token": False, "add_eos_token": False}}


def _write_tokenizer(folder: Path, post_processor: processors.PostProcessor | None, flags: dict) -> Path:
    tok: tokenizers.Tokenizer = byte_tokenizer()
    tok.add_special_tokens([tokenizers.AddedToken(BOS, special=True, normalized=False)])
    tok.post_processor = post_processor
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", **flags}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("post", POST_PROCESSORS, ids=POST_PROCESSORS.keys())
def test_encode_adds_what_the_post_processor_adds_as_transformers_whatever_the_flags(tmp_path, post, flags):
    post_processor, before, after = POST_PROCESSORS[post]
    folder = _write_tokenizer(tmp_path, post_processor, flags)
    ours, hf = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        body = ours.encode(text, add_special_tokens=False)
        assert body == hf(text, add_special_tokens=False).input_ids, text
        assert body == (list(text.encode()) if BOS not in text else [BOS_ID, *text[1:].encode()]), text
        assert ours.encode(text) == hf(text).input_ids == before + body + after, text
    assert (ours.add_bos_token, ours.add_eos_token) == (bool(before), bool(after))
    assert ours.bos_token_id == BOS_ID  # the post-processor's, else tokenizer_config.json's bos_token


def test_bos_id_is_the_post_processor_s_where_only_it_names_one(tmp_path):
    """Meta's Llama 3 folder: no bos_token anywhere but the post-processor's template."""
    folder = _write_tokenizer(tmp_path, POST_PROCESSORS["llama3-bos"][0], {})
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    tok = Tokenizer(folder)
    assert (tok.bos_token_id, tok.add_bos_token, tok.add_eos_token) == (BOS_ID, True, False)


def test_a_chat_template_that_spells_the_bos_gets_it_once_with_a_post_processor_bos(tmp_path):
    from launcher.serving.openai_protocol import parse_chat

    folder = _write_tokenizer(tmp_path, POST_PROCESSORS["llama3-bos"][0], {})
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    want = list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    parsed = parse_chat({"messages": messages}, tokenizer=Tokenizer(folder), model_name="tiny", max_model_len=64)
    assert parsed.prompt_ids == want and want.count(BOS_ID) == 1 and want[0] == BOS_ID


def test_tiny_llama_with_a_post_processor_only_bos_generates_as_transformers(tmp_path):
    from tests.unit.test_families import Chain, _stages

    folder = write_tiny_model(tmp_path / "m", seed=1)
    _write_tokenizer(folder, POST_PROCESSORS["llama3-bos"][0], {})  # no flags, as Meta's Llama 3 folders
    prompt = Tokenizer(folder).encode("the cat sat on the mat")
    assert prompt == transformers.AutoTokenizer.from_pretrained(folder)("the cat sat on the mat").input_ids
    assert prompt[0] == BOS_ID and prompt.count(BOS_ID) == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        ref_logits = model(torch.tensor([prompt])).logits[0]
    assert Chain(_stages(folder, 2)).greedy(prompt, 10) == want, want
    ours_logits = Chain(_stages(folder, 2))(prompt, 0, all_rows=True)
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-4, atol=1e-4)
    without_bos = Chain(_stages(folder, 2))(prompt[1:], 0, all_rows=True)
    assert not torch.allclose(without_bos[-1], ours_logits[-1], atol=1e-3)  # the BOS changes what follows
