"""Ordered sends that never block the caller on its receiver: posted gloo sends, or a send thread.

Owns `SendQueue`, the one way the stage loop and the coordinator send on the data plane: per
destination rank, messages leave in the order they were queued, at most `max_queued` wait, and a
failure is re-raised by the next `send` or `flush`. Must not: interpret messages (the stage loop and
the coordinator do) or frame them (workers/channel.py and pipeline/engine/wire.py do).

[Note: background sends]
A gloo send completes only once the receiver has posted the matching receive. A stage that
sends its output inline therefore cannot post its own next receive until its downstream
neighbour is free, and the item waiting upstream (e.g. a draft the coordinator just injected)
sits on the critical path. So no caller waits for its sends: messages to each destination keep
their order (in-band squash relies on that), at most `max_queued` wait per destination
(backpressure, not an unbounded queue), and a send failure is re-raised (as ChannelError) by the
next `send` or `flush`.

[Note: posted sends]
On a CPU channel the caller posts the message to gloo itself (`Channel.post`: frame and payload
handed to gloo, which queues sends per peer in order and writes each once the peer's receive is
posted, at once when the peer already waits) and returns. Handing it to a send thread instead
costs a thread wake-up and a GIL hand-over before the first byte moves: 107 µs median of the 2.15
ms from the last stage's end to stage 0's next start at `--stages 1`, measured on 2 vCPUs
(`tests/benchmarks/channel_rtt.py` and `checkout_ab.py` measure it). Each destination keeps its
last `max_queued` posted sends (work and buffers, at most MAX_KEPT_BYTES of them); the caller waits
for the oldest only to make room (long done, in the steady state) or in `flush`, so no thread waits
on them. A gloo wait cannot be interrupted: aborting the sender's own group does not end it
(measured: it runs to its deadline), so a thread blocked on a send would keep a replaced group and
its ports alive until then. `abandon` drops the kept sends before a fail-over closes the group, and
a failure is kept as text (an exception's frames would hold a work). On a CUDA channel a message's
hidden states travel over NCCL after its gloo header, so there the send thread (`Channel.send`,
waiting for each piece in turn) stays.

[Note: deferred posts]
Posting is not free: framing a message and handing it to gloo takes 0.1-0.5 ms of the caller's
thread (measured on the exit stage: EXIT_GUESS 233 µs median, 519 µs mean; FORWARD 105 / 184 µs).
Where the caller has work that must start at once and the message can leave a little later, it
passes `defer=True`: the message joins the destination's deferred FIFO, which a post thread of that
destination (started on first use) posts, in order, while the caller computes; it is then kept
and waited for like any posted send. Order per destination holds across both ways: a direct send
to a destination whose deferred FIFO is not empty is deferred too, and the post thread takes a
message off the FIFO only after posting it (under the lane's lock). The exit stage defers the
sends of a pass that its own draft follows ([Note: stage-local drafting] in
pipeline/engine/local_draft.py: the draft's wait for those sends is `draft_gap_share`).
"""

from __future__ import annotations

import collections
import threading

from pipeline.engine.wire import Message, rank_name
from workers.channel import Channel, ChannelError

# Posted mode keeps a sent message's buffers until it waits for it; past this many bytes kept per
# destination it waits before posting more (a prefill's prompt logits can be hundreds of MB).
MAX_KEPT_BYTES = 64 << 20


class SendQueue:
    """Ordered, non-blocking sends over `channel`, per destination rank ([Note: background sends]).

    posted: post CPU messages straight to gloo ([Note: posted sends]); default: whenever the
    channel's device is the CPU. Otherwise one send thread and FIFO per destination.
    """

    def __init__(self, channel: Channel, *, max_queued: int = 8, posted: bool | None = None) -> None:
        self.channel = channel
        self.max_queued = max_queued
        self.posted = channel.device.type == "cpu" if posted is None else posted
        self._lanes: dict[int, _Lane] = {}
        self._lanes_lock = threading.Lock()
        # The first failure, as text: a kept exception would hold frames, and through them a work
        # and its group ([Note: posted sends]); each caller gets a fresh ChannelError.
        self._error: str | None = None

    def send(self, msg: Message, dst: int, *, defer: bool = False) -> None:
        """Queue `msg` for rank `dst`. defer: in posted mode, post it from the destination's post
        thread rather than this one ([Note: deferred posts]; ignored in send-thread mode). Raises
        ChannelError if an earlier send failed or `max_queued` messages to `dst` stay unsent for
        the channel's deadline."""
        self._raise_if_failed()
        lane = self._lane(dst)
        with lane.cond:
            if self.posted and (defer or lane.deferred):
                if lane.thread is None:
                    lane.thread = threading.Thread(target=self._post_deferred, args=(lane, dst), daemon=True,
                                                   name=f"post-to-{dst}")
                    lane.thread.start()
                self._enqueue(lane, lane.deferred, msg, dst)
                return
            if self.posted:
                self._post(lane, msg, dst)
                self._raise_if_failed()
                return
            self._enqueue(lane, lane.pending, msg, dst)

    def _enqueue(self, lane: _Lane, fifo: collections.deque, msg: Message, dst: int) -> None:
        """Append `msg` to a lane's `fifo` (for its send or post thread) once it holds fewer than
        `max_queued` (lane.cond held). Raises ChannelError if it stays full for the deadline."""
        if not lane.cond.wait_for(lambda: len(fifo) < self.max_queued or self._error is not None,
                                  timeout=self.channel.timeout_s):
            raise ChannelError(f"{self.channel.label}send queue to {rank_name(dst)} stayed full for "
                               f"{self.channel.timeout_s:g} s (--stage-timeout-s)")
        self._raise_if_failed()
        fifo.append(msg)
        lane.cond.notify_all()

    def _post(self, lane: _Lane, msg: Message, dst: int) -> None:
        """Post `msg` to gloo after the lane's earlier posts (lane.cond held); a failure is kept."""
        while len(lane.pending) >= self.max_queued or (lane.pending and lane.kept_bytes > MAX_KEPT_BYTES):
            self._wait_oldest(lane, dst)
        self._raise_if_failed()  # abandoned meanwhile
        try:
            posted = self.channel.post(msg, dst)  # in order: gloo keeps it per peer
            lane.pending.append(posted)
            lane.kept_bytes += _nbytes(posted)
        except ChannelError as exc:
            self._fail(lane, str(exc))

    def _post_deferred(self, lane: _Lane, dst: int) -> None:
        """Post thread of one destination: posts its deferred messages in order ([Note: deferred posts])."""
        with lane.cond:
            while True:
                lane.cond.wait_for(lambda: lane.deferred or lane.closing)
                if not lane.deferred:
                    return
                try:
                    self._post(lane, lane.deferred[0], dst)
                except ChannelError:
                    pass  # kept in self._error: the caller's next send or flush raises it
                except Exception as exc:  # noqa: BLE001 - e.g. a header too big for its frame: fail, never hang
                    self._fail(lane, f"{self.channel.label}deferred send to {rank_name(dst)} failed: "
                                     f"{type(exc).__name__}: {exc}")
                if lane.deferred:  # abandon() may have cleared it meanwhile
                    lane.deferred.popleft()
                lane.cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued message was sent (at most the channel's deadline per message).
        Raises ChannelError if a send failed."""
        with self._lanes_lock:
            lanes, self._lanes = dict(self._lanes), {}
        for dst, lane in lanes.items():
            with lane.cond:
                while lane.deferred and self._error is None:  # each deferred message gets one deadline
                    left = len(lane.deferred)
                    if not lane.cond.wait_for(lambda: len(lane.deferred) < left or self._error is not None,  # noqa: B023
                                              timeout=self.channel.timeout_s):
                        raise ChannelError(f"{self.channel.label}deferred sends to {rank_name(dst)} were not "
                                           f"posted within {self.channel.timeout_s:g} s (--stage-timeout-s)")
                while self.posted and lane.pending and self._error is None:
                    self._wait_oldest(lane, dst)
                lane.closing = True
                lane.cond.notify_all()
        for lane in lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=self.channel.timeout_s * (self.max_queued + 1))
        self._raise_if_failed()

    def abandon(self) -> None:
        """Drop every unsent message and posted send, and fail later sends (before the group is
        closed in a fail-over: nothing then holds it, [Note: posted sends]). Never waits for a
        sender blocked in a transfer (that one ends at its deadline)."""
        if self._error is None:
            self._error = f"{self.channel.label}send queue abandoned (its data-plane group was replaced)"
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.closing = True
            lane.deferred.clear()
            lane.pending.clear()  # without lane.cond: a posted-mode waiter may hold it for a deadline
            lane.kept_bytes = 0
            if lane.cond.acquire(timeout=1.0):  # wake a send thread waiting for work
                lane.cond.notify_all()
                lane.cond.release()

    def _lane(self, dst: int) -> _Lane:
        with self._lanes_lock:
            lane = self._lanes.get(dst)
            if lane is None:
                lane = self._lanes[dst] = _Lane()
                if not self.posted:
                    lane.thread = threading.Thread(target=self._drain, args=(lane, dst), daemon=True,
                                                   name=f"send-to-{dst}")
                    lane.thread.start()
            return lane

    def _wait_oldest(self, lane: _Lane, dst: int) -> None:
        """Wait for the oldest posted send to `dst` (lane.cond held). Raises ChannelError."""
        oldest = id(lane.pending[0])
        error = _wait_all(self.channel, lane.pending[0], dst)
        if error is not None:
            self._fail(lane, error)
        if lane.pending and id(lane.pending[0]) == oldest:  # abandon() may have dropped it meanwhile
            lane.kept_bytes -= _nbytes(lane.pending.popleft())
        self._raise_if_failed()

    def _drain(self, lane: _Lane, dst: int) -> None:
        """Send each queued message to `dst` in order (the send-thread mode)."""
        while (msg := lane.next()) is not None:
            try:
                self.channel.send(msg, dst)
            except ChannelError as exc:
                with lane.cond:
                    self._fail(lane, str(exc))
                return
            lane.done()

    def _fail(self, lane: _Lane, error: str) -> None:
        """Keep the first failure for the callers; drop what waits (lane.cond held): a dead
        destination never takes it, and a fail-over frees the group only once nothing holds it."""
        if self._error is None:
            self._error = error
        lane.pending.clear()
        lane.kept_bytes = 0
        lane.cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ChannelError(self._error)


def _nbytes(posted: list) -> int:
    """Bytes of one message's posted buffers."""
    return sum(buffer.numel() * buffer.element_size() for _, buffer in posted)


def _wait_all(channel: Channel, posted: list, dst: int) -> str | None:
    """Wait for one message's posted (work, buffer) pairs; the ChannelError's text, or None. A
    function of its own: once it returns, no frame holds the works."""
    try:
        for work, _buffer in posted:
            channel.wait_sent(work, dst)
    except ChannelError as exc:
        return str(exc)
    return None


class _Lane:
    """One destination's FIFO of queued messages (send-thread mode) or posted sends (posted mode,
    with its deferred messages and their post thread)."""

    def __init__(self) -> None:
        self.pending: collections.deque = collections.deque()
        self.deferred: collections.deque = collections.deque()  # posted mode: messages the post thread posts
        self.kept_bytes = 0  # posted mode: bytes of the buffers in `pending`
        self.cond = threading.Condition()
        self.closing = False
        self.thread: threading.Thread | None = None

    def next(self):
        """The oldest message, left in place until `done`; None once closing and empty."""
        with self.cond:
            self.cond.wait_for(lambda: self.pending or self.closing)
            return self.pending[0] if self.pending else None

    def done(self) -> None:
        """The oldest message was sent: drop it and wake a sender waiting for room."""
        with self.cond:
            if self.pending:
                self.pending.popleft()
            self.cond.notify_all()
