"""A SentencePiece GGUF vocabulary (`tokenizer.ggml.model = "llama"`) tokenises as SentencePiece and transformers.

What breaks when these fail: Llama 2, TinyLlama, Mistral, Mixtral, Phi-3 and Gemma GGUFs tokenise
differently from the model's own tokenizer (merges recovered from the scores in the wrong order, a
character outside the vocabulary not spelled as its UTF-8 byte pieces, the "▁" space prefix added
where the file says not to, or not added, or not stripped again on decode), BOS/EOS added against the
file's add_bos_token / add_eos_token (SentencePiece's default: BOS, no EOS), control tokens cut into
pieces, streamed text that is not the full decode (the first generated "▁word", a character spelled
over several byte pieces), or an unsupported vocabulary accepted instead of refused in one line.
The oracles: a tiny BPE SentencePiece model trained here (byte fallback, identity normalisation and
no whitespace collapsing, as Llama's), written into a GGUF as llama.cpp's `_set_vocab_sentencepiece`
does; SentencePiece's own `encode`; transformers' tokenizer loaded from the same GGUF; and, end to
end, transformers' greedy generation on the converted folder.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
import torch
import transformers
from sentencepiece import sentencepiece_model_pb2

from pipeline.model.config import tiny_config
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights.gguf_import import convert_gguf, open_gguf, tokenizer_from_gguf
from tests.unit.test_gguf_import_tiny import write_gguf

_WORDS = ["the", "cat", "sat", "on", "mat", "café", "naïve", "über", "façade", "résumé", "日本語", "中文", "東京",
          "😀", "👍🏽", "2024", "3.14", "hello", "world", "pipeline", "stage", "token", "ünïcödé"]
_SEPARATORS = [" ", " ", " ", "  ", "   ", "\t", " \t "]
# Never starting with whitespace: where transformers' GGUF loader differs from SentencePiece (LEADING).
TEXTS = ["the cat sat on the mat", "café naïve über façade", "日本語と中文、東京へ", "emoji 😀👍🏽 end",
         "digits 2024 3.14159 1234567", "two  spaces   three\tand\ttabs", "line one\nline two\n\nthree",
         "unseen ß Ω 한국어 🦀 ∑ glyphs", "MiXeD CaSe wOrDs", "trailing spaces  ", "x", "punctuation: (a, b); c!?",
         "stagepipelinetokenhello", "a\r\nb\u00a0c\u200bd"]
LEADING = ["  two leading", " one leading", "\tleading tab", "\n newline first", " "]
USER_DEFINED = "<tool>"
BOS, EOS, UNK = 1, 2, 0


def _corpus() -> list[str]:
    rng = random.Random(0)
    return ["".join(w + rng.choice(_SEPARATORS) for w in rng.choices(_WORDS, k=rng.randint(3, 12))).rstrip()
            for _ in range(400)]


@pytest.fixture(scope="module")
def spm_proto() -> sentencepiece_model_pb2.ModelProto:
    """A ~500-piece BPE SentencePiece model trained with Llama's settings (identity normalisation,
    whitespace kept, digits split, byte fallback; 256 byte pieces included)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, model_type="bpe", vocab_size=520,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        split_digits=True, unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=-1, user_defined_symbols=[USER_DEFINED],
        num_threads=1, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return proto


def _processor(proto: sentencepiece_model_pb2.ModelProto, *, space_prefix: bool) -> spm.SentencePieceProcessor:
    changed = sentencepiece_model_pb2.ModelProto()
    changed.CopyFrom(proto)
    changed.normalizer_spec.add_dummy_prefix = space_prefix
    return spm.SentencePieceProcessor(model_proto=changed.SerializeToString())


def _spm_vocab(proto: sentencepiece_model_pb2.ModelProto, *, space_prefix: bool | None = None,
               add_bos: bool | None = None, add_eos: bool | None = None, model: str = "llama", scores: bool = True):
    """A `write_gguf` vocab hook writing `proto` as llama.cpp's `_set_vocab_sentencepiece` does
    (SentencePiece's piece types are llama.cpp's token types); None: leave that key out."""
    def add(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre("default")
        w.add_token_list([p.piece for p in proto.pieces])
        if scores:
            w.add_token_scores([p.score for p in proto.pieces])
        w.add_token_types([p.type for p in proto.pieces])
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_unk_token_id(UNK)
        for key, value in (("add_bos_token", add_bos), ("add_eos_token", add_eos),
                           ("add_space_prefix", space_prefix)):
            if value is not None:
                getattr(w, f"add_{key}")(value)
    return add


def _gguf(tmp_path: Path, proto, **vocab) -> Path:
    path = tmp_path / "spm.gguf"
    write_gguf(path, tiny_config(vocab_size=len(proto.pieces), bos_token_id=BOS), vocab=_spm_vocab(proto, **vocab))
    return path


@pytest.fixture(scope="module")
def converted(spm_proto, tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF, speedpipe's conversion of it), keys left at their defaults."""
    path = _gguf(tmp_path_factory.mktemp("spm"), spm_proto)
    return path, convert_gguf(path, path.parent / "out", progress=False)


def test_encoding_equals_sentencepiece_and_transformers_from_the_same_gguf(spm_proto, converted):
    path, folder = converted
    ours, sp = tokenizer_from_gguf(open_gguf(path)), _processor(spm_proto, space_prefix=True)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert ids == hf.encode(text, add_special_tokens=False), text
    # transformers' llama GGUF tokenizer (Metaspace, prepend_scheme "first") adds no "▁" before text that
    # starts with a space; SentencePiece (add_dummy_prefix), llama.cpp and speedpipe do.
    for text in LEADING:
        assert ours.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert len({len(sp.encode(t)) for t in TEXTS}) > 5 and max(len(sp.encode(t)) for t in TEXTS) > 10


def test_without_the_space_prefix_encoding_and_decoding_equal_sentencepiece_s(spm_proto, tmp_path):
    path = _gguf(tmp_path, spm_proto, space_prefix=False)
    ours, sp = tokenizer_from_gguf(open_gguf(path)), _processor(spm_proto, space_prefix=False)
    for text in TEXTS + LEADING:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert ours.decode(ids) == sp.decode(ids) == text, text
    assert ours.encode("the cat", add_special_tokens=False).tokens[0] == "the"  # with the prefix: "▁the"


def test_decoding_round_trips_and_equals_sentencepiece_s(spm_proto, converted):
    path, folder = converted
    ours, sp, tok = tokenizer_from_gguf(open_gguf(path)), _processor(spm_proto, space_prefix=True), Tokenizer(folder)
    for text in TEXTS + LEADING:
        ids = sp.encode(text)
        assert ours.decode(ids) == sp.decode(ids) == tok.decode(ids) == text, text


def test_characters_outside_the_vocabulary_become_their_utf8_byte_pieces(spm_proto, converted):
    ours = tokenizer_from_gguf(open_gguf(converted[0]))
    for char in ("🦀", "한", "ß"):
        tokens = ours.encode(f"a{char}b", add_special_tokens=False).tokens
        assert [f"<0x{b:02X}>" for b in char.encode("utf-8")] == [t for t in tokens if t.startswith("<0x")], tokens
    assert "<unk>" not in ours.encode("🦀 \x00 \U0010ffff").tokens


@pytest.mark.parametrize("add_bos, add_eos, want", [(None, None, "bos"), (False, True, "eos"), (True, True, "both")],
                         ids=["no-keys-bos-only", "bos-false-eos-true", "both"])
def test_bos_and_eos_follow_the_gguf_keys_else_sentencepiece_s_defaults(spm_proto, tmp_path, add_bos, add_eos, want):
    path = _gguf(tmp_path, spm_proto, add_bos=add_bos, add_eos=add_eos)
    tok = Tokenizer(convert_gguf(path, tmp_path / "out", progress=False))
    body = tok.encode("the cat", add_special_tokens=False)
    expected = {"bos": [BOS, *body], "eos": [*body, EOS], "both": [BOS, *body, EOS]}[want]
    assert tok.encode("the cat") == expected
    for hf in (transformers.AutoTokenizer.from_pretrained(tmp_path / "out"),  # reads our tokenizer_config.json
               transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)):
        assert hf.encode("the cat") == expected, type(hf)


def test_control_tokens_are_special_and_user_defined_ones_are_kept_whole(converted):
    tok = Tokenizer(converted[1])
    ids = tok.encode(f"</s>the{USER_DEFINED}the", add_special_tokens=False)
    assert tok.token_strings(ids) == ["</s>", "▁the", USER_DEFINED, "▁the"]  # llama.cpp: "▁" after every added token
    assert tok.decode(ids) == f"the{USER_DEFINED} the"  # the special EOS skipped, the user-defined token kept
    assert tok.decode(ids, skip_special_tokens=False) == f"</s> the{USER_DEFINED} the"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (BOS, (EOS,), True)


def test_a_llama_2_chat_prompt_tokenises_as_meta_s_reference_code(spm_proto, converted):
    """Meta's llama `chat_completion` encodes each turn alone, so "[INST]" after <s> gets the "▁" prefix
    (as llama.cpp and Llama 2's legacy tokenizer.json); transformers' GGUF loader would give none."""
    tok, sp = Tokenizer(converted[1]), _processor(spm_proto, space_prefix=True)
    rendered = "<s>[INST] the cat sat 😀 [/INST] on the mat </s><s>[INST] café  naïve [/INST]"  # HF's Llama 2 template
    meta = [BOS, *sp.encode("[INST] the cat sat 😀 [/INST] on the mat "), EOS, BOS, *sp.encode("[INST] café  naïve [/INST]")]
    assert tok.encode(rendered, add_special_tokens=False) == meta


@pytest.mark.parametrize("prompt", ["", "Once upon a café"], ids=["no-prompt", "prompt"])
def test_streamed_text_is_the_full_decode_however_the_ids_arrive(converted, prompt):
    tok = Tokenizer(converted[1])
    prompt_ids = tok.encode(prompt) if prompt else []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer(prompt_ids=prompt_ids)
        deltas = [detok.add(i) for i in ids]
        deltas.append(detok.flush())
        full = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):] if prompt else tok.decode(ids)
        assert "".join(deltas) == full == (f" {text}" if prompt else text), text
        assert not any("\ufffd" in d for d in deltas), deltas  # a character spelled in byte pieces waits whole
    assert any(t.startswith("<0x") for t in tok.token_strings(tok.encode(TEXTS[7]))), "no byte pieces streamed"
    # "<0x78>" alone is "x", but a run of byte pieces that is not UTF-8 decodes all as U+FFFD (ByteFallback)
    ids = [tok.token_id(t) for t in ("▁the", "<0x78>", "<0xE7>", "<0x12>", "▁the", "<0xF0>", "<0x9F>")]
    detok = tok.detokenizer(prompt_ids=prompt_ids)
    assert detok.add_many(ids) + detok.flush() == tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):]
    # a skipped special token does not end a run: "<0x78></s><0xE7>" decodes as the run "<0x78><0xE7>"
    ids = [tok.token_id(t) for t in ("▁the", "<0x78>", "</s>", "<0xE7>", "<unk>", "▁the")]
    for skip in (True, False):
        detok = tok.detokenizer(prompt_ids=prompt_ids, skip_special_tokens=skip)
        streamed = detok.add_many(ids) + detok.flush()
        full, before = tok.decode(prompt_ids + ids, skip_special_tokens=skip), tok.decode(prompt_ids, skip_special_tokens=skip)
        assert streamed == full[len(before):], skip


def test_streaming_random_ids_with_byte_pieces_and_special_tokens_gives_the_full_decode(converted):
    """Random ids, a third byte pieces and a third special tokens (<unk> <s> </s> <tool>), arrive one by
    one: the joined deltas equal the full decode, with special tokens skipped and kept."""
    tok, rng = Tokenizer(converted[1]), random.Random(0)
    byte_ids, specials = sorted(tok.byte_piece_ids), [UNK, BOS, EOS, tok.token_id(USER_DEFINED)]
    for _ in range(300):
        ids = [rng.choice([rng.randrange(tok.vocab_size), rng.choice(byte_ids), rng.choice(specials)])
               for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            detok = tok.detokenizer(skip_special_tokens=skip)
            assert detok.add_many(ids) + detok.flush() == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.mark.parametrize("change, match", [
    (dict(model="bert"), r"^tokenizer.ggml.model 'bert' is not supported"),
    (dict(model="t5"), r"^tokenizer.ggml.model 't5' is not supported"),
    (dict(scores=False), r"needs tokenizer.ggml.scores, which this file lacks"),
], ids=["bert", "t5", "no-scores"])
def test_unsupported_vocabularies_are_one_line_errors_naming_the_key(spm_proto, tmp_path, change, match):
    path = _gguf(tmp_path, spm_proto, **change)
    with pytest.raises(ValueError, match=match) as err:
        tokenizer_from_gguf(open_gguf(path))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^GGUF file .*spm.gguf: "):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_mismatched_scores_types_and_special_ids_are_one_line_errors(spm_proto, tmp_path, monkeypatch):
    for key, value, match in (("add_token_scores", [0.0], r"scores has 1 entries for \d+ tokens"),
                              ("add_token_types", [1, 1], r"token_type has 2 entries for \d+ tokens"),
                              ("add_unk_token_id", 10_000, r"unknown_token_id 10000 is outside the \d+ tokens")):
        original = getattr(gguf.GGUFWriter, key)
        monkeypatch.setattr(gguf.GGUFWriter, key, lambda self, _, original=original, value=value: original(self, value))
        path = _gguf(tmp_path, spm_proto)
        monkeypatch.undo()
        with pytest.raises(ValueError, match=match):
            tokenizer_from_gguf(open_gguf(path))


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_files_rank_merges_by_position_respell_space_pieces_and_add_no_prefix(tmp_path, arch):
    """transformers' `gemma_tokenizer`: Gemma's scores do not follow its merge order, and llama.cpp's
    Gemma files spell whitespace pieces with spaces; Gemma's files set add_space_prefix false."""
    pieces = ["ab", "ba", "  ", "a", "b", "\u2581"]  # "ab" first in the file, but "ba" scores higher
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 260 + [-10.0, -1.0, -2.0, -20.0, -21.0, -22.0])
    w.add_token_types(types)
    w.add_unk_token_id(3)
    w.add_bos_token_id(2)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    tok = tokenizer_from_gguf(open_gguf(tmp_path / "g.gguf"))
    assert tok.encode("aba").tokens == ["<bos>", "ab", "a"]  # by score: a ba
    enc = tok.encode("a  b", add_special_tokens=False)
    assert enc.ids == [tokens.index(p) for p in ("a", "  ", "b")] and enc.tokens[1] == "\u2581\u2581"
    assert tok.decode(enc.ids) == "a  b" and tok.decode(tok.encode(" a").ids) == " a"  # <bos> skipped


def test_tiny_llama_with_a_sentencepiece_gguf_generates_as_transformers_on_one_and_two_stages(converted):
    from tests.unit.test_families import Chain, _stages

    path, folder = converted
    tok = Tokenizer(folder)
    prompt = tok.encode("the cat sat on 日本語 🦀")
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert prompt == hf_tok.encode("the cat sat on 日本語 🦀") and prompt[0] == BOS
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert {s: Chain(_stages(folder, s)).greedy(prompt, 12) for s in (1, 2)} == {1: want, 2: want}
    assert len(set(want)) > 2, want
    detok = tok.detokenizer(prompt_ids=prompt)
    streamed = detok.add_many(want) + detok.flush()
    full, before = (hf_tok.decode(ids, skip_special_tokens=True) for ids in (prompt + want, prompt))
    assert streamed == full[len(before):] and full.startswith(before)
