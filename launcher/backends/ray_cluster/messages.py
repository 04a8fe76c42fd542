"""What Ray tells the user, in speedpipe's words and on the right stream (used by launcher/backends/ray_cluster/stage_actors.py).

Owns: routing every line Ray forwards to the driver (the stage actors' own logs, and Ray's "(raylet)"
error notices such as "A worker died or was killed") to stderr, so stdout carries only model output;
one-line descriptions of an actor's death (naming its node when the node died) and of a failed
connection to a Ray cluster (authentication, or no cluster there); a placement-group's resources as
a user wrote them. Must not: start, place or kill anything.

[Note: Ray's driver output]
Ray prints forwarded worker lines and cluster error notices in the driver through one function,
`ray._private.worker.print_to_stdstream(data, ignore_prefix)`, which picks stdout or stderr by
`data["is_err"]`: the log-forwarding thread (`log_to_driver=True`) binds it when `ray.init` connects,
and the error-notice thread looks it up on every message. `route_ray_output_to_stderr()` replaces it,
before `ray.init`, with a wrapper that marks every batch `is_err`; the lines keep their Ray prefix
("(Stage1 pid=...)", "(raylet)") and are printed by Ray's own code. A Ray without that function
prints as before (logged once at DEBUG).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

log = logging.getLogger("speedpipe.ray")

_HIDDEN_RESOURCE = re.compile(r"^(node:|object_store_memory$|memory$|accelerator_type:|bundle_group_)|_group_")
_AUTH_FAILURE = re.compile(r"AuthenticationError|InvalidAuthToken|UNAUTHENTICATED|authenticat|auth[ _-]?token", re.I)


def route_ray_output_to_stderr() -> None:
    """Send everything Ray prints in the driver to stderr ([Note: Ray's driver output]); idempotent."""
    try:
        from ray._private import worker as ray_worker

        original = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):
        log.debug("this Ray has no ray._private.worker.print_to_stdstream; its driver output is not rerouted")
        return
    if getattr(original, "speedpipe_stderr", False):
        return

    def to_stderr(data: dict, ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    to_stderr.speedpipe_stderr = True
    ray_worker.print_to_stdstream = to_stderr


def format_resources(resources: Mapping[str, float]) -> str:
    """`{CPU: 2, GPU: 1}`: the resources a user asks for, without Ray's bookkeeping (node:, *_group_*)."""
    shown = {k: v for k, v in sorted(resources.items()) if not _HIDDEN_RESOURCE.search(k)}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def death_cause(exc: BaseException, *, node_ip: str = "", node_alive: bool = True) -> str:
    """One line from Ray's multi-line actor-death message: its headline plus why (node died, exit
    code). `node_alive` False (the GCS says the actor's node is dead): the line starts with that,
    since Ray's own reason may then be speedpipe's later `ray.kill` of the unreachable actor."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = [line for line in lines[1:] if line.startswith(("The actor is dead because", "The actor died because"))]
    text = " ".join(lines[:1] + why) or type(exc).__name__
    if not node_alive:
        text = f"its node {node_ip or '?'} died (Ray: {text})"
    return text if len(text) <= 300 else text[:297] + "..."


def connect_failure(address: str, exc: BaseException) -> str:
    """The one-line PlacementError message for a `ray.init(address=...)` that failed with `exc`:
    authentication (a token-auth cluster, and no or a wrong token here) or no cluster there. `exc`'s
    causes are read too: Ray wraps a refused token in a ConnectionError whose cause's text holds the
    AuthenticationError ([Note: Ray token authentication] in connect.py)."""
    chain, link = [], exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    if any(type(e).__name__ == "AuthenticationError" or _AUTH_FAILURE.search(str(e)) for e in chain):
        return (f"--ray-address {address}: Ray authentication failed: the cluster uses token authentication "
                f"and this process's token is missing or wrong; set RAY_AUTH_MODE=token and the cluster's "
                f"token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) for this process")
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return (f"--ray-address {address}: no Ray cluster there ({first}); start one with `ray start --head` "
            f"or check the address")
