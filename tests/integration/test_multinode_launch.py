"""The torchrun-style multi-node mode: two `launch` processes on one machine (node 0 and node 1 over
loopback) give the local backend's greedy token ids on the real default model and both exit 0,
leaving no stage process; node 0 without its peer, and node 1 without node 0, fail within
--placement-timeout-s (exit 2).

Node 0 checks --master-addr and the data-plane port before it starts anything; node 1 exits
non-zero when node 0 freezes (within --placement-timeout-s) or fails.

Fail-over across nodes ([Note: multi-node restart] in launcher/backends/multinode.py), tiny model:
node 1's stage killed mid-generation is respawned by node 1's launcher and node 0 prints the same
text as an undisturbed local run; when node 1's launcher cannot answer (stopped), node 0 gives up
after --placement-timeout-s and fails the request naming the node (fenced, as without fail-over)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.conftest import wait_for
from tests.distributed.conftest import sharpen_weights
from tests.integration.conftest import PLACEMENT_NEW_TOKENS, PLACEMENT_PROMPTS
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NUM_STAGES = 2  # node 0 runs stage 0 and the coordinator, node 1 runs stage 1
TAG_ENV = "SPEEDPIPE_TEST_MULTINODE_TAG"
RUN_TIMEOUT_S = 240


def _free_port_pair() -> int:
    """A port P with P and P + 1 free a moment ago (launch rendezvous and data plane)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def _launch(*args: str, tag: str) -> subprocess.Popen:
    env = {**os.environ, TAG_ENV: tag}
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _tagged_workers(tag: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if (proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag
                    and "workers.stage_worker" in " ".join(proc.info["cmdline"] or [])):
                found.append(" ".join(proc.info["cmdline"]))
                proc.kill()  # never leak it into later tests
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_two_launch_processes_on_loopback_give_the_local_backends_tokens(smollm2_dir, local_backend_tokens):
    port, tag = _free_port_pair(), uuid.uuid4().hex
    common = ["--stages", str(NUM_STAGES), "--model", str(smollm2_dir), "--nnodes", "2", "--master-addr",
              "127.0.0.1", "--master-port", str(port), "--max-model-len", "256", "--max-num-seqs", "2"]
    node1 = _launch(*common, "--node-rank", "1", tag=tag)  # before node 0: it waits for node 0's store
    node0 = _launch(*common, "--node-rank", "0", "--max-new-tokens", str(PLACEMENT_NEW_TOKENS), "--ignore-eos",
                    "--json", *(a for p in PLACEMENT_PROMPTS for a in ("--prompt", p)), tag=tag)
    try:
        out0, err0 = node0.communicate(timeout=RUN_TIMEOUT_S)
        out1, err1 = node1.communicate(timeout=60)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert node0.returncode == 0, err0[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    report = json.loads(out0.strip().splitlines()[-1])
    assert [o["token_ids"] for o in report["outputs"]] == local_backend_tokens
    assert "node 1: stage 1 at 127.0.0.1:" in err1 and "node 0 finished" in err1, err1[-2000:]
    assert not _tagged_workers(tag), "stage workers left running"


def test_node_0_without_its_peer_fails_within_the_placement_timeout(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    start = time.monotonic()
    node0 = _launch("--stages", "2", "--model", str(model_dir), "--nnodes", "2", "--node-rank", "0",
                    "--master-addr", "127.0.0.1", "--master-port", str(port), "--placement-timeout-s", "2",
                    "--prompt", "Hi", tag=tag)
    _, err = node0.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert node0.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("speedpipe launch: error: node(s) 1 of --nnodes 2 did not report their stages within "
                           "2 s (--placement-timeout-s)"), err[-3000:]
    assert f"--master-addr 127.0.0.1 --master-port {port}" in last and "Traceback" not in err
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert not _tagged_workers(tag), "stage workers left running"


def test_node_1_without_node_0_fails_within_the_placement_timeout(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    start = time.monotonic()
    node1 = _launch("--stages", "2", "--model", str(model_dir), "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "127.0.0.1", "--master-port", str(port), "--placement-timeout-s", "3", tag=tag)
    _, err = node1.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert node1.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"speedpipe launch: error: node 1: cannot reach node 0 at 127.0.0.1:{port} within 3 s "
                           "(--placement-timeout-s)"), err[-3000:]
    assert "Traceback" not in err
    assert elapsed < 40, f"took {elapsed:.0f} s with --placement-timeout-s 3"
    assert not _tagged_workers(tag), "stage workers left running"


LONG_PROMPT = "Once upon a time"
LONG_ARGS = ("--prompt", LONG_PROMPT, "--max-new-tokens", "1500", "--max-model-len", "2048", "--ignore-eos")


def _stage_workers_of(pid: int) -> list[psutil.Process]:
    """The live stage-worker processes among the children of `pid`."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "workers.stage_worker" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _streamed(proc: subprocess.Popen, chars: int, timeout_s: float = 120) -> str:
    """Read node 0's streamed stdout until it holds `chars` characters (text is generating)."""
    text = ""
    deadline = time.monotonic() + timeout_s
    while len(text) < chars:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        text += proc.stdout.read(1)
    return text


def _two_nodes(model_dir, port: int, tag: str, *node0_args: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    common = ["--stages", "2", "--model", str(model_dir), "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), *node0_args]
    node1 = _launch(*common, "--node-rank", "1", tag=tag)
    node0 = _launch(*common, "--node-rank", "0", *LONG_ARGS, tag=tag)
    return node0, node1


def _kill_all(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_stage_killed_on_node_1_is_respawned_there_and_node_0_prints_the_undisturbed_text(tmp_path):
    model_dir = sharpen_weights(write_tiny_model(tmp_path / "tiny"))
    local = subprocess.run([sys.executable, "-m", "launcher.cli.main", "launch", "--stages", "2", "--model",
                            str(model_dir), *LONG_ARGS], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert local.returncode == 0, local.stderr[-3000:]
    port, tag = _free_port_pair(), uuid.uuid4().hex
    node0, node1 = _two_nodes(model_dir, port, tag)
    try:
        head = _streamed(node0, len(LONG_PROMPT) + 16)
        victims = _stage_workers_of(node1.pid)
        assert len(victims) == 1, victims
        victims[0].kill()
        out0, err0 = node0.communicate(timeout=RUN_TIMEOUT_S)
        out1, err1 = node1.communicate(timeout=60)
    finally:
        _kill_all(node0, node1)
    assert node0.returncode == 0, err0[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    assert "pipeline restored" in err0 and "stage 1 respawned" in err1, (err0[-2000:], err1[-2000:])
    assert (head + out0).splitlines()[0] == local.stdout.splitlines()[0]
    assert not _tagged_workers(tag), "stage workers left running"


def test_node_0_fences_when_node_1_does_not_respawn_its_stage_within_the_placement_timeout(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    node0, node1 = _two_nodes(model_dir, port, tag, "--placement-timeout-s", "8")
    try:
        _streamed(node0, len(LONG_PROMPT) + 16)
        victims = _stage_workers_of(node1.pid)
        assert len(victims) == 1, victims
        os.kill(node1.pid, signal.SIGSTOP)  # its launcher cannot answer node 0's restart request
        victims[0].kill()
        start = time.monotonic()
        _, err0 = node0.communicate(timeout=RUN_TIMEOUT_S)
        elapsed = time.monotonic() - start
    finally:
        _kill_all(node0, node1)
    assert node0.returncode != 0, err0[-3000:]
    assert "node 1 did not respawn stage 1 within 8 s (--placement-timeout-s)" in err0, err0[-3000:]
    # the node missed its deadline: asking it again could only wait as long, so no budget is spent on it
    assert "stage restarts exhausted" not in err0 and err0.count("restarting (restart") == 1, err0[-3000:]
    assert elapsed < 8 + 60, f"took {elapsed:.0f} s"
    assert wait_for(lambda: not _tagged_workers(tag), timeout_s=30), "stage workers left running"


def test_node_0_with_a_master_addr_of_another_machine_fails_in_one_line(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    node0 = _launch("--stages", "2", "--model", str(model_dir), "--nnodes", "2", "--node-rank", "0",
                    "--master-addr", "192.0.2.1", "--master-port", str(port), "--prompt", "Hi", tag=tag)
    _, err = node0.communicate(timeout=120)
    assert node0.returncode == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == ("speedpipe launch: error: --master-addr 192.0.2.1 is not an address of "
                                            "this machine (node 0 listens on it): give node 0 its own address, as "
                                            "the other nodes reach it"), err[-3000:]
    assert "frame #" not in err and "Traceback" not in err and len(err.strip().splitlines()) < 5, err[-3000:]
    assert not _tagged_workers(tag), "stage workers left running"


def test_node_0_with_a_busy_data_plane_port_fails_before_starting_stages(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        start = time.monotonic()
        node0 = _launch("--stages", "2", "--model", str(model_dir), "--nnodes", "2", "--node-rank", "0",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), "--placement-timeout-s", "30",
                        "--prompt", "Hi", tag=tag)
        _, err = node0.communicate(timeout=120)
        elapsed = time.monotonic() - start
    assert node0.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"speedpipe launch: error: node 0: data-plane port {port + 1} (--master-port {port} + 1) "
                           "cannot be used on 127.0.0.1"), err[-3000:]
    assert elapsed < 30, f"took {elapsed:.0f} s: it waited for node 1 instead"
    assert not _tagged_workers(tag), "stage workers left running"


def test_node_1_exits_non_zero_naming_node_0_when_node_0_freezes(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    node0, node1 = _two_nodes(model_dir, port, tag, "--placement-timeout-s", "8")
    try:
        _streamed(node0, len(LONG_PROMPT) + 16)
        for proc in [*_stage_workers_of(node0.pid), psutil.Process(node0.pid)]:
            proc.send_signal(signal.SIGSTOP)  # no reset reaches node 1: a deleted pod, a partition
        start = time.monotonic()
        _, err1 = node1.communicate(timeout=RUN_TIMEOUT_S)
        elapsed = time.monotonic() - start
    finally:
        for proc in _stage_workers_of(node0.pid):
            proc.kill()
        _kill_all(node0, node1)
    assert node1.returncode == 1, err1[-3000:]
    assert (f"node 1: pipeline failed: node 0 at 127.0.0.1:{port} has not answered for 8 s (--placement-timeout-s)"
            in err1), err1[-3000:]
    assert elapsed < 8 + 30, f"took {elapsed:.0f} s"
    assert wait_for(lambda: not _tagged_workers(tag), timeout_s=30), "stage workers left running"


def test_node_1_exits_non_zero_when_node_0_is_interrupted(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port, tag = _free_port_pair(), uuid.uuid4().hex
    node0, node1 = _two_nodes(model_dir, port, tag)
    try:
        _streamed(node0, len(LONG_PROMPT) + 16)
        node0.send_signal(signal.SIGTERM)  # node 0's launch fails: the job must not look successful
        _, err0 = node0.communicate(timeout=RUN_TIMEOUT_S)
        _, err1 = node1.communicate(timeout=60)
    finally:
        _kill_all(node0, node1)
    assert node0.returncode != 0, err0[-3000:]
    assert node1.returncode == 1, err1[-3000:]
    assert "node 1: pipeline failed: node 0 failed: terminated (SIGTERM)" in err1, err1[-3000:]
    assert not _tagged_workers(tag), "stage workers left running"


@pytest.mark.parametrize(("node1_args", "why"), [
    (["--stages", "3"], "--stages 3 here, 2 on node 0"),
    (["--stages", "2", "--model", "OTHER"], "--model resolves to other here, tiny on node 0"),
])
def test_a_node_given_other_stages_or_model_refuses_and_node_0_fails_at_once(tmp_path, node1_args, why):
    """Node 1 with another --stages waited out --placement-timeout-s on both sides (node 1 then said
    node 0 "went away"); with another --model it ran node 0's model without a word."""
    model_dir = write_tiny_model(tmp_path / "tiny")
    other = write_tiny_model(tmp_path / "other", seed=5)
    port, tag = _free_port_pair(), uuid.uuid4().hex
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--placement-timeout-s",
              "60")
    start = time.monotonic()
    node0 = _launch("--stages", "2", "--model", str(model_dir), "--node-rank", "0", *common, "--prompt", "Hi",
                    tag=tag)
    time.sleep(1)
    args1 = [str(other) if a == "OTHER" else a for a in node1_args]
    node1 = _launch(*args1, *(["--model", str(model_dir)] if "--model" not in args1 else []), "--node-rank", "1",
                    *common, tag=tag)
    _, err1 = node1.communicate(timeout=120)
    _, err0 = node0.communicate(timeout=120)
    assert time.monotonic() - start < 45, "waited for the placement timeout"
    assert node1.returncode == 2 and f"node 1: {why}: give every node the same --stages and --model" in err1, err1
    assert node0.returncode == 2 and f"node 1 refused to join: {why}" in err0, err0
    assert "Traceback" not in err0 + err1 and not _tagged_workers(tag)
