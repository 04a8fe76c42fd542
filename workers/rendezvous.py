"""Data-plane rendezvous steps: counting in at the TCPStore, forming the gloo group in abortable
slices, and telling an abandoned rendezvous from a slow one.

Owns the waits of a `DataPlaneGroup` (workers/channel.py) before its first transfer, the store keys
they use (`speedpipe/joined`, `speedpipe/all_joined`, `speedpipe/abort`) and `RendezvousAbandoned`.
Must not: move messages (workers/channel.py) or decide when to give a rendezvous up (the coordinator does).
"""

from __future__ import annotations

import atexit
import datetime
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

JOINED_KEY, ALL_JOINED_KEY = "speedpipe/joined", "speedpipe/all_joined"
ABORT_KEY = "speedpipe/abort"  # set by rank 0 when it gives the rendezvous up: the reason
JOIN_POLL_S = 0.05  # how often a rendezvous wait looks whether it is done, unless abandoned first


# [Note: a rendezvous wait at interpreter exit]
# A process that exits while a rank still polls its rendezvous (rank 0, or any rank waiting for
# all_joined; a launch that failed at start-up, a test) must not leave that daemon thread inside a
# TCPStore call: once finalisation starts, a daemon thread coming back from C++ for the GIL is ended by a forced unwind, which through torch's
# noexcept frames is std::terminate ("terminate called without an active exception", exit 134 in
# about 2 of 5 such exits, measured). At exit every polling rank stops as if abandoned, and the
# exit waits (briefly) until it has left the store. The same holds for the threads that form gloo
# groups (`form_gloo`): a wait given up leaves its former inside torch until its store's server goes,
# which for the ranks of this process's own rank 0 is when that rank 0 drops its store, as it does
# when it stops; so the exit then also waits for the formers (5 of 6 exits with two formers waiting
# aborted before, measured). All of it at most EXIT_WAIT_S: a former whose rank 0 lives in another
# process that keeps its store stays in torch, and is ended with the process.
EXIT_WAIT_S = 5.0
_exiting = threading.Event()
_polling: set[threading.Thread] = set()  # threads in a rendezvous wait, then the gloo formers
_forming: set[threading.Thread] = set()
_polling_lock = threading.Lock()


@atexit.register
def _stop_polling_at_exit() -> None:
    _exiting.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for waiting in (_polling, _forming):  # the waits first: they drop the stores the formers wait on
        with _polling_lock:
            threads = list(waiting)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class RendezvousAbandoned(RuntimeError):
    """Rank 0 stopped waiting at its rendezvous: the caller abandoned it (a failed fail-over attempt)."""


def count_in(store: dist.TCPStore, *, rank: int, world_size: int, timeout_s: float,
             abandoned: threading.Event | None) -> str | None:
    """Count this rank in at the rendezvous, then wait until every rank has, at most `timeout_s` (the
    join's own deadline, not the data plane's per-step one: [Note: every rank waits for all_joined] in
    workers/channel.py). Stops at once when `abandoned` is set, or, on a non-zero rank, when rank 0 set
    ABORT_KEY or its store went away (`stop_reason`: [Note: abandoned rendezvous] in workers/channel.py). Returns None
    when every rank counted in, else why this rank stopped waiting (no exception: its traceback would
    keep the store, and so the port, alive)."""
    if store.add(JOINED_KEY, 1) == world_size:
        store.set(ALL_JOINED_KEY, "1")
    deadline, flag = time.monotonic() + timeout_s, abandoned if abandoned is not None else threading.Event()
    with _polling_lock:
        _polling.add(threading.current_thread())
    try:
        while not _all_joined(store):
            flag.wait(JOIN_POLL_S)  # [Note: a rendezvous wait at interpreter exit]: stop_reason sees it
            if (why := stop_reason(store, rank=rank, abandoned=abandoned)) is not None:
                return why
            if time.monotonic() > deadline:
                return (f"timed out after {timeout_s:g} s waiting for the data plane's ranks: "
                        f"{store.add(JOINED_KEY, 0)}/{world_size} joined")
        return None
    finally:
        with _polling_lock:
            _polling.discard(threading.current_thread())


def _all_joined(store: dist.TCPStore) -> bool:
    """Whether ALL_JOINED_KEY is set; False when the store went away (a non-zero rank's check of
    ABORT_KEY then says so)."""
    try:
        return store.check([ALL_JOINED_KEY])
    except RuntimeError:
        return False


class GiveUp(threading.Event):
    """An `abandoned` flag that can say why: `give_up(reason)` ("stage 2 (Rejoin) failed: ..."); a
    plain `set()` gives no reason. The first reason stays."""

    reason = ""

    def give_up(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.set()


def why_abandoned(abandoned: threading.Event | None) -> str | None:
    """The reason rank 0 gives its rendezvous up now ("abandoned", or ": " and `GiveUp.reason`), else None."""
    if _exiting.is_set() or (abandoned is not None and abandoned.is_set()):
        reason = getattr(abandoned, "reason", "")
        return f"abandoned: {reason}" if reason else "abandoned"
    return None


def abort_key_reason(store: dist.TCPStore) -> str | None:
    """A non-zero rank's check: "abandoned: <reason>" once rank 0 set ABORT_KEY ([Note: abandoned
    rendezvous] in workers/channel.py) or its store went away; else None."""
    try:
        if store.check([ABORT_KEY]):
            return "abandoned: " + store.get(ABORT_KEY).decode(errors="replace")
    except RuntimeError as exc:  # the server closed: rank 0 dropped its store
        return "abandoned: rank 0's store went away (" + (str(exc).strip().splitlines() or ["closed"])[0] + ")"
    return "abandoned" if _exiting.is_set() else None


def stop_reason(store: dist.TCPStore | None, *, rank: int, abandoned: threading.Event | None) -> str | None:
    """Why a rank waiting at its rendezvous stops now, else None: any rank when `abandoned` is set
    (`why_abandoned`), a non-zero rank also once rank 0 set ABORT_KEY or its store went away
    (`abort_key_reason`); every rank at interpreter exit."""
    return why_abandoned(abandoned) or (abort_key_reason(store) if rank != 0 else None)


def form_gloo(store: dist.Store, *, rank: int, world_size: int, timeout: datetime.timedelta,
              stop: Callable[[], str | None]) -> tuple[str, object]:
    """Form the gloo group on `store` in a thread of its own while this one asks `stop()` every
    JOIN_POLL_S ([Note: abandoned rendezvous] in workers/channel.py): ("group", the group), ("abandoned",
    why) as soon as `stop` says why, or ("error", torch's first line: e.g. "wait timeout after 120000ms,
    keys: /gloo/0/2", a rank that counted in and died). An abandoned former ends when `store`'s server goes
    (rank 0 drops it) or at `timeout`; a group it forms then is dropped; an exit waits for it, briefly
    ([Note: a rendezvous wait at interpreter exit])."""
    box, done = {}, threading.Event()

    def form() -> None:
        try:
            box["group"] = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)
        except Exception as exc:  # noqa: BLE001 - one line to the caller, no traceback holding the store
            box["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        finally:
            done.set()
            with _polling_lock:
                _forming.discard(former)

    former = threading.Thread(target=form, name="gloo-rendezvous", daemon=True)
    with _polling_lock:
        _forming.add(former)
        _polling.add(threading.current_thread())
    former.start()
    try:
        while not done.wait(JOIN_POLL_S):
            if (why := stop()) is not None:
                return "abandoned", why
    finally:
        with _polling_lock:
            _polling.discard(threading.current_thread())
    return ("group", box["group"]) if "group" in box else ("error", box["error"])


REFUSALS_ABANDONED = 5  # connections refused in a row that mean nobody hosts a (held) rendezvous port


def await_listener(host: str, port: int, *, timeout_s: float) -> str | None:
    """For a rendezvous whose port was held before this rank was told of it ([Note: held rendezvous
    port] in workers/channel.py: every fail-over's): None once something listens at host:port (or
    after `timeout_s` of other errors: torch's store then says why), else why it is abandoned, after
    REFUSALS_ABANDONED refused connections in a row: rank 0 gave it up and its port closed. torch's
    own connect retries a refused port until its timeout (600 s for a Rejoin)."""
    deadline, refused = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return None
        except ConnectionRefusedError:
            refused += 1
            if refused >= REFUSALS_ABANDONED:
                return (f"nothing listens at {host}:{port} ({refused} connections refused): the coordinator gave "
                        f"this rendezvous up (a newer fail-over attempt replaces it)")
        except OSError:
            refused = 0
        time.sleep(JOIN_POLL_S)
    return None


def own_address(master_addr: str) -> str:
    """Where rank 0 reaches its own store: `master_addr` when it is a loopback address, else the
    loopback address of its family (the store then listens on every interface; `master_addr` may be
    a NAT address no interface holds)."""
    if master_addr == "localhost" or master_addr.startswith("127.") or master_addr == "::1":
        return master_addr
    family = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][0]
    return "::1" if family == socket.AF_INET6 else "127.0.0.1"
