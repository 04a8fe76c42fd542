"""Fail-over rendezvous that can no longer complete end promptly, with torch's real TCPStore and gloo
on loopback ([Note: abandoned rendezvous] in workers/channel.py).

What breaks when these fail: a stage that counts in and dies before its gloo group forms keeps every
other rank, the coordinator included, inside torch's gloo constructor until --stage-timeout-s (120 s);
a stage told to Rejoin a rendezvous the coordinator already gave up retries its connect until the
Rejoin's own timeout (600 s).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launcher.backends.ports import free_port
from tests.conftest import wait_for
from workers.channel import DataPlaneGroup, GiveUp, RendezvousAbandoned, hold_listener

ROOT = Path(__file__).resolve().parents[2]
STAGE_TIMEOUT_S = 120.0  # the old code waited this long; the tests wait at most OUTCOME_S
OUTCOME_S = 30.0

# rank 2: counts in at the rendezvous, then dies before it forms its gloo group
COUNTS_IN_AND_DIES = """
import datetime, os, sys
import torch.distributed as dist
from workers.rendezvous import count_in
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 3, False, timeout=datetime.timedelta(seconds=30))
count_in(store, rank=2, world_size=3, timeout_s=30, abandoned=None)
os._exit(9)
"""


def _join_in_thread(outcome: dict, **kwargs) -> threading.Thread:
    def join() -> None:
        try:
            DataPlaneGroup(master_addr="127.0.0.1", timeout_s=STAGE_TIMEOUT_S, connect_timeout_s=STAGE_TIMEOUT_S,
                           **kwargs)
            outcome["error"] = None
        except RuntimeError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_a_stage_dying_between_count_in_and_gloo_ends_every_ranks_wait_once_given_up():
    port = hold_listener("127.0.0.1")
    given_up, coordinator, stage = GiveUp(), {}, {}
    threads = [_join_in_thread(coordinator, master_port=port, rank=0, world_size=3, abandoned=given_up),
               _join_in_thread(stage, master_port=port, rank=1, world_size=3)]
    dead = subprocess.run([sys.executable, "-c", COUNTS_IN_AND_DIES, str(port)], cwd=ROOT, capture_output=True,
                          text=True, timeout=OUTCOME_S)
    assert dead.returncode == 9, dead.stderr[-500:]
    # both ranks past count-in, inside the gloo rendezvous (bounded: the old code had no such thread)
    wait_for(lambda: sum(t.name == "gloo-rendezvous" for t in threading.enumerate()) >= 2, timeout_s=10.0)
    given_up.give_up("stage 1 (Rejoin) failed: Socket closed")  # as rejoin_all does when the dead stage's call fails
    for thread in threads:
        thread.join(timeout=OUTCOME_S)
    assert not any(t.is_alive() for t in threads), "a rank still waits inside the gloo rendezvous"
    assert isinstance(coordinator["error"], RendezvousAbandoned), coordinator["error"]
    assert "stage 1 (Rejoin) failed: Socket closed" in str(coordinator["error"])
    assert isinstance(stage["error"], RendezvousAbandoned), stage["error"]
    assert "rendezvous abandoned" in str(stage["error"])


@pytest.mark.timeout(120)
def test_a_rejoin_at_a_rendezvous_nobody_hosts_any_more_says_it_was_abandoned():
    port, outcome = free_port(), {}  # the coordinator gave it up: its port closed
    thread = _join_in_thread(outcome, master_port=port, rank=1, world_size=3, refused_is_abandoned=True)
    thread.join(timeout=OUTCOME_S)
    assert not thread.is_alive(), "the stage still retries its connect to an abandoned rendezvous"
    assert isinstance(outcome["error"], RendezvousAbandoned), outcome["error"]
    assert "the coordinator gave this rendezvous up" in str(outcome["error"])
