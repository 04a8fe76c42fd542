"""Command-line flags of placement: `--backend`, the Ray flags and the torchrun-style multi-node flags.

Owns turning flags (and, for the multi-node mode, the MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK
environment variables that SLURM and Kubernetes set) into `PlacementOptions`.
Must not: start anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from launcher.backends.placement import (
    BACKENDS,
    PLACEMENT_STRATEGIES,
    PlacementError,
    PlacementOptions,
    parse_stage_resources,
)


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """Flags of every command that places a pipeline."""
    g = p.add_argument_group("placement")
    g.add_argument("--backend", "--distributed-executor-backend", default="local", choices=BACKENDS,
                   type=lambda name: "local" if name == "mp" else name,  # vLLM's `mp` is the local backend
                   help="local (or vLLM's mp): one process per stage on this machine; ray: one Ray actor per stage "
                   "(default local)")
    g.add_argument("--ray-address", help="Ray cluster to join: auto or HOST:PORT (default: start a local Ray "
                   "instance sized to the stages)")
    g.add_argument("--stage-resources", help='Ray resources of one stage, JSON, e.g. \'{"CPU": 1}\' or '
                   '\'{"GPU": 1}\' (default one CPU, or one GPU with --device cuda)')
    g.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="Ray placement-group strategy of the stage bundles (default PACK)")
    g.add_argument("--placement-timeout-s", type=float, default=60.0,
                   help="fail if the stages cannot be placed (Ray) or every node has not joined (--nnodes) "
                   "within this many seconds (default 60)")
    g.add_argument("--nnodes", type=int, help="torchrun-style mode: number of nodes, one `launch` per node "
                   "(default $WORLD_SIZE or 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank; node 0 runs the coordinator (default $RANK or 0)")
    g.add_argument("--master-addr", help="address of node 0, reachable from every node "
                   "(default $MASTER_ADDR or 127.0.0.1)")
    g.add_argument("--master-port", type=int, help="launch rendezvous port on node 0; the data plane uses "
                   "port + 1 (default $MASTER_PORT or 29500)")
    g.add_argument("--host-ip", help="address this node's stages bind and advertise (default: the interface "
                   "that routes to --master-addr)")


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise PlacementError(f"environment variable {name}={value!r} is not an integer") from None


def placement_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> PlacementOptions:
    """PlacementOptions from the flags; multi-node flags fall back to the torchrun environment variables
    (local backend only). Raises PlacementError (a ValueError) for bad values."""
    env = os.environ if environ is None else environ
    resources = parse_stage_resources(args.stage_resources) if args.stage_resources else None
    if args.backend != "local":
        env = {}
    nnodes = args.nnodes if args.nnodes is not None else _env_int(env, "WORLD_SIZE") or 1
    node_rank = args.node_rank if args.node_rank is not None else _env_int(env, "RANK") or 0
    return PlacementOptions(
        backend=args.backend, ray_address=args.ray_address, stage_resources=resources,
        placement_strategy=args.placement_strategy, placement_timeout_s=args.placement_timeout_s,
        nnodes=nnodes, node_rank=node_rank,
        master_addr=args.master_addr or env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=args.master_port if args.master_port is not None else _env_int(env, "MASTER_PORT") or 29500,
        host_ip=args.host_ip)
