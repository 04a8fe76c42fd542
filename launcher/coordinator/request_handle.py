"""Request handles: what `Coordinator.submit` returns, and what a request's caller reads.

Owns one request's committed tokens, their detokenised text (stop strings held back until known
not to be one; `TextOptions`: special tokens shown or skipped, the stop string or EOS kept or not),
timings, and the stream of chunks. Thread-safe hand-off: the coordinator's engine
thread calls `emit` / `finish`, the caller iterates or calls `result`.
Must not: decide what is committed (pipeline/engine/engine.py does).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence

from pipeline.engine.records import Commit, FinishReason
from pipeline.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pipeline.run_config import check_prompt_length
from pipeline.speculation.grammar import GrammarVocab
from pipeline.speculation.logprobs import TokenLogprob
from pipeline.speculation.sampling import SamplingParams


class PipelineError(RuntimeError):
    """The pipeline failed (a stage died, timed out or refused to load); every request fails."""


class StageLoadError(PipelineError):
    """A stage refused or failed to load the model; the message names the stage once ("stage 1 failed
    to load: ..."). `user_input`: the stage named a problem with the user's input (its Load answered
    INVALID_ARGUMENT: a model file, a setting), which `launch` answers with exit 2; otherwise (an
    unexpected exception in the stage, a Load the worker was not started for, a rendezvous that
    failed) exit 1."""

    def __init__(self, message: str, *, user_input: bool) -> None:
        super().__init__(message)
        self.user_input = user_input


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextOptions:
    """How a request's tokens become its text: vLLM's SamplingParams fields of these names.

    skip_special_tokens: special tokens' text is left out (the default); False shows it, and stop strings
        then match the text as shown. The token that ended the request (EOS) is never shown unless
        `include_stop_str_in_output` (vLLM's v1 detokenizer: a stop-terminated request's last token is not
        decoded); EOS tokens generated under ignore_eos are shown like any other.
    spaces_between_special_tokens: with skip_special_tokens False, False joins two consecutive added tokens
        without the space a decoder may put between them (vLLM's fast detokenizer: the second one's text is its
        bare content). Byte-level BPE and SentencePiece decoders put none, so it changes only a WordPiece-style
        decoder's text.
    include_stop_str_in_output: the matched stop string (and the EOS token's text) stays at the end of the text;
        nothing after it does. Raises ValueError for a value that is not a bool.
    """

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"{field.name} must be true or false, got {getattr(self, field.name)!r}")

    def detokenizer(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        """The incremental detokenizer of one sequence with these options, primed with its prompt."""
        return tokenizer.detokenizer(prompt_ids=prompt_ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)


class RequestError(PipelineError):
    """One request failed while the pipeline stays up: its logits were not finite ([Note: non-finite
    logits] in pipeline/engine/records.py), or its structured output cannot go on (`Commit.error`). A PipelineError, so every caller that handles a failed
    pipeline handles it; servers answer it as an internal error of that request (HTTP 500, gRPC
    INTERNAL), not as an unavailable server."""

    NON_FINITE = ("the model's logits are not finite (NaN or inf) at output token {position}: the weights hold "
                  "NaN or inf values, or the activations overflowed the numeric mode (float16 overflows "
                  "easily; try --dtype bfloat16 or float32)")


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], params: SamplingParams, *,
                  max_model_len: int) -> tuple[str, list[int]]:
    """(text, token ids) of a request's prompt, given as text or token ids. Raises ValueError for
    an empty prompt, a token id outside the vocabulary, or prompt + max new tokens > max_model_len;
    SamplingParamError (a ValueError) for a `logit_bias` token id outside the vocabulary; ValueError for
    a grammar (structured output) when llguidance cannot read this tokenizer."""
    if isinstance(prompt, str):
        tokenizer.check_fits(prompt, max_model_len)
        text, ids = prompt, tokenizer.encode(prompt) if prompt else []
    else:
        ids = [int(t) for t in prompt]
        text = tokenizer.decode(ids)
    for t in ids:
        if not 0 <= t < tokenizer.vocab_size:
            raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {tokenizer.vocab_size})")
    params.check_vocab(tokenizer.vocab_size)
    if params.grammar is not None:  # the engine's llguidance tokenizer and the grammar's matcher, built here on the
        GrammarVocab.of(tokenizer).matcher(params.grammar)  # caller's thread (~0.3 s each at most), not the engine's
    check_prompt_length(num_prompt_tokens=len(ids), max_new_tokens=params.max_new_tokens, max_model_len=max_model_len)
    return text, ids


@dataclasses.dataclass
class RequestOutput:
    """Final state of one request."""

    request_id: str
    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    e2e_s: float


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """Newly committed tokens of one request and their text; `finish_reason` set on the last chunk.
    logprobs / prompt_logprobs: as `Commit`'s (None unless the request asked). `stop_reason`: the
    stop string that ended the request (on the last chunk; None otherwise, and after EOS or length,
    as vLLM's `stop_reason`)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: str | None = None


class RequestHandle:
    """A submitted request: iterate it for StreamChunks, or call `result()`."""

    def __init__(self, request_id: str, prompt: str, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer, text_options: TextOptions = TextOptions()) -> None:
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.detok, self.text_options = detok, text_options
        self.token_ids: list[int] = []
        self.text = ""
        self._held = ""  # decoded text not streamed yet: it may be the start of a stop string
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # the stop string that ended it, if one did
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._chunks: queue.Queue[StreamChunk | BaseException] = queue.Queue()
        self._done = threading.Event()

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            chunk = self._chunks.get()
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
            if chunk.finish_reason is not None:
                return

    def result(self, timeout_s: float | None = None, *, raise_request_error: bool = True) -> RequestOutput:
        """Block until finished. Raises PipelineError if the pipeline failed, TimeoutError on timeout,
        and RequestError if this request alone failed, unless `raise_request_error` is False (then the
        output so far, finish reason "error", for the caller to report beside the others)."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout_s} s")
        if self.error is not None and (raise_request_error or not isinstance(self.error, RequestError)):
            raise self.error
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, list(self.token_ids), self.text,
                             self.finish_reason or "", (self.first_token_at or self.finished_at) - self.submitted_at,
                             self.finished_at - self.submitted_at)

    # -- the coordinator's side (its engine thread) ---------------------------------------------------
    def emit(self, commit: Commit) -> bool:
        """Record newly committed tokens and stream their text; returns True if one of the
        request's stop strings ended it (the coordinator then finishes the sequence)."""
        if commit.finish_reason is FinishReason.ERROR:  # after the tokens committed before the failing row
            if commit.token_ids and self.emit(dataclasses.replace(commit, finish_reason=None)):
                return True  # a stop string among them ended the request first
            self.finish("error", RequestError(commit.error or RequestError.NON_FINITE.format(position=len(self.token_ids))))
            return False
        stop, include = self.params.stop, self.text_options.include_stop_str_in_output
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        shown_ids = commit.token_ids  # the EOS that ends it is not decoded (vLLM), unless include_stop_str_in_output
        if commit.finish_reason is FinishReason.EOS and not include:
            shown_ids = shown_ids[:-1]
        delta = self.detok.add_many(shown_ids) if not stop else ""
        for k, token in enumerate(shown_ids if stop else (), 1):
            delta += self.detok.add(token)
            if k < len(commit.token_ids) and any(s in self._stop_window(delta) for s in stop):
                # A stop string ends at this token: the tokens after it (one commit of several, a FIRP
                # chain's or a jump-forward run's) are not the request's, as in token-by-token decoding.
                commit = dataclasses.replace(commit, token_ids=commit.token_ids[:k], finish_reason=None,
                                             logprobs=commit.logprobs and commit.logprobs[:k])
                break
        self.token_ids.extend(commit.token_ids)
        if commit.finish_reason is not None:
            delta += self.detok.flush()
        # Text that could be the start of a stop string is held back until it is known not to be
        # one (as vLLM does), so no chunk ever streams part of a stop string; with include_stop_str_in_output
        # nothing is held back (the stop string is streamed anyway) and the match may start in streamed text.
        pending, hit = self._held + delta, False
        if stop:
            # The match that is complete first ends it (the first listed where two end together), cut at
            # its start (its end with include_stop_str_in_output): what token-by-token decoding finds,
            # however many tokens one commit brings.
            window = self._stop_window(delta)
            found = [(i + len(s), n, i) for n, s in enumerate(stop) if (i := window.find(s)) >= 0]
            if found:
                end, which, start = min(found)
                back = len(window) - len(pending)  # streamed text at the window's start
                pending, hit, self.stop_reason = pending[:max(0, (end if include else start) - back)], True, stop[which]
        keep = 0 if include else max((len(s) for s in stop), default=1) - 1
        if hit or commit.finish_reason is not None or keep == 0:
            delta, self._held = pending, ""
        else:
            delta, self._held = pending[:max(0, len(pending) - keep)], pending[max(0, len(pending) - keep):]
        self.text += delta
        reason = "stop" if hit else (commit.finish_reason.value if commit.finish_reason else None)
        self._chunks.put(StreamChunk(commit.token_ids, delta, reason, commit.logprobs, commit.prompt_logprobs,
                                     self.stop_reason))
        if reason is not None:
            self.finish(reason)
        return hit

    def _stop_window(self, delta: str) -> str:
        """The text a stop string may end in: the held text and `delta`, and with include_stop_str_in_output
        (nothing held back) the streamed text a stop string may have started in."""
        if not self.text_options.include_stop_str_in_output:
            return self._held + delta
        back = max(len(s) for s in self.params.stop) - 1
        return self.text[max(0, len(self.text) - back):] + self._held + delta

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """End the request: `reason` is a finish reason ("aborted", "error", ...), `error` the
        exception `result()` and iteration raise. A second call is ignored."""
        if self._done.is_set():
            return
        self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()
        if error is not None:
            self._chunks.put(error)
        elif reason == "aborted":  # wake a streaming reader: nothing more will come
            self._chunks.put(StreamChunk((), "", reason))
        self._done.set()
