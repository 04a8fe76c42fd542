"""Every rank waits for `speedpipe/all_joined` before it forms the gloo group, up to the join's own
deadline, giving up at rank 0's word ([Note: every rank waits for all_joined] in workers/channel.py).

What breaks when these fail: a stage that Rejoins at once while a restarted stage still loads its
weights enters gloo's constructor at once and fails after --stage-timeout-s ("wait timeout"), so a
fail-over whose restarted stage loads slowly (under load) fails and spends another restart; or a stage
waiting there does not hear why the coordinator gave the rendezvous up.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from tests.conftest import wait_for
from workers.channel import DataPlaneGroup, GiveUp, RendezvousAbandoned
from workers.rendezvous import ABORT_KEY, ALL_JOINED_KEY, JOINED_KEY, count_in, stop_reason


class FakeStore:
    """The TCPStore calls `count_in` makes; `on_check(store, n)` runs at the n-th `check` (another rank
    counting in, rank 0 giving up, the store going away)."""

    def __init__(self, on_check=lambda store, n: None) -> None:
        self.data: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}
        self.num_checks, self.on_check, self.gone = 0, on_check, False

    def add(self, key: str, n: int) -> int:
        self._alive()
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._alive()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self.num_checks += 1
        self.on_check(self, self.num_checks)
        self._alive()
        return all(k in self.data for k in keys)

    def _alive(self) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer\nException raised from recvBytes")


def _count_in_later(store: FakeStore, n: int) -> None:
    if n == 3:  # the slow rank counts in while this one waits
        if store.add(JOINED_KEY, 1) == 2:
            store.set(ALL_JOINED_KEY, "1")


def test_a_non_zero_rank_waits_until_every_rank_counted_in():
    store = FakeStore(_count_in_later)
    assert count_in(store, rank=1, world_size=2, timeout_s=30.0, abandoned=None) is None
    # before: it returned at once (no check), and went into gloo's constructor with the slow rank not there
    assert store.num_checks >= 3 and store.counts[JOINED_KEY] == 2


def test_a_non_zero_rank_waiting_hears_rank_0_give_up_with_its_reason():
    def gives_up(store: FakeStore, n: int) -> None:
        if n == 2:
            store.set(ABORT_KEY, "stage 1 (pid 42) exited unexpectedly with signal SIGKILL")

    why = count_in(FakeStore(gives_up), rank=1, world_size=3, timeout_s=30.0, abandoned=None)
    assert why == "abandoned: stage 1 (pid 42) exited unexpectedly with signal SIGKILL"


def test_a_non_zero_rank_waiting_stops_when_rank_0s_store_goes_away():
    def goes_away(store: FakeStore, n: int) -> None:
        store.gone = n >= 2

    why = count_in(FakeStore(goes_away), rank=2, world_size=3, timeout_s=30.0, abandoned=None)
    assert why == "abandoned: rank 0's store went away (Connection reset by peer)"


def test_a_non_zero_rank_waits_at_most_its_join_deadline():
    why = count_in(FakeStore(), rank=1, world_size=2, timeout_s=0.01, abandoned=None)
    assert why == "timed out after 0.01 s waiting for the data plane's ranks: 1/2 joined"


def test_rank_0_gives_up_naming_the_reason():
    flag = GiveUp()
    flag.give_up("stage 2 (Ray actor pid 7 on node 10.0.0.3 id 0123456789ab) died: its node was lost")
    why = count_in(FakeStore(), rank=0, world_size=3, timeout_s=30.0, abandoned=flag)
    assert why == "abandoned: stage 2 (Ray actor pid 7 on node 10.0.0.3 id 0123456789ab) died: its node was lost"


def test_one_stop_rule_for_counting_in_and_forming_the_group():
    """`stop_reason` is what `count_in` and the gloo formation both ask: rank 0 its own flag only, a
    non-zero rank its own flag first (the formation's check used to ignore it), then rank 0's word."""
    told = FakeStore()
    told.set(ABORT_KEY, "stage 2 (pid 7) exited unexpectedly with signal SIGKILL")
    flag = GiveUp()
    assert stop_reason(told, rank=0, abandoned=None) is None  # rank 0 sets ABORT_KEY, never obeys it
    assert stop_reason(told, rank=1, abandoned=None) == "abandoned: stage 2 (pid 7) exited unexpectedly with signal SIGKILL"
    assert stop_reason(FakeStore(), rank=1, abandoned=flag) is None
    flag.give_up("stage 1 (Rejoin) failed: refused")
    assert stop_reason(told, rank=1, abandoned=flag) == "abandoned: stage 1 (Rejoin) failed: refused"
    assert stop_reason(told, rank=0, abandoned=flag) == "abandoned: stage 1 (Rejoin) failed: refused"


def _join(box: dict, name: str, **kwargs) -> threading.Thread:
    def run() -> None:
        try:
            box[name] = DataPlaneGroup(master_addr="127.0.0.1", **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box[name] = exc

    thread = threading.Thread(target=run, name=f"test-{name}", daemon=True)
    thread.start()
    return thread


def test_a_rank_slower_than_the_stage_timeout_still_joins_within_the_join_deadline():
    """Three real ranks on loopback: rank 0 and rank 1 join at once, rank 2 (a restarted stage still
    loading) counts in only after rank 1 could have spent its whole gloo deadline (1 s) waiting.
    Before, rank 1 failed with gloo's "wait timeout"."""
    from workers.channel import hold_listener

    port, box = hold_listener("127.0.0.1"), {}
    common = dict(master_port=port, world_size=3, timeout_s=1.0, connect_timeout_s=60.0)
    threads = [_join(box, "rank0", rank=0, **common), _join(box, "rank1", rank=1, **common)]
    watcher = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=30))
    assert wait_for(lambda: watcher.add(JOINED_KEY, 0) == 2, timeout_s=30.0)
    time.sleep(2.0)  # past rank 1's gloo deadline: before, it was in gloo's constructor and failed meanwhile
    threads.append(_join(box, "rank2", rank=2, **common))
    for thread in threads:
        thread.join(timeout=60.0)
    try:
        assert all(isinstance(box[r], DataPlaneGroup) for r in ("rank0", "rank1", "rank2")), box
    finally:
        for group in box.values():
            if isinstance(group, DataPlaneGroup):
                group.close()


def test_a_rank_waiting_for_the_others_stops_at_once_when_rank_0_gives_up():
    """Rank 0 gives up while rank 1 waits for rank 2 (which never comes): both stop, rank 0 naming the
    reason, rank 1 as abandoned (it names the reason when it looks before rank 0's store goes: ABORT_KEY).
    Before, rank 1 was inside gloo's constructor until its own deadline."""
    from workers.channel import hold_listener

    port, box, flag = hold_listener("127.0.0.1"), {}, GiveUp()
    common = dict(master_port=port, world_size=3, timeout_s=120.0, connect_timeout_s=120.0)
    threads = [_join(box, "rank0", rank=0, abandoned=flag, **common), _join(box, "rank1", rank=1, **common)]
    watcher = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=30))
    assert wait_for(lambda: watcher.add(JOINED_KEY, 0) == 2, timeout_s=30.0)
    flag.give_up("stage 1 (pid 4242) exited unexpectedly with signal SIGKILL")
    for thread in threads:
        thread.join(timeout=30.0)
    assert not any(t.is_alive() for t in threads), "a rank still waits at the rendezvous"
    assert isinstance(box["rank1"], RendezvousAbandoned) and "rendezvous abandoned" in str(box["rank1"]), box
    with pytest.raises(RendezvousAbandoned, match="stage 1 \\(pid 4242\\) exited unexpectedly"):
        raise box["rank0"]
