"""The launch store of the torchrun-style multi-node mode: hosting it, joining it, watching node 0.

Owns the TCPStore at --master-addr:--master-port that node 0's launcher hosts and every other node's
launcher joins (launcher/backends/multinode.py says what its keys mean), the checks node 0 makes
before anything starts (--master-addr is its own, the data-plane port --master-port + 1 is free), and
`Node0Watch`: how node R > 0 learns that node 0 finished, failed, went away or went silent.
Must not: start stages or know about the pipeline (multinode.py does).

[Note: node 0 silent]
torch's TCPStore client has no deadline of its own against a server that stopped answering (node 0
frozen, or partitioned without a reset, as a deleted Kubernetes pod usually is): a call, even a
`wait` with a timeout, then blocks forever. So a member node never waits on the store in the thread
that decides: a daemon thread asks `check(["done"])` every HEARTBEAT_S, and the launcher's main
thread gives up when no answer came for --placement-timeout-s. A thread left blocked in that call
is harmless at exit (it holds no lock Python needs; the kernel closes its socket).
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
import time

import torch.distributed as dist

from launcher.backends.placement import PlacementError, PlacementOptions
from workers.channel import hold_listener, loopback_listener

CONNECT_RETRY_S = 0.5
HEARTBEAT_S = 1.0
DONE_OK = "ok"  # the value of `done` when node 0 finished; else "failed: why"


def wait_listening(host: str, port: int, *, timeout_s: float) -> bool:
    """True once something accepts TCP connections at host:port, False after `timeout_s`.

    torch's TCPStore client retries a refused connection with a random back-off that can overrun its
    own timeout by as much again, so nodes R > 0 wait here first, against the placement deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(CONNECT_RETRY_S)


def check_master_addr_is_local(master_addr: str) -> None:
    """Node 0 listens on --master-addr, so it must be an address (or a name of one) of this machine.

    Checked by binding a socket to it, before torch's store tries and fails with pages of C++ frames.
    Raises PlacementError naming the flag.
    """
    try:
        infos = socket.getaddrinfo(master_addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PlacementError(f"--master-addr {master_addr} does not resolve on node 0 ({exc.strerror}); "
                             f"check the name or pass an address") from None
    for family, socktype, proto, _, addr in infos:
        with socket.socket(family, socktype, proto) as sock:
            try:
                sock.bind(addr)
                return
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    return  # local, and something else is wrong: torch's store says what
    raise PlacementError(f"--master-addr {master_addr} is not an address of this machine (node 0 listens on "
                         f"it): give node 0 its own address, as the other nodes reach it")


def hold_data_port(options: PlacementOptions) -> int:
    """Hold the data-plane rendezvous port --master-port + 1 for node 0's first data-plane group
    ([Note: held rendezvous port] in workers/channel.py). Returns it; raises PlacementError naming
    the port and the flag when it is in use."""
    port = options.master_port + 1
    try:
        return hold_listener(options.master_addr, port)
    except OSError as exc:
        raise PlacementError(f"node 0: data-plane port {port} (--master-port {options.master_port} + 1) cannot be "
                             f"used on {options.master_addr}: {exc.strerror or exc}; free it or choose another "
                             f"--master-port") from None


def open_store(options: PlacementOptions) -> dist.TCPStore:
    """Node 0 hosts the launch store; other nodes connect to it (retrying until the placement timeout).
    Raises PlacementError naming the flags."""
    start = time.monotonic()
    is_master = options.node_rank == 0
    if not is_master and not wait_listening(options.master_addr, options.master_port,
                                            timeout_s=options.placement_timeout_s):
        raise PlacementError(
            f"node {options.node_rank}: cannot reach node 0 at {options.master_addr}:{options.master_port} within "
            f"{options.placement_timeout_s:g} s (--placement-timeout-s); check that node 0 runs `launch --nnodes "
            f"{options.nnodes} --node-rank 0 ...` with the same --master-addr/--master-port, and that the port is "
            f"open")
    remaining_s = max(1.0, options.placement_timeout_s - (time.monotonic() - start))
    timeout = datetime.timedelta(seconds=remaining_s)
    try:
        return dist.TCPStore(options.master_addr, options.master_port, None, is_master, timeout=timeout,
                             wait_for_workers=False,
                             master_listen_fd=loopback_listener(options.master_addr, options.master_port)
                             if is_master else None)
    except (RuntimeError, OSError) as exc:  # torch raises DistNetworkError / DistStoreError (RuntimeErrors)
        what = (f"cannot listen on port {options.master_port}" if is_master else
                f"cannot reach node 0 at {options.master_addr}:{options.master_port} within "
                f"{options.placement_timeout_s:g} s (--placement-timeout-s)")
        raise PlacementError(f"node {options.node_rank}: {what}: {str(exc).splitlines()[0]}; check that node 0 "
                             f"runs `launch --nnodes {options.nnodes} --node-rank 0 ...` with the same "
                             f"--master-addr/--master-port, and that the port is open") from None


class Node0Watch:
    """A member node's watch over node 0 through the launch store ([Note: node 0 silent]).

    `wait(stop)` returns the outcome: ("done", "") when node 0 finished, ("failed", why) when it says
    it failed, ("error", why) when its store went away or stayed silent for `silence_s` seconds (the
    placement timeout); None when `stop` was set first (a local stage decided). `store` is used only
    by this watch's thread until `wait` returned an outcome other than ("error", ...).
    """

    def __init__(self, store: dist.TCPStore, options: PlacementOptions) -> None:
        self.store, self.options = store, options
        self.where = f"node 0 at {options.master_addr}:{options.master_port}"
        self.last_answer_s = time.monotonic()
        self.outcome: tuple[str, str] | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="speedpipe-node0-watch", daemon=True)

    def start(self) -> Node0Watch:
        # past the silence deadline the main thread has decided; torch would only add warnings before it
        self.store.set_timeout(datetime.timedelta(seconds=2 * self.options.placement_timeout_s))
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.store.check(["done"]):
                self.last_answer_s = time.monotonic()
                time.sleep(HEARTBEAT_S)
            status = self.store.get("done").decode()
            self.outcome = ("done", "") if status == DONE_OK else ("failed", status.removeprefix("failed: "))
        except RuntimeError as exc:
            self.outcome = ("error", f"{self.where} went away ({str(exc).splitlines()[0]})")
        self.ended.set()

    def wait(self, stop: threading.Event, *, timeout_s: float | None = None) -> tuple[str, str] | None:
        """Block until node 0's outcome, `stop`, or `timeout_s` (then None); never longer than node 0's
        silence allows (then ("error", why naming node 0 and --placement-timeout-s))."""
        silence_s = self.options.placement_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.ended.wait(min(HEARTBEAT_S, silence_s)):
            if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            if time.monotonic() - self.last_answer_s > silence_s:
                return "error", (f"{self.where} has not answered for {silence_s:g} s (--placement-timeout-s): "
                                 f"it is frozen or unreachable")
        return self.outcome
