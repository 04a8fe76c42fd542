"""Request handles: what `Coordinator.submit` returns, and what a request's caller reads.

Owns one request's committed tokens, their detokenised text (stop strings held back until known
not to be one; `TextOptions`: special tokens shown or skipped, the stop string or EOS kept or not),
timings, and the stream of chunks. Thread-safe hand-off: the coordinator's engine
thread calls `emit` / `finish`, the caller iterates or calls `result`.
Must not: decide what is committed (pipeline/engine/engine.py does).

[Note: streaming after the send]
A commit's text (detokenising, stop-string search, the chunk queue, finishing the request) is not
needed to choose the next micro-batch unless a stop string may end the request there: only then must
the engine learn it before it sends (`emit` returns True and the engine finishes the sequence). So
the coordinator streams the commits of a request without stop strings (`stops_on_text` False) only
after the engine step's sends have left (launcher/coordinator/coordinator.py, `_pump`): on the
per-token ring return the next FORWARD no longer waits for that work. What a client sees does not
change: each request's commits are emitted in the order they were made, all of one request the same
way, with the same text, chunks, finish reason and counters; the engine's timeline and counters
are updated before its commits are emitted either way.
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
from pipeline.speculation.masks.token_masks import bad_word_token_ids, check_leaves_a_token
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
        then match the text as shown. The token that ended the request (EOS, a stop token id) is never shown unless
        `include_stop_str_in_output` (vLLM's v1 detokenizer: a stop-terminated request's last token is not
        decoded); EOS tokens generated under ignore_eos are shown like any other.
    spaces_between_special_tokens: with skip_special_tokens False, False joins two consecutive added tokens
        without the space a decoder may put between them (vLLM's fast detokenizer: the second one's text is its
        bare content). Byte-level BPE and SentencePiece decoders put none, so it changes only a WordPiece-style
        decoder's text.
    include_stop_str_in_output: the matched stop string (or the ending EOS / stop token's text) stays at the end of the text;
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
    INTERNAL), not as an unavailable server; `NoTokenLeftError` (bad input) excepted."""

    NON_FINITE = ("the model's logits are not finite (NaN or inf) at output token {position}: the weights hold "
                  "NaN or inf values, or the activations overflowed the numeric mode (float16 overflows "
                  "easily; try --dtype bfloat16 or float32)")


class NoTokenLeftError(RequestError):
    """One request's own masks (allowed_token_ids, bad_words, min_tokens, its structured output) left no token
    to generate at some output position: bad input found mid-generation ([Note: no token left] in
    pipeline/speculation/verify.py). `fields`: the SamplingParams fields (`GrammarSpec.field`, e.g. "structured_outputs", for the grammar);
    `param`: the first. Servers answer it as bad input: HTTP 400 (non-streamed) or an in-stream error event
    with code 400 and `param`, gRPC INVALID_ARGUMENT naming the field; the pipeline stays up."""

    def __init__(self, message: str, fields: tuple[str, ...]) -> None:
        super().__init__(message)
        self.fields, self.param = fields, fields[0]


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], params: SamplingParams, *,
                  max_model_len: int) -> tuple[str, list[int], SamplingParams]:
    """(text, token ids, params) of a request's prompt, given as text or token ids; params with the token
    sequences of its `bad_words` (`bad_word_ids`, [Note: token masks] in pipeline/speculation/masks/token_masks.py).
    Raises ValueError for an empty prompt, a token id outside the vocabulary, or prompt + max new tokens >
    max_model_len; SamplingParamError (a ValueError) from `tokenized_masks`; ValueError for a grammar (structured
    output) when llguidance cannot read this tokenizer."""
    if isinstance(prompt, str):
        tokenizer.check_fits(prompt, max_model_len)
        text, ids = prompt, tokenizer.encode(prompt) if prompt else []
    else:
        ids = [int(t) for t in prompt]
        text = tokenizer.decode(ids)
    for t in ids:
        if not 0 <= t < tokenizer.vocab_size:
            raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {tokenizer.vocab_size})")
    params = tokenized_masks(tokenizer, params)
    if params.grammar is not None:  # the engine's llguidance tokenizer and the grammar's matcher, built here on the
        GrammarVocab.of(tokenizer).matcher(params.grammar)  # caller's thread (~0.3 s each at most), not the engine's
    check_prompt_length(num_prompt_tokens=len(ids), max_new_tokens=params.max_new_tokens, max_model_len=max_model_len)
    return text, ids, params


def tokenized_masks(tokenizer: Tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` with the token sequences of its `bad_words` (`bad_word_ids`), checked against this tokenizer:
    SamplingParamError (naming the field) for a `logit_bias`, stop, allowed or bad-word token id outside the
    vocabulary, or allowed ids the other masks all ban (`check_leaves_a_token`). The coordinator's and, before
    anything is spawned, `launch`'s check."""
    if params.bad_words:
        words = bad_word_token_ids(params.bad_words, lambda w: tokenizer.encode(w, add_special_tokens=False))
        params = dataclasses.replace(params, bad_word_ids=words)
    params.check_vocab(tokenizer.vocab_size)
    check_leaves_a_token(params, tokenizer.eos_token_ids)
    return params


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
    stop string or stop token id that ended the request (on the last chunk; None otherwise, and after EOS
    or length, as vLLM's `stop_reason`)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: str | int | None = None


class RequestHandle:
    """A submitted request: iterate it for StreamChunks, or call `result()`."""

    def __init__(self, request_id: str, prompt: str, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer, text_options: TextOptions = TextOptions()) -> None:
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.detok, self.text_options = detok, text_options
        self.token_ids: list[int] = []
        self.text = ""
        self._held = ""  # decoded text not streamed yet: it may be the start of a stop string
        self._floor = 0  # characters of _held + new text that no stop string may end in (min_tokens)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if one did
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
    @property
    def stops_on_text(self) -> bool:
        """Whether a stop string may end this request: `emit` can then return True, so its commits are
        streamed before the engine sends more ([Note: streaming after the send])."""
        return bool(self.params.stop)

    def emit(self, commit: Commit) -> bool:
        """Record newly committed tokens and stream their text; returns True if one of the
        request's stop strings ended it (the coordinator then finishes the sequence). The EOS or stop token
        id that ended it is kept in the tokens, not in the text (unless include_stop_str_in_output); a stop
        token id is the `stop_reason` (vLLM's)."""
        if commit.finish_reason is FinishReason.ERROR:  # after the tokens committed before the failing row
            if commit.token_ids and self.emit(dataclasses.replace(commit, finish_reason=None)):
                return True  # a stop string among them ended the request first
            error = (NoTokenLeftError(commit.error or "", commit.error_fields) if commit.error_fields else
                     RequestError(commit.error or RequestError.NON_FINITE.format(position=len(self.token_ids))))
            self.finish("error", error)
            return False
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        commit, delta = self._decode(commit)
        self.token_ids.extend(commit.token_ids)
        if commit.finish_reason is not None:
            delta += self.detok.flush()
        pending, hit = self._end_at_stop(delta, commit)
        delta = self._release(pending, final=hit or commit.finish_reason is not None)
        self.text += delta
        reason = "stop" if hit else (commit.finish_reason.value if commit.finish_reason else None)
        self._chunks.put(StreamChunk(commit.token_ids, delta, reason, commit.logprobs, commit.prompt_logprobs,
                                     self.stop_reason))
        if reason is not None:
            self.finish(reason)
        return hit

    def _decode(self, commit: Commit) -> tuple[Commit, str]:
        """(the commit's tokens that are the request's, their new text). The EOS or stop token id that ends the
        request is not decoded unless include_stop_str_in_output (vLLM's v1 detokenizer leaves a stop-terminated
        request's last token out). With stop strings, tokens are decoded one by one: `_floor` moves past the
        first min_tokens tokens' text, and a stop string that ends at a token drops the tokens after it (one
        commit of several, a FIRP chain's or a jump-forward run's), as in token-by-token decoding."""
        ids, include = commit.token_ids, self.text_options.include_stop_str_in_output
        ended = commit.finish_reason in (FinishReason.EOS, FinishReason.STOP) and not include
        shown = ids[:-1] if ended else ids
        if not self.params.stop:
            return commit, self.detok.add_many(shown)
        delta = ""
        for k, token in enumerate(shown, 1):
            delta += self.detok.add(token)
            if len(self.token_ids) + k <= self.params.min_tokens:
                self._floor = len(self._held + delta)  # [Note: token masks]: no stop string ends before here
            if k < len(ids) and self._first_stop(delta) is not None:
                return dataclasses.replace(commit, token_ids=ids[:k], finish_reason=None,
                                           logprobs=commit.logprobs and commit.logprobs[:k]), delta
        return commit, delta

    def _end_at_stop(self, delta: str, commit: Commit) -> tuple[str, bool]:
        """(the held and new text up to the request's end, whether a stop string ended it), and `stop_reason`.
        The match that is complete first ends it (the first listed where two end together), cut at its start
        (its end with include_stop_str_in_output): what token-by-token decoding finds, however many tokens
        one commit brings. Otherwise a stop token id that ended the request is its stop_reason."""
        pending = self._held + delta
        if self.params.stop and (found := self._first_stop(delta)) is not None:
            end, which, start = found
            self.stop_reason = self.params.stop[which]
            return pending[:max(0, end if self.text_options.include_stop_str_in_output else start)], True
        if commit.finish_reason is FinishReason.STOP and commit.token_ids:
            self.stop_reason = commit.token_ids[-1]  # a stop token id (vLLM's stop_reason)
        return pending, False

    def _release(self, pending: str, *, final: bool) -> str:
        """The part of `pending` (held and new text) to stream now. Text that could be the start of a stop
        string is held back until it is known not to be one (as vLLM does), so no chunk ever streams part of
        a stop string; with include_stop_str_in_output nothing is held back (the stop string is streamed
        anyway) and a match may start in streamed text (`_stop_window`). `_floor` moves with the held text."""
        stop = self.params.stop
        keep = 0 if self.text_options.include_stop_str_in_output else max((len(s) for s in stop), default=1) - 1
        split = len(pending) if final or keep == 0 else max(0, len(pending) - keep)
        delta, self._held = pending[:split], pending[split:]
        self._floor = max(0, self._floor - len(delta))
        return delta

    def _first_stop(self, delta: str) -> tuple[int, int, int] | None:
        """(end, index in `stop`, start) of the stop string match that ends first in the held text + `delta`,
        counted from their start; None when there is none. A match counts only where it ends after their first
        `_floor` characters (the first min_tokens tokens' text: vLLM's detokenizer, vllm-project/vllm#22014)
        and, with include_stop_str_in_output, after the streamed text it may start in (`_stop_window`; its
        `start` is then negative): that text was searched when it was new."""
        window = self._stop_window(delta)
        floor = (back := len(window) - len(self._held) - len(delta)) + self._floor  # back: streamed text in window
        found = [(i + len(s) - back, n, i - back) for n, s in enumerate(self.params.stop)
                 if (i := window.find(s, max(0, floor - len(s) + 1))) >= 0]
        return min(found, default=None)

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
