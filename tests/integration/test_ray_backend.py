"""`--backend ray` on a simulated 3-node Ray cluster (ray.cluster_utils.Cluster), and the CLI on a
local Ray instance it starts itself.

The cluster (head node = the driver's node, plus nodes at 127.0.0.3 and 127.0.0.2, one CPU each) is
started once for the module. On it: 2 and 3 stages give the local backend's greedy token ids on the
real default model, with stages spread over nodes in the deterministic order (driver node first, then
by IP); with fail-over on, a stage actor killed (`ray.kill`) mid-generation is replaced by a new actor
in the same placement-group bundle (same node) and every request completes with the tokens of an
undisturbed run (tiny model, 3 stages), and closing the session lets every actor stop its own gRPC
server before it is killed (no grpc `__del__` cut short by Ray's SIGTERM); a lost node (three extra
nodes, one removed mid-generation) costs one restart, into its bundle moved to a live node; an
unsatisfiable placement fails within --placement-timeout-s
saying what was asked and what the cluster has; without fail-over, a killed stage actor is reported
by stage index and node. Then the CLI starts its
own Ray instance (`ray.init(num_cpus=...)`), asks for GPUs this machine lacks, exits 2 in time and
leaves no Ray process behind.

[Note: Ray processes and the leftover-child fixture]
Ray's own processes (gcs_server, raylet, idle workers) belong to the module's cluster and are
started and reused across tests, so the module opts out of tests/conftest.py's per-test check
(`allow_leftover_children`) and checks instead: each test's stage actors are gone after the session
closed, and after the cluster shut down no descendant of this process is left.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from launcher.backends.placement import PlacementError, PlacementOptions  # noqa: E402
from launcher.backends.ray_cluster.stage_actors import RayStageActors  # noqa: E402
from launcher.coordinator.coordinator import PipelineError  # noqa: E402
from launcher.coordinator.pipeline_options import PipelineOptions  # noqa: E402
from launcher.coordinator.run_plan import resolve  # noqa: E402
from launcher.coordinator.session import PipelineSession  # noqa: E402
from launcher.coordinator.stage_restarts import RestartBudget  # noqa: E402
from pipeline.speculation.sampling import SamplingParams  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.distributed.conftest import sharpen_weights  # noqa: E402
from tests.integration.conftest import PLACEMENT_NEW_TOKENS, PLACEMENT_PROMPTS  # noqa: E402
from tests.tiny_model import write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.allow_leftover_children]

NODE_IPS = ("127.0.0.3", "127.0.0.2")  # added in this order; stage order must sort them
RESULT_TIMEOUT_S = 120.0
PROCESS_GONE_TIMEOUT_S = 20.0


def _gone(pids, timeout_s: float = PROCESS_GONE_TIMEOUT_S) -> list[int]:
    """Pids still alive (not zombies) after waiting up to timeout_s."""
    def alive() -> list[int]:
        living = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    living.append(pid)
            except psutil.NoSuchProcess:
                pass
        return living

    wait_for(lambda: not alive(), timeout_s=timeout_s, step_s=0.2)
    return alive()


@pytest.fixture(scope="module")
def cluster():
    """A 3-node Ray cluster on this machine; the test process is its driver, on the head node."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for ip in NODE_IPS:
        c.add_node(num_cpus=1, node_ip_address=ip)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING")
    yield c
    ray.shutdown()
    c.shutdown()
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not _gone(left), "Ray processes left after the cluster shut down"


def _options(model_dir: Path, num_stages: int, placement: PlacementOptions) -> PipelineOptions:
    return PipelineOptions(num_stages=num_stages, model=str(model_dir), progress=False, max_model_len=256,
                           max_num_seqs=2, stage_timeout_s=60.0, placement=placement)


def _generate(session: PipelineSession) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=PLACEMENT_NEW_TOKENS, ignore_eos=True)
    handles = [session.coordinator.submit(p, params) for p in PLACEMENT_PROMPTS]
    return [h.result(timeout_s=RESULT_TIMEOUT_S).token_ids for h in handles]


@pytest.fixture(scope="module")
def three_stage_session(cluster, smollm2_dir):
    """A 3-stage Ray session, one stage per node (STRICT_SPREAD); the last test using it kills a stage."""
    placement = PlacementOptions(backend="ray", placement_strategy="STRICT_SPREAD", placement_timeout_s=30)
    options = _options(smollm2_dir, 3, placement)
    session = PipelineSession(options, resolve(options)).__enter__()
    pids = [p.pid for p in session.backend.placements]
    yield session
    session.close()
    assert not _gone(pids), "stage actors still alive after the session closed"


def _check_rank_order(placements, num_stages: int) -> None:
    head_ip = ray.util.get_node_ip_address()
    driver_node = ray.get_runtime_context().get_node_id()
    ips = [p.node_ip for p in placements]
    assert len(set(p.node_id for p in placements)) == num_stages, placements  # one stage per node
    # driver node first (its IP sorts after 127.x, yet comes first), then by IP: .2 before .3
    rank_keys = [(p.node_id != driver_node, ipaddress.ip_address(p.node_ip)) for p in placements]
    assert rank_keys == sorted(rank_keys), ips
    if num_stages == 3:  # STRICT_SPREAD used every node
        assert ips == [head_ip, "127.0.0.2", "127.0.0.3"]
    assert [p.address.rsplit(":", 1)[0] for p in placements] == ips  # gRPC bound on the node's IP


def test_ray_2_stages_spread_over_nodes_give_the_local_backends_tokens_in_rank_order(
        cluster, smollm2_dir, local_backend_tokens):
    placement = PlacementOptions(backend="ray", placement_strategy="SPREAD", placement_timeout_s=30)
    options = _options(smollm2_dir, 2, placement)
    with PipelineSession(options, resolve(options)) as session:
        tokens = _generate(session)
        placements = list(session.backend.placements)
    assert tokens == local_backend_tokens
    _check_rank_order(placements, 2)
    assert not _gone([p.pid for p in placements]), "stage actors still alive after the session closed"


def test_a_stage_actor_killed_mid_generation_is_replaced_in_its_bundle_and_requests_keep_their_tokens(
        cluster, tmp_path):
    """Runs before the module's 3-stage session exists (file order): that one holds every CPU."""
    model_dir = sharpen_weights(write_tiny_model(tmp_path / "tiny"))
    placement = PlacementOptions(backend="ray", placement_timeout_s=30)
    options = PipelineOptions(num_stages=3, model=str(model_dir), progress=False, max_model_len=256,
                              max_num_seqs=3, stage_timeout_s=60.0, placement=placement)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    prompts = ["Once upon a time", "abc", "hello world"]
    with PipelineSession(options, resolve(options), restart_budget=RestartBudget(max_restarts=1)) as session:
        coord, backend = session.coordinator, session.backend
        undisturbed = [h.result(timeout_s=RESULT_TIMEOUT_S).token_ids
                       for h in [coord.submit(p, params) for p in prompts]]
        before = list(backend.placements)
        handles = [coord.submit(p, params) for p in prompts]
        wait_for(lambda: len(handles[0].token_ids) >= 4 or handles[0].error is not None, timeout_s=60, step_s=0.01)
        ray.kill(backend.actors[1], no_restart=True)
        outputs = [h.result(timeout_s=RESULT_TIMEOUT_S).token_ids for h in handles]
        after = list(backend.placements)
        assert coord.num_restarts == 1 and coord.failure is None
        assert outputs == undisturbed
        assert after[1].pid != before[1].pid  # a new actor ...
        assert (after[1].bundle_index, after[1].node_id) == (before[1].bundle_index, before[1].node_id)  # ... same bundle
        assert [p.pid for p in after[::2]] == [p.pid for p in before[::2]]  # the others kept
        assert not _gone([before[1].pid]), "the killed actor's process is still alive"
        assert coord.sync(10)
        # RELEASE travels in-band after the last result: every slot frees, maybe a little later
        wait_for(lambda: not any(s.kv_slots_in_use for s in coord.stage_stats()), timeout_s=10.0)
        assert [s.kv_slots_in_use for s in coord.stage_stats()] == [0, 0, 0]
        exits = list(backend._stopped_refs)  # each actor's wait_stopped() call, the new stage 1's included
    assert not _gone([p.pid for p in after]), "stage actors still alive after the session closed"
    # closing waited for every stage to stop its own gRPC server (returning 0) before ray.kill
    assert ray.get(exits, timeout=10) == [0, 0, 0]


def test_a_lost_node_costs_one_restart_and_its_stage_moves_to_a_live_node(cluster, tmp_path):
    """[Note: node loss] in launcher/backends/ray_cluster/nodes.py: the data plane notices a dead node before Ray
    does; the restart waits for Ray to move the bundle instead of starting an actor on the dead node
    (on the old code: 2 restarts). Three extra nodes with their own resource, so the module's nodes are
    left as they were."""
    extra = [cluster.add_node(num_cpus=1, node_ip_address=ip, resources={"nodeloss": 1})
             for ip in ("127.0.0.4", "127.0.0.5", "127.0.0.6")]
    cluster.wait_for_nodes()
    model_dir = sharpen_weights(write_tiny_model(tmp_path / "tiny"))
    placement = PlacementOptions(backend="ray", placement_strategy="STRICT_SPREAD", placement_timeout_s=60,
                                 stage_resources={"CPU": 1, "nodeloss": 1})
    options = PipelineOptions(num_stages=2, model=str(model_dir), progress=False, max_model_len=256,
                              max_num_seqs=2, stage_timeout_s=60.0, placement=placement)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    removed = []
    try:
        with PipelineSession(options, resolve(options), restart_budget=RestartBudget(max_restarts=3)) as session:
            coord, backend = session.coordinator, session.backend
            undisturbed = coord.submit("Once upon a time", params).result(timeout_s=RESULT_TIMEOUT_S).token_ids
            handle = coord.submit("Once upon a time", params)
            wait_for(lambda: len(handle.token_ids) >= 4 or handle.error is not None, timeout_s=60, step_s=0.01)
            before = list(backend.placements)
            victim = next(n for n in extra if n.node_ip_address == before[1].node_ip)
            os.kill(before[1].pid, signal.SIGSTOP)  # the request cannot finish before the node is gone
            cluster.remove_node(victim, allow_graceful=False)
            removed.append(victim)
            os.kill(before[1].pid, signal.SIGKILL)  # as the machine's loss would
            assert handle.result(timeout_s=RESULT_TIMEOUT_S).token_ids == undisturbed
            after = list(backend.placements)
            assert coord.num_restarts == 1 and coord.failure is None
        assert after[1].node_ip not in (before[0].node_ip, before[1].node_ip), after
        assert after[1].bundle_index == before[1].bundle_index
        assert not _gone([p.pid for p in after]), "stage actors still alive after the session closed"
    finally:
        for node in extra:
            if node not in removed:
                cluster.remove_node(node)


def test_ray_3_stages_one_per_node_give_the_local_backends_tokens_in_rank_order(three_stage_session, local_backend_tokens):
    assert _generate(three_stage_session) == local_backend_tokens
    _check_rank_order(three_stage_session.backend.placements, 3)


def test_a_killed_stage_actor_is_reported_by_stage_index_and_node(three_stage_session):
    victim = three_stage_session.backend.placements[1]
    handle = three_stage_session.coordinator.submit("abc", SamplingParams(max_new_tokens=200, ignore_eos=True))
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(PipelineError) as err:
        handle.result(timeout_s=60)
    message = str(err.value)
    assert "stage 1" in message and victim.node_ip in message and str(victim.pid) in message, message


def test_unsatisfiable_placement_fails_within_the_timeout_with_what_was_asked_and_what_the_cluster_has(cluster):
    placement = PlacementOptions(backend="ray", stage_resources={"GPU": 1}, placement_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(PlacementError) as err, RayStageActors(num_stages=4, placement=placement) as stages:
        stages.start()
    elapsed = time.monotonic() - start
    assert elapsed < 3 + 10, f"took {elapsed:.1f} s with --placement-timeout-s 3"
    message = str(err.value)
    for expected in ("within 3 s", "4 bundle(s) of {GPU: 1}", "strategy PACK", "3 node(s)", "127.0.0.2 {CPU: 1}",
                     "total {CPU: 3}", "Check --stage-resources"):
        assert expected in message, message
    gpu_groups = [pg for pg in ray.util.placement_group_table().values()
                  if any("GPU" in bundle for bundle in pg["bundles"].values())]
    assert gpu_groups and all(pg["state"] == "REMOVED" for pg in gpu_groups), f"placement group left: {gpu_groups}"


def test_cli_with_its_own_ray_instance_exits_2_when_gpus_are_missing_and_leaves_no_process(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    tag = uuid.uuid4().hex
    env = {**os.environ, "SPEEDPIPE_TEST_RAY_TAG": tag, "RAY_ADDRESS": ""}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli.main", "launch", "--backend", "ray", "--stages", "2", "--model",
         str(model_dir), "--stage-resources", '{"GPU": 1}', "--placement-timeout-s", "3", "--prompt", "Hi"],
        capture_output=True, text=True, env=env, timeout=180)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("speedpipe launch: error: Ray placement not satisfied within 3 s"), proc.stderr[-3000:]
    assert "2 bundle(s) of {GPU: 1}" in last and "1 node(s)" in last and "Traceback" not in proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"
    left = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("SPEEDPIPE_TEST_RAY_TAG") == tag:
                left.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not _gone(left), f"processes of the CLI's Ray instance left: {left}"
