"""Ray placement backend: one Ray actor per pipeline stage, in one placement group.

Owns the Ray side of placement: joining (or starting) a Ray instance, one placement group with a
bundle per stage, waiting for it at most `placement_timeout_s` and explaining a placement that cannot
be satisfied, one `StageActor` per bundle in the deterministic stage order of
`launcher.backends.placement.stage_order`, the forwarded environment, noticing a dead actor or node, and
stopping everything it started. With connect.py (joining a cluster), messages.py (Ray's driver output on
stderr, death and connection messages) and nodes.py (node liveness) beside it, the only modules of
the project that import ray.
Must not: know about models, the control-plane RPCs or the data plane beyond handing out the stages'
gRPC addresses (the same role as launcher/backends/local.py).

A stage actor runs the very same worker code as a local stage process, in-process: it starts the
stage's gRPC `StageService` (`workers.stage_worker.start_server`) on its node's IP and reports the
address; the coordinator then drives it exactly like a local stage. Each actor also answers one
long-running `wait_stopped()` call; its ObjectRef resolves when the stage shuts down, or fails with
`RayActorError` when the actor or its node dies, so the watcher thread sleeps in `ray.wait` and
never polls. Actors are owned by the driver, so Ray kills them when the driver exits (no orphans).

Fail-over ([Note: fail-over] in launcher/coordinator/stage_failover.py): `restart_stage(i)` kills stage
i's actor (a hung one too) and starts a new one in the same placement-group bundle, so it gets the
same resources on the same node; the coordinator then `Load`s it and `Rejoin`s the others, as for
local processes. The actors' `rejoin_wait_s` keeps a surviving stage whose data plane broke alive
until that `Rejoin` (without it the worker exits, and with it the actor). After a node loss the bundle
moves to a live node first ([Note: node loss] in launcher/backends/ray_cluster/nodes.py).

[Note: rendezvous address]
The data plane's TCPStore is hosted by rank 0, the coordinator, which runs in the driver; so the
rendezvous address is the driver node's IP as Ray sees it (`ray.util.get_node_ip_address()`). Stage 0
runs on the driver's node whenever that node holds a bundle ([Note: stage order] in
launcher/backends/placement.py), so this is then also the first stage's node IP; when the driver's node holds
no bundle (a CPU-only head with GPU bundles), the stages still reach the coordinator there. Across
nodes, gloo picks its interface from the host name, or from GLOO_SOCKET_IFNAME (forwarded).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.backends.placement import (
    BundleNode,
    PlacementError,
    PlacementOptions,
    forwarded_env,
    stage_order,
)
from launcher.backends.ports import format_address
from launcher.backends.ray_cluster.connect import join_ray
from launcher.backends.ray_cluster.messages import death_cause, format_resources
from launcher.backends.ray_cluster.nodes import node_alive, wait_for_lost_node
from workers.channel import hold_listener
from workers.log_config import LOG_LEVELS, configure_logging, default_log_level

log = logging.getLogger("speedpipe.ray")

STOP_JOIN_TIMEOUT_S = 10.0
STOP_GRACE_S = 10.0  # stop(): how long told stages get to stop their own servers before ray.kill
PROBE_TIMEOUT_S = 10.0  # at most this long (and --placement-timeout-s) to reach a HOST:PORT cluster


class StageActor:
    """One pipeline stage inside a Ray actor (max_concurrency 2: `wait_stopped` blocks one thread)."""

    def __init__(self, stage_index: int) -> None:
        self.stage_index = stage_index
        self.stop_event = threading.Event()
        self.server = None
        self.servicer = None

    def __repr__(self) -> str:  # Ray prefixes forwarded log lines with it: "(Stage1 pid=...)"
        return f"Stage{self.stage_index}"

    def start(self, control_secret: str | None = None, tls=None, rejoin_wait_s: float = 0.0) -> dict:
        """Start the StageService on this node's IP (checking `control_secret` on every call, see
        workers/rpc/control_auth.py; waiting `rejoin_wait_s` for a Rejoin after a data-plane failure),
        logging at the driver's level (SPEEDPIPE_LOG_LEVEL in the actor's environment); returns where it runs."""
        import torch

        from workers.stage_worker import start_server  # the worker code, imported in the actor only

        configure_logging()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        host = ray.util.get_node_ip_address()
        self.server, self.servicer, port = start_server(stage_index=self.stage_index, host=host, port=0,
                                                        stop_event=self.stop_event, control_secret=control_secret,
                                                        tls=tls, rejoin_wait_s=rejoin_wait_s)
        return {"host": host, "port": port, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "hostname": socket.gethostname()}

    def wait_stopped(self) -> int:
        """Blocks until the Shutdown RPC; then stops the server. Returns 0."""
        from workers.stage_worker import stop_server

        self.stop_event.wait()
        server, servicer = self.server, self.servicer
        self.server = self.servicer = None
        if server is not None:
            stop_server(server, servicer)
        # Drop the last references here, so grpc's Server.__del__ runs now, in this call, and not
        # later while Ray's SIGTERM handler (ray.kill) interrupts it ("Exception ignored in __del__").
        del server, servicer
        return 0


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage runs."""

    stage_index: int
    bundle_index: int
    node_id: str
    node_ip: str
    pid: int = 0
    address: str = ""


def _actor_options(bundle: Mapping[str, float]) -> dict:
    """Actor resource options that use exactly one bundle (CPU/GPU/memory are Ray's keywords)."""
    options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if "memory" in bundle:
        options["memory"] = bundle["memory"]
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


class RayStageActors:
    """The stage actors of one pipeline; plays the StageBackend role (see launcher/backends/placement.py).

    Usage::

        with RayStageActors(num_stages=2, placement=PlacementOptions(backend="ray")) as stages:
            addresses = stages.start()   # ["10.0.0.5:41234", "10.0.0.6:40111"]

    Raises PlacementError (a ValueError: exit code 2) if the placement cannot be satisfied within
    `placement.placement_timeout_s`; RuntimeError if an actor fails to start (naming stage and node).
    rejoin_wait_s: how long a stage whose data plane broke waits for the coordinator's Rejoin (fail-over).
    log_level: the actors' (None: $SPEEDPIPE_LOG_LEVEL, else WARNING), sent as their SPEEDPIPE_LOG_LEVEL.
    """

    def __init__(self, *, num_stages: int, placement: PlacementOptions, device: str = "cpu",
                 log_level: str | None = None, threads_per_stage: int = 1, startup_timeout_s: float = 120.0,
                 environ: Mapping[str, str] | None = None, control_secret: str | None = None,
                 tls=None, rejoin_wait_s: float = 0.0) -> None:
        log_level = default_log_level() if log_level is None else log_level
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        self.num_stages = num_stages
        self.options = placement
        self.bundle = placement.bundle(device)
        self.log_level = log_level
        self.threads_per_stage = threads_per_stage
        self.startup_timeout_s = startup_timeout_s
        self.environ = dict(os.environ if environ is None else environ)
        self.control_secret, self.tls = control_secret, tls  # tls: workers.rpc.control_auth.TlsFiles or None
        self.rejoin_wait_s = rejoin_wait_s
        self.master_addr = "127.0.0.1"
        self.placements: list[StagePlacement] = []
        self._started_ray = False
        self._pg = None
        self._actors: list = []
        self._stopped_refs: dict = {}
        self._stopping = threading.Event()
        self._unwatched = threading.Event()  # the current watcher's: exits from now on are expected
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def actors(self) -> list:
        """The stage actors' handles in stage order (for `ray.kill` in tests and tools)."""
        return list(self._actors)

    # -- StageBackend -----------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Place the bundles, start one actor per stage, return gRPC addresses in stage order."""
        self._init_ray()
        self.master_addr = ray.util.get_node_ip_address()
        try:
            order = self._place()
            self._start_actors(order)
        except BaseException:
            self.stop()
            raise
        return [p.address for p in self.placements]

    def data_port(self) -> int:
        return hold_listener(self.master_addr)  # [Note: held rendezvous port]

    def describe(self, stage_index: int) -> str:
        if stage_index >= len(self.placements):
            return f"stage {stage_index}"
        p = self.placements[stage_index]
        return f"stage {stage_index} (Ray actor pid {p.pid} on node {p.node_ip} id {p.node_id[:12]})"

    def watch(self, on_death: Callable[[int, str], None]) -> None:
        """Call `on_death(stage_index, description)` once if an actor, or its node, dies before
        `unwatch()` or stop(). A watch after an unwatch watches the current actors (fail-over)."""
        self._unwatched = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(on_death, dict(self._stopped_refs), self._unwatched),
                                         name="speedpipe-ray-watch", daemon=True)
        self._watcher.start()

    def unwatch(self) -> None:
        """Exits from now on are expected (the coordinator is shutting the stages down, or restarting one)."""
        self._unwatched.set()

    pause_watch = unwatch  # during a fail-over (a new `watch` follows)

    def dead_stages(self) -> list[int]:
        """Indices of the stages whose actor has stopped or died (its `wait_stopped` call resolved)."""
        refs = list(self._stopped_refs)
        if not refs:
            return []
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return sorted(self._stopped_refs[ref] for ref in done)

    def restart_stage(self, stage_index: int) -> str:
        """Kill stage `stage_index`'s actor if it still runs and start a new one in the same bundle
        (same resources; same node unless that node was lost: [Note: node loss]), with the same secret; returns its new gRPC address. The
        coordinator loads it ([Note: fail-over]). Raises RuntimeError if it does not start within
        `startup_timeout_s`, or if the stages are stopping."""
        with self._lock:
            if self._stopping.is_set() or not self._actors:
                raise RuntimeError("restart_stage() needs started stages that are not being stopped")
            old = self.placements[stage_index]
            with contextlib.suppress(Exception):
                ray.kill(self._actors[stage_index], no_restart=True)
            where = BundleNode(bundle_index=old.bundle_index, node_id=old.node_id, node_ip=old.node_ip)
            if wait_for_lost_node(old.node_id, what=self.describe(stage_index), stopping=self._stopping,
                                  timeout_s=self.options.placement_timeout_s):  # [Note: node loss]
                where = BundleNode(bundle_index=old.bundle_index, node_id="", node_ip="(its bundle's new node)")
            actor = self._new_actor(stage_index, where)
            self._actors[stage_index] = actor
            placement = self._started(stage_index, where, actor.start.remote(*self._start_args()))
            self.placements[stage_index] = placement
            self._stopped_refs = {ref: i for ref, i in self._stopped_refs.items() if i != stage_index}
            self._stopped_refs[actor.wait_stopped.remote()] = stage_index
        log.warning("restarted %s", self.describe(stage_index))
        return placement.address

    def stop(self) -> None:
        """Kill every actor, remove the placement group, shut down Ray if this object started it."""
        self._stopping.set()  # before the lock: a restart waiting for a lost node gives up at once
        with self._lock:
            if self._unwatched.is_set():  # the coordinator told the stages to shut down (Session.close)
                self._await_stopped(STOP_GRACE_S)
            for actor in self._actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            self._actors = []
            if self._watcher is not None and self._watcher is not threading.current_thread():
                self._watcher.join(STOP_JOIN_TIMEOUT_S)
            if self._pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(self._pg)
                self._pg = None
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False

    def _await_stopped(self, timeout_s: float) -> None:
        """Give stages already told to shut down (the coordinator's Shutdown RPC) up to `timeout_s`
        to stop their own servers before `ray.kill`; a hung stage costs the full wait once."""
        refs = list(self._stopped_refs) if self._actors else []
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def __enter__(self) -> RayStageActors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        num_cpus = max(1, math.ceil(self.bundle.get("CPU", 0) * self.num_stages))
        probe_s = min(PROBE_TIMEOUT_S, self.options.placement_timeout_s)
        self._started_ray = join_ray(self.options.ray_address, num_cpus=num_cpus, probe_timeout_s=probe_s)

    def _place(self) -> list[BundleNode]:
        bundles = [dict(self.bundle) for _ in range(self.num_stages)]
        self._pg = placement_group(bundles, strategy=self.options.placement_strategy, name="")
        timeout_s = self.options.placement_timeout_s
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            raise PlacementError(self._unsatisfiable_message())
        table = placement_group_table(self._pg)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        placed = [BundleNode(bundle_index=int(b), node_id=node, node_ip=ips.get(node, "?"))
                  for b, node in table["bundles_to_node_id"].items()]
        return stage_order(placed, driver_node_id=ray.get_runtime_context().get_node_id())

    def _unsatisfiable_message(self) -> str:
        opt = self.options
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = "; ".join(f"{n['NodeManagerAddress']} {format_resources(n['Resources'])}" for n in nodes)
        hint = ""
        if opt.placement_strategy == "STRICT_SPREAD" and len(nodes) < self.num_stages:
            hint = f" STRICT_SPREAD needs {self.num_stages} nodes, one per stage."
        elif opt.placement_strategy == "STRICT_PACK":
            hint = " STRICT_PACK needs every bundle on one node."
        return (f"Ray placement not satisfied within {opt.placement_timeout_s:g} s (--placement-timeout-s): asked "
                f"for {self.num_stages} bundle(s) of {format_resources(self.bundle)} (--stages {self.num_stages}, "
                f"--stage-resources), strategy {opt.placement_strategy}; the cluster has {len(nodes)} node(s): "
                f"{per_node}; total {format_resources(ray.cluster_resources())}, available now "
                f"{format_resources(ray.available_resources())}.{hint} Check --stage-resources against the "
                f"nodes' resources, --placement-strategy, that every node joined (`ray status`), and that no "
                f"other job holds the resources.")

    def _env(self) -> dict[str, str]:
        env = forwarded_env(self.environ, log_level=self.log_level)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads_per_stage)
        return env

    def _new_actor(self, stage_index: int, where: BundleNode):
        """A StageActor for `stage_index` in bundle `where.bundle_index` of the placement group."""
        return ray.remote(StageActor).options(
            **_actor_options(self.bundle), max_concurrency=2, max_restarts=0,
            runtime_env={"env_vars": self._env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=where.bundle_index),
        ).remote(stage_index)

    def _start_args(self) -> tuple:
        return self.control_secret, self.tls, self.rejoin_wait_s

    def _started(self, stage_index: int, where: BundleNode, ref, *, timeout_s: float | None = None) -> StagePlacement:
        """Where stage `stage_index` runs once its `start` call `ref` returned. Raises RuntimeError
        if it fails or takes longer than `timeout_s` (default `startup_timeout_s`)."""
        ready, _ = ray.wait([ref], timeout=self.startup_timeout_s if timeout_s is None else timeout_s)
        if not ready:
            raise RuntimeError(f"stage {stage_index} (Ray actor on node {where.node_ip}) did not start within "
                               f"{self.startup_timeout_s:g} s")
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"stage {stage_index} (Ray actor on node {where.node_ip}) failed to start: "
                               f"{str(exc).splitlines()[0]}") from None
        host = info["host"]
        return StagePlacement(stage_index=stage_index, bundle_index=where.bundle_index, node_id=info["node_id"],
                              node_ip=host, pid=info["pid"], address=format_address(host, info["port"]))

    def _start_actors(self, order: list[BundleNode]) -> None:
        self._actors = [self._new_actor(stage_index, where) for stage_index, where in enumerate(order)]
        started = [actor.start.remote(*self._start_args()) for actor in self._actors]
        ray.wait(started, num_returns=len(started), timeout=self.startup_timeout_s)  # one deadline for all
        for stage_index, (ref, where) in enumerate(zip(started, order, strict=True)):
            self.placements.append(self._started(stage_index, where, ref, timeout_s=0))
        self._stopped_refs = {actor.wait_stopped.remote(): i for i, actor in enumerate(self._actors)}
        log.info("Ray stages: %s", "; ".join(self.describe(i) for i in range(self.num_stages)))

    def _watch(self, on_death: Callable[[int, str], None], pending: dict, unwatched: threading.Event) -> None:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            if self._stopping.is_set() or unwatched.is_set():
                return
            stage_index = pending.pop(ready[0])
            try:
                ray.get(ready[0])
                cause = "stopped on its own"
            except ray.exceptions.RayError as exc:
                node = self.placements[stage_index]
                cause = death_cause(exc, node_ip=node.node_ip, node_alive=node_alive(node.node_id))
            if self._stopping.is_set() or unwatched.is_set():
                return
            log.error("%s died: %s", self.describe(stage_index), cause)
            on_death(stage_index, f"{self.describe(stage_index)} died: {cause}")
            return
