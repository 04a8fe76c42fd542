"""The n streams of one OpenAI request: choice i of `n` is sequence i, generated independently.

Owns cancelling every choice at once, merging their chunks, in arrival order, for one
server-sent event stream (launcher/serving/http_server.py), and merging their usage.
Must not: format responses or validate requests.
"""

from __future__ import annotations

import asyncio

from launcher.serving.serving_engine import FinalInfo, RequestStream


class ChoiceStreams(list):
    """The n RequestStreams of one request (choice i is element i; see `ParsedRequest.choice_params`)."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id

    def cancel(self) -> None:
        """Abort every choice still running."""
        for stream in self:
            stream.cancel()

    @property
    def final(self) -> FinalInfo | None:
        """The usage of the n choices: the prompt counted once, completion tokens summed (as OpenAI
        reports n > 1); latencies of the slowest choice. None if any choice has none (yet)."""
        finals = [stream.final for stream in self]
        if not finals or any(f is None for f in finals):
            return None
        return FinalInfo(finals[0].finish_reason, finals[0].prompt_tokens, sum(f.completion_tokens for f in finals),
                         max(f.ttft_s for f in finals), max(f.e2e_s for f in finals))


async def merged(streams: ChoiceStreams):
    """(choice index, chunk) of every choice's stream as they arrive; raises what a stream raises."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                left -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
