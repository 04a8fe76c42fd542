"""The data-plane rendezvous port is held from the moment it is chosen until rank 0's store serves on
it ([Note: held rendezvous port] in workers/channel.py): nothing can take it in between."""

import socket
import threading

import pytest

from workers.channel import DataPlaneGroup, hold_listener, release_listener


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_held_port_cannot_be_bound_by_anyone_else():
    port = hold_listener("127.0.0.1")
    with pytest.raises(OSError):
        _bind(port)
    DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=0, world_size=1, timeout_s=5).close()


def test_a_held_port_accepts_connections_before_any_store_serves_it():
    port = hold_listener("127.0.0.1")
    with socket.create_connection(("127.0.0.1", port), timeout=2):  # completes in the listen backlog
        pass
    release_listener("127.0.0.1", port)
    _bind(port)  # released: free again
    release_listener("127.0.0.1", port)  # a second release is a no-op


def test_a_non_loopback_host_is_held_on_every_interface():
    port = hold_listener("0.0.0.0")
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    release_listener("0.0.0.0", port)


def test_rank_0_serves_on_the_held_port_and_a_peer_that_connected_early_joins():
    port = hold_listener("127.0.0.1")
    joined = {}

    def peer() -> None:  # connects before rank 0's store exists: waits in the held socket's backlog
        joined["group"] = DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=1, world_size=2,
                                         timeout_s=10, connect_timeout_s=10)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    thread.join(timeout=0.5)
    group = DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=10,
                           connect_timeout_s=10)
    thread.join(timeout=15)
    assert "group" in joined
    with pytest.raises(OSError):  # the store serves on the held socket itself
        _bind(port)
    group.close()
    joined["group"].close()


def test_an_unheld_port_is_bound_by_the_store_as_before():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=0, world_size=1, timeout_s=5)
    with pytest.raises(OSError):
        _bind(port)
    group.close()
