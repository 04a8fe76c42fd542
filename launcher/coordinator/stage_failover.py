"""Stage fail-over: restarting the stages that died or hung, and re-forming the data plane.

Owns the hooks a session hands the coordinator (`StageFailover`; the restart budget itself,
`--max-stage-restarts` within `--restart-window-s`, is launcher/coordinator/stage_restarts.py), deciding
which stages must be restarted (dead processes, and
hung ones: a `Health` call that runs into its deadline), and the control round that moves every
stage into a fresh data-plane group (`Load` for a restarted stage, `Rejoin` for the others).
Also owns the recovery the coordinator's engine thread runs (`StageRecovery`, which `Coordinator`
inherits: restart, re-form, then step the engine with `ReplayRunning`). Must not: hold requests or engine
state (launcher/coordinator/coordinator.py does), or spawn processes itself (the placement backend's `restart_stage` does: a new process, launcher/backends/local.py;
a new actor in the same bundle, launcher/backends/ray_cluster/stage_actors.py; a respawn by the stage's node launcher,
[Note: multi-node restart] in launcher/backends/multinode.py).

[Note: fail-over]
A dead stage (its process exited: launcher/backends/stage_monitor.py), a hung one (missed heartbeats:
launcher/coordinator/stage_heartbeat.py) or a failed data-plane transfer reaches the coordinator's engine
thread as an error. With budget left, that thread, which alone drives the engine, recovers in
place while new requests queue behind it (clients see a pause, not an error):
1. bump the coordinator's generation: results, exit events and errors of the old ring that are
   still queued or still arrive are dropped; the old receivers end quietly;
2. restart every stage whose process died or whose control plane does not answer within
   `HUNG_PROBE_S` (the backend kills it first), with the same arguments and session secret (on any
   backend: a local process, a Ray actor in the same placement-group bundle, or a stage on another
   node, respawned by that node's launcher within --placement-timeout-s);
3. pick a new rendezvous port; `Load` each restarted stage (weights, empty KV cache, join) and
   `Rejoin` each surviving one (retire its loop, clear its KV cache, join) while the coordinator
   joins as rank 0: a new TCPStore and a new gloo group on every rank, never the old ones; each
   Rejoin carries the attempt's number (the generation of step 1: a stage refuses an older one that
   arrives late), and an attempt that fails gives its rendezvous up at once ([Note: abandoned
   rendezvous] in workers/channel.py);
4. warm the ring up, start new receivers, and step the engine with `ReplayRunning`: every running
   sequence is prefilled again from prompt + committed tokens ([Note: replay] in pipeline/engine/engine.py).
A failure during these steps counts as another restart. Past the budget the coordinator fails
every request as before (serve: /health 503, the server keeps answering). A stage that dies while
the server drains, or of SIGTERM / SIGINT up to SHUTDOWN_SIGNAL_GRACE_S before the server's own, is
not restarted: the requests it held end with an error event and the drain goes on
(`StageFailover.shutting_down`). Local stage workers ignore both signals (systemd, `timeout` and
`kill -- -PGID` signal every process at once: the server drains and stops them), so this covers
stages that do not: a `--no-stdin-watch` worker, or one signalled on its own.

[Note: a death during a join]
A death the placement backend reports while a data-plane join waits (the start's Load round, or a
fail-over attempt's Load / Rejoin round: a local process exits, a Ray actor or its node dies; every
backend's `watch` reports `on_death(stage_index, description)`, which the session hands to
`Coordinator.fail`) gives that rendezvous up at once, told the backend's one line ("stage 1 (pid 4242)
exited unexpectedly with signal SIGKILL"): `StageLink.abandon_join` sets the join's `GiveUp`, rank 0
stops waiting, the stages waiting there stop too (with that reason when they look before rank 0's
store goes: [Note: abandoned rendezvous] in workers/channel.py), and the attempt fails naming the
stage; the report itself, still queued, is dropped once the next attempt bumps the generation. A fail-over attempt builds its new link before
it resumes the backend's watch, so a stage that died while the watch was paused is reported to it at
once. Before, only a local process's refused Load / Rejoin call ended the round early: a Ray node that
vanished silently held it until the round's own timeout (600 s). A member node's stage in multi-node
mode is not watched by node 0 (its death reaches the coordinator on the data plane or the control plane).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

import grpc

from launcher.backends.placement import StageGone
from launcher.coordinator.request_handle import PipelineError
from launcher.coordinator.stage_control import in_daemon_thread, wait_reachable
from launcher.coordinator.stage_restarts import RestartLedger
from pipeline.engine.events import ReplayRunning
from pipeline.engine.stage_assembly import StageLoadSpec
from proto import speedpipe_pb2 as pb
from workers.load_spec_codec import spec_to_proto

log = logging.getLogger("speedpipe.failover")

HUNG_PROBE_S = 2.0  # a stage whose Health call does not answer within this is hung: restart it
# A stage killed by SIGTERM / SIGINT this long before the server's own shutdown signal arrives
# (systemd, `timeout` and `kill -- -PGID` signal every process at once; under load the server's
# handler can run a second later) died of the shutdown: it is not restarted. Other deaths (SIGKILL,
# a crash, a hang) are restarted at once.
SHUTDOWN_SIGNAL_GRACE_S = 2.0
SHUTDOWN_SIGNALS = ("SIGTERM", "SIGINT")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageFailover:
    """What the coordinator needs from its session to recover ([Note: fail-over]).

    budget: the restarts so far, against --max-stage-restarts / --restart-window-s.
    restart_stage(i) -> address: kill stage i if it runs, start it again, its control address.
    dead_stages() -> indices of stages whose process has exited.
    data_port() -> a free port for the next rendezvous; load_specs(port): every stage's Load spec.
    pause_watch / resume_watch: stop and restart the process monitor around the restarts.
    shutting_down: set when the server starts draining (a shutdown signal): no restart from then on.
    """

    budget: RestartLedger
    restart_stage: Callable[[int], str]
    dead_stages: Callable[[], Sequence[int]]
    data_port: Callable[[], int]
    load_specs: Callable[[int], Sequence[StageLoadSpec]]
    pause_watch: Callable[[], None] = lambda: None
    resume_watch: Callable[[], None] = lambda: None
    shutting_down: threading.Event = dataclasses.field(default_factory=threading.Event)

    def may_restart(self, error: Exception | None = None) -> bool:
        """False once the server is shutting down, or, for a stage that `error` says was killed by
        a shutdown signal ("killed by signal SIGTERM", `describe_returncode`), when the shutdown
        starts within SHUTDOWN_SIGNAL_GRACE_S; else True."""
        by_signal = error is not None and any(f"signal {name}" in str(error) for name in SHUTDOWN_SIGNALS)
        return not self.shutting_down.wait(SHUTDOWN_SIGNAL_GRACE_S if by_signal else 0.0)


def stages_to_restart(stubs: Sequence, dead: Sequence[int], *, probe_s: float = HUNG_PROBE_S) -> list[int]:
    """The dead stages plus those whose Health call does not answer within `probe_s` (hung, or
    refusing: a process that is gone but not yet reaped)."""
    calls = {i: stub.Health.future(pb.HealthRequest(), timeout=probe_s) for i, stub in enumerate(stubs) if i not in dead}
    silent = []
    for i, call in calls.items():
        try:
            call.result()
        except grpc.RpcError:
            silent.append(i)
    return sorted({*dead, *silent})


def restart_dead_stages(fo: StageFailover, stubs: Sequence, reconnect: Callable[[int, str], None], *,
                        unloaded: Collection[int] = ()) -> set[int]:
    """Restart the dead and hung stages (`stages_to_restart`) and the `unloaded` ones, then those that
    died meanwhile, each once, in this one fail-over attempt (a stage killed a second after another
    used to cost a second restart and a 30 s wait); `reconnect(i, address)` after each. Returns the
    restarted indices.

    unloaded: stages an earlier attempt restarted whose Load did not succeed (another stage died
    while they joined). Such a stage holds its weights, and its Load may still wait at that attempt's
    rendezvous: a second Load would wait for it (before the failed attempt gave its rendezvous up at
    once, up to --stage-timeout-s, and was then refused as "already loaded", failing every later
    attempt until the budget was spent). A fresh process takes the next attempt's Load."""
    todo, restarted = sorted({*stages_to_restart(stubs, fo.dead_stages()), *unloaded}), set()
    while todo:
        for i in todo:
            reconnect(i, fo.restart_stage(i))
        restarted.update(todo)
        todo = [i for i in fo.dead_stages() if i not in restarted]
    return restarted


def rejoin_all(stubs: Sequence, specs: Sequence[StageLoadSpec], restarted: set[int], join: Callable[[], None],
               *, timeout_s: float, attempt: int = 0, abandon: Callable[[str], None] = lambda why: None) -> None:
    """Load the restarted stages and Rejoin the others at the specs' rendezvous port, while `join`
    joins it as rank 0. Raises PipelineError naming the stage (or the coordinator) that failed first,
    the lowest such stage where several did, as soon as one fails: a stage killed while the others
    join fails its call at once, while theirs wait at the rendezvous until --stage-timeout-s (waiting
    in stage order cost that whole wait when the dead stage was not stage 0). On timeout, names the
    first call still running. Before raising, calls `abandon`, which ends `join` at once and frees
    its port, and tells the stages waiting there why ([Note: abandoned rendezvous] in workers/channel.py).

    attempt: this fail-over attempt's number (monotonic within the coordinator's run), sent with each
    Rejoin: a stage refuses one older than the newest it has seen ([Note: superseded rejoin] in
    workers/rejoin.py)."""
    port = specs[0].dist_master_port
    calls = {}
    for i, (stub, spec) in enumerate(zip(stubs, specs, strict=True)):
        if i in restarted:
            calls[in_daemon_thread(stub.Load, spec_to_proto(spec), timeout=timeout_s)] = f"stage {i} (Load)"
        else:
            request = pb.RejoinRequest(dist_master_port=port, join_timeout_s=timeout_s, attempt=attempt)
            calls[in_daemon_thread(stub.Rejoin, request, timeout=timeout_s)] = f"stage {i} (Rejoin)"
    calls[in_daemon_thread(join)] = "coordinator (join)"
    done, pending = concurrent.futures.wait(calls, timeout=timeout_s, return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = [f for f in calls if f in done and f.exception() is not None]  # in stage order, the coordinator last
    if failed:
        exc, who = failed[0].exception(), calls[failed[0]]
        detail = exc.details() if isinstance(exc, grpc.RpcError) else (str(exc) or type(exc).__name__)
    elif pending:
        who, detail = next(calls[f] for f in calls if f in pending), f"not done within {timeout_s:g} s"
    if failed or pending:
        abandon(f"{who} failed: {detail}")  # told to the stages still waiting there
        raise PipelineError(f"{who} failed while re-forming the data plane: {detail}")


class StageRecovery:
    """The coordinator's engine thread recovering from a stage failure ([Note: fail-over]): restart,
    re-form the data plane, replay. The Coordinator that inherits it provides `failover`, `generation`,
    `link`, `_new_link(port)`, `stubs`, `channels`, `_reconnect(i, address)`, `_unloaded`, `engine`,
    `_start_receivers()`, `_receivers_stopping`, `_stopping`, `num_restarts`, `recovering` and
    `recovery_listeners`."""

    def _recover(self, error: PipelineError) -> PipelineError | None:
        """Restart the failed stages, replay every running sequence ([Note: fail-over]); None once recovered,
        else the error to fail every request with (no fail-over, its budget spent, or StageGone)."""
        fo = self.failover
        while fo is not None and not self._stopping.is_set() and fo.may_restart(error):
            if not fo.budget.allows(time.monotonic()):
                b = fo.budget.budget
                return PipelineError(f"{error} (stage restarts exhausted: --max-stage-restarts {b.max_restarts} "
                                     f"within --restart-window-s {b.window_s:g})")
            fo.budget.record(time.monotonic())
            self.num_restarts += 1
            log.warning("stage failure (%s): restarting (restart %d)", error, self.num_restarts)
            self.recovering = f"restarting after a stage failure: {error}"
            self._notify_recovery("start")
            try:
                self._restart_and_replay(fo)
            except StageGone as exc:  # cannot come back: more attempts would only spend the budget
                return PipelineError(f"stage restart failed: {exc}")
            except Exception as exc:  # noqa: BLE001 - a failed attempt spends another restart
                error = PipelineError(f"stage restart failed: {exc}")
                continue
            log.warning("pipeline restored after %d restart(s); replayed the running requests", self.num_restarts)
            self.recovering = None
            self._notify_recovery("done")
            return None
        return error

    def _restart_and_replay(self, fo: StageFailover) -> None:
        """One fail-over attempt, steps 1-4 of [Note: fail-over]. Raises on failure (another restart)."""
        self._receivers_stopping.set()
        self.generation += 1  # from now on, events of the old ring are dropped
        fo.pause_watch()
        try:  # the new link exists before the watch resumes: [Note: a death during a join]
            restart_dead_stages(fo, self.stubs, self._reconnect, unloaded=set(self._unloaded))
            wait_reachable(self.channels, dead=fo.dead_stages)
            self.link.close()  # the old ring's store and gloo listeners
            self.link = self._new_link(fo.data_port())
        finally:
            fo.resume_watch()  # a stage that died meanwhile is reported at once
        rejoin_all(self.stubs, fo.load_specs(self.link.master_port), self._unloaded, self.link.join, timeout_s=600.0,
                   attempt=self.generation, abandon=self.link.close)  # [Note: abandoned rendezvous]
        self._unloaded.clear()
        self.link.warm_up()
        self._start_receivers()
        out = self.engine.step([ReplayRunning()], now_ns=time.perf_counter_ns())
        self.link.send_step(out)

    def _notify_recovery(self, phase: str) -> None:
        """Call every recovery listener with (`phase`, why); one that raises is logged, not fatal."""
        for listener in self.recovery_listeners:
            try:
                listener(phase, self.recovering or "")
            except Exception:  # noqa: BLE001 - a listener must not stop the recovery
                log.exception("recovery listener failed")
