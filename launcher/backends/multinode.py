"""Torchrun-style multi-node mode: one `launch` process per node, no Ray (SLURM, Kubernetes).

Owns the launch rendezvous of `launch --nnodes N --node-rank R --master-addr HOST --master-port P`:
node 0's launcher hosts a TCPStore at HOST:P; every node starts its own block of stages as local
processes (launcher/backends/local.py) bound to its host IP and publishes their gRPC addresses there;
node 0 collects all of them, runs the coordinator (rank 0 of the data plane, whose rendezvous is
HOST:P+1) and drives every stage; the other nodes only keep their stages alive until node 0 says
it is done (and whether it failed), node 0 goes away or stays silent for --placement-timeout-s
([Note: node 0 silent] in launcher/backends/launch_store.py), or one of their stages dies.
Must not: know about models or requests (PipelineSession and the coordinator do).

Store keys: `control_secret` = the session secret every stage's control plane checks (set by node 0;
[Note: control-plane secret] in workers/rpc/control_auth.py); `rejoin_wait_s` = how long a stage whose
data plane broke waits for a Rejoin (> 0: fail-over is on); `stage/<i>` = gRPC address of stage i;
`done` = node 0 is shutting the pipeline down
(stage exits are expected from now on): `ok`, or `failed: why` (its launch or serve failed, so
every node exits non-zero); `left/<r>` = node r saw `done` (node 0 waits for these so
that its store outlives their last read); `restart/<r>/<n>` = node 0's n-th request (n = 1, 2, ...)
to node r: restart stage <value> (`end`: no more requests); `respawned/<r>/<n>` = node r's answer:
the new gRPC address, `error: why`, or `gone: why` (its launcher was stopped: it answers no more);
`run` = node 0's --stages and model (a member given others refuses: `refused/<r>` = why).

[Note: multi-node restart]
With fail-over on ([Note: fail-over] in launcher/coordinator/stage_failover.py), a dead or hung stage
on node r > 0 is found by node 0's coordinator (its data plane breaks, its Health call refuses or
times out). Node 0's `restart_stage(i)` posts `restart/<r>/<n>`; node r's launcher, which waits for
these on its own store connection, kills the stage if it still runs, respawns it with the same
arguments and session secret and posts `respawned/<r>/<n>`; node 0 waits for that at most
`--placement-timeout-s`, then Loads the new stage and Rejoins the others. A node that misses that
deadline, or answers `gone`, is not asked again: the restart fails with StageGone and the
coordinator fences at once, as without fail-over, without spending its restart budget on attempts
that cannot succeed. With fail-over on, a member node no longer
gives up when one of its stages dies: node 0 decides (restart, or fence and say `done`).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from launcher.backends.launch_store import (
    DONE_OK,
    Node0Watch,
    check_master_addr_is_local,
    hold_data_port,
    open_store,
)
from launcher.backends.local import LocalStageBackend
from launcher.backends.placement import (
    PlacementError,
    PlacementOptions,
    StageGone,
    detect_host_ip,
    node_stages,
)
from launcher.backends.stage_monitor import StageProcessMonitor
from launcher.backends.stage_process import describe_returncode
from launcher.backends.worker_command import LocalLaunchConfig
from workers.channel import hold_listener, release_listener
from workers.rpc.control_auth import SECRET_ENV, TlsFiles

log = logging.getLogger("speedpipe.multinode")

LEFT_WAIT_S = 10.0
STAGE_EXIT_WAIT_S = 30.0
RESTART_POLL_S = 0.2  # how often a member's restart thread looks for node 0's next request
GONE = "gone: "  # a member's answer to a restart request once its launcher was stopped
JOIN_POLL_S = 0.2  # node 0, waiting for the members' stages: how often it looks


def _local_backend(options: PlacementOptions, *, num_stages: int, log_level: str, threads_per_stage: int,
                   control_secret: str, tls: TlsFiles | None, rejoin_wait_s: float) -> tuple[LocalStageBackend, range]:
    stages = node_stages(num_stages=num_stages, nnodes=options.nnodes, node_rank=options.node_rank)
    host = options.host_ip or detect_host_ip(options.master_addr, options.master_port)
    config = LocalLaunchConfig(num_stages=len(stages), host=host, log_level=log_level,
                               threads_per_stage=threads_per_stage, first_stage_index=stages.start,
                               env={SECRET_ENV: control_secret, **(tls.env() if tls else {})},
                               extra_args=("--rejoin-wait-s", f"{rejoin_wait_s:g}") if rejoin_wait_s > 0 else ())
    return LocalStageBackend(config), stages


def _node_of_stage(stage_index: int, *, num_stages: int, nnodes: int) -> int:
    return next(r for r in range(nnodes) if stage_index in node_stages(num_stages=num_stages, nnodes=nnodes,
                                                                       node_rank=r))


class MultiNodeStages:
    """Node 0's StageBackend: its own stages locally, every other node's through the launch store.

    rejoin_wait_s > 0 turns fail-over on, on every node ([Note: multi-node restart]).
    """

    def __init__(self, *, num_stages: int, placement: PlacementOptions, control_secret: str,
                 log_level: str = "WARNING", threads_per_stage: int = 1, tls: TlsFiles | None = None,
                 rejoin_wait_s: float = 0.0, model: tuple[str, str] = ("", "")) -> None:
        assert placement.node_rank == 0, "only node 0 runs the coordinator"
        # model: (registry.model_key, folder name) of the resolved model, for the members' check
        self.num_stages, self.model = num_stages, model
        self.options = placement
        self.master_addr = placement.master_addr
        self.control_secret = control_secret
        self.rejoin_wait_s = rejoin_wait_s
        self.local, self.stages = _local_backend(placement, num_stages=num_stages, log_level=log_level,
                                                 threads_per_stage=threads_per_stage, control_secret=control_secret,
                                                 tls=tls, rejoin_wait_s=rejoin_wait_s)
        self.store: dist.TCPStore | None = None
        self.addresses: list[str] = []
        self._num_groups = 0  # data-plane groups handed out (data_port)
        self._missed: dict[int, str] = {}  # node rank -> why it is not asked to restart a stage again
        self._failure = ""  # why node 0 failed, for `done`

    def start(self) -> list[str]:
        """Check --master-addr and hold --master-port + 1 (nothing started yet), host the launch store,
        start this node's stages and collect every node's. Raises PlacementError naming the flag."""
        check_master_addr_is_local(self.master_addr)
        hold_data_port(self.options)
        self.store = open_store(self.options)
        self.store.set("run", json.dumps({"num_stages": self.num_stages, "model": list(self.model)}))  # members check
        self.store.set("rejoin_wait_s", f"{self.rejoin_wait_s:g}")  # before the secret: members read it first
        self.store.set("control_secret", self.control_secret)
        for i, address in zip(self.stages, self.local.start(), strict=True):
            self.store.set(f"stage/{i}", address)
        keys = [f"stage/{i}" for i in range(self.num_stages)]
        deadline = time.monotonic() + self.options.placement_timeout_s
        while not self.store.check(keys) and time.monotonic() < deadline:
            for rank in range(1, self.options.nnodes):  # a member given other --stages or --model says so
                if self.store.check([f"refused/{rank}"]):
                    raise PlacementError(f"node {rank} refused to join: {self.store.get(f'refused/{rank}').decode()}")
            time.sleep(JOIN_POLL_S)
        if not self.store.check(keys):
            missing = [r for r in range(1, self.options.nnodes) if not self.store.check(
                [f"stage/{i}" for i in node_stages(num_stages=self.num_stages, nnodes=self.options.nnodes,
                                                   node_rank=r)])]
            raise PlacementError(
                f"node(s) {', '.join(map(str, missing))} of --nnodes {self.options.nnodes} did not report their "
                f"stages within {self.options.placement_timeout_s:g} s (--placement-timeout-s); check that each "
                f"runs `launch --nnodes {self.options.nnodes} --node-rank R --master-addr "
                f"{self.options.master_addr} --master-port {self.options.master_port}` with the same --stages "
                f"and --model, and can reach {self.options.master_addr}:{self.options.master_port}")
        self.addresses = [self.store.get(k).decode() for k in keys]
        log.info("stages: %s", ", ".join(f"{i}: {a}" for i, a in enumerate(self.addresses)))
        return list(self.addresses)

    def data_port(self) -> int:
        """The data-plane rendezvous is fixed at --master-port + 1, so firewalls can name it; a group
        re-formed after a fail-over uses a free port held until its store serves ([Note: held rendezvous
        port]; the old group may still hold port + 1)."""
        self._num_groups += 1
        return self.options.master_port + 1 if self._num_groups == 1 else hold_listener(self.master_addr)

    def dead_stages(self) -> list[int]:
        """This node's exited stages; a remote stage's death is found by the coordinator's Health probe."""
        return self.local.dead_stages()

    def restart_stage(self, stage_index: int) -> str:
        """Restart stage `stage_index`: here, or by asking its node's launcher and waiting at most
        --placement-timeout-s for the new address ([Note: multi-node restart]). Raises RuntimeError
        naming the node when it answers with an error (another attempt may succeed), StageGone when
        it misses the deadline, missed one before, or its launcher was stopped."""
        if stage_index in self.stages:
            return self.local.restart_stage(stage_index)
        rank = _node_of_stage(stage_index, num_stages=self.num_stages, nnodes=self.options.nnodes)
        if rank in self._missed:
            raise StageGone(self._missed[rank])
        n = self.store.add(f"restarts/{rank}", 1)
        self.store.set(f"restart/{rank}/{n}", str(stage_index))
        timeout_s = self.options.placement_timeout_s
        try:
            self.store.wait([f"respawned/{rank}/{n}"], datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            self._missed[rank] = (f"node {rank} did not respawn stage {stage_index} within {timeout_s:g} s "
                                  f"(--placement-timeout-s)")
            raise StageGone(self._missed[rank]) from None  # asking again could only wait as long
        answer = self.store.get(f"respawned/{rank}/{n}").decode()
        if answer.startswith(GONE):  # no later request will be answered either
            self._missed[rank] = f"node {rank} could not respawn stage {stage_index}: {answer[len(GONE):]}"
            raise StageGone(self._missed[rank])
        if answer.startswith("error:"):
            raise RuntimeError(f"node {rank} could not respawn stage {stage_index}:{answer[len('error:'):]}")
        self.addresses[stage_index] = answer
        log.warning("node %d respawned stage %d at %s", rank, stage_index, answer)
        return answer

    def describe(self, stage_index: int) -> str:
        if stage_index in self.stages:
            return self.local.describe(stage_index)
        where = self.addresses[stage_index] if stage_index < len(self.addresses) else "?"
        return f"stage {stage_index} (at {where})"

    def watch(self, on_death: Callable[[int, str], None]) -> None:
        """Watches this node's stages; a remote stage's death reaches the coordinator on the data plane."""
        self.local.watch(on_death)

    def pause_watch(self) -> None:
        """During a fail-over: stop watching this node's stages (the other nodes go on)."""
        self.local.unwatch()

    def unwatch(self) -> None:
        """Stage exits are expected from now on, here and (through `done`) on every node."""
        self.local.unwatch()
        self._say_done()

    def mark_failed(self, why: str) -> None:
        """Node 0's launch or serve failed: `done` says so, and every node exits non-zero."""
        self._failure = self._failure or (why.splitlines()[0] if why.strip() else "interrupted")

    def _say_done(self) -> None:
        """`done` (`ok` or `failed: why`), and an `end` request to every node that answers restart requests."""
        if self.store is None or self.store.check(["done"]):
            return
        self.store.set("done", f"failed: {self._failure}" if self._failure else DONE_OK)
        if self.rejoin_wait_s > 0:
            for rank in range(1, self.options.nnodes):
                self.store.set(f"restart/{rank}/{self.store.add(f'restarts/{rank}', 1)}", "end")

    def stop(self) -> None:
        self._say_done()
        self.local.stop()
        release_listener(self.master_addr, self.options.master_port + 1)  # held but never taken: start failed
        if self.store is not None and self.addresses:  # every node joined: let them read `done` first
            try:
                self.store.wait([f"left/{r}" for r in range(1, self.options.nnodes)],
                                datetime.timedelta(seconds=LEFT_WAIT_S))
            except RuntimeError:
                log.warning("not every node acknowledged the shutdown within %.0f s", LEFT_WAIT_S)
        self.store = None


class _MemberWatch:
    """A member node's watch over its stages: the death monitor, and (fail-over on) the thread that
    answers node 0's restart requests ([Note: multi-node restart]) on its own store connection (a
    TCPStore client runs one blocking call at a time, and Node0Watch polls `done` on the other)."""

    def __init__(self, placement: PlacementOptions, backend: LocalStageBackend,
                 died: Callable[[int, int], None]) -> None:
        self.placement, self.backend, self.died = placement, backend, died
        self.lock = threading.Lock()
        self.monitor = StageProcessMonitor(backend.processes, died).start()
        self.leaving = threading.Event()  # this launcher was interrupted: refuse restarts, end the thread

    def stop(self, restarts: threading.Thread | None) -> None:
        """Stop the monitor; wait for the `restarts` thread (node 0 ends it with `end` after `done`)."""
        with self.lock:
            self.monitor.stop()
        if restarts is not None:
            restarts.join(LEFT_WAIT_S)  # a thread left inside a store call would abort the interpreter

    def answer_restarts(self) -> None:
        """Serve `restart/<r>/<n>` for n = 1, 2, ... until node 0 goes away or `leaving` is set
        (daemon thread). It polls rather than blocking in a store call: a thread left inside one
        when the interpreter exits aborts it (exit 134 on SIGTERM). On `leaving` it answers node 0's
        next request before it is made, so node 0 fails at once instead of waiting
        --placement-timeout-s for a node that is gone."""
        rank = self.placement.node_rank
        try:
            store = open_store(self.placement)
            for n in itertools.count(1):
                while not store.check([f"restart/{rank}/{n}"]):
                    if self.leaving.wait(RESTART_POLL_S):
                        store.set(f"respawned/{rank}/{n}", f"{GONE}node {rank}'s launcher was stopped "
                                  "(Ctrl-C or SIGTERM)")
                        return
                request = store.get(f"restart/{rank}/{n}").decode()
                if request == "end":
                    return
                store.set(f"respawned/{rank}/{n}", self._respawn(int(request)))
        except RuntimeError as exc:  # node 0 went away (or finished): the main thread decides
            log.info("node %d: restart requests end: %s", rank, str(exc).splitlines()[0])

    def _respawn(self, stage_index: int) -> str:
        """The new address of stage `stage_index`, or `error: why`."""
        with self.lock:
            self.monitor.stop()  # it watches the old process
            try:
                address = self.backend.restart_stage(stage_index)
                log.warning("node %d: stage %d respawned at %s", self.placement.node_rank, stage_index, address)
                return address
            except Exception as exc:  # noqa: BLE001 - reported to node 0, which decides
                log.error("node %d: stage %d could not be respawned: %s", self.placement.node_rank, stage_index, exc)
                return f"error: {exc}"
            finally:
                self.monitor = StageProcessMonitor(self.backend.processes, self.died).start()


def _member_death(stage: str, returncode: int, *, fail_over: bool) -> tuple[str, str] | None:
    """What a member node makes of its `stage` exiting with `returncode`: ("done", "") for exit code
    0 (the stage obeyed a Shutdown RPC: only node 0's coordinator sends one, right after `done`,
    which may reach this node a moment after the stage's exit does); None with fail-over on (node 0
    asks for a restart, or fences and says `done`); else ("error", why)."""
    if returncode == 0:
        return "done", ""
    if fail_over:
        log.error("%s exited with %s; node 0 decides", stage, describe_returncode(returncode))
        return None
    return "error", f"{stage} exited unexpectedly with {describe_returncode(returncode)}"


def _member_outcome(node0: Node0Watch, stage_decided: threading.Event,
                    stage_verdict: dict[str, str]) -> tuple[str, str]:
    """What ends a member node: node 0's outcome (Node0Watch.wait), or a local stage's verdict
    (`_member_death`). A stage that exited 0 obeyed node 0's Shutdown: `done`, with node 0's status,
    is on its way; past LEFT_WAIT_S without it, an error."""
    outcome = node0.wait(stage_decided)
    if outcome is not None:
        return outcome
    kind, why = next(iter(stage_verdict.items()))
    if kind != "done":
        return kind, why
    return node0.wait(threading.Event(), timeout_s=LEFT_WAIT_S) or (
        "error", f"a stage was shut down but {node0.where} did not say `done` within {LEFT_WAIT_S:g} s")


def _check_same_run(store: dist.TCPStore, placement: PlacementOptions, *, num_stages: int,
                    model: tuple[str, str]) -> None:
    """Raise PlacementError (and tell node 0, which then fails at once too) when this node was given
    other --stages or another --model than node 0: it would wait for stages that never come, or
    serve node 0's model without a word."""
    run = json.loads(store.get("run").decode())
    problems = []
    if run["num_stages"] != num_stages:
        problems.append(f"--stages {num_stages} here, {run['num_stages']} on node 0")
    (key, name), (key0, name0) = model, run["model"]
    if key and key0 and key != key0:
        problems.append(f"--model resolves to {name} here, {name0} on node 0")
    if problems:
        why = f"{'; '.join(problems)}: give every node the same --stages and --model"
        store.set(f"refused/{placement.node_rank}", why)
        raise PlacementError(f"node {placement.node_rank}: {why}")


def run_member_node(placement: PlacementOptions, *, num_stages: int, log_level: str, threads_per_stage: int,
                    say: Callable[[str], None], tls: TlsFiles | None = None,
                    model: tuple[str, str] = ("", "")) -> int:
    """Node R > 0: start this node's stages, publish them, keep them until node 0 is done; with
    fail-over on (node 0's `rejoin_wait_s`), respawn a stage when node 0 asks ([Note: multi-node restart]).

    Returns 0 when node 0 finished; 1 when node 0 failed, went away or stayed silent for
    --placement-timeout-s ([Note: node 0 silent] in launch_store.py), or a local stage died
    (fail-over off). Raises PlacementError when node 0 is not reachable within the placement timeout,
    or runs another --stages or --model (`model`: (registry.model_key, folder name) of this node's;
    an empty key skips that check).
    """
    store = open_store(placement)
    _check_same_run(store, placement, num_stages=num_stages, model=model)
    rejoin_wait_s = float(store.get("rejoin_wait_s").decode())
    backend, stages = _local_backend(placement, num_stages=num_stages, log_level=log_level,
                                     threads_per_stage=threads_per_stage,
                                     control_secret=store.get("control_secret").decode(), tls=tls,
                                     rejoin_wait_s=rejoin_wait_s)
    stage_verdict: dict[str, str] = {}
    stage_decided = threading.Event()

    def died(local_index: int, returncode: int) -> None:
        verdict = _member_death(backend.describe(stages.start + local_index), returncode, fail_over=rejoin_wait_s > 0)
        if verdict is not None:
            stage_verdict.setdefault(*verdict)
            stage_decided.set()

    try:
        addresses = backend.start()
        for i, address in zip(stages, addresses, strict=True):
            store.set(f"stage/{i}", address)
        span = f"stage {stages.start}" if len(stages) == 1 else f"stages {stages.start}-{stages.stop - 1}"
        say(f"node {placement.node_rank}: {span} at {', '.join(addresses)}; "
            f"waiting for node 0 at {placement.master_addr}:{placement.master_port}")
        watch, restarts = _MemberWatch(placement, backend, died), None
        if rejoin_wait_s > 0:
            restarts = threading.Thread(target=watch.answer_restarts, name="speedpipe-restarts", daemon=True)
            restarts.start()
        try:
            kind, why = _member_outcome(Node0Watch(store, placement).start(), stage_decided, stage_verdict)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: refuse node 0's restarts, end the thread, go
            watch.leaving.set()
            watch.stop(restarts)
            raise
        watch.stop(restarts if kind != "error" else None)
        if kind != "error":  # node 0's store still answers (and its Node0Watch thread has ended)
            store.set(f"left/{placement.node_rank}", "1")
            # node 0's coordinator is sending Shutdown to our stages: let them drain and exit on their own
            backend.processes.wait_exited(STAGE_EXIT_WAIT_S)
    finally:
        backend.stop()
    if kind != "done":
        print(f"node {placement.node_rank}: pipeline failed: {'node 0 failed: ' if kind == 'failed' else ''}{why}",
              file=sys.stderr)
        return 1
    say(f"node {placement.node_rank}: node 0 finished; stages stopped")
    return 0
