"""Token masks: vLLM's token-level sampling parameters `min_tokens`, `stop_token_ids`,
`allowed_token_ids` and `bad_words` ([Note: token masks]).

Owns their validation and caps (MAX_STOP_TOKEN_IDS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS,
MAX_BAD_WORD_CHARS; `check_leaves_a_token`: allowed ids that the other masks all ban), tokenising bad
words (`bad_word_token_ids`, vLLM's rule), the mask one logits row gets (`apply_token_masks`, at the
row's own history) and which committed token ends a sequence (`ends_sequence`). Also owns
`SamplingParamError`, the error of every invalid sampling setting (here because this module sits below
pipeline/speculation/sampling.py, which re-exports it).
Must not: import the rest of pipeline/speculation (sampling.py imports this module), choose or commit
tokens (pipeline/speculation/verify.py calls `apply_token_masks` per row), or do I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import torch

# Caps on one request's lists (vLLM sets none; like MAX_LOGIT_BIAS_ENTRIES they bound the per-row work and
# the request's size): stop ids as many as logit_bias entries; allowed ids enough for a sizeable sub-vocabulary.
MAX_STOP_TOKEN_IDS = 300
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 200  # characters of one bad word
# Tokens of one bad word's sequence: byte-level and byte-fallback vocabularies give at most one token per UTF-8
# byte (up to 4 a character), plus the leading space's.
_MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 1

# [Note: token masks]
# As vLLM's SamplingParams define them (vllm/sampling_params.py; the v1 engine's sampler and logits
# processors, vllm/v1/sample/sampler.py `apply_logits_processors`, vllm/v1/sample/ops/bad_words.py,
# vllm/v1/sample/logits_processor builtins `MinTokensLogitsProcessor`; stop checks in
# vllm/v1/core/sched/utils.py `check_stop`, stop strings in vllm/v1/engine/detokenizer.py):
# - min_tokens: before `min_tokens` tokens were generated, every EOS id of the tokenizer and every
#   `stop_token_ids` id is masked (vLLM's `all_stop_token_ids`, which holds the EOS ids with
#   ignore_eos too); stop strings end nothing whose match lies inside the first min_tokens tokens' text
#   (launcher/coordinator/request_handle.py). 0 <= min_tokens <= max_new_tokens.
# - stop_token_ids: a committed stop id ends the sequence ("stop"; its id is vLLM's `stop_reason`), with
#   ignore_eos too; like EOS its text is not part of the output text.
# - allowed_token_ids: every other token is masked (non-empty; ids checked against the vocabulary).
# - bad_words: each word, and its variant with a leading space when that tokenises to a different
#   first token but as many tokens (`bad_word_token_ids`), is a token sequence; a one-token sequence
#   is always masked, a longer one's last token is masked when the output so far ends with its other
#   tokens (the output only, not the prompt, as vLLM's `apply_bad_words`).
# - EOS ids (vLLM's `SamplingParams.update_from_generation_config`, vllm/sampling_params.py): the tokenizer's
#   eos_token is the primary EOS (`eos_token_ids[0]`, pipeline/model/tokenizer.py); it ends a sequence as EOS
#   (no stop_reason) unless ignore_eos. The generation config's other EOS ids are added to the request's
#   stop_token_ids unless ignore_eos, so each ends it as a stop token id does ("stop", the id as stop_reason, its
#   text left out); with ignore_eos none of them ends it. min_tokens masks all of them, ignore_eos or not
#   (vLLM's `_all_stop_token_ids`). Here the engine gets every EOS id and `finish_reason_at`
#   (pipeline/engine/records.py) tells the primary from the others. A tokenizer without an eos_token has no
#   primary (vLLM passes `eos_token_id` None to `update_from_generation_config`, and its `check_stop` in
#   vllm/v1/core/sched/utils.py matches no EOS): every generation-config EOS id is then a stop token id
#   (`SchedulerConfig.primary_eos` False), and a chat template's `eos_token` is undefined, as in Hugging Face.
# Masks set -inf, so their order among themselves and against the bias and penalties changes nothing;
# the grammar's mask comes after them. verify_result (pipeline/speculation/verify.py) applies them to
# each row with the exact history plain decoding has at that position (the output committed before
# it), so output stays token-identical to plain decoding under every speculation mode and stage count.


class SamplingParamError(ValueError):
    """An invalid `SamplingParams` setting; `param` is its field name (e.g. "top_p"), which the
    message starts with."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class MaskFields(Protocol):
    """The fields of `pipeline.speculation.sampling.SamplingParams` this module reads."""

    max_new_tokens: int
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    allowed_token_ids: tuple[int, ...] | None
    bad_words: tuple[str, ...]
    bad_word_ids: tuple[tuple[int, ...], ...]


def _shown(value: Any) -> str:  # a client's value in a message, at most 80 characters of its repr
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}… ({len(text)} characters)"


def _token_ids(name: str, value: Any, cap: int, *, unique: bool = True) -> tuple[int, ...]:
    """`value` (a list or tuple of token ids) as a tuple; without repeats (first occurrence kept) when
    `unique`. Raises SamplingParamError(name)."""
    if not isinstance(value, (list, tuple)):
        raise SamplingParamError(name, f"{name} must be a list of token ids, got {type(value).__name__}")
    if len(value) > cap:
        raise SamplingParamError(name, f"{name} has {len(value)} entries; at most {cap}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise SamplingParamError(name, f"{name} must hold token ids (integers >= 0), got {_shown(t)}")
    return tuple(dict.fromkeys(value)) if unique else tuple(value)


def check_token_masks(params: MaskFields) -> None:
    """Validate and normalise (lists -> tuples, repeats dropped) the token-mask fields of a frozen
    `SamplingParams` in place, from its `__post_init__`. Raises SamplingParamError naming the field."""
    n = params.min_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= params.max_new_tokens:
        raise SamplingParamError("min_tokens", f"min_tokens must be an integer in [0, max_tokens = "
                                               f"{params.max_new_tokens}], got {_shown(n)}")
    object.__setattr__(params, "stop_token_ids", _token_ids("stop_token_ids", params.stop_token_ids, MAX_STOP_TOKEN_IDS))
    if params.allowed_token_ids is not None:
        allowed = _token_ids("allowed_token_ids", params.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        if not allowed:
            raise SamplingParamError("allowed_token_ids", "allowed_token_ids must not be empty (null: every token)")
        object.__setattr__(params, "allowed_token_ids", tuple(sorted(allowed)))
    words = params.bad_words
    if not isinstance(words, (list, tuple)):
        raise SamplingParamError("bad_words", f"bad_words must be a list of strings, got {type(words).__name__}")
    if len(words) > MAX_BAD_WORDS:
        raise SamplingParamError("bad_words", f"bad_words has {len(words)} entries; at most {MAX_BAD_WORDS}")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
            raise SamplingParamError("bad_words", f"bad_words must hold non-blank strings of at most "
                                                  f"{MAX_BAD_WORD_CHARS} characters, got {_shown(w)}")
    object.__setattr__(params, "bad_words", tuple(words))
    ids = params.bad_word_ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(s, (list, tuple)) and s for s in ids):
        raise SamplingParamError("bad_words", f"bad_word_ids must be non-empty token id lists, got {_shown(ids)}")
    object.__setattr__(params, "bad_word_ids", tuple(_token_ids("bad_words", s, _MAX_BAD_WORD_TOKENS, unique=False)
                                                     for s in ids))


def check_token_mask_vocab(params: MaskFields, vocab_size: int) -> None:
    """Raise SamplingParamError (naming the field and the id) when a stop, allowed or bad-word token id
    is not in [0, vocab_size)."""
    lists = [("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids or ()),
             *(("bad_words", s) for s in params.bad_word_ids)]
    for name, ids in lists:
        for t in ids:
            if t >= vocab_size:
                raise SamplingParamError(name, f"{name} token id {t} is outside the vocabulary [0, {vocab_size})")


def check_leaves_a_token(params: MaskFields, eos_token_ids: Collection[int]) -> None:
    """Raise SamplingParamError("allowed_token_ids") when the masks leave no token at the first output position,
    whatever the logits: every allowed id is a one-token bad word or, with min_tokens, an EOS or stop token id
    (such a request could only fail at its first token). Needs `bad_word_ids` filled (the coordinator's
    `encode_prompt`); masks that leave nothing only later, or only with a grammar, fail the request there."""
    if params.allowed_token_ids is None:
        return
    banned = {word[0] for word in params.bad_word_ids if len(word) == 1}
    if params.min_tokens > 0:
        banned.update(eos_token_ids, params.stop_token_ids)
    if banned.issuperset(params.allowed_token_ids):
        why = "a bad word" + (", an EOS id or a stop token id (before min_tokens)" if params.min_tokens > 0 else "")
        raise SamplingParamError("allowed_token_ids",
                                 f"allowed_token_ids leave no token to generate: each of them is {why}")


def bad_word_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences `bad_words` masks: vLLM's `SamplingParams.update_from_tokenizer`. For each
    word w (leading whitespace stripped): encode(w), then encode(" " + w) too when it differs in its
    first token and has as many tokens (the same word in the middle of a text). encode: text -> ids
    without special tokens added. Raises SamplingParamError when a word encodes to no token."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise SamplingParamError("bad_words", f"bad_words entry {_shown(word)} encodes to no token")
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def has_token_masks(params: MaskFields) -> bool:
    """True when the masks can change a row's logits (min_tokens, allowed_token_ids or bad words set)."""
    return params.min_tokens > 0 or params.allowed_token_ids is not None or bool(params.bad_word_ids)


def masks_act_at(params: MaskFields, position: int) -> bool:
    """True when the masks can change the logits row that chooses output token `position` (0 = the first
    generated): allowed_token_ids and bad words at every position (a bad word's prefix may come later),
    min_tokens before `min_tokens` tokens only (`apply_token_masks` bans nothing for it after them)."""
    return position < params.min_tokens or params.allowed_token_ids is not None or bool(params.bad_word_ids)


def apply_token_masks(logits: torch.Tensor, params: MaskFields, *, history: Sequence[int],
                      eos_token_ids: Collection[int]) -> torch.Tensor:
    """logits: [vocab_size] float with every token the masks forbid at output position len(history) set
    to -inf ([Note: token masks]); a new tensor (the input when nothing is masked). history: the
    sequence's output before this position (prompt excluded); eos_token_ids: the tokenizer's EOS ids."""
    banned: list[int] = []
    if len(history) < params.min_tokens:
        banned += [*eos_token_ids, *params.stop_token_ids]
    for word in params.bad_word_ids:
        if len(word) == 1 or (len(word) - 1 <= len(history) and tuple(history[len(history) - len(word) + 1:]) == word[:-1]):
            banned.append(word[-1])
    vocab_size = logits.shape[-1]
    banned = [t for t in banned if t < vocab_size]  # an EOS id beyond a small test vocabulary
    if not banned and params.allowed_token_ids is None:
        return logits
    out = logits.float().clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
        keep[list(params.allowed_token_ids)] = True
        out[~keep] = float("-inf")
    if banned:
        out[banned] = float("-inf")
    return out


def ends_sequence(token: int, *, eos_token_ids: Collection[int], ignore_eos: bool,
                  stop_token_ids: Collection[int]) -> bool:
    """True when committing `token` ends the sequence: an EOS id (unless ignore_eos) or one of the request's
    stop token ids (with ignore_eos too, as vLLM's `check_stop`). The masks keep both out before min_tokens."""
    return (token in eos_token_ids and not ignore_eos) or token in stop_token_ids
