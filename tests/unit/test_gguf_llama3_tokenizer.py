"""A Llama 3.x GGUF vocabulary (`tokenizer.ggml.pre = llama-bpe`) tokenizes as Meta's tokenizer.json.

What breaks when these fail: a word that Llama 3's vocabulary holds whole but its merges do not build
(llama.cpp PR 7193: " Việt" is one token for Meta's tokenizer, three without `ignore_merges`) split
into pieces the model never saw in training; or a Llama 3.x prompt sent without `<|begin_of_text|>`
because the GGUF has no `tokenizer.ggml.add_bos_token` key (llama.cpp adds BOS for the llama-bpe
pre-tokenizer unless the key says otherwise: `llama-vocab.cpp`, the `tokenizer_pre == "llama-bpe"` arm).
The reference tokenizer is built here from the settings of Meta's published tokenizer.json (no
normalizer, the Split + ByteLevel pre-tokenizer, a BPE model with `ignore_merges: true`), not from
the converter's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers

from pipeline.model.tokenizer import Tokenizer
from pipeline.weights.gguf_import import convert_gguf, open_gguf, tokenizer_from_gguf
from tests.unit.test_gguf_import_tiny import LLAMA3_TOKENIZER_JSON, bytes_to_unicode, tiny, write_gguf

# In the vocabulary but not built by the merges: "Ġthe" (no "Ġt he"), "123" (no "12 3"), "ĠĠĠ" (no "ĠĠ Ġ").
EXTRA_TOKENS = ["Ġt", "Ġthe", "12", "123", "'s", "ĠĠ", "ĠĠĠ", "ĊĊ"]
MERGES = ["Ġ t", "1 2", "' s", "Ġ Ġ", "Ċ Ċ"]
TEXTS = ["the the 123 12 1234 12345 1", "In 2024, 1234567 cats", "it's I'M we'LL 'S", "a\n\n  b\t\tc   \n\n\nd",
         "naïve cafe\u0301 日本語 😀", "x=3.14159;y", "   the"]


def _vocab_gguf(path: Path, pre: str) -> list[str]:
    """A metadata-only GGUF holding a byte-level vocabulary with EXTRA_TOKENS and MERGES; returns its tokens."""
    tokens = ["<|begin_of_text|>", *bytes_to_unicode().values(), *EXTRA_TOKENS]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)  # llama-bpe adds it (a GGUF that adds BOS without naming it is refused)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _meta_style(tokens: list[str]) -> tokenizers.Tokenizer:
    """The tokenizer Meta's tokenizer.json settings give this vocabulary (without BOS post-processing)."""
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": MERGES}
    doc = {"version": "1.0", "truncation": None, "padding": None, "post_processor": None,
           "added_tokens": [{"id": 0, "content": tokens[0], "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}],
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": model} | LLAMA3_TOKENIZER_JSON
    return tokenizers.Tokenizer.from_str(json.dumps(doc))


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "llama-v3"])  # llama.cpp's names of its LLAMA3 pre-type
def test_llama_bpe_keeps_a_pre_token_whole_when_the_vocabulary_has_it_as_meta_s_tokenizer_does(tmp_path, pre):
    tokens = _vocab_gguf(tmp_path / "v.gguf", pre)
    ours, ref = tokenizer_from_gguf(open_gguf(tmp_path / "v.gguf")), _meta_style(tokens)
    for text in TEXTS:  # the text's own tokens: BOS (its post-processor's) is test_bos_follows_the_gguf_key...
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text).ids, text
        assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text
    assert ours.encode(" the 123", add_special_tokens=False).tokens == ["Ġthe", "Ġ", "123"]  # not Ġt h e, 12 3
    # Only llama-bpe (llama.cpp's LLAMA3 pre-type) ignores merges: qwen2's tokenizer.json builds by merges.
    _vocab_gguf(tmp_path / "q.gguf", "qwen2")
    qwen2 = tokenizer_from_gguf(open_gguf(tmp_path / "q.gguf"))
    assert qwen2.encode(" the", add_special_tokens=False).tokens == ["Ġt", "h", "e"]


@pytest.mark.parametrize("pre, add_bos, bos", [("llama-bpe", None, True), ("llama-bpe", False, False),
                                               ("smollm", None, False), ("smollm", True, True)],
                         ids=["llama-bpe-no-key", "llama-bpe-key-false", "smollm-no-key", "smollm-key-true"])
def test_bos_follows_the_gguf_key_else_llama_cpp_s_default_for_the_pre_tokenizer(tmp_path, pre, add_bos, bos):
    write_gguf(tmp_path / "m.gguf", tiny(), pre=pre, add_bos=add_bos)
    tok = Tokenizer(convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False))
    body = tok.encode("he 12", add_special_tokens=False)
    assert tok.encode("he 12") == ([1] if bos else []) + body  # tiny(): bos_token_id 1
