"""The text of one token in a logprobs answer, as current vLLM writes it.

Owns `TokenStrings`: per tokenizer, the string of a token id at one position of a sequence, for completions'
`tokens` / `top_logprobs` keys / `text_offset`, chat's `token` / `bytes` / `top_logprobs[].token` and
`prompt_logprobs`' `decoded_token` (launcher/serving/openai_logprobs.py writes those objects).

[Note: logprob token strings]
A token's string is the token decoded alone (special tokens kept), with two corrections vLLM makes:
1. Leading spaces (vLLM PR #48674, vllm/tokenizers/detokenizer_utils.py `convert_ids_list_to_tokens` and
   `_restore_leading_spaces`): with a Metaspace pre-tokenizer (SentencePiece vocabularies: Llama 2, Mistral,
   T5) decoding "▁true" alone strips the space its marker stands for, so it read "true", as the token "true"
   does, and the two collided as keys of completions' `top_logprobs` map (a client saw fewer alternatives
   than it asked for). The spaces the raw vocabulary piece starts with (`Tokenizer.leading_space_marker`)
   that the decoded text lacks are put back in front: "▁true" is " true". Other tokenizers (byte-level BPE:
   GPT-2, Llama 3, SmolLM2) keep the plain decode.
2. Partial characters (vLLM PR #34875, vllm/v1/engine/logprobs.py `_verify_tokens` / `_correct_decoded_token`):
   a string that ends in U+FFFD (a byte-level or byte-fallback token holding part of a multi-byte UTF-8
   character: emoji, CJK) is decoded again after 1, 2, .. up to 4 preceding tokens of the same sequence
   (the context; never the other alternatives at the same position, which use the chosen token's context),
   and gets what that decode adds after the context's "clean" prefix (the context tokens before the trailing
   ones that alone end in U+FFFD: the bytes those held belong to the token that completes the character):
   the token that completes a character reads as the whole character, one that leaves it incomplete reads "".
The context of a position is the sequence's tokens before it (at most `CONTEXT_TOKENS`): for a generated
token, the output so far preceded by the prompt's last tokens; for a prompt token (prompt_logprobs, echo),
the prompt tokens before it. vLLM's LogprobsProcessor starts a sample's context empty and leaves the first
prompt token out of the prompt context; here the sequence reads as one, so a character that a token-id
prompt leaves open and the first generated token completes, or one that begins in the first prompt token, reads
as that character instead of "". Only the context-free part (a token decoded alone) is cached.
Must not: build the API's JSON objects, or cache a string that depends on the context.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipeline.model.tokenizer import Tokenizer

CONTEXT_TOKENS = 4  # vLLM's max_context: the most tokens one UTF-8 character (<= 4 bytes) can span
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


class TokenStrings:
    """Token strings of one tokenizer ([Note: logprob token strings]); caches each id's context-free strings."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoded: dict[int, str] = {}
        self._alone: dict[int, str] = {}

    @functools.cached_property
    def _marker(self) -> str | None:  # read at first use: an app may be built before its tokenizer is used
        return self.tokenizer.leading_space_marker

    def decoded(self, token_id: int) -> str:
        """`token_id` decoded alone, special tokens kept (vLLM's `tokenizer.decode([token_id])`)."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def alone(self, token_id: int) -> str:
        """`decoded` with the leading spaces decoding stripped put back (correction 1 of [Note: logprob token
        strings]; vLLM's `convert_ids_list_to_tokens`). An id outside the vocabulary has no piece: its decode."""
        text = self._alone.get(token_id)
        if text is None:
            text = self._alone[token_id] = _restore_leading_spaces(self._piece(token_id), self.decoded(token_id),
                                                                   self._marker)
        return text

    def text(self, token_id: int, context: Sequence[int]) -> str:
        """The string of `token_id` after the sequence's tokens `context` (oldest first; only the last
        `CONTEXT_TOKENS` matter): `alone`, or, when that ends in U+FFFD, what the token adds to the text
        there (correction 2 of [Note: logprob token strings]; "" while the character is still incomplete)."""
        text = self.alone(token_id)
        return self._completed(token_id, list(context[-CONTEXT_TOKENS:])) if text.endswith(REPLACEMENT) else text

    def _piece(self, token_id: int) -> str:
        if self._marker is None:
            return ""
        try:
            return self.tokenizer.token_strings([token_id])[0]
        except ValueError:  # an id past the tokenizer's vocabulary (a padded LM head): no piece, no marker
            return ""

    def _completed(self, token_id: int, context: list[int]) -> str:
        """vLLM's `LogprobsProcessor._correct_decoded_token` (vllm/v1/engine/logprobs.py, PR #34875): decode
        the token after its last 1, 2, .. len(context) context tokens until the text no longer ends in U+FFFD,
        then drop the clean prefix (the context before its trailing tokens that alone end in U+FFFD, which
        the caller wrote as ""); "" when no context completes the character."""
        for num_ctx in range(1, len(context) + 1):
            window = context[-num_ctx:]
            full = self.tokenizer.decode([*window, token_id], skip_special_tokens=False)
            if full.endswith(REPLACEMENT):
                continue
            clean_end = len(window)
            while clean_end > 0 and self.decoded(window[clean_end - 1]).endswith(REPLACEMENT):
                clean_end -= 1
            prefix = self.tokenizer.decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0  # a normaliser changed the prefix: drop what the two texts share
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return ""


def _restore_leading_spaces(piece: str, text: str, marker: str | None) -> str:
    """`text` with a space in front for each leading `marker` of the vocabulary `piece` that `text` does not
    start with a space for (vLLM's `_restore_leading_spaces`)."""
    if marker is None:
        return text
    num_markers = len(piece) - len(piece.lstrip(marker))
    missing = num_markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
