"""OpenAI-style `logprobs` objects of responses: completions' legacy form and chat's `content` list.

Owns turning the pipeline's `TokenLogprob` records (pipeline/speculation/logprobs.py: raw-model log-probabilities,
natural log, see [Note: logprobs and penalties] there) into the JSON shapes of the OpenAI API
reference: for /v1/completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with
`echo`, the prompt's tokens come first, the very first one with logprob null), for
/v1/chat/completions `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Token strings are vLLM's (launcher/serving/formats/token_strings.py, [Note: logprob token strings]): each token
decoded alone, with the leading spaces of a Metaspace piece kept and a token that ends in part of a multi-byte
character read in its sequence's context, so each choice carries its last tokens from chunk to chunk
(`ChoiceLogprobs`). `top_logprobs` lists the k most likely alternatives of
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

from launcher.serving.formats.token_strings import CONTEXT_TOKENS, TokenStrings
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.logprobs import TokenLogprob

if TYPE_CHECKING:
    from launcher.serving.openai_protocol import ParsedRequest


class LogprobFormatter:
    """Formats `TokenLogprob`s for one tokenizer; token strings come from `TokenStrings`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.strings = TokenStrings(tokenizer)

    def token_text(self, token_id: int, context: Sequence[int] = (), as_id: bool = False) -> str:
        """The string of `token_id` after the sequence's tokens `context` (`TokenStrings.text`), or
        "token_id:<id>" when `as_id`."""
        return f"token_id:{token_id}" if as_id else self.strings.text(token_id, context)

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], *,
                   context: Sequence[int] = (), text_offset: int = 0, as_ids: bool = False,
                   num_top: int | None = None) -> dict[str, Any]:
        """The legacy completions `logprobs` object of `token_ids` (one entry each; None = the first
        prompt token, which has no logprob: its text is its plain decode, as vLLM's). context: the sequence's
        tokens before token_ids[0] (`token_text`). text_offset: character offset of the first token in
        the choice's text; offsets then advance by each token's text length. as_ids: tokens as
        "token_id:<id>" (`token_text`). num_top: the request's `logprobs`; a map keeps its first num_top + 1
        entries (the chosen token, then the alternatives), as vLLM's `_create_completion_logprobs` does when
        a larger `prompt_logprobs` gave the echoed prompt tokens more alternatives."""
        tokens, logprobs, tops, offsets = [], [], [], []
        context = list(context)
        for t, entry in zip(token_ids, entries, strict=True):
            plain = entry is None and not as_ids
            tokens.append(self.strings.decoded(t) if plain else self.token_text(t, context, as_ids))
            offsets.append(text_offset)
            text_offset += len(tokens[-1])
            logprobs.append(None if entry is None else entry.logprob)
            if entry is None:
                tops.append(None)
            else:
                by_id = list(dict([(t, entry.logprob), *entry.top]).items())  # the chosen token first, as vLLM's
                tops.append({self.token_text(i, context, as_ids): lp
                             for i, lp in by_id[:None if num_top is None else num_top + 1]})
            context = [*context[-CONTEXT_TOKENS + 1:], t]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob], *, context: Sequence[int] = (),
             as_ids: bool = False) -> dict[str, Any]:
        """The chat `logprobs` object: {"content": [one record per token]}; context, as_ids: as `completion`'s."""
        content, context = [], list(context)
        for t, e in zip(token_ids, entries, strict=True):
            content.append({**self._chat_token(t, e.logprob, context, as_ids),
                            "top_logprobs": [self._chat_token(i, lp, context, as_ids) for i, lp in e.top]})
            context = [*context[-CONTEXT_TOKENS + 1:], t]
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float, context: Sequence[int], as_id: bool) -> dict[str, Any]:
        text = self.token_text(token_id, context, as_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def choice(self, parsed: ParsedRequest, chat: bool) -> ChoiceLogprobs:
        """A fresh `ChoiceLogprobs` for one choice of `parsed`."""
        return ChoiceLogprobs(self, parsed, chat)

    def vllm_prompt(self, parsed: ParsedRequest, entries: Sequence[TokenLogprob | None] | None) -> list | None:
        """vLLM's `prompt_logprobs` list of `parsed` (None when it computed none): per prompt token, null for the
        first, else {token id (a JSON string): {"logprob", "rank", "decoded_token"}} with the prompt token first
        (its own rank) and then its k alternatives (ranks 1..k; the prompt token among them keeps its place and
        takes the alternative's rank), as vLLM v1's LogprobsProcessor `_make_logprob_dict` builds it; logprobs
        below -9999 are -9999 (vLLM's `clamp_prompt_logprobs`). `decoded_token` is the token's string after the
        prompt tokens before it (`token_text`), also with `return_tokens_as_token_ids` (which vLLM applies to
        `logprobs` only)."""
        if parsed.params.prompt_logprobs is None or entries is None:
            return None
        prompt = parsed.prompt_ids
        return [None if e is None else {str(t): {"logprob": max(lp, -9999.0), "rank": rank,
                                                 "decoded_token": self.token_text(t, prompt[max(0, j - CONTEXT_TOKENS):j])}
                                        for t, lp, rank in [(e.token_id, e.logprob, e.rank),
                                                            *((i, v, r + 1) for r, (i, v) in enumerate(e.top))]}
                for j, e in enumerate(entries)]


class ChoiceLogprobs:
    """The `logprobs` objects of one choice's chunks, in order. Carries from chunk to chunk what the next
    chunk's strings depend on: the choice's last tokens (the context of `TokenStrings.text`, first the
    prompt's last ones) and, on completions, the text offset of its next token."""

    def __init__(self, formatter: LogprobFormatter, parsed: ParsedRequest, chat: bool) -> None:
        self.formatter, self.parsed, self.chat = formatter, parsed, chat
        self._context = list(parsed.prompt_ids[-CONTEXT_TOKENS:])
        self._text_offset = 0

    def of_chunk(self, ids: list[int], entries: list,
                 prompt_entries: Sequence[TokenLogprob | None] | None) -> dict[str, Any] | None:
        """The `logprobs` object of the choice's next chunk (token ids `ids`, one entry each), or None when
        the request asked for none. prompt_entries: the prompt's logprobs (on the first chunk), else None; they
        come first in completions' object only with `echo` (vLLM's `prompt_logprobs` alone is a field of its
        own: `LogprobFormatter.vllm_prompt`)."""
        parsed = self.parsed
        if parsed.params.logprobs is None:
            return None
        as_ids, context = parsed.return_tokens_as_token_ids, self._context
        if self.chat:
            out = self.formatter.chat(ids, entries, context=context, as_ids=as_ids)
        else:
            if parsed.echo and prompt_entries is not None:  # echo: the prompt's tokens first
                ids, entries, context = [*parsed.prompt_ids, *ids], [*prompt_entries, *entries], []
            out = self.formatter.completion(ids, entries, context=context, text_offset=self._text_offset,
                                            as_ids=as_ids, num_top=parsed.params.logprobs)
            self._text_offset += sum(len(t) for t in out["tokens"])
        self._context = [*context, *ids][-CONTEXT_TOKENS:]
        return out
