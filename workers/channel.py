"""Data-plane channel: ordered point-to-point messages between neighbour ranks.

Owns moving `pipeline.wire.Message`s over torch.distributed (gloo for CPU tensors, NCCL for CUDA
tensors when the process group was created with backend "cpu:gloo,cuda:nccl"), the per-wait
deadline, and turning transport failures into `ChannelError`s that name the peer.
Must not: interpret items or decide what runs (the stage loop and coordinator do).

Ranks: 0 is the coordinator, stage i is rank i + 1 (see launcher/coordinator.py).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from pipeline.wire import (
    DEFAULT_FRAME_BYTES,
    Message,
    WireError,
    decode_header,
    encode_header,
    header_end,
    inline_tensors,
    payload_bytes_of,
    split_payload,
)


class ChannelError(RuntimeError):
    """A data-plane transfer failed: the peer timed out, died, or sent a malformed message."""


def rank_name(rank: int) -> str:
    """Human name of a rank: 'coordinator' or 'stage i'."""
    return "coordinator" if rank == 0 else f"stage {rank - 1}"


class Channel:
    """Sends and receives framed messages; every wait has a deadline of `timeout_s` seconds.

    [Note: deadlines]
    A gloo wait that times out closes the connection, so a timeout is fatal by design: the
    coordinator sends KEEPALIVE messages around the ring when it has nothing else in flight, so a
    healthy but idle stage always hears something well within its deadline.
    """

    def __init__(self, *, timeout_s: float, device: torch.device | str = "cpu",
                 frame_bytes: int = DEFAULT_FRAME_BYTES, max_payload_bytes: int = 1 << 31,
                 label: str = "") -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.frame_bytes = frame_bytes
        self.max_payload_bytes = max_payload_bytes
        self.label = label
        self.bytes_sent = 0
        self.wait_ns = 0  # time spent blocked in recv (idle + transfer)

    def send(self, msg: Message, dst: int) -> None:
        """Send `msg` to rank `dst`. Raises ChannelError if the peer does not take it in time."""
        frame, inline = encode_header(msg, frame_bytes=self.frame_bytes)
        self._wait(dist.isend(torch.frombuffer(frame, dtype=torch.uint8), dst), "send to", dst)
        self.bytes_sent += self.frame_bytes
        if inline or not msg.tensors:
            return
        if any(t.device.type != "cpu" for t in msg.tensors.values()):
            for t in msg.tensors.values():
                self._wait(dist.isend(t.contiguous(), dst), "send to", dst)
        else:
            payload = payload_bytes_of(msg.tensors)
            self._wait(dist.isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst), "send to", dst)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in msg.tensors.values())

    def recv(self, src: int) -> Message:
        """Receive the next message from rank `src`; the header is validated before the payload.

        Raises ChannelError on timeout, peer failure or a malformed message.
        """
        frame = torch.empty(self.frame_bytes, dtype=torch.uint8)
        start = time.perf_counter_ns()
        self._wait(dist.irecv(frame, src), "receive from", src)
        raw = frame.numpy()
        try:
            header = decode_header(memoryview(raw), max_payload_bytes=self.max_payload_bytes)
        except WireError as exc:
            raise ChannelError(f"{self.label}malformed message from {rank_name(src)}: {exc}") from None
        if header.inline:
            tensors = inline_tensors(memoryview(raw), header_end(memoryview(raw)), header)
        elif header.on_device:
            tensors = {}
            for spec in header.specs:
                t = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                self._wait(dist.irecv(t, src), "receive from", src)
                tensors[spec.name] = t
        else:
            payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
            if header.payload_bytes:
                self._wait(dist.irecv(payload, src), "receive from", src)
            tensors = split_payload(memoryview(payload.numpy()), header.specs)
        self.wait_ns += time.perf_counter_ns() - start
        return Message(header.kind, header.items, tensors, header.meta)

    def _wait(self, work, verb: str, peer: int) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            text = str(exc)
            if "Timed out" in text or "timeout" in text.lower():
                raise ChannelError(
                    f"{self.label}timed out after {self.timeout_s:g} s waiting to {verb} {rank_name(peer)} "
                    f"(--stage-timeout-s); is that process alive?"
                ) from None
            raise ChannelError(f"{self.label}failed to {verb} {rank_name(peer)}: {text.splitlines()[0]}") from None
