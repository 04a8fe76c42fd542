"""Whether a Ray node is alive: the GCS's word, the node's raylet answering, and waiting for a node
loss to be declared.

Owns the liveness questions stage_actors.py asks about a dead stage's node (its death message, and
where its restart goes). Must not start or kill actors.

[Note: node loss]
When a node dies, the data plane usually notices first (a peer's gloo socket closes), seconds before
Ray's GCS has missed enough health checks to declare the node dead; until then the placement group
keeps the dead stage's bundle on that node, so a new actor started in it dies at once and costs a
second restart from the budget (seen on a simulated cluster: 2 restarts for one node loss). So
`restart_stage` first asks the old node's raylet for a TCP connection (`raylet_answers`, at most
RAYLET_PROBE_S); when none comes, it waits, at most --placement-timeout-s, until the GCS declares the
node dead (`await_node_declared_dead`). Ray then reschedules the placement group's bundles of the dead
node onto nodes with room, and the new actor, started in its bundle, waits for that: one node loss,
one restart. A node that answers (only the actor died) is not waited for.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import ray

log = logging.getLogger("speedpipe.ray")

RAYLET_PROBE_S = 2.0  # a raylet that accepts no connection this fast: its node is lost
NODE_DEATH_POLL_S = 0.5


def _gcs_node(node_id: str) -> dict | None:
    """The GCS's record of node `node_id` (`ray.nodes()`), or None when it has none or cannot say."""
    try:
        return next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except Exception:  # noqa: BLE001 - callers treat "cannot tell" as alive
        return None


def node_alive(node_id: str) -> bool:
    """Whether the GCS lists node `node_id` as alive (True when it cannot tell)."""
    node = _gcs_node(node_id)
    return True if node is None else bool(node.get("Alive"))


def raylet_answers(node_id: str, *, timeout_s: float = RAYLET_PROBE_S) -> bool:
    """Whether node `node_id`'s raylet accepts a TCP connection within `timeout_s` seconds.

    False when the GCS already lists the node as dead; True when the GCS has no address for it
    (nothing to probe: the caller goes ahead as if it were alive).
    """
    node = _gcs_node(node_id)
    if node is None:
        return True
    if not node.get("Alive"):
        return False
    host, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    if not host or not port:
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def await_node_declared_dead(node_id: str, *, timeout_s: float, stopping: threading.Event | None = None) -> bool:
    """Wait until the GCS lists node `node_id` as dead, at most `timeout_s` seconds, or until
    `stopping` is set; True if the node was declared dead."""
    deadline = time.monotonic() + timeout_s
    while node_alive(node_id):
        if time.monotonic() >= deadline or (stopping is not None and stopping.is_set()):
            return False
        time.sleep(NODE_DEATH_POLL_S)
    return True


def wait_for_lost_node(node_id: str, *, what: str, timeout_s: float, stopping: threading.Event) -> bool:
    """[Note: node loss]: False when node `node_id`'s raylet answers (only the actor died: nothing to
    wait for); True once the GCS has declared the node dead. `what` names the stage in messages.
    Raises RuntimeError when Ray does not declare it dead within `timeout_s` (--placement-timeout-s),
    or when `stopping` is set meanwhile."""
    if raylet_answers(node_id):
        return False
    log.warning("%s: its node does not answer; waiting for Ray to declare it dead and move its bundle", what)
    if not await_node_declared_dead(node_id, timeout_s=timeout_s, stopping=stopping):
        raise RuntimeError("the stages are being stopped" if stopping.is_set() else
                           f"{what}: its node does not answer, and Ray did not declare it dead within "
                           f"{timeout_s:g} s (--placement-timeout-s)")
    return True
