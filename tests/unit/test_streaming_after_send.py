"""The coordinator streams a commit after the engine step's sends unless a stop string may end it there.

[Note: streaming after the send] in launcher/coordinator/request_handle.py. What breaks when these
fail: the next FORWARD waits for detokenising and streaming on every token's ring return (the first
test), or a request with stop strings is sent one more item after its stop string ended it, and the
engine no longer finishes it before it sends (the second), or clients see other chunks, text or
finish reasons than a handle fed the same commits directly (the reference: `RequestHandle.emit`).
"""

from __future__ import annotations

import queue
import threading
import types

import pytest

from launcher.coordinator.coordinator import Coordinator
from launcher.coordinator.request_handle import RequestHandle, TextOptions
from pipeline.engine.events import StepOutput
from pipeline.engine.records import Commit, FinishReason
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from tests.tiny_model import write_tiny_model

TOKENS = (40, 41, 42, 43, 44)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_tiny_model(tmp_path_factory.mktemp("stream")))


class _Engine:
    """Makes one scripted commit per result event and tells its commit sink, as `Engine.step` does."""

    num_inflight = num_fed = 0

    def __init__(self, commits: list[Commit]) -> None:
        self.commits, self.commit_sink, self.stopped_at = list(commits), None, None

    def step(self, events, now_ns: int = 0) -> StepOutput:
        if not events or not self.commits:
            return StepOutput()
        commit = self.commits.pop(0)
        if self.commit_sink(commit):  # the engine finishes the sequence: nothing more is sent for it
            self.stopped_at, self.commits = commit, []
            return StepOutput(commits=[commit])
        return StepOutput(sends=[("next item",)], commits=[commit])


class _Link:
    """Records, at each send, the tokens the request's handle had streamed by then."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle, self.streamed_at_send = handle, []

    def send_step(self, out: StepOutput, *, feeding: bool = False) -> None:
        if out.sends:
            self.streamed_at_send.append(len(self.handle.token_ids))


def _pump(tokenizer: Tokenizer, params: SamplingParams, commits: list[Commit]) -> tuple[RequestHandle, _Engine, _Link]:
    """Run the coordinator's engine loop over one result event per commit (then a stop)."""
    handle = _handle(tokenizer, params)
    c = Coordinator.__new__(Coordinator)  # only the engine loop's state is used
    c.events, c.generation, c._stopping = queue.SimpleQueue(), 0, threading.Event()
    c.config = types.SimpleNamespace(keepalive_s=5.0)
    c.handles, c._after_send = {0: handle}, []
    c.engine, c.link = _Engine(commits), _Link(handle)
    c.engine.commit_sink = c._emit
    for _ in commits:
        c.events.put(("event", (0, "result")))
    c.events.put(("stop", None))
    c._pump()
    return handle, c.engine, c.link


def _handle(tokenizer: Tokenizer, params: SamplingParams) -> RequestHandle:
    text = TextOptions()
    return RequestHandle("r", "p", [1], params, text.detokenizer(tokenizer, [1]), text)


def _commits(last: FinishReason) -> list[Commit]:
    return [Commit(0, (t,), last if i == len(TOKENS) - 1 else None) for i, t in enumerate(TOKENS)]


def _chunks(handle: RequestHandle) -> list:
    return list(handle)


def _reference(tokenizer: Tokenizer, params: SamplingParams, commits: list[Commit]) -> tuple[list, RequestHandle, Commit | None]:
    """The same commits emitted straight into a handle, stopping where a stop string ended it."""
    handle, stopped = _handle(tokenizer, params), None
    for commit in commits:
        if handle.emit(commit):
            stopped = commit
            break
    return _chunks(handle), handle, stopped


def test_a_request_without_stop_strings_is_streamed_after_the_next_item_was_sent(tokenizer):
    params = SamplingParams(max_new_tokens=len(TOKENS))
    commits = _commits(FinishReason.LENGTH)
    handle, engine, link = _pump(tokenizer, params, commits)
    # at each send, the commit of that step had not been streamed yet
    assert link.streamed_at_send == list(range(len(TOKENS)))
    chunks, ref, _ = _reference(tokenizer, params, commits)
    assert _chunks(handle) == chunks
    assert (handle.text, handle.token_ids, handle.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)


def test_a_request_with_stop_strings_is_streamed_before_the_send_and_its_stop_string_ends_it_first(tokenizer):
    stop = tokenizer.decode([TOKENS[2]])
    assert stop, "the tiny tokenizer gives the token no text: pick another"
    params = SamplingParams(max_new_tokens=len(TOKENS), stop=(stop,))
    commits = _commits(FinishReason.LENGTH)
    chunks, ref, ref_stopped = _reference(tokenizer, params, commits)
    assert ref_stopped is not None, "the reference handle did not stop on the stop string"
    handle, engine, link = _pump(tokenizer, params, commits)
    assert engine.stopped_at == ref_stopped  # the engine learnt of the stop string in the same step
    assert link.streamed_at_send == list(range(1, commits.index(ref_stopped) + 1))  # streamed, then sent
    assert _chunks(handle) == chunks
    assert (handle.text, handle.token_ids, handle.finish_reason, handle.stop_reason) == (
        ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)
