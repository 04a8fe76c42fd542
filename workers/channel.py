"""Data-plane channel: ordered point-to-point messages between neighbour ranks.

Owns the data-plane process group of one pipeline (a TCPStore rendezvous plus a gloo group for
CPU tensors and, on CUDA, an NCCL group for hidden states), moving `pipeline.engine.wire.Message`s over
it, the per-wait deadline, and turning transport failures into `ChannelError`s naming the peer.
Must not: interpret items or decide what runs (the stage loop and coordinator do).

The groups are explicit objects, never torch.distributed's process-global default group, so one
process can drive several pipelines (benchmarks, tests, a server restarting its pipeline).
Ranks: [Note: ranks] in pipeline/engine/wire.py (`rank_of_stage`).
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import re
import socket
import threading

import torch
import torch.distributed as dist

from pipeline.engine.wire import (
    DEFAULT_FRAME_BYTES,
    Message,
    WireError,
    decode_header,
    encode_header,
    header_end,
    inline_tensors,
    payload_bytes_of,
    rank_name,
    split_payload,
)
from workers.rendezvous import (  # noqa: F401 - RendezvousAbandoned, GiveUp: part of this module's API
    ABORT_KEY,
    GiveUp,
    RendezvousAbandoned,
    abort_key_reason,
    await_listener,
    count_in,
    form_gloo,
    own_address,
    stop_reason,
)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_listener(host: str, port: int) -> int | None:
    """A listening socket's fd bound to `host`:`port` when `host` is a loopback address, else None.

    torch's TCPStore server listens on every interface; handed this fd (`master_listen_fd`, which it
    then owns) it serves on loopback only. A non-loopback `host` (multi-node) keeps torch's default.
    """
    if not _is_loopback(host):
        return None
    family, socktype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    return sock.detach()


_held_listeners: dict[tuple[str, int], socket.socket] = {}
_held_lock = threading.Lock()


def hold_listener(host: str, port: int = 0) -> int:
    """Listen on `port` of `host` (0: a free one) now and hold the socket for this process's next
    rank-0 `DataPlaneGroup` at `host`:port, which then serves on it. Returns the port.

    [Note: held rendezvous port]
    Probing a free port and binding it later loses races: in between, any process's outgoing
    connection may take it as its ephemeral source port (EADDRINUSE at the coordinator's join, seen
    under the full test suite). A held port is never free in between. Stages that connect early
    wait in the socket's backlog until the store serves. A loopback `host` is served on loopback
    only (as `loopback_listener`), any other on every interface of its address family (as torch's
    own store: `host` may be a name or a NAT address that no interface holds). Whoever holds a
    port and may not join releases it (`release_listener`). Raises OSError if it cannot bind.
    """
    family, socktype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socktype, proto)
    try:
        if port:  # a fixed port may still have connections in TIME_WAIT from the last run
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr if _is_loopback(host) else ("::" if family == socket.AF_INET6 else "", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    port = int(sock.getsockname()[1])
    with _held_lock:
        _held_listeners[(host, port)] = sock
    return port


def release_listener(host: str, port: int) -> None:
    """Close the socket `hold_listener(host)` holds at `port`, if no group took it (a start or a
    fail-over that failed before rank 0 joined). No-op otherwise."""
    with _held_lock:
        held = _held_listeners.pop((host, port), None)
    if held is not None:
        held.close()


def _master_listener(host: str, port: int) -> int | None:
    """The fd rank 0's TCPStore serves on: the held one ([Note: held rendezvous port]), else a
    loopback-only listener, else None (torch listens on every interface)."""
    with _held_lock:
        held = _held_listeners.pop((host, port), None)
    return held.detach() if held is not None else loopback_listener(host, port)


class DataPlaneGroup:
    """Rendezvous and process groups of one pipeline: gloo always, NCCL too when `device` is CUDA.

    Blocks until all `world_size` ranks joined, at most `connect_timeout_s` (stages join after
    loading their weights, which can take far longer than one data-plane step); then every
    operation has the `timeout_s` deadline. Rank 0 hosts the TCPStore at master_addr:master_port.
    Raises RuntimeError (from torch, or rank 0's own) if the rendezvous times out, and
    RendezvousAbandoned when rank 0's `abandoned` is set first, on every rank (the reason named,
    where rank 0 got one) when rank 0 gave it up, on a Rejoin's rank when nothing listens at its port.

    [Note: abandoned rendezvous]
    Rank 0 (the coordinator) waits for the other ranks in steps of JOIN_POLL_S, not in torch's
    TCPStore constructor: a fail-over attempt that failed (another stage died while they joined)
    sets `abandoned` (a `GiveUp` says why), and its join ends at once, dropping the store: its port
    closes, its thread ends, and the stages still waiting at that rendezvous fail at once too (their
    store went away). Before, the join thread and the store's port stayed until the rendezvous timed out (600 s).
    The gloo group then forms in a thread of its own, over a store connection of its own, while every
    rank looks every JOIN_POLL_S whether to give up (`stop_reason`): rank 0 at `abandoned`, the others at it
    and at ABORT_KEY, which rank 0 sets (the reason) before it drops its store, or at that store going away.
    Before, a stage that counted in and died before it published its gloo address left every other rank,
    the coordinator included, inside torch's gloo constructor until --stage-timeout-s, `abandoned` unseen.
    Rank 0 sets ABORT_KEY whenever it gives up, while the ranks count in as while they form the group.

    [Note: every rank waits for all_joined]
    Every rank, not only rank 0, waits for ALL_JOINED_KEY (`count_in`) before it forms the gloo group, up to
    the join's own deadline (`connect_timeout_s`: a Load's JOIN_TIMEOUT_S, a Rejoin's join_timeout_s),
    looking every JOIN_POLL_S at the same signals as above (`abandoned`, ABORT_KEY, rank 0's store going
    away); it forms the group only once every rank counted in, so gloo's own deadline (`timeout_s`,
    --stage-timeout-s) covers only the formation itself, as on rank 0. Before, a non-zero rank went into
    gloo's constructor right after counting in, and a fail-over whose restarted stage loaded its weights
    for longer than --stage-timeout-s failed there ("wait timeout", seen under load).
    With `refused_is_abandoned` (a Rejoin: its port was held before it was sent), a stage whose rendezvous
    port refuses connections REFUSALS_ABANDONED times in a row gives up at once: rank 0 abandoned it.
    Before, torch's connect retried until the Rejoin's own timeout (600 s).
    """

    def __init__(self, *, master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float,
                 device: str = "cpu", connect_timeout_s: float = 600.0, abandoned: threading.Event | None = None,
                 refused_is_abandoned: bool = False) -> None:
        timeout, connect_s = datetime.timedelta(seconds=timeout_s), max(timeout_s, connect_timeout_s)
        self.rank, self.world_size = rank, world_size
        where = f"rank {rank} at {master_addr}:{master_port}"
        if refused_is_abandoned and rank != 0 and (why := await_listener(master_addr, master_port, timeout_s=connect_s)):
            raise RendezvousAbandoned(f"{where}: rendezvous abandoned: {why}")
        self.store = dist.TCPStore(master_addr, master_port, world_size, rank == 0,
                                   timeout=datetime.timedelta(seconds=connect_s), wait_for_workers=rank != 0,
                                   master_listen_fd=_master_listener(master_addr, master_port) if rank == 0 else None)
        why = count_in(self.store, rank=rank, world_size=world_size, timeout_s=connect_s, abandoned=abandoned)
        if why is None:  # the gloo group, over a connection of its own: giving up may drop self.store at once
            gloo_store = dist.TCPStore(own_address(master_addr) if rank == 0 else master_addr, master_port, world_size,
                                       False, timeout=datetime.timedelta(seconds=connect_s))
            stop = functools.partial(stop_reason, self.store, rank=rank, abandoned=abandoned)
            outcome, what = form_gloo(gloo_store, rank=rank, world_size=world_size, timeout=timeout, stop=stop)
            del gloo_store
            if outcome == "group":
                self.gloo, self.nccl = what, None
                if device.startswith("cuda"):
                    self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), rank, world_size)
                return
            why = what
            if rank != 0 and outcome == "error" and (aborted := abort_key_reason(self.store)):
                why = aborted  # the coordinator gave it up first: say so
        if rank == 0 and why.startswith("abandoned"):  # counting in or forming: the others hear why
            self.store.set(ABORT_KEY, why.removeprefix("abandoned").lstrip(": ") or "rank 0 gave it up")
        self.store = None  # the store and its port go now
        raise (RendezvousAbandoned if why.startswith("abandoned") else RuntimeError)(f"{where}: rendezvous {why}")

    def group_for(self, t: torch.Tensor):
        """The process group that moves tensors on `t`'s device. Raises ChannelError after close()."""
        if self.store is None:
            raise ChannelError(f"rank {self.rank}: data-plane group closed")
        return self.gloo if t.device.type == "cpu" else self.nccl

    def close(self) -> None:
        """Abort the groups and drop them and the store: once no transfer holds them any more (a
        transfer already blocked on one ends at its deadline, or when its peer's sockets close), they
        are freed and their listening sockets close, so a group a fail-over replaced leaks no port.
        Later transfers on this group raise ChannelError. Idempotent."""
        for pg in (self.gloo, self.nccl):
            if pg is not None:
                try:
                    pg.abort()
                except RuntimeError:
                    pass
        self.gloo = self.nccl = self.store = None


class ChannelError(RuntimeError):
    """A data-plane transfer failed: the peer timed out, died, or sent a malformed message."""


class Channel:
    """Sends and receives framed messages; every wait has a deadline of `timeout_s` seconds.

    [Note: deadlines]
    A gloo wait that times out closes the connection, so a timeout is fatal by design: the
    coordinator sends KEEPALIVE messages around the ring when it has nothing else in flight, so a
    healthy but idle stage always hears something well within its deadline; an exit stage that is
    not the last also sends each KEEPALIVE it passes on to the coordinator, whose receiver of its
    exit events waits with the same deadline (workers/stage_loop.py).
    """

    def __init__(self, group: DataPlaneGroup, *, timeout_s: float, device: torch.device | str = "cpu",
                 frame_bytes: int = DEFAULT_FRAME_BYTES, max_payload_bytes: int = 1 << 31,
                 label: str = "") -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.frame_bytes = frame_bytes
        self.max_payload_bytes = max_payload_bytes
        self.label = label

    def send(self, msg: Message, dst: int) -> None:
        """Send `msg` to rank `dst`. Raises ChannelError if the peer does not take it in time."""
        if any(t.device.type != "cpu" for t in msg.tensors.values()):
            frame, _ = encode_header(msg, frame_bytes=self.frame_bytes)
            self._wait(self._send(torch.frombuffer(frame, dtype=torch.uint8), dst), "send to", dst)
            for t in msg.tensors.values():
                self._wait(self._send(t.contiguous(), dst), "send to", dst)
            return
        for work, _ in self.post(msg, dst):
            self.wait_sent(work, dst)

    def post(self, msg: Message, dst: int) -> list[tuple[object, torch.Tensor]]:
        """Start sending `msg` (CPU tensors only) to rank `dst` and return at once: its frame (and
        payload, if not inline) are posted to gloo, which sends them in order once `dst` posts the
        matching receives. Returns (work, buffer) pairs: the buffer must stay alive until
        `wait_sent(work)` returned ([Note: posted sends] in workers/send_queue.py).
        Raises ValueError for a tensor on an accelerator, ChannelError after close() or when gloo
        refuses the send (its connection to `dst` already failed)."""
        if any(t.device.type != "cpu" for t in msg.tensors.values()):
            raise ValueError("only messages of CPU tensors can be posted; send() moves device tensors")
        frame, inline = encode_header(msg, frame_bytes=self.frame_bytes)
        bufs = [torch.frombuffer(frame, dtype=torch.uint8)]
        if not inline and msg.tensors:
            bufs.append(torch.frombuffer(bytearray(payload_bytes_of(msg.tensors)), dtype=torch.uint8))
        posted = []
        for b in bufs:
            error = None
            try:
                posted.append((self._send(b, dst), b))
            except RuntimeError as exc:
                error = self._error_text(str(exc), "send to", dst)
            if error is not None:  # raised outside the handler: no context that could hold a work
                raise ChannelError(error)
        return posted

    def wait_sent(self, work, dst: int) -> None:
        """Wait until a posted send to rank `dst` completed. Raises ChannelError on timeout or failure."""
        self._wait(work, "send to", dst)

    def recv(self, src: int) -> Message:
        """Receive the next message from rank `src`; the header is validated before the payload.

        Raises ChannelError on timeout, peer failure or a malformed message.
        """
        frame = torch.empty(self.frame_bytes, dtype=torch.uint8)
        self._wait(self._recv(frame, src), "receive from", src)
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
                self._wait(self._recv(t, src), "receive from", src)
                tensors[spec.name] = t
        else:
            payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
            if header.payload_bytes:
                self._wait(self._recv(payload, src), "receive from", src)
            tensors = split_payload(memoryview(payload.numpy()), header.specs)
        return Message(header.kind, header.items, tensors, header.timing, header.releases)

    def _send(self, t: torch.Tensor, dst: int):
        return self.group.group_for(t).send([t], dst, 0)

    def _recv(self, t: torch.Tensor, src: int):
        return self.group.group_for(t).recv([t], src, 0)

    def _wait(self, work, verb: str, peer: int) -> None:
        error = None
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            error = self._error_text(str(exc), verb, peer)
        if error is not None:
            # Raised outside the handler, with `work` gone: an error someone keeps (SendQueue does)
            # then holds no frame or context that holds a work, so a group a fail-over replaced is
            # freed and its sockets close (no leaked port).
            del work
            raise ChannelError(error)

    def _error_text(self, text: str, verb: str, peer: int) -> str:
        """The one-line ChannelError message of a failed gloo transfer."""
        if "Timed out" in text or "timeout" in text.lower():
            return (f"{self.label}timed out after {self.timeout_s:g} s waiting to {verb} {rank_name(peer)} "
                    f"(--stage-timeout-s); is that process alive?")
        return f"{self.label}failed to {verb} {rank_name(peer)}: {_gloo_reason(text)}"


def _gloo_reason(text: str) -> str:
    """The reason in a gloo error, without its source location or advice: "[/path/pair.cc:553]
    Connection closed by peer [127.0.0.1]:12451. This is typically caused by ..." -> "Connection
    closed by peer [127.0.0.1]:12451"."""
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0] if text else "")
    return line.split(". This is typically caused", 1)[0].rstrip(".") or "unknown error"
