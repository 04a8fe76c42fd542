"""The data-plane loop of one stage worker: receive, run, forward, in order.

Owns the order in which a stage handles messages from its upstream neighbour: every FORWARD
message yields exactly one message downstream (possibly with no items, if all were stale), so the
coordinator's in-flight accounting is a plain count; control messages are applied and passed on
in order with the work (see [Note: in-band squash] in pipeline/engine/stage_executor.py). On stage 0
as the exit stage, a draft it makes itself runs right after its parent, as a micro-batch of its own
(its RESULT answers its announcement, not a coordinator send), and once the coordinator grants
such drafts, CREDITs are read on a reader thread so that a chain of them sees each credit at once,
and a self-made draft is stopped between two layers, and WITHDRAWN to the coordinator instead of
sent on, once a newer epoch (or a release) of every sequence in it has arrived ([Note: stage-local drafting] 6 in
pipeline/engine/local_draft.py). A last stage that is stage 0 feeds an authorised greedy decode
item itself in the same way: run next, announced in its parent's RESULT, withdrawn on a RELEASE;
never while a message waits in its inbox. A last stage that is not stage 0 sends that item straight
to stage 0 over the feed link instead (`FeedLink` in workers/feed_link.py: stage 0 then receives from the coordinator and
the last stage alike, in arrival order, and withdraws a fed item of a released sequence downstream)
([Note: self-fed decode] in pipeline/engine/decode_feed.py).
Must not: decide what runs (the coordinator does, or grants it) or talk gRPC.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

from pipeline.engine import decode_feed
from pipeline.engine.local_draft import StageDrafter
from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import (
    COORDINATOR_RANK,
    PROMPT_LOGPROB_TENSORS,
    Message,
    MessageKind,
    forward_tensors,
    rank_of_stage,
)
from pipeline.measure.timeline import StageTiming
from pipeline.model.row_layout import PassInterrupted
from pipeline.speculation.items import Item
from workers.channel import Channel
from workers.feed_link import FeedLink
from workers.send_queue import SendQueue

log = logging.getLogger(__name__)
RELEASED = 1 << 62  # `StageLoop._newest` of a released sequence: newer than any epoch


class StageLoop:
    """Runs until a SHUTDOWN message passes through, or a channel error (re-raised)."""

    def __init__(self, *, executor: StageExecutor, channel: Channel, stage_index: int, num_stages: int) -> None:
        self.executor = executor
        self.channel = channel
        self.stage_index = stage_index
        self.is_last = stage_index == num_stages - 1
        self.prev_rank = COORDINATOR_RANK if stage_index == 0 else rank_of_stage(stage_index - 1)
        self.next_rank = COORDINATOR_RANK if self.is_last else rank_of_stage(stage_index + 1)
        self.messages_received = 0
        self.stopped = threading.Event()
        self._retired = False  # set by Rejoin (`retired`): this loop's group is abandoned
        self.sends = SendQueue(channel)  # see [Note: background sends] in workers/send_queue.py
        self.drafter = StageDrafter() if stage_index == 0 and executor.exit_layer is not None else None
        self._inbox: queue.Queue | None = None  # the reader thread's messages (stage 0 with a drafter)
        self._newest: dict[int, int] = {}  # seq -> newest epoch the reader thread has received (released: RELEASED)
        self.link = FeedLink(channel, stage_index, num_stages)  # self-fed decode at --stages >= 2

    @property
    def retired(self) -> bool:
        """Set by Rejoin: this loop's group is abandoned; it (and the feed link's readers) stop at
        their next message."""
        return self._retired

    @retired.setter
    def retired(self, value: bool) -> None:
        self._retired = self.link.retired = value

    def run(self) -> None:
        """Handle messages until SHUTDOWN. Raises ChannelError / ValueError on failure."""
        try:
            while True:
                msg = self._recv()
                if self.retired:
                    return
                self.messages_received += 1
                if msg.kind == MessageKind.FORWARD:
                    self._run_forward(msg)
                    self.link.after(None, self.sends)
                    continue
                if msg.kind == MessageKind.CREDIT and self.drafter is not None:  # before the reader started
                    self.drafter.credit(msg.items)
                    continue
                if msg.kind == MessageKind.RELEASE:
                    self.executor.release([r.seq_id for r in msg.releases], [r.slot for r in msg.releases])
                    self.link.note_releases(msg.releases)
                    if self.drafter is not None:
                        self.drafter.release([r.seq_id for r in msg.releases])
                    for r in msg.releases:  # nothing of a released sequence follows its RELEASE
                        self._newest.pop(r.seq_id, None)
                elif msg.kind == MessageKind.WITHDRAWN and self.stage_index > 0:
                    pass  # a fed item stage 0 withdrew, on to the coordinator ([Note: self-fed decode] 6)
                elif msg.kind not in (MessageKind.KEEPALIVE, MessageKind.SHUTDOWN):
                    raise ValueError(f"[Stage {self.stage_index}] unexpected {msg.kind.name} message from upstream")
                self.sends.send(msg, self.next_rank)
                if msg.kind != MessageKind.SHUTDOWN:
                    self.link.after(msg.kind, self.sends)
                if msg.kind == MessageKind.KEEPALIVE and self.executor.exit_layer is not None and not self.is_last:
                    # the coordinator's receiver of exit events waits with the deadline too: an idle
                    # pipeline keeps that connection alive as well ([Note: deadlines] in workers/channel.py)
                    self.sends.send(Message(MessageKind.KEEPALIVE), COORDINATOR_RANK)
                if msg.kind == MessageKind.SHUTDOWN:
                    if self.executor.exit_layer is not None and not self.is_last:
                        # the coordinator's receiver of exit events ends on it too (no thread is
                        # left blocked in a receive when the process group goes away)
                        self.sends.send(Message(MessageKind.SHUTDOWN), COORDINATOR_RANK)
                    self.link.shut_down(self.sends)
                    self.sends.flush()
                    log.info("[Stage %d] data plane shut down", self.stage_index)
                    return
        finally:
            self.stopped.set()

    def _recv(self) -> Message:
        """The next message from upstream (via the reader thread on stage 0 with a drafter; from the
        coordinator or the feed link on stage 0 of several, once fed: `FeedLink.recv`)."""
        if self._inbox is None:
            return self.link.recv(self.prev_rank)
        msg = self._inbox.get()
        if isinstance(msg, BaseException):
            raise msg
        return msg

    def _read(self) -> None:
        """Reader thread: CREDITs go to the drafter at once, everything else to the inbox in order."""
        while True:
            try:
                msg = self.channel.recv(self.prev_rank)
                if msg.kind == MessageKind.CREDIT and self.drafter is not None:
                    self.drafter.credit(msg.items)
                    continue
                self._note_newest(msg)
            except Exception as exc:  # noqa: BLE001 - handed to the loop, which raises it
                self._inbox.put(exc)
                return
            self._inbox.put(msg)
            if msg.kind == MessageKind.SHUTDOWN or self.retired:
                return

    def _note_newest(self, msg: Message) -> None:
        """Record the newest epoch (or the release) of each sequence `msg` names, as it arrives."""
        for it in msg.items if msg.kind == MessageKind.FORWARD else ():
            self._newest[it.seq_id] = max(it.epoch, self._newest.get(it.seq_id, -1))
        for release in msg.releases if msg.kind == MessageKind.RELEASE else ():
            self._newest[release.seq_id] = RELEASED

    def _run_forward(self, msg: Message) -> None:
        """Run a FORWARD, then each draft this stage made after it, each alone and at once; a draft
        whose sequences all have a newer epoch upstream stops and is withdrawn."""
        interrupt = None
        if self.link.withdraws(msg):  # stage 0 of several: a fed item of a released sequence
            self.sends.send(Message(MessageKind.WITHDRAWN, list(msg.items), {}, msg.timing), self.next_rank)
            return
        while msg is not None:
            out, drafts = self._forward(msg, interrupt)
            # a draft follows: it starts now, its parent's output is posted meanwhile ([Note: deferred posts])
            self.sends.send(out, COORDINATOR_RANK if out.kind == MessageKind.WITHDRAWN else self.next_rank,
                            defer=bool(drafts))
            msg = None
            if drafts:
                x = torch.tensor([t for it in drafts for t in it.token_ids], dtype=torch.int64)
                msg = Message(MessageKind.FORWARD, [it.without_tokens() for it in drafts], {"x": x},
                              None if out.timing is None else [])
                interrupt = functools.partial(self._superseded, drafts)

    def _superseded(self, drafts: Sequence[Item]) -> bool:
        """Whether every sequence of `drafts` has a newer epoch (or a release) on its way here: the
        coordinator squashed after them, so their results would be stale."""
        return all(self._newest.get(it.seq_id, -1) > it.epoch for it in drafts)

    def _forward(self, msg: Message, interrupt=None) -> tuple[Message, list[Item]]:
        """Run one micro-batch; returns the message for downstream and the drafts this stage made
        (stage-local drafting). On the exit stage, first tell the coordinator which items passed the
        exit layer (EXIT_GUESS, with the exit head's guesses and the drafts made) so it can inject
        or register drafts at once. If the message carries a timing list (the coordinator records a
        timeline), each stage appends the StageTiming of its compute (CLOCK_MONOTONIC). When
        `interrupt()` stops the pass, returns the WITHDRAWN message for the coordinator instead."""
        x = msg.tensors.get("x")
        if x is None:
            raise ValueError(f"[Stage {self.stage_index}] FORWARD message without tensor 'x'")
        start_ns = time.perf_counter_ns()
        try:
            out = self.executor.run(msg.items, x, msg.tensors.get("pseudo"), interrupt=interrupt,
                                    prompt_next=msg.tensors.get("prompt_next"))
        except PassInterrupted:
            out = None
        timing = msg.timing
        if timing is not None:
            timing = [*timing, StageTiming(self.stage_index, start_ns, time.perf_counter_ns())]
        if out is None:
            return Message(MessageKind.WITHDRAWN, list(msg.items), {}, timing), []
        drafts = []
        if self.drafter is not None:
            self.drafter.observe(msg.items, x, out.items)
            if any(it.draft_upto for it in out.items):
                self._start_reader()  # the coordinator drafts here: credits must reach a chain of drafts
        self.link.saw(out.items)
        if self.executor.exit_layer is not None and any(it.may_precede_draft for it in out.items):
            guesses = {}
            if out.exit_tokens is not None:
                guesses = {"exit_tokens": out.exit_tokens, "exit_probs": out.exit_probs}
            if self.drafter is not None:
                drafts, tokens, keys = self.drafter.drafts(out.items, out.exit_tokens, out.exit_probs)
                if drafts:
                    guesses["self_drafts"] = torch.tensor(tokens, dtype=torch.int64)
                    guesses["self_draft_keys"] = torch.tensor(keys, dtype=torch.int64)
            self.sends.send(Message(MessageKind.EXIT_GUESS, out.items, guesses, timing and timing[-1:]),
                            COORDINATOR_RANK, defer=bool(drafts))  # [Note: deferred posts] in workers/send_queue.py
        if not self.is_last:
            hidden = out.hidden if out.hidden is not None else torch.empty(0)
            tensors = {"x": hidden}
            if out.pseudo is not None:
                tensors["pseudo"] = out.pseudo
            if out.prompt_next is not None:
                tensors["prompt_next"] = out.prompt_next
            return Message(MessageKind.FORWARD, out.items, tensors, timing), drafts
        tensors = {"token_ids": out.token_ids if out.token_ids is not None else torch.empty(0, dtype=torch.int64)}
        if out.logits is not None:
            tensors["logits"] = out.logits
        if out.prompt_logprobs is not None:
            tensors.update(zip(PROMPT_LOGPROB_TENSORS, out.prompt_logprobs, strict=True))
        if out.firp_tokens is not None:
            tensors["firp_tokens"], tensors["firp_probs"] = out.firp_tokens, out.firp_probs
        fed = self._feed(out, tensors, timing)
        return Message(MessageKind.RESULT, out.items, tensors, timing), drafts + fed

    def _feed(self, out, tensors: dict[str, torch.Tensor], timing) -> list[Item]:
        """The decode items this last stage feeds after `out`'s items (none while a message waits),
        announced as the RESULT tensor "fed" ([Note: self-fed decode] in pipeline/engine/decode_feed.py).
        As stage 0 it runs them next (returned); otherwise it sends them to stage 0 over the feed
        link at once, before its RESULT leaves (returns [])."""
        if not any(it.feed_upto for it in out.items):
            return []
        if self.stage_index == 0:
            self._start_reader()  # a RELEASE must reach a running fed item, and the inbox be seen
            if not self._inbox.empty():
                return []
        elif self.link.stops():
            return []
        fed, flags = decode_feed.fed_items(out.items, out.token_ids)
        if not fed:
            return []
        tensors["fed"] = torch.tensor(flags, dtype=torch.int64)
        if self.stage_index == 0:
            return fed
        self.link.send(Message(MessageKind.FORWARD, [it.without_tokens() for it in fed], forward_tensors(fed),
                               None if timing is None else []), self.sends)
        return []

    def _start_reader(self) -> None:
        """From now on a reader thread receives from upstream (once): CREDITs at once, the rest
        into the inbox, each sequence's newest epoch noted as it arrives (`_superseded`)."""
        if self._inbox is None:
            self._inbox = queue.Queue()
            threading.Thread(target=self._read, name=f"stage-{self.stage_index}-reader", daemon=True).start()
