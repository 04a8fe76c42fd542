"""The data-plane loop of one stage worker: receive, run, forward, in order.

Owns the order in which a stage handles messages from its upstream neighbour: every FORWARD
message yields exactly one message downstream (possibly with no items, if all were stale), so the
coordinator's in-flight accounting is a plain count; control messages are applied and passed on
in order with the work (see [Note: in-band squash] in pipeline/engine/stage_executor.py).
Must not: decide what runs (the coordinator does) or talk gRPC.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import COORDINATOR_RANK, Message, MessageKind, rank_of_stage
from pipeline.measure.timeline import StageTiming
from workers.channel import Channel, SendQueue

log = logging.getLogger(__name__)


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
        self.retired = False  # set by Rejoin: this loop's group is abandoned; stop at the next message
        self.sends = SendQueue(channel)  # see [Note: background sends] in workers/channel.py

    def run(self) -> None:
        """Handle messages until SHUTDOWN. Raises ChannelError / ValueError on failure."""
        try:
            while True:
                msg = self.channel.recv(self.prev_rank)
                if self.retired:
                    return
                self.messages_received += 1
                if msg.kind == MessageKind.FORWARD:
                    self.sends.send(self._forward(msg), self.next_rank)
                    continue
                if msg.kind == MessageKind.RELEASE:
                    self.executor.release([r.seq_id for r in msg.releases], [r.slot for r in msg.releases])
                elif msg.kind not in (MessageKind.KEEPALIVE, MessageKind.SHUTDOWN):
                    raise ValueError(f"[Stage {self.stage_index}] unexpected {msg.kind.name} message from upstream")
                self.sends.send(msg, self.next_rank)
                if msg.kind == MessageKind.SHUTDOWN:
                    if self.executor.exit_layer is not None and not self.is_last:
                        # the coordinator's receiver of exit events ends on it too (no thread is
                        # left blocked in a receive when the process group goes away)
                        self.sends.send(Message(MessageKind.SHUTDOWN), COORDINATOR_RANK)
                    self.sends.flush()
                    log.info("[Stage %d] data plane shut down", self.stage_index)
                    return
        finally:
            self.stopped.set()

    def _forward(self, msg: Message) -> Message:
        """Run one micro-batch. On the exit stage, first tell the coordinator which items passed the
        exit layer (EXIT_GUESS, with the exit head's guesses) so it can inject drafts at once. If
        the message carries a timing list (the coordinator records a timeline), each stage appends
        the StageTiming of its compute (CLOCK_MONOTONIC)."""
        x = msg.tensors.get("x")
        if x is None:
            raise ValueError(f"[Stage {self.stage_index}] FORWARD message without tensor 'x'")
        start_ns = time.perf_counter_ns()
        out = self.executor.run(msg.items, x, msg.tensors.get("pseudo"))
        timing = msg.timing
        if timing is not None:
            timing = [*timing, StageTiming(self.stage_index, start_ns, time.perf_counter_ns())]
        if self.executor.exit_layer is not None and any(it.may_precede_draft for it in out.items):
            guesses = {}
            if out.exit_tokens is not None:
                guesses = {"exit_tokens": out.exit_tokens, "exit_probs": out.exit_probs}
            self.sends.send(Message(MessageKind.EXIT_GUESS, out.items, guesses, timing and timing[-1:]),
                            COORDINATOR_RANK)
        if not self.is_last:
            hidden = out.hidden if out.hidden is not None else torch.empty(0)
            tensors = {"x": hidden}
            if out.pseudo is not None:
                tensors["pseudo"] = out.pseudo
            return Message(MessageKind.FORWARD, out.items, tensors, timing)
        tensors = {"token_ids": out.token_ids if out.token_ids is not None else torch.empty(0, dtype=torch.int64)}
        if out.logits is not None:
            tensors["logits"] = out.logits
        if out.firp_tokens is not None:
            tensors["firp_tokens"], tensors["firp_probs"] = out.firp_tokens, out.firp_probs
        return Message(MessageKind.RESULT, out.items, tensors, timing)
