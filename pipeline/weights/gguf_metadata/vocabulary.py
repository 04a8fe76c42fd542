"""GGUF vocabularies -> `tokenizers.Tokenizer` and the tokenizer_config.json facts that go with them.

Owns rebuilding a model's tokenizer from llama.cpp's `tokenizer.ggml.*` metadata, for the two
vocabulary kinds speedpipe supports: `gpt2` (byte-level BPE with merges and a pre-tokenizer named
by `tokenizer.ggml.pre`) and `llama` (SentencePiece: pieces with scores and no merges, see
[Note: SentencePiece vocabularies]); and the special-token facts (BOS/EOS/UNK/PAD, add_bos_token,
add_eos_token, chat template) written to tokenizer_config.json; one function (`adds_bos_eos`) decides
BOS/EOS, for those flags and for tokenizer.json's post-processor, which is what pipeline/model/tokenizer.py
and transformers 5 read.
Must not: tokenise text itself (the tokenizers library does), read tensors, or import transformers.

[Note: SentencePiece vocabularies]
llama.cpp's converter (`convert_hf_to_gguf.py`, `_set_vocab_sentencepiece`) stores a SentencePiece
model as `tokenizer.ggml.model = "llama"`: its pieces (a space spelled "▁", bytes as "<0xNN>"),
their scores and token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), and
no merges. As transformers' `LlamaConverter` (convert_slow_tokenizer.py) and its GGUF loader
(integrations/gguf), it becomes a BPE model whose merges are recovered from the scores: every way
to cut a piece in two vocabulary pieces is a merge ranked by the piece's score (higher first; ties:
longer left part, longer right part, then vocabulary order), with `byte_fallback` (a character
outside the vocabulary becomes its UTF-8 byte pieces) and `fuse_unk`. Gemma files rank merges by
file position instead (their scores do not follow the merge order) and may spell whitespace pieces
with real spaces ("  " for "▁▁"; transformers' `gemma_tokenizer` respells them).
The space prefix (`tokenizer.ggml.add_space_prefix`, default true; Gemma's files say false) is the
normalizer `Prepend("▁")` + `Replace(" ", "▁")`, the legacy Llama tokenizer.json's: it is
SentencePiece's `add_dummy_prefix` exactly ("  hi" -> "▁▁▁hi"), and as llama.cpp's SPM tokenizer it
also prefixes the text after a special token (each span between added tokens is normalised alone).
transformers' GGUF loader instead uses a `Metaspace(prepend_scheme="first")` pre-tokenizer for the
`llama` architecture (no prefix after a special token or before a leading space; its Phi-3 builder
uses this normalizer) and ignores add_space_prefix=false outside Gemma. The decoder undoes it:
Replace("▁", " "), ByteFallback, Fuse, then Strip one leading space when the prefix was added.
A SentencePiece Unigram model stored the same way is tokenised as this BPE too (as by llama.cpp
and transformers), which can differ from SentencePiece's own Viterbi segmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pipeline.model.config import ModelConfig
from pipeline.weights.gguf_metadata.families import field

# tokenizer.ggml.pre -> pre-tokenizer of the model's own tokenizer.json. The smollm family (also
# StarCoder, Refact) isolates every digit, then applies GPT-2's byte-level regex to the rest.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_GPT2 = ("gpt2", "default")
# Qwen2's tokenizer.json: NFC, then this split (isolated), then byte-level without GPT-2's regex.
_QWEN2 = ("qwen2",)
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3.x's tokenizer.json (llama.cpp: `llama-bpe`, and the older names `llama3`, `llama-v3`): Qwen2's split with
# digits in runs of up to three, no normalizer; its BPE model has `ignore_merges` (a pre-token that is in the
# vocabulary is one token even where the merges would not build it, as tiktoken; llama.cpp's LLAMA3 pre-type too),
# and llama.cpp adds BOS for it when the GGUF has no tokenizer.ggml.add_bos_token (`tokenizer_config`).
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_BYTE_LEVEL_BPE, _SENTENCEPIECE = "gpt2", "llama"  # tokenizer.ggml.model values
_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # merges by position, no space prefix by default


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    if pre in _QWEN2 + _LLAMA3:
        pattern = _QWEN2_PATTERN if pre in _QWEN2 else _LLAMA3_PATTERN
        split = pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported yet "
                     f"(supported: {', '.join(_DIGITS_THEN_GPT2 + _GPT2 + _QWEN2 + _LLAMA3)})")


def _token_types(reader: gguf.GGUFReader, tokens: Sequence[str]) -> list[int]:
    """tokenizer.ggml.token_type, all normal when absent. Raises ValueError on a length mismatch."""
    types = field(reader, "tokenizer.ggml.token_type", None) or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return list(types)


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a GGUF vocabulary: byte-level BPE (`gpt2`) or SentencePiece (`llama`).

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
    tokens (matched whole in text, as llama.cpp does). BOS/EOS: `adds_bos_eos` (a SentencePiece
    tokenizer's post-processor adds them; a byte-level one's does not: tokenizer_config.json says). Raises ValueError, one line naming the metadata key, for another
    `tokenizer.ggml.model` (bert, t5, rwkv, ...), an unknown pre-tokenizer, or missing or
    mismatched tokens, scores or token types.
    """
    kind = field(reader, "tokenizer.ggml.model")
    if kind == _BYTE_LEVEL_BPE:
        tok, specials = _byte_level_bpe(reader)
    elif kind == _SENTENCEPIECE:
        tok, specials = _sentencepiece_bpe(reader)
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', byte-level BPE, and "
                         "'llama', SentencePiece): give the model's Hugging Face folder, with its tokenizer.json")
    tokens = field(reader, "tokenizer.ggml.tokens")
    typed = list(enumerate(zip(tokens, _token_types(reader, tokens), strict=True)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, (t, token_type) in typed if token_type == _CONTROL or i in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for i, (t, token_type) in typed if token_type == _USER_DEFINED and i not in specials])
    return tok


def _byte_level_bpe(reader: gguf.GGUFReader) -> tuple[Tokenizer, set[int]]:
    """A `gpt2` vocabulary's byte-level BPE with its merges and pre-tokenizer, and BOS/EOS added as
    `adds_bos_eos` says (a Sequence of ByteLevel and the template, as Meta's Llama 3 tokenizer.json);
    no extra special ids."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    pre = field(reader, "tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=pre in _LLAMA3))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _QWEN2:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                              _bos_eos_template(reader, tokens)])
    return tok, set()


def _sentencepiece_bpe(reader: gguf.GGUFReader) -> tuple[Tokenizer, set[int]]:
    """A `llama` (SentencePiece) vocabulary as [Note: SentencePiece vocabularies] describes; returns it
    and the ids to add as special tokens beside the control ones (BOS, EOS, UNK, PAD and unknown-type
    tokens: transformers makes its named special tokens special). Raises ValueError as
    `tokenizer_from_gguf`."""
    arch = field(reader, "general.architecture")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    scores = field(reader, "tokenizer.ggml.scores", None)
    if scores is None:
        raise ValueError("a SentencePiece vocabulary (tokenizer.ggml.model 'llama') needs tokenizer.ggml.scores, "
                         "which this file lacks")
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    types = _token_types(reader, tokens)
    if arch in _GEMMA_ARCHITECTURES:  # whitespace pieces spelled with spaces; merge order = file order
        known = set(tokens)
        tokens = [_SPACE * len(t) if t and not t.strip(" ") and _SPACE * len(t) not in known else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    ids = special_token_ids(reader)
    unknown = [t for t, token_type in zip(tokens, types, strict=True) if token_type == _UNKNOWN]
    unk = tokens[ids["unk"]] if "unk" in ids else (unknown or [None])[0]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", arch not in _GEMMA_ARCHITECTURES))
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if space_prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    tok.post_processor = _bos_eos_template(reader, tokens)
    return tok, set(ids.values()) | {i for i, k in enumerate(types) if k == _UNKNOWN}


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float],
                       types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges that rebuild SentencePiece's pieces in score order: for each normal piece (type 1;
    control, byte and user-defined pieces are never built by merging), every cut into a left and a
    right piece that are both in the vocabulary, ranked by the piece's score, higher first; ties
    broken by the longer left part, then the longer right part, then the piece's vocabulary order
    (a stable sort). This is transformers' `generate_merges` ranking (tokenization_utils_base.py),
    which its LlamaConverter and GGUF loader use. Cost: one dictionary lookup per cut (~2 M for
    256 k pieces).
    """
    known = set(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score, token_type in zip(tokens, scores, types, strict=True):
        if token_type != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                ranked.append((-score, -len(left), -len(right), left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(left, right) for *_, left, right in ranked]


def special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    """{"bos"|"eos"|"pad"|"unk": id} for the tokenizer.ggml.*_token_id keys the file has. Raises
    ValueError naming the key for an id outside tokenizer.ggml.tokens."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    num_tokens = len(field(reader, "tokenizer.ggml.tokens"))
    ids = {}
    for name, key in keys.items():
        i = field(reader, f"tokenizer.ggml.{key}", None)
        if i is not None and not 0 <= i < num_tokens:
            raise ValueError(f"tokenizer.ggml.{key} {i} is outside the {num_tokens} tokens of tokenizer.ggml.tokens")
        if i is not None:
            ids[name] = i
    return ids


def adds_bos_eos(reader: gguf.GGUFReader) -> tuple[bool, bool]:
    """(add BOS, add EOS): the file's tokenizer.ggml.add_bos_token / add_eos_token, else llama.cpp's
    defaults (llama-vocab.cpp): BOS for SentencePiece vocabularies and the LLAMA3 pre-tokenizer, not
    for other byte-level ones; never EOS. The one rule behind tokenizer_config.json's two flags and a
    SentencePiece tokenizer.json's post-processor."""
    default_bos = (field(reader, "tokenizer.ggml.model") == _SENTENCEPIECE
                   or field(reader, "tokenizer.ggml.pre", "default") in _LLAMA3)
    return (bool(field(reader, "tokenizer.ggml.add_bos_token", default_bos)),
            bool(field(reader, "tokenizer.ggml.add_eos_token", False)))


def _bos_eos_template(reader: gguf.GGUFReader, tokens: Sequence[str]) -> processors.TemplateProcessing:
    """The post-processor adding BOS/EOS as `adds_bos_eos` says: what transformers 5 and speedpipe's
    Tokenizer read from a folder with a tokenizer.json (not tokenizer_config.json's flags, written for
    older readers: [Note: BOS/EOS] in pipeline/model/tokenizer.py). Raises ValueError when a token to
    add has no id in the file."""
    add_bos, add_eos = adds_bos_eos(reader)
    ids = special_token_ids(reader)
    added = {name: ids.get(name) for name, wanted in (("bos", add_bos), ("eos", add_eos)) if wanted}
    for name, i in added.items():
        if i is None:
            raise ValueError(f"tokenizer.ggml.add_{name}_token is set but tokenizer.ggml.{name}_token_id is missing")

    def spell(sequence: str, type_id: int) -> str:
        before, after = ([f"{tokens[added[n]]}:{type_id}"] if n in added else [] for n in ("bos", "eos"))
        return " ".join([*before, f"${sequence}:{type_id}", *after])

    return processors.TemplateProcessing(single=spell("A", 0), pair=f"{spell('A', 0)} {spell('B', 1)}",
                                         special_tokens=[(tokens[i], i) for i in added.values()])


def tokenizer_config(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, Any]:
    """tokenizer_config.json for the converted folder: the special tokens as strings, `add_bos_token` /
    `add_eos_token` (`adds_bos_eos`), the
    chat template, and `PreTrainedTokenizerFast` so that transformers loads tokenizer.json as it is. The
    flags agree with tokenizer.json's post-processor (`_bos_eos_template`), which is what transformers 5
    and pipeline/model/tokenizer.py read."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    d: dict[str, Any] = {f"{name}_token": tokens[i] for name, i in special_token_ids(reader).items()}
    add_bos, add_eos = adds_bos_eos(reader)
    d.update(
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=field(reader, "tokenizer.chat_template", None),
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    return d
