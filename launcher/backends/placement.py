"""Placement: where the stage workers run, independent of how they are started.

Owns the placement options of a pipeline (`--backend local|ray`, the Ray flags, the torchrun-style
multi-node flags), the `StageBackend` role every placement backend plays for `PipelineSession`, and
the pure placement rules: the deterministic stage order of Ray bundles, which stages a node runs in
the multi-node mode, how many stages can compute at once, the environment forwarded to remote
workers, and interface detection.
Must not: import ray (only launcher/backends/ray_cluster/ does), spawn processes, or
talk to stages.

[Note: stage order]
Stage i is rank i + 1 of the data plane and neighbours talk point-to-point, so the order of stages
over nodes decides which hops cross the network. As vLLM does for its Ray workers, the order is a
pure function of where the bundles landed, not of the order Ray happened to report them: stages on
the driver's node first (the coordinator, rank 0, runs there, so stage 0 and the last stage are its
nearest neighbours when they can be), then nodes by IP address (numerically), then node id, then
bundle index. The same placement always gives the same ranks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import json
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from workers.log_config import LOG_LEVEL_ENV
from workers.rpc.control_auth import API_KEY_ENV, SECRET_ENV

BACKENDS = ("local", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Environment forwarded to every remote stage worker (the table in deploy/README.md).
FORWARDED_ENV_PREFIXES = ("NCCL_", "MASTER_", "SPEEDPIPE_")
FORWARDED_ENV_NAMES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")
# Credentials never travel in a runtime_env (Ray keeps it in its GCS and shows it on its dashboard):
# the control secret goes to each actor's Start call, the API key is the driver's own.
NOT_FORWARDED_ENV_NAMES = (API_KEY_ENV, SECRET_ENV)


class StageGone(RuntimeError):
    """A stage that cannot be restarted at all (its node's launcher was stopped): the coordinator
    fails at once instead of spending its restart budget on attempts that cannot succeed."""


class PlacementError(ValueError):
    """The requested placement cannot be satisfied (bad flags, or not enough cluster resources).

    A ValueError: the CLI reports it in one line with exit code 2.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementOptions:
    """Where the stages run.

    backend: `local` (processes on this machine) or `ray` (actors in a placement group).
    ray_address: None starts a local Ray instance sized to the stages; `auto` or `HOST:PORT` joins one.
    stage_resources: Ray resources of one stage's bundle, e.g. {"CPU": 1} or {"GPU": 1}.
    placement_strategy: Ray placement-group strategy of the stage bundles.
    placement_timeout_s: how long to wait for the placement (Ray) or for every node (multi-node mode).
    nnodes, node_rank, master_addr, master_port: torchrun-style multi-node mode (nnodes > 1).
    host_ip: address this node's stages bind and advertise (None: the interface that reaches master_addr).
    """

    backend: str = "local"
    ray_address: str | None = None
    stage_resources: Mapping[str, float] | None = None  # None: {"CPU": 1}, or {"GPU": 1} on CUDA
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 60.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    host_ip: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise PlacementError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise PlacementError(f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                                 f"got {self.placement_strategy!r}")
        if not self.placement_timeout_s > 0:
            raise PlacementError(f"--placement-timeout-s must be > 0, got {self.placement_timeout_s}")
        if self.stage_resources is not None:
            validate_resources(self.stage_resources)
        if self.nnodes < 1:
            raise PlacementError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise PlacementError(f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                                 f"got {self.node_rank}")
        if not 0 < self.master_port < 65535:
            raise PlacementError(f"--master-port must be in [1, 65534] (the data plane uses port + 1), "
                                 f"got {self.master_port}")
        if not self.master_addr:
            raise PlacementError("--master-addr must be a host name or address, got ''")
        if self.backend == "ray" and importlib.util.find_spec("ray") is None:
            raise PlacementError("--backend ray needs the ray package: pip install 'speedpipe[ray]' (ray==2.60.0)")
        if self.nnodes > 1 and self.backend != "local":
            raise PlacementError("--nnodes > 1 is the torchrun-style mode without Ray; drop --backend ray "
                                 "(Ray places stages across its own nodes)")

    @property
    def multi_node(self) -> bool:
        """True in the torchrun-style mode (more than one `launch` process, one per node)."""
        return self.nnodes > 1

    def bundle(self, device: str) -> dict[str, float]:
        """Resources of one stage's bundle: `stage_resources`, else one CPU (or one GPU on CUDA)."""
        if self.stage_resources is not None:
            return dict(self.stage_resources)
        return {"GPU": 1.0} if device.startswith("cuda") else {"CPU": 1.0}


def validate_resources(resources: Mapping[str, float]) -> None:
    """Raises PlacementError unless `resources` maps non-empty names to numbers >= 0, not all zero."""
    if not isinstance(resources, Mapping) or not resources:
        raise PlacementError(f"--stage-resources must be a non-empty JSON object such as "
                             f'{{"CPU": 1}}, got {resources!r}')
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise PlacementError(f"--stage-resources: resource names must be non-empty strings, got {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise PlacementError(f"--stage-resources: {name} must be a number >= 0, got {amount!r}")
    if not any(resources.values()):
        raise PlacementError(f"--stage-resources asks for nothing: {dict(resources)}")


def parse_stage_resources(text: str) -> dict[str, float]:
    """`'{"GPU": 1}'` -> {"GPU": 1.0}. Raises PlacementError naming the problem."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlacementError(f"--stage-resources is not valid JSON ({exc.msg}): {text!r}") from None
    validate_resources(value)
    return {k: float(v) for k, v in value.items()}


# -- Ray stage order ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class BundleNode:
    """Where one placement-group bundle landed."""

    bundle_index: int
    node_id: str
    node_ip: str


def _ip_key(ip: str) -> tuple[int, int, str]:
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, int(addr), "")
    except ValueError:  # a host name: after every address, alphabetically
        return (99, 0, ip)


def stage_order(bundles: Sequence[BundleNode], *, driver_node_id: str) -> list[BundleNode]:
    """The bundles in stage order (element i hosts stage i); see [Note: stage order]. Pure."""
    return sorted(bundles, key=lambda b: (b.node_id != driver_node_id, _ip_key(b.node_ip), b.node_id,
                                          b.bundle_index))


# -- torchrun-style multi-node mode ------------------------------------------------------------------
def node_stages(*, num_stages: int, nnodes: int, node_rank: int) -> range:
    """Stages run by node `node_rank`: contiguous blocks, leftover stages to the earliest nodes.

    5 stages on 2 nodes: node 0 runs stages 0-2, node 1 runs 3-4. Raises PlacementError if a node
    would run no stage.
    """
    if nnodes > num_stages:
        raise PlacementError(f"--nnodes {nnodes} is more than --stages {num_stages}: every node must run "
                             f"at least one stage")
    base, extra = divmod(num_stages, nnodes)
    start = node_rank * base + min(node_rank, extra)
    return range(start, start + base + (1 if node_rank < extra else 0))


def stages_on_this_machine(placement: PlacementOptions) -> bool:
    """True when every stage runs on this machine: local processes (not the multi-node mode), or
    the actors of a private Ray instance (no `ray_address`). The one rule for what shares this
    machine's CPUs (`parallel_stages`) and memory (run_plan's `check_lengths`)."""
    if placement.backend == "local":
        return not placement.multi_node
    return placement.ray_address is None


def available_memory_bytes(*, cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Bytes this process's stages can still allocate: the kernel's estimate of available memory
    (psutil), capped by this process's cgroup v2 limit (`memory.max` - `memory.current`: a
    container's `--memory`), which the machine-wide figure does not see."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        path = next(line[3:] for line in Path(proc_cgroup).read_text().splitlines() if line.startswith("0::"))
        here = Path(cgroup_root, *[p for p in path.split("/") if p])
        limit = (here / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, max(0, int(limit) - int((here / "memory.current").read_text())))
    except (OSError, ValueError, StopIteration):
        pass  # no cgroup v2 limit readable: the machine's figure stands
    return available


def parallel_stages(placement: PlacementOptions, *, num_stages: int, device: str, threads_per_stage: int,
                    cpus: int | None = None) -> int:
    """How many of `num_stages` stages can compute at the same time, in [1, num_stages]: what the
    draft gate's break-even needs ([Note: adaptive drafting] in pipeline/speculation/draft_gate.py).

    CPU stages started by `launch` share their node's CPUs: `cpus` (default: `usable_cpus()`, which
    sees the affinity mask and a container's CPU quota) // threads_per_stage per node, e.g. 2 of 4 stages on
    2 CPUs at one thread each. In the multi-node mode every node is assumed to have as many CPUs as
    this one and runs its block of stages (`node_stages`). A private Ray instance (no
    `ray_address`) runs on this machine, so it counts as local; the bundles of a Ray cluster reserve
    their own resources, and CUDA stages count as one each (stages sharing one GPU: not measured)."""
    if (placement.backend != "local" and not stages_on_this_machine(placement)) or device != "cpu":
        return num_stages
    if cpus is None:
        cpus = usable_cpus()
    per_node = max(1, cpus // max(1, threads_per_stage))
    sizes = [len(node_stages(num_stages=num_stages, nnodes=placement.nnodes, node_rank=r))
             for r in range(placement.nnodes)] if placement.multi_node else [num_stages]
    return max(1, min(num_stages, sum(min(size, per_node) for size in sizes)))


def usable_cpus(*, cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process can keep busy at once: the affinity mask (taskset, cpuset), capped by the
    tightest cgroup CPU quota on the way to the root (a container's `--cpus`, a systemd slice's
    CPUQuota; v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded down: a stage
    needs a whole CPU to compute without waiting (1.5 CPUs run one stage at a time and a half).
    At least 1. Unreadable cgroup files count as no quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


def cgroup_cpu_quota(*, cgroup_root: str, proc_cgroup: str) -> float | None:
    """The tightest CPU quota (quota / period, in CPUs) of this process's cgroup and its ancestors,
    v1 and v2, or None where there is none (`max`, -1, no cpu controller, files unreadable). Inside
    a container without a cgroup namespace the listed path may not exist below `cgroup_root`; its
    ancestors that do, and the root, are read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            bases, files = [Path(cgroup_root)], ("cpu.max", None)
        elif "cpu" in controllers.split(","):
            names = (controllers, ",".join(sorted(controllers.split(","))), "cpu")
            bases, files = [Path(cgroup_root, n) for n in names], ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        base = next((b for b in bases if b.is_dir()), None)
        if base is None:
            continue
        rel = [p for p in path.split("/") if p]
        for depth in range(len(rel), -1, -1):  # the cgroup itself, then each ancestor, then the root
            here = base.joinpath(*rel[:depth])
            quota = _read_quota(here / files[0], None if files[1] is None else here / files[1])
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _read_quota(quota_file: Path, period_file: Path | None) -> float | None:
    try:
        if period_file is None:  # v2: "max 100000" or "150000 100000"
            quota, period = quota_file.read_text().split()[:2]
        else:
            quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return None
    return int(quota) / int(period) if int(quota) > 0 else None


def detect_host_ip(peer_host: str, peer_port: int) -> str:
    """The local address of the interface that routes to `peer_host` (no packet is sent).

    Loopback peers give 127.0.0.1. Raises PlacementError if `peer_host` does not resolve.
    """
    try:
        infos = socket.getaddrinfo(peer_host, peer_port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise PlacementError(f"--master-addr {peer_host} does not resolve ({exc.strerror}); "
                             f"check the name or pass an address") from None
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.connect(sockaddr)  # UDP connect only picks a route
        return str(sock.getsockname()[0])


def forwarded_env(environ: Mapping[str, str], *, log_level: str) -> dict[str, str]:
    """The allow-listed variables of `environ` for remote workers, plus SPEEDPIPE_LOG_LEVEL.

    Allow-list: NCCL_*, MASTER_*, SPEEDPIPE_* (but not SPEEDPIPE_API_KEY or SPEEDPIPE_CONTROL_SECRET),
    GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, LOG_LEVEL, TORCH_CPP_LOG_LEVEL.
    Anything else (credentials, PATH of the driver's machine) stays on the driver.
    """
    env = {k: v for k, v in environ.items() if k not in NOT_FORWARDED_ENV_NAMES
           and (k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES)}
    env[LOG_LEVEL_ENV] = log_level
    return env


# -- the role a placement backend plays --------------------------------------------------------------
class StageBackend(Protocol):
    """The stage workers of one pipeline, wherever they run (local processes, Ray actors, nodes).

    `start()` returns the gRPC address of every stage in stage order once each worker listens;
    `watch(on_death)` calls `on_death(stage_index, description)` once, from another thread, when a
    worker dies before `unwatch()` or `stop()` (the session unwatches before the coordinator shuts the
    stages down, so their exits are expected); `stop()` stops every worker, is idempotent and safe on every exit
    path. `master_addr` is the address of this (the coordinator's) machine that every stage can reach:
    rank 0 hosts the data-plane rendezvous there. `data_port()` is the port it uses, held by this
    process until rank 0's store serves on it where it can be ([Note: held rendezvous port]).
    Fail-over ([Note: fail-over] in launcher/coordinator/stage_failover.py): `dead_stages()` are the
    indices of workers that exited; `restart_stage(i)` kills worker i if it runs, starts it again
    (same arguments and session secret) and returns its new gRPC address; `pause_watch()` stops
    `watch` for the restart (a new `watch` follows) without telling other nodes the pipeline ends.
    """

    master_addr: str

    def start(self) -> list[str]: ...

    def data_port(self) -> int: ...

    def watch(self, on_death: Callable[[int, str], None]) -> None: ...

    def unwatch(self) -> None: ...

    def describe(self, stage_index: int) -> str: ...

    def dead_stages(self) -> list[int]: ...

    def restart_stage(self, stage_index: int) -> str: ...

    def pause_watch(self) -> None: ...

    def stop(self) -> None: ...


def probe_ray_address(address: str, *, timeout_s: float) -> None:
    """Raise PlacementError unless a TCP connection to a `HOST:PORT` Ray address opens within
    `timeout_s`: `ray.init` itself retries an unreachable GCS without any deadline. `auto` and
    `ray://` client addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PlacementError(f"--ray-address must be HOST:PORT, auto or ray://HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise PlacementError(f"--ray-address {address}: no Ray cluster reachable there within {timeout_s:g} s "
                             f"({exc.strerror or exc}); start one with `ray start --head` or check the address") from None
