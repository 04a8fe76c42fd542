"""Joining a Ray instance for the Ray backend: a private local one, or the cluster at --ray-address.

Owns `join_ray`: the TCP probe of a HOST:PORT address, the token pre-flight, `ray.init`, and the
one-line PlacementError (exit 2) for a connection that fails. Must not: place or start actors
(stage_actors.py does), or word the messages (messages.py does).

[Note: Ray token authentication]
A cluster started with RAY_AUTH_MODE=token (Ray 2.60's `ray start --head` also turns it on by itself
when ~/.ray/auth_token exists) refuses a driver whose token is missing or wrong. Its
GCS client then raises `ray.exceptions.AuthenticationError("RPC error: InvalidAuthToken:
Authentication token is missing or incorrect")`, but `ray.init` retries that for about 20 s (one
C++ warning line a second) and raises `ConnectionError("Failed to connect to Ray cluster at ...")`,
the AuthenticationError only in the formatted traceback of its cause: speedpipe used to call that
"no Ray cluster there". Only RAY_AUTH_MODE=token without any token fails at once, with the
AuthenticationError itself. So before `ray.init`, `check_token` takes ray.init's first two steps
itself (the token check, one GCS client: milliseconds on a GCS that answers) and fails at once on an
AuthenticationError; `connect_failure` also reads
the cause chain. A GCS that does not answer within the probe time (a slow one, or another service
on that port) is left to `ray.init`, as before.
"""

from __future__ import annotations

import logging
import threading

import ray

from launcher.backends.placement import PlacementError, probe_ray_address
from launcher.backends.ray_cluster.messages import connect_failure, route_ray_output_to_stderr

log = logging.getLogger("speedpipe.ray")


def join_ray(address: str | None, *, num_cpus: int, probe_timeout_s: float) -> bool:
    """Join the Ray cluster at `address` (HOST:PORT, `auto` or `ray://...`), or start a private local
    instance with `num_cpus` CPUs when it is None. Returns True when this call initialised Ray (the
    caller shuts it down), False when Ray was already initialised (an embedding program or a test).

    Raises PlacementError (exit 2) naming the address and the remedy when nothing listens there
    within `probe_timeout_s` s, when the cluster refuses this process's token ([Note: Ray token
    authentication]), or when `ray.init` fails to connect.
    """
    route_ray_output_to_stderr()  # stdout carries only model output ([Note: Ray's driver output])
    if ray.is_initialized():
        return False
    common = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, **common)  # "local": never join a running one
        return True
    probe_ray_address(address, timeout_s=probe_timeout_s)
    if address != "auto" and "://" not in address:
        check_token(address, timeout_s=probe_timeout_s)
    try:
        ray.init(address=address, **common)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        raise PlacementError(connect_failure(address, exc)) from None
    return True


def check_token(address: str, *, timeout_s: float) -> None:
    """Raise PlacementError at once when this process has no Ray token though RAY_AUTH_MODE=token, or
    the GCS at HOST:PORT `address` refuses its token. Anything else (it accepts, another error, no
    answer within `timeout_s` s, a Ray without these internals) returns: `ray.init` then connects or
    reports it."""
    try:  # the two steps of ray.init's own connection (ray._private.worker.init, ray._private.node)
        from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
        from ray._raylet import GcsClient
    except ImportError:
        return
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            GcsClient(address=address)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    try:  # first, as ray.init does: in token mode without a token, GcsClient aborts the process
        ensure_token_if_auth_enabled(None, create_token_if_missing=False)
    except ray.exceptions.AuthenticationError as exc:
        raise PlacementError(connect_failure(address, exc)) from None
    worker = threading.Thread(target=connect, name="speedpipe-ray-token-check", daemon=True)
    worker.start()
    worker.join(timeout_s)
    error = outcome[0] if outcome else None
    if isinstance(error, ray.exceptions.AuthenticationError):
        raise PlacementError(connect_failure(address, error)) from None
    if error is not None or not outcome:
        log.debug("Ray token pre-flight at %s: %s", address, error or f"no answer within {timeout_s:g} s")
