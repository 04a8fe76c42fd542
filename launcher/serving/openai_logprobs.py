"""OpenAI-style `logprobs` objects of responses: completions' legacy form and chat's `content` list.

Owns turning the pipeline's `TokenLogprob` records (pipeline/speculation/logprobs.py: raw-model log-probabilities,
natural log, see [Note: logprobs and penalties] there) into the JSON shapes of the OpenAI API
reference: for /v1/completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with
`echo`, the prompt's tokens come first, the very first one with logprob null), for
/v1/chat/completions `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Token strings are each token decoded alone (a byte-level token that is part of a multi-byte
character decodes to U+FFFD, as in vLLM). `top_logprobs` lists the k most likely alternatives of
each position (k = the request's `logprobs` / `top_logprobs`); in the completions form the chosen
token comes first in that map whether or not it is among them (up to k + 1 entries, as the OpenAI
reference and vLLM give), in the chat form it is reported in `token` only. With vLLM's
`return_tokens_as_token_ids` every token string (and so `bytes` and `text_offset`) is "token_id:<id>" instead,
as vLLM's serving code writes it. vLLM's `prompt_logprobs` (`prompt_logprobs`): per prompt token (null for the
first) a map of token id -> {"logprob", "rank", "decoded_token"}, per choice on completions and at the top level
of a chat response (launcher/serving/http_server.py places it).
Must not: do I/O, validate requests (launcher/serving/openai_protocol.py) or know about the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.logprobs import TokenLogprob

if TYPE_CHECKING:
    from launcher.serving.openai_protocol import ParsedRequest


class LogprobFormatter:
    """Formats `TokenLogprob`s for one tokenizer; token strings are cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """The text of one token decoded alone (special tokens kept), or "token_id:<id>" when `as_id`."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], *,
                   text_offset: int = 0, as_ids: bool = False, num_top: int | None = None) -> dict[str, Any]:
        """The legacy completions `logprobs` object of `token_ids` (one entry each; None = the first
        prompt token, which has no logprob). text_offset: character offset of the first token in
        the choice's text; offsets then advance by each token's text length. as_ids: tokens as
        "token_id:<id>" (`token_text`). num_top: the request's `logprobs`; a map keeps its first num_top + 1
        entries (the chosen token, then the alternatives), as vLLM's `_create_completion_logprobs` does when
        a larger `prompt_logprobs` gave the echoed prompt tokens more alternatives."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for t, entry in zip(token_ids, entries, strict=True):
            tokens.append(self.token_text(t, as_ids))
            offsets.append(text_offset)
            text_offset += len(tokens[-1])
            logprobs.append(None if entry is None else entry.logprob)
            if entry is None:
                tops.append(None)
                continue
            by_id = list(dict([(t, entry.logprob), *entry.top]).items())  # the chosen token first, as vLLM's
            tops.append({self.token_text(i, as_ids): lp for i, lp in by_id[:None if num_top is None else num_top + 1]})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob], *, as_ids: bool = False) -> dict[str, Any]:
        """The chat `logprobs` object: {"content": [one record per token]}; as_ids: as `completion`'s."""
        return {"content": [{**self._chat_token(t, e.logprob, as_ids),
                             "top_logprobs": [self._chat_token(i, lp, as_ids) for i, lp in e.top]}
                            for t, e in zip(token_ids, entries, strict=True)]}

    def _chat_token(self, token_id: int, logprob: float, as_id: bool) -> dict[str, Any]:
        text = self.token_text(token_id, as_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def of_choice(self, parsed: ParsedRequest, chat: bool, ids: list[int], entries: list,
                  prompt_entries: Sequence[TokenLogprob | None] | None, text_offset: int) -> dict[str, Any] | None:
        """The `logprobs` object of (a chunk of) one choice of `parsed`, or None when it asked for none.
        prompt_entries: the prompt's logprobs (on the first chunk), else None; they come first in completions'
        object only with `echo` (vLLM's `prompt_logprobs` alone is a field of its own: `vllm_prompt`)."""
        if parsed.params.logprobs is None:
            return None
        as_ids = parsed.return_tokens_as_token_ids
        if chat:
            return self.chat(ids, entries, as_ids=as_ids)
        if parsed.echo and prompt_entries is not None:  # echo: the prompt's tokens first
            ids, entries = [*parsed.prompt_ids, *ids], [*prompt_entries, *entries]
        return self.completion(ids, entries, text_offset=text_offset, as_ids=as_ids, num_top=parsed.params.logprobs)

    def vllm_prompt(self, parsed: ParsedRequest, entries: Sequence[TokenLogprob | None] | None) -> list | None:
        """vLLM's `prompt_logprobs` list of `parsed` (None when it computed none): per prompt token, null for the
        first, else {token id (a JSON string): {"logprob", "rank", "decoded_token"}} with the prompt token first
        (its own rank) and then its k alternatives (ranks 1..k; the prompt token among them keeps its place and
        takes the alternative's rank), as vLLM v1's LogprobsProcessor `_make_logprob_dict` builds it; logprobs
        below -9999 are -9999 (vLLM's `clamp_prompt_logprobs`). `decoded_token` is the token decoded alone,
        also with `return_tokens_as_token_ids` (which vLLM applies to `logprobs` only)."""
        if parsed.params.prompt_logprobs is None or entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": max(lp, -9999.0), "rank": rank,
                                                 "decoded_token": self.token_text(t)}
                                        for t, lp, rank in [(e.token_id, e.logprob, e.rank),
                                                            *((i, v, j + 1) for j, (i, v) in enumerate(e.top))]}
                for e in entries]
