"""Pure placement rules: deterministic stage order of Ray bundles, stages per node in the multi-node
mode, the forwarded environment, and the placement flags (including the torchrun environment)."""

from __future__ import annotations

import argparse
import random

import pytest

from launcher.backends.placement import (
    BundleNode,
    PlacementError,
    PlacementOptions,
    cgroup_cpu_quota,
    detect_host_ip,
    forwarded_env,
    node_stages,
    parallel_stages,
    parse_stage_resources,
    stage_order,
    usable_cpus,
)
from launcher.backends.placement_options import add_placement_args, placement_from_args

DRIVER = "node-driver"


def _bundles() -> list[BundleNode]:
    return [
        BundleNode(bundle_index=0, node_id="node-b", node_ip="10.0.0.10"),
        BundleNode(bundle_index=1, node_id=DRIVER, node_ip="10.0.0.200"),
        BundleNode(bundle_index=2, node_id="node-c", node_ip="10.0.0.9"),
        BundleNode(bundle_index=3, node_id=DRIVER, node_ip="10.0.0.200"),
        BundleNode(bundle_index=4, node_id="node-a", node_ip="10.0.0.10"),
    ]


def test_stage_order_puts_the_driver_node_first_then_nodes_by_numeric_ip():
    order = stage_order(_bundles(), driver_node_id=DRIVER)
    # driver's bundles (1, 3), then 10.0.0.9 (numerically before 10.0.0.10), then 10.0.0.10 by node id
    assert [b.bundle_index for b in order] == [1, 3, 2, 4, 0]


def test_stage_order_does_not_depend_on_the_order_ray_reports_bundles():
    expected = stage_order(_bundles(), driver_node_id=DRIVER)
    rng = random.Random(0)
    for _ in range(20):
        shuffled = _bundles()
        rng.shuffle(shuffled)
        assert stage_order(shuffled, driver_node_id=DRIVER) == expected


@pytest.mark.parametrize(("num_stages", "nnodes", "expected"), [
    (4, 2, [range(0, 2), range(2, 4)]),
    (5, 2, [range(0, 3), range(3, 5)]),
    (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
])
def test_node_stages_are_contiguous_blocks_with_leftovers_on_early_nodes(num_stages, nnodes, expected):
    got = [node_stages(num_stages=num_stages, nnodes=nnodes, node_rank=r) for r in range(nnodes)]
    assert got == expected


def test_more_nodes_than_stages_is_a_placement_error():
    with pytest.raises(PlacementError, match="--nnodes 3 is more than --stages 2"):
        node_stages(num_stages=2, nnodes=3, node_rank=0)


def test_forwarded_env_keeps_only_the_allow_list():
    environ = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
               "MASTER_ADDR": "10.0.0.1", "SPEEDPIPE_CACHE_DIR": "/models", "AWS_SECRET_ACCESS_KEY": "x",
               "HOME": "/root", "PATH": "/usr/bin", "GLOO_OTHER": "1",
               "SPEEDPIPE_API_KEY": "k", "SPEEDPIPE_CONTROL_SECRET": "s"}  # Ray shows a runtime_env on its dashboard
    env = forwarded_env(environ, log_level="INFO")
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
                   "MASTER_ADDR": "10.0.0.1", "SPEEDPIPE_CACHE_DIR": "/models", "SPEEDPIPE_LOG_LEVEL": "INFO"}


def test_stage_resources_parse_and_reject_bad_json():
    assert parse_stage_resources('{"GPU": 1, "CPU": 2}') == {"GPU": 1.0, "CPU": 2.0}
    for bad, message in (("{GPU: 1}", "not valid JSON"), ("[1]", "non-empty JSON object"),
                         ('{"GPU": -1}', "GPU must be a number >= 0"), ('{"CPU": 0}', "asks for nothing")):
        with pytest.raises(PlacementError, match=message):
            parse_stage_resources(bad)


def test_default_bundle_is_one_cpu_or_one_gpu():
    assert PlacementOptions().bundle("cpu") == {"CPU": 1.0}
    assert PlacementOptions().bundle("cuda") == {"GPU": 1.0}
    assert PlacementOptions(stage_resources={"CPU": 2}).bundle("cuda") == {"CPU": 2}


def test_parallel_stages_counts_shared_cpus_only_for_local_cpu_stages():
    local = PlacementOptions()
    assert parallel_stages(local, num_stages=4, device="cpu", threads_per_stage=1, cpus=2) == 2
    assert parallel_stages(local, num_stages=2, device="cpu", threads_per_stage=1, cpus=16) == 2  # capped
    assert parallel_stages(local, num_stages=4, device="cpu", threads_per_stage=2, cpus=6) == 3
    assert parallel_stages(local, num_stages=3, device="cpu", threads_per_stage=4, cpus=2) == 1  # at least one
    assert parallel_stages(local, num_stages=4, device="cuda", threads_per_stage=1, cpus=2) == 4
    cluster = PlacementOptions(backend="ray", ray_address="10.0.0.10:6379")  # bundles reserve their own CPUs
    assert parallel_stages(cluster, num_stages=4, device="cpu", threads_per_stage=1, cpus=2) == 4
    private = PlacementOptions(backend="ray")  # a Ray instance started on this machine shares its CPUs
    assert parallel_stages(private, num_stages=4, device="cpu", threads_per_stage=1, cpus=2) == 2
    two_nodes = PlacementOptions(nnodes=2)  # stages 0-1 on node 0, 2-3 on node 1 (2 CPUs each, as this one)
    assert parallel_stages(two_nodes, num_stages=4, device="cpu", threads_per_stage=1, cpus=2) == 4
    assert parallel_stages(two_nodes, num_stages=6, device="cpu", threads_per_stage=1, cpus=2) == 4
    assert parallel_stages(two_nodes, num_stages=5, device="cpu", threads_per_stage=2, cpus=2) == 2


def _cgroup(tmp_path, proc: str, files: dict[str, str]) -> dict[str, str]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc)
    return {"cgroup_root": str(tmp_path / "fs"), "proc_cgroup": str(tmp_path / "self-cgroup")}


@pytest.mark.parametrize(("proc", "files", "want"), [
    ("0::/docker/abc\n", {"fs/docker/abc/cpu.max": "150000 100000\n"}, 1.5),  # v2, own cgroup
    ("0::/\n", {"fs/cpu.max": "100000 100000\n"}, 1.0),  # v2, container's namespace root
    ("0::/\n", {"fs/cpu.max": "max 100000\n"}, None),
    ("0::/system.slice/app.service\n",  # a parent slice's CPUQuota is tighter than the service's own
     {"fs/system.slice/cpu.max": "200000 100000", "fs/system.slice/app.service/cpu.max": "max 100000"}, 2.0),
    ("0::/system.slice/app.service\n",  # the tightest of the chain wins
     {"fs/system.slice/cpu.max": "400000 100000", "fs/system.slice/app.service/cpu.max": "300000 100000"}, 3.0),
    ("0::/docker/abc\n", {"fs/cpu.max": "250000 100000"}, 2.5),  # no cgroup namespace: the path is not mounted
    ("4:cpu,cpuacct:/k8s/pod\n1:name=systemd:/\n",
     {"fs/cpu,cpuacct/k8s/pod/cpu.cfs_quota_us": "300000", "fs/cpu,cpuacct/k8s/pod/cpu.cfs_period_us": "100000"}, 3.0),
    ("4:cpuacct,cpu:/k8s\n",  # the line lists the controllers in another order than the directory
     {"fs/cpu,cpuacct/k8s/cpu.cfs_quota_us": "50000", "fs/cpu,cpuacct/k8s/cpu.cfs_period_us": "100000"}, 0.5),
    ("1:cpu:/\n", {"fs/cpu/cpu.cfs_quota_us": "-1", "fs/cpu/cpu.cfs_period_us": "100000"}, None),  # v1, no quota
    ("0::/\n1:cpu:/\n", {"fs/cpu/cpu.cfs_quota_us": "100000", "fs/cpu/cpu.cfs_period_us": "100000"}, 1.0),  # hybrid
    ("1:memory:/x\n", {}, None),  # no cpu controller
    ("0::/\n", {"fs/cpu.max": "garbage"}, None),
    ("0::/\n", {"fs/cpu.max": "100000 0"}, None),  # period 0
    ("not a cgroup line\n0::/\n", {"fs/cpu.max": "100000 100000"}, 1.0),  # a malformed line is skipped
])
def test_cgroup_cpu_quota_reads_v1_and_v2(tmp_path, proc, files, want):
    assert cgroup_cpu_quota(**_cgroup(tmp_path, proc, files)) == want


def test_usable_cpus_caps_the_affinity_mask_by_the_quota_rounded_down(tmp_path, monkeypatch):
    """A stage needs a whole CPU to compute without waiting: 1.5 CPUs run one stage at a time."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    assert usable_cpus(**_cgroup(tmp_path / "a", "0::/\n", {"fs/cpu.max": "150000 100000"})) == 1
    assert usable_cpus(**_cgroup(tmp_path / "b", "0::/\n", {"fs/cpu.max": "250000 100000"})) == 2
    assert usable_cpus(**_cgroup(tmp_path / "c", "0::/\n", {"fs/cpu.max": "800000 100000"})) == 4  # the mask caps
    assert usable_cpus(**_cgroup(tmp_path / "d", "0::/\n", {"fs/cpu.max": "20000 100000"})) == 1  # at least one
    assert usable_cpus(cgroup_root=str(tmp_path / "none"), proc_cgroup=str(tmp_path / "missing")) == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backend": "slurm"}, "--backend must be one of local, ray"),
    ({"placement_strategy": "RANDOM"}, "--placement-strategy must be one of"),
    ({"placement_timeout_s": 0}, "--placement-timeout-s must be > 0"),
    ({"nnodes": 2, "node_rank": 2}, r"--node-rank must be in \[0, 2\)"),
    ({"nnodes": 2, "backend": "ray"}, "drop --backend ray"),
    ({"master_port": 65535}, "--master-port must be in"),
])
def test_bad_placement_options_name_the_flag(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        PlacementOptions(**kwargs)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_placement_args(parser)
    return parser.parse_args(list(argv))


def test_multi_node_flags_fall_back_to_the_torchrun_environment():
    env = {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "speedpipe-0.speedpipe", "MASTER_PORT": "29400"}
    opts = placement_from_args(_args(), env)
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port) == (3, 2, "speedpipe-0.speedpipe", 29400)
    opts = placement_from_args(_args("--nnodes", "2", "--node-rank", "1", "--master-port", "1234"), env)
    assert (opts.nnodes, opts.node_rank, opts.master_port) == (2, 1, 1234)
    assert placement_from_args(_args(), {}).multi_node is False
    assert placement_from_args(_args("--backend", "ray"), env).nnodes == 1  # Ray ignores the torchrun env
    with pytest.raises(PlacementError, match="WORLD_SIZE='two' is not an integer"):
        placement_from_args(_args(), {"WORLD_SIZE": "two"})


def test_host_ip_detection_on_loopback():
    assert detect_host_ip("127.0.0.1", 29500) == "127.0.0.1"
    with pytest.raises(PlacementError, match="does not resolve"):
        detect_host_ip("no-such-host.invalid", 29500)
