"""The feed link of self-fed decode at --stages >= 2: the last stage sends a fed decode item straight
to stage 0 ([Note: self-fed decode] 6 in pipeline/engine/decode_feed.py).

Owns `FeedLink`: when each end switches on, stage 0's two upstreams (the coordinator and the last
stage) merged in arrival order, stage 0's drop rule for fed items of released sequences, the last
stage's rule for when a chain stops, and the link's keepalives and shutdown. Used by the stage loop
(workers/stage_loop.py), which runs what this hands it. Must not: run items or decide what is fed
(pipeline/engine/decode_feed.py decides).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Sequence

from pipeline.engine.wire import Message, MessageKind, rank_name, rank_of_stage
from pipeline.speculation.items import Item
from workers.channel import Channel
from workers.send_queue import SendQueue

MAX_RELEASED = 4096  # stage 0 remembers this many released sequences for the drop rule


class FeedLink:
    """The feed link of self-fed decode at --stages >= 2 ([Note: self-fed decode] 6 in
    pipeline/engine/decode_feed.py): the last stage sends a fed decode item straight to stage 0.

    Both ends switch on at the first authorised item they run (`saw`; stage 0 runs it first, and
    the last stage runs exactly the items stage 0 sent on, so they agree). From then on stage 0
    takes its next message from either sender, in arrival order, through two reader threads and one
    queue (gloo's receive from any rank took ~4 ms a message here, a thread hand-over ~0.1 ms; a
    posted receive does not complete until waited for, so it cannot be polled), drops a fed item of
    a sequence whose RELEASE it applied (`withdraws`: its slot may have a new owner), and at SHUTDOWN
    drains the link up to the last stage's SHUTDOWN on it (no send is left unmatched). The last
    stage feeds only while it took nothing but the chain's own items since the chain's root (`stops`),
    and keeps the link within stage 0's deadline: it copies each KEEPALIVE there and sends one itself
    after a quarter of the deadline without a send (`after`).
    """

    def __init__(self, channel: Channel, stage_index: int, num_stages: int) -> None:
        self.channel = channel
        self.feed_rank = rank_of_stage(num_stages - 1)
        self.first = stage_index == 0 and num_stages > 1
        self.last = stage_index == num_stages - 1 and num_stages > 1
        self.on = False
        self.retired = False  # set with the loop's: the readers end at their next message
        self._inbox: queue.Queue | None = None  # stage 0: (from the link, message or exception)
        self._link_open = True  # stage 0: the last stage's SHUTDOWN on the link not yet taken
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._quiet = False  # last stage: it took nothing but a chain's own items since the chain's root
        self._sent_s = 0.0  # last stage: when it last sent on the link

    def saw(self, items: Sequence[Item]) -> None:
        """Switch the link on at this end once an authorised item (`Item.feed_upto`) ran here."""
        if not self.on and (self.first or self.last) and any(it.feed_upto for it in items):
            self.on = True
            self._sent_s = time.monotonic()

    def recv(self, prev_rank: int) -> Message:
        """The next message for this stage: from `prev_rank`, or, on stage 0 with the link on, from
        the coordinator or the last stage (the link's KEEPALIVEs skipped). Raises ChannelError, and
        ValueError for a message the link may not carry."""
        if not (self.on and self.first):
            msg = self.channel.recv(prev_rank)
            if self.last:
                # an authorised item the coordinator sent (a chain's root) starts a quiet chain; the
                # chain's own fed items keep it; anything else the coordinator sent ends it
                chain = msg.kind == MessageKind.FORWARD and any(it.feed_upto for it in msg.items)
                self._quiet = chain and (self._quiet or not msg.items[0].self_made)
            return msg
        if self._inbox is None:
            self._inbox = queue.Queue()
            for src in (prev_rank, self.feed_rank):
                threading.Thread(target=self._read, args=(src,), name=f"stage-0-reader-{src}", daemon=True).start()
        while True:
            from_link, msg = self._take()
            if not from_link:
                return msg
            if msg.kind == MessageKind.FORWARD:
                return msg

    def stops(self) -> bool:
        """Last stage: whether the coordinator sent something since the chain's root (a message it
        took between the chain's items), so it feeds no more."""
        return not self._quiet

    def after(self, kind: MessageKind | None, sends: SendQueue) -> None:
        """Last stage, link on, after handling a message of `kind` (None: a FORWARD): a KEEPALIVE
        goes on to stage 0 as well, and one is sent after a quarter of the deadline without a send."""
        if self.on and self.last and (kind == MessageKind.KEEPALIVE
                                      or time.monotonic() - self._sent_s > self.channel.timeout_s / 4):
            self.send(Message(MessageKind.KEEPALIVE), sends)

    def send(self, msg: Message, sends: SendQueue) -> None:
        """Last stage: `msg` to stage 0 over the link."""
        self._sent_s = time.monotonic()
        sends.send(msg, rank_of_stage(0))

    def note_releases(self, releases) -> None:
        """Stage 0: remember the sequences a RELEASE it applied freed (the last MAX_RELEASED)."""
        if self.on and self.first:
            for r in releases:
                self._released[r.seq_id] = None
            while len(self._released) > MAX_RELEASED:
                self._released.popitem(last=False)

    def withdraws(self, msg: Message) -> bool:
        """Stage 0: whether `msg` is a fed item (from the link: `self_made`) of a sequence released
        meanwhile, to be withdrawn downstream rather than run. A fed micro-batch holds the items of
        one announcement, of the one sequence authorised (`decode_feed.authorise`: alone)."""
        return (self.on and self.first and bool(msg.items) and msg.items[0].self_made
                and any(it.seq_id in self._released for it in msg.items))

    def shut_down(self, sends: SendQueue) -> None:
        """At SHUTDOWN (after passing it on): the last stage tells stage 0 the link ends; stage 0
        drops what the link still carries up to that."""
        if self.on and self.last:
            self.send(Message(MessageKind.SHUTDOWN), sends)
        elif self.on and self.first and self._inbox is not None:
            while self._link_open:
                self._take()

    def _take(self) -> tuple[bool, Message]:
        """Stage 0: the next (from the link, message) off the queue; raises what a reader met."""
        from_link, msg = self._inbox.get()
        if isinstance(msg, BaseException):
            raise msg
        if from_link:
            if msg.kind == MessageKind.SHUTDOWN:
                self._link_open = False
            elif msg.kind != MessageKind.KEEPALIVE and not (
                    msg.kind == MessageKind.FORWARD and msg.items and all(it.self_made for it in msg.items)):
                raise ValueError(f"[Stage 0] unexpected {msg.kind.name} message from "
                                 f"{rank_name(self.feed_rank)} on the feed link")
        return from_link, msg

    def _read(self, src: int) -> None:
        """Stage 0's reader of `src` (the coordinator or the link): messages into the queue in order,
        until that sender's SHUTDOWN, the loop's retirement, or a channel error (handed on)."""
        from_link = src == self.feed_rank
        while not self.retired:
            try:
                msg = self.channel.recv(src)
            except Exception as exc:  # noqa: BLE001 - handed to the loop, which raises it
                self._inbox.put((from_link, exc))
                return
            self._inbox.put((from_link, msg))
            if msg.kind == MessageKind.SHUTDOWN:
                return
