"""Tokenizer: text <-> token ids for a Hugging Face-format model folder, and streaming detokenization.

Owns `Tokenizer` (a thin wrapper over `tokenizers.Tokenizer` loaded from `tokenizer.json`, with
the special-token facts from `tokenizer_config.json`, `config.json` and `generation_config.json`)
and `IncrementalDetokenizer`, which turns committed token ids into text deltas for streaming.
Must not: import transformers, render chat templates (it only exposes the template string), or
check stop strings (the coordinator does that on the streamed text).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pipeline.model.family_config import text_model_dict


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist. Raises ValueError naming the
    file when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value: Any) -> list[int]:
    """An `eos_token_id` value (int, list of ints or None) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config's (str or named list),
    else a multimodal model's processor template (chat_template.json, e.g. Gemma 3's; with text
    messages its image branches are never taken)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template or _read_json(model_dir / "chat_template.json").get("chat_template")


# [Note: class default EOS]
# A folder whose tokenizer_config.json and special_tokens_map.json name no eos_token (the key absent; a null is
# none) still has one in transformers when the tokenizer CLASS AutoTokenizer loads has an `eos_token` default in
# its __init__ (Qwen2Tokenizer: "<|endoftext|>"): that is Hugging Face's `eos_token_id` and so vLLM's primary EOS.
# The class AutoTokenizer picks (transformers 5, models/auto/tokenization_auto.py): the model type's registered
# class where that type ignores the hub's name (qwen2, phi3: MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) or
# registers TokenizersBackend (mistral, mixtral; no default); else the class tokenizer_config.json (else
# config.json) names, "Fast" dropped, but a LlamaTokenizer over a tokenizer.json that spells "ByteLevel" loads
# as TokenizersBackend; no name: the registered class. The two tables are checked against the installed
# transformers (tests/unit/test_class_default_eos.py). A default this vocabulary does not know gives no EOS
# (transformers would add it as a new id past tokenizer.json's vocabulary). A class outside the table gives none,
# also where transformers' has a default: only the classes of the families speedpipe runs are listed (other
# families' RobertaTokenizer "</s>", CohereTokenizer, WhisperTokenizer, ... are not).
_CLASS_DEFAULT_EOS = {"GPT2Tokenizer": "<|endoftext|>", "GPTNeoXTokenizer": "<|endoftext|>",
                      "Qwen2Tokenizer": "<|endoftext|>", "LlamaTokenizer": "</s>", "CodeLlamaTokenizer": "</s>",
                      "GemmaTokenizer": "<eos>"}  # PreTrainedTokenizerFast, TokenizersBackend: no default
_REGISTERED_TOKENIZER = {"mistral": "TokenizersBackend", "mixtral": "TokenizersBackend", "phi3": "TokenizersBackend",
                         "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer", "qwen3_moe": "Qwen2Tokenizer",
                         "gemma": "GemmaTokenizer", "gemma2": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer",
                         "gemma3": "GemmaTokenizer"}  # speedpipe's model types; llama registers none
_HUB_CLASS_IGNORED = ("qwen2", "phi3")


def class_default_eos(tokenizer_config: dict[str, Any], model_config: dict[str, Any], tokenizer_json: Path) -> str | None:
    """The eos_token the tokenizer class transformers' AutoTokenizer loads for this folder gives by default, or
    None: [Note: class default EOS]. `model_config`: config.json as written (a multimodal model's outer type)."""
    model_type = model_config.get("model_type")
    named = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    registered = _REGISTERED_TOKENIZER.get(model_type)
    if not isinstance(named, str) or model_type in _HUB_CLASS_IGNORED or registered == "TokenizersBackend":
        chosen = registered
    elif named.removesuffix("Fast") == "LlamaTokenizer" and '"ByteLevel"' in tokenizer_json.read_text("utf-8"):
        chosen = "TokenizersBackend"
    else:
        chosen = named
    return _CLASS_DEFAULT_EOS.get(chosen.removesuffix("Fast")) if chosen else None


# What to do about a folder without tokenizer.json (e.g. one with only SentencePiece's tokenizer.model).
_TOKENIZER_REMEDY = ("speedpipe reads the tokenizers library's tokenizer.json; copy the model's own, or write one "
                     "with transformers: AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER)")

# [Note: BOS/EOS]
# Whether a prompt gets BOS (EOS) is decided by tokenizer.json's post-processor alone, as transformers 5
# decides it: with a tokenizer.json, `from_pretrained` drops tokenizer_config.json's add_bos_token /
# add_eos_token and keeps the file's post-processor (none: nothing added), and `save_pretrained` no
# longer writes the flags. Meta's Llama 3 folders carry BOS only there (Sequence[ByteLevel,
# TemplateProcessing "<|begin_of_text|> $A"]); Llama 2's carry both, agreeing. The flags are ignored;
# the GGUF converter writes a post-processor from the same rule as the flags it writes
# (pipeline/weights/gguf_metadata/vocabulary.py `adds_bos_eos`). `encode` lets the library apply it;
# the ids it adds, found once by encoding a probe with and without (`_post_processor_specials`),
# give `add_bos_token`, `add_eos_token` and `bos_token_id`. A pair template's `$B` is never used.
_PROBES = ("a", "0", " ", "hello")  # texts to find the added ids around: the first with tokens


class Tokenizer:
    """Text <-> token ids of one model folder.

    Attributes: `vocab_size` (ids the tokenizer knows, added tokens included, capped at config.json's
    `vocab_size`, the rows of the model's logits, where a tokenizer has an added token past them:
    such an id can be neither embedded nor biased; the model's embedding may be larger), `eos_token_id` (the eos_token of special_tokens_map.json, else of tokenizer_config.json,
    else the tokenizer class's default ([Note: class default EOS]), or None: vLLM's primary EOS, Hugging Face's `tokenizer.eos_token_id`), `eos_token_ids` (tuple: eos_token_id first when there is one, then generation_config.json's, or without that
    file config.json's (of a multimodal model, its text model's: [Note: text-only multimodal]); the others than
    eos_token_id are secondary EOS ids, all of them without an eos_token: [Note: token masks] in
    pipeline/speculation/masks/token_masks.py), `add_bos_token` / `add_eos_token` (whether tokenizer.json's
    post-processor adds ids before / after a text: [Note: BOS/EOS]; `num_added`: how many, (before, after)), `bos_token_id` (int or None; the
    post-processor's first added id, else generation_config.json, config.json, tokenizer_config.json),
    `chat_template` (Jinja source or None). Raises FileNotFoundError without tokenizer.json, and
    ValueError for a tokenizer.json the tokenizers library cannot read or whose post-processor changes
    the text's own tokens.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {self.model_dir}: {_TOKENIZER_REMEDY}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception for any unreadable file
            raise ValueError(f"{path} is not a tokenizer file the tokenizers library can read: {exc}") from None
        tok_config = _read_json(self.model_dir / "tokenizer_config.json")
        folder_config = _read_json(self.model_dir / "config.json")
        model_config = text_model_dict(folder_config)  # multimodal: its text side
        gen_config = _read_json(self.model_dir / "generation_config.json")
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        rows = model_config.get("vocab_size")  # the model's logits: an id past them has no row to bias or embed
        if isinstance(rows, int) and not isinstance(rows, bool) and 0 < rows < self.vocab_size:
            self.vocab_size = rows
        self.chat_template: str | None = _chat_template(self.model_dir, tok_config)
        prefix, suffix = self._post_processor_specials()
        self.add_bos_token: bool = bool(prefix)
        self.add_eos_token: bool = bool(suffix)
        self.num_added: tuple[int, int] = (len(prefix), len(suffix))  # ids the post-processor adds before, after
        self.bos_token_id: int | None = prefix[0] if prefix else self._first_id(
            gen_config.get("bos_token_id"), model_config.get("bos_token_id"), tok_config.get("bos_token"))
        # vLLM's primary EOS: Hugging Face's eos_token, special_tokens_map.json's over tokenizer_config.json's (as
        # transformers' from_pretrained reads them; a folder may name it in the first file only)
        special_map = _read_json(self.model_dir / "special_tokens_map.json")
        named = "eos_token" in special_map or "eos_token" in tok_config  # else the class's: [Note: class default EOS]
        self.eos_token_id: int | None = self._first_id(special_map.get("eos_token"), tok_config.get("eos_token")) \
            if named else self._first_id(class_default_eos(tok_config, folder_config, path))
        # generation_config.json's EOS ids where that file exists (none if it names none), else config.json's:
        # the model's generation config, what transformers' generate and vLLM's update_from_generation_config
        # stop on (the two files' ids were merged before)
        has_gen_config = (self.model_dir / "generation_config.json").is_file()
        eos = _as_ids((gen_config if has_gen_config else model_config).get("eos_token_id"))
        primary = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(primary + eos))  # [Note: token masks] EOS ids

    def _post_processor_specials(self) -> tuple[list[int], list[int]]:
        """(ids added before, ids added after) a text by tokenizer.json's post-processor, asked of the
        tokenizers library (any kind: TemplateProcessing, Roberta, Bert, a Sequence): [Note: BOS/EOS]."""
        for probe in _PROBES:
            body = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            if body:
                break
        for start in range(len(full) - len(body) + 1):
            if full[start:start + len(body)] == body:
                return full[:start], full[start + len(body):]
        raise ValueError(f"{self.model_dir / 'tokenizer.json'}: its post-processor changes the text's own tokens "
                         f"({body} -> {full}); speedpipe supports post-processors that only add special tokens")

    def _first_id(self, *candidates: Any) -> int | None:
        """The first candidate that is an id, or a token string this vocabulary knows."""
        for c in candidates:
            if isinstance(c, int):
                return c
            text = _token_text(c)
            if text and self.token_id(text) is not None:
                return self.token_id(text)
        return None

    def to_json(self) -> str:
        """The Hugging Face `tokenizers` JSON of this tokenizer (what llguidance reads for structured outputs)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled exactly `token` (e.g. "<|im_end|>"), or None."""
        return self._tok.token_to_id(token)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for, bounded above by the longest vocabulary
        entry as spelled (byte-level BPE spells each byte as one character of one or two bytes)."""
        return max(len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True))

    @functools.cached_property
    def byte_piece_ids(self) -> frozenset[int]:
        """Ids of byte pieces ("<0xE6>") when the decoder has ByteFallback (SentencePiece vocabularies),
        else empty. ByteFallback decodes a run of them together, and a run that is not UTF-8 all as
        U+FFFD, even bytes that alone were a valid character: [Note: SentencePiece streaming]."""
        decoder = self._tok.decoder  # its own JSON only: the tokenizer's may be megabytes
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        vocab = self._tok.get_vocab(with_added_tokens=False)
        return frozenset(i for t, i in vocab.items() if re.fullmatch(r"<0x[0-9A-F]{2}>", t))

    @functools.cached_property
    def leading_space_marker(self) -> str | None:
        """The character a Metaspace pre-tokenizer (alone or in a Sequence) spells a space with (its
        `replacement`, "▁" by default), else None. Decoding a piece alone strips the space its leading
        marker stands for (SentencePiece's dummy prefix); vLLM's `_get_leading_space_marker` reads the same."""
        pre = self._tok.pre_tokenizer  # its own JSON only, as `byte_piece_ids`
        config = json.loads(pre.__getstate__()) if pre is not None else {}
        for sub in [config] if config.get("type") == "Metaspace" else config.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "\u2581")
        return None

    @functools.cached_property
    def byte_run_ids_skipping_specials(self) -> frozenset[int]:
        """`byte_piece_ids` and, when there are any, the special tokens' ids: a skipped special token
        decodes to nothing, so it does not end a run of byte pieces ([Note: SentencePiece streaming])."""
        if not self.byte_piece_ids:
            return frozenset()
        added = self._tok.get_added_tokens_decoder()
        return self.byte_piece_ids | {i for i, t in added.items() if t.special}

    def check_fits(self, text: str, max_tokens: int, *, what: str = "prompt") -> None:
        """Raise ValueError when `text` cannot be `max_tokens` tokens or fewer, from its size alone,
        before any tokenising: a server must not spend seconds on megabytes that cannot fit. The
        bound is twice the most a token spells (`max_token_bytes`); it holds while normalisers shrink
        text at most 2x and unknown characters are not merged into one token (true of byte-level BPE,
        whose tokens average a few bytes against a longest of 100-260)."""
        limit = 2 * max_tokens * self.max_token_bytes
        if len(text) > limit // 4 and (size := len(text.encode("utf-8", "surrogatepass"))) > limit:
            raise ValueError(f"{what} is {size} bytes: it cannot fit max_model_len {max_tokens} tokens (no token "
                             f"of this vocabulary spells more than {self.max_token_bytes} bytes)")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`: [num_tokens]. Special-token text such as "<|im_start|>" maps to its id;
        with `add_special_tokens` the tokenizer.json post-processor adds what it adds (BOS, EOS: see
        `add_bos_token` / `add_eos_token`, [Note: BOS/EOS]), as Hugging Face's `tokenizer(text)`.
        `add_special_tokens=False` for text a chat template rendered, which spells its own BOS (Hugging
        Face's `apply_chat_template` tokenises it so). Runs without holding Python's GIL (the library's
        `encode_batch`; its `encode` holds it, ~0.5 s for 660 KB of text), so a server's other threads
        (heartbeats, streams) go on while a long prompt is tokenised."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id ([num_tokens]; byte-level BPE spells a space "Ġ"), as
        Hugging Face's `convert_ids_to_tokens`. Raises ValueError for an id outside the vocabulary."""
        strs = [self._tok.id_to_token(i) for i in ids]
        if None in strs:
            raise ValueError(f"token id {ids[strs.index(None)]} is not in the vocabulary")
        return strs

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` ([num_tokens]); special tokens dropped unless `skip_special_tokens=False`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh `IncrementalDetokenizer` for one sequence's generated tokens."""
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens,
                                      spaces_between_special_tokens=spaces_between_special_tokens)

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """{id: text} of every added token (special or not), as the tokenizers library lists them."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}


# Prompt tokens kept as left context for the first generated tokens (vLLM uses 5 as well): enough
# for a tokenizer whose decoding of a token depends on its neighbour (SentencePiece spaces).
#
# [Note: SentencePiece streaming]
# SentencePiece's decoder strips the space of the first "▁word" it decodes: with the prompt as left
# context the first generated "▁word" streams as " word", the continuation of the prompt's text
# (without a prompt, "word", as a full decode of the generated ids). Its byte pieces ("<0xE6>", ...)
# spell one character over several tokens, and the ByteFallback decoder decodes a whole run of them
# at once: a run that is not UTF-8 becomes one U+FFFD per byte, even bytes that were a character
# alone ("<0x78>" is "x", but "<0x78><0xE7>" is two U+FFFD). So a run is emitted only once a
# token that is not a byte piece ends it (or at `flush`), and the stream stays the full decode
# (tests/unit/test_gguf_spm_tokenizer.py). A special token that decoding skips does not end a run
# (the decoder never sees it: "<0x04></s><0x9E>" is one run), so it is held back too.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas whose concatenation is the full decode.

    Decodes a short window ending at the new id and emits what it adds beyond the window's
    previous text; while the new text ends in U+FFFD (an incomplete multi-byte UTF-8 sequence
    split across tokens) it emits nothing and waits for more ids. The offsets scheme is the one
    of text-generation-inference / vLLM (`prefix_offset`, `read_offset`). Call `flush` at the end.
    With `skip_special_tokens` False and `spaces_between_special_tokens` False, an added token right
    after another generated added token emits its bare text, without a space the decoder may put
    between them (vLLM's `FastIncrementalDetokenizer` rule; the deltas then differ from the full decode).
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._bare_added = {} if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens
        self._last_added = False  # the previous generated token was an added token (for `_bare_added`)
        self._held_ids = tokenizer.byte_run_ids_skipping_specials if skip_special_tokens else tokenizer.byte_piece_ids
        self._ids = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the new text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        bare, self._last_added = self._last_added and token_id in self._bare_added, token_id in self._bare_added
        if token_id in self._held_ids:  # [Note: SentencePiece streaming]
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = self._bare_added[token_id] if bare else new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        """`add` each id in turn; return the concatenated deltas."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the sequence: return pending text, including U+FFFD for bytes that never
        completed a character, so that all deltas joined equal the full decode."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
