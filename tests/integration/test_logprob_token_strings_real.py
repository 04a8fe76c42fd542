"""Logprob token strings on the default model's tokenizer (SmolLM2: byte-level BPE, whose merged tokens split
emoji and CJK characters, and carry a space with a character's first bytes: " \\xf0\\x9f").

Reference: vLLM's algorithm (tests/vllm_token_strings.py) on transformers' tokenizer of the converted folder.
What breaks when this fails: a real vocabulary's partial tokens read other than vLLM's (U+FFFD left, the
space of " 😀" lost, a character split between two tokens' strings).
"""

from __future__ import annotations

import random

import pytest

from launcher.serving.formats.token_strings import TokenStrings
from pipeline.model.tokenizer import Tokenizer
from tests import vllm_token_strings as vllm

pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

TEXT = "Hello 😀 世界, naïve — “quotes” 👍🏽 ok"


def test_smollm2_token_strings_match_vllms(smollm2_dir):
    tok, hf = Tokenizer(smollm2_dir), vllm.hf_tokenizer(smollm2_dir)
    strings = TokenStrings(tok)
    assert tok.leading_space_marker is None is vllm.leading_space_marker(hf)
    ids = tok.encode(TEXT, add_special_tokens=False)
    partial = [i for i in range(tok.vocab_size) if strings.decoded(i).endswith("\ufffd")]
    alternatives = [*partial, *random.Random(0).sample(range(tok.vocab_size), 500)]
    for j, t in enumerate(ids):  # the chosen token, every partial token and some others as alternatives
        want = vllm.verify_tokens(hf, [t, *alternatives], ids[:j])
        assert [strings.text(i, ids[:j]) for i in [t, *alternatives]] == want, j
    chosen = [strings.text(t, ids[:j]) for j, t in enumerate(ids)]
    assert "".join(chosen) == tok.decode(ids) and " 😀" in chosen and "世" in chosen and "🏽" in chosen
