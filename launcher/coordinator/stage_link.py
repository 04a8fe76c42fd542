"""The coordinator's data-plane link: rank 0's channel to stage 0 and from the last stage.

Owns joining the data plane as rank 0, the warm-up round, and turning the engine's output into
messages (RELEASE, FORWARD), keepalives and the in-band SHUTDOWN. Must not: decide what to send
(pipeline/engine/engine.py does) or receive results (launcher/coordinator/stage_receivers.py does).
"""

from __future__ import annotations

import threading
import time

from launcher.coordinator.request_handle import PipelineError
from pipeline.engine.events import StepOutput
from pipeline.engine.wire import (
    COORDINATOR_RANK,
    Message,
    MessageKind,
    forward_tensors,
    rank_of_stage,
    world_size,
)
from workers.channel import Channel, DataPlaneGroup, GiveUp, RendezvousAbandoned
from workers.send_queue import SendQueue


class StageLink:
    """Rank 0's end of the ring. `join` first (it blocks until every stage joined)."""

    def __init__(self, *, num_stages: int, master_addr: str, master_port: int, timeout_s: float,
                 max_num_seqs: int, record_timeline: bool) -> None:
        self.num_stages, self.master_addr, self.master_port = num_stages, master_addr, master_port
        self.timeout_s, self.max_num_seqs, self.record_timeline = timeout_s, max_num_seqs, record_timeline
        self.channel: Channel | None = None
        self.sends: SendQueue | None = None
        self.first, self.last = rank_of_stage(0), rank_of_stage(num_stages - 1)
        self.abandoned = GiveUp()  # set by close(): a join still waiting gives up at once
        self._join_lock = threading.Lock()  # [Note: joined or abandoned, never both]
        self.last_send_s = time.monotonic()  # when a message last went to stage 0

    def join(self) -> None:
        """Join the data plane as rank 0 (host of its rendezvous). Raises RuntimeError on timeout,
        RendezvousAbandoned (workers/channel.py) once `close` was called: its store and port go at once
        ([Note: abandoned rendezvous] in workers/channel.py)."""
        group = DataPlaneGroup(master_addr=self.master_addr, master_port=self.master_port, rank=COORDINATOR_RANK,
                               world_size=world_size(self.num_stages), timeout_s=self.timeout_s, device="cpu",
                               abandoned=self.abandoned)
        with self._join_lock:  # [Note: joined or abandoned, never both]
            if not self.abandoned.is_set():
                self.channel = Channel(group, timeout_s=self.timeout_s, label="[coordinator] ",
                                       max_payload_bytes=(1 << 20) * max(64, self.max_num_seqs))
                self.sends = SendQueue(self.channel)  # the engine never blocks on stage 0 ([Note: background sends])
                return
        group.close()  # formed just as the attempt was given up
        why = f": {self.abandoned.reason}" if self.abandoned.reason else ""
        raise RendezvousAbandoned(f"the data plane at port {self.master_port} was abandoned as it formed{why}")

    def abandon_join(self, reason: str) -> None:
        """A stage died (its backend said so, `reason` naming it): a `join` still waiting gives up at once
        and tells the stages waiting there `reason` ([Note: a death during a join] in
        launcher/coordinator/stage_failover.py); a joined link is left to the fail-over that replaces it.

        [Note: joined or abandoned, never both]
        `join` publishes its channel, and `abandon_join` / `close` give the join up, under one lock, each
        looking at the other's mark first: a link that joined is never marked abandoned by `abandon_join`
        (a death reported just after the join is the fail-over's to handle), and a join that forms as it
        is given up closes its group and raises RendezvousAbandoned naming the reason, never publishing
        it. Before, a report that saw no channel yet could set the flag after `join` had looked at it."""
        with self._join_lock:
            if self.channel is None:
                self.abandoned.give_up(reason)

    def close(self, reason: str = "") -> None:
        """Close this ring's data-plane group (after a fail-over replaced it, or its attempt failed):
        its sockets close; a `join` still waiting at its rendezvous ends at once, and its port closes;
        the stages waiting there are told `reason` ("stage 2 (Load) failed: ...")."""
        with self._join_lock:  # [Note: joined or abandoned, never both]: closed below, or the join sees the flag
            self.abandoned.give_up(reason)
            sends, channel = self.sends, self.channel
        if sends is not None:
            sends.abandon()  # nothing may hold the group ([Note: posted sends] in workers/send_queue.py)
        if channel is not None:
            channel.group.close()

    def warm_up(self) -> None:
        """Create every neighbour link in one fixed order: one KEEPALIVE round the ring."""
        self.channel.send(Message(MessageKind.KEEPALIVE), self.first)
        msg = self.channel.recv(self.last)
        if msg.kind != MessageKind.KEEPALIVE:
            raise PipelineError(f"warm-up: expected KEEPALIVE back from the last stage, got {msg.kind.name}")

    def send_step(self, out: StepOutput, *, feeding: bool = False) -> None:
        """Send the engine's releases (one RELEASE), its credits (one CREDIT, consumed by stage 0),
        then each of its micro-batches (FORWARD: the token ids as tensor "x", items without them;
        "prompt_next" for items that want prompt logprobs; a timing list when a timeline is recorded).
        feeding: stage 0 has fed decode items in flight: it then hears a KEEPALIVE when nothing went
        to it for a quarter of the deadline ([Note: self-fed decode] 4 in pipeline/engine/decode_feed.py)."""
        if feeding and not (out.releases or out.credits or out.sends) and (
                time.monotonic() - self.last_send_s > self.timeout_s / 4):
            self.keepalive()
        if out.releases or out.credits or out.sends:
            self.last_send_s = time.monotonic()
        if out.releases:
            self.sends.send(Message(MessageKind.RELEASE, releases=list(out.releases)), self.first)
        if out.credits:
            self.sends.send(Message(MessageKind.CREDIT, list(out.credits)), self.first)
        for batch in out.sends:
            self.sends.send(Message(MessageKind.FORWARD, [it.without_tokens() for it in batch], forward_tensors(batch),
                                    [] if self.record_timeline else None), self.first)

    def keepalive(self) -> None:
        """A KEEPALIVE round the ring, so idle stages hear something within their deadline."""
        self.last_send_s = time.monotonic()
        self.sends.send(Message(MessageKind.KEEPALIVE), self.first)

    def shutdown(self) -> None:
        """The in-band SHUTDOWN, after everything queued. Raises ChannelError if a send fails."""
        self.sends.send(Message(MessageKind.SHUTDOWN), self.first)
        self.sends.flush()
