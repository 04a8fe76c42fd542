"""A loaded stage's Rejoin: moving it into a fresh data-plane group, in fail-over attempts' order.

Owns the `Rejoin` RPC of the stage worker's servicer (`RejoinHandler`, a base of
workers/stage_worker.py's StageServicer), the order of fail-over attempts as this stage sees them,
and the status a failed rendezvous answers (`join_failure`, for Load as for Rejoin). Must not: load
models, run the data-plane loop (workers/stage_loop.py) or form groups itself (workers/channel.py).

[Note: superseded rejoin]
A fail-over attempt can fail while this stage waits at its rendezvous (another stage died), and
the next attempt's Rejoin follows. So the join runs outside the lock, in a daemon thread: a newer
Rejoin joins its own group at once and the waiting one answers ABORTED at once (its rendezvous
ends in that thread: as soon as the coordinator closes that attempt's store if it was connected,
else when its own connect times out; a group that formed late is closed). Before, the newer one
waited until the stale rendezvous timed out, each stale one holding a gRPC thread.
Two attempts milliseconds apart can also deliver their Rejoins out of order (separate calls on
separate threads): each carries its attempt number (`RejoinRequest.attempt`, the coordinator's
generation), and a Rejoin older than the newest this stage has seen answers ABORTED naming both,
without touching the newer one's group. Before, the stale one arrived last and superseded the
newer one, whose rendezvous then lacked this stage.
A stage whose join failed (its Load's or a Rejoin's) holds its weights in no group, and takes a Rejoin or a
Load, as does one whose Rejoin still waits (it retired its loop): a Load drops the retired loop, loads the
weights again and supersedes a Rejoin still waiting, as a newer Rejoin does (else that one's group, forming
after the Load's, started a second data-plane loop). Before, a stage whose Rejoin had retired a loop refused
every Load "already loaded" (the retired loop stayed its `loop`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading

import grpc

from pipeline.engine.stage_assembly import StageLoadSpec
from proto import speedpipe_pb2 as pb

log = logging.getLogger("speedpipe.worker")

JOIN_TIMEOUT_S = 600.0  # a Load's rendezvous, and a Rejoin's without join_timeout_s: the others load meanwhile
_TIMED_OUT = re.compile(r"timed out|timeout after", re.IGNORECASE)  # torch's store, socket and gloo


def join_failure(exc: Exception, spec: StageLoadSpec, *, timeout_s: float) -> tuple[grpc.StatusCode, str]:
    """The status and one-line message for a data-plane join at `spec`'s rendezvous that raised `exc`:
    for torch's RuntimeError (DistStoreError, DistNetworkError) or an OSError, DEADLINE_EXCEEDED when
    it timed out, UNAVAILABLE otherwise (the store went away: the coordinator abandoned the attempt);
    INTERNAL naming the type of any other exception (a bug). The message does not name the stage
    (Load's callers add it; Rejoin does)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if not isinstance(exc, (RuntimeError, OSError)):
        code, first = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {first}"
    elif isinstance(exc, TimeoutError) or _TIMED_OUT.search(first):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        code = grpc.StatusCode.UNAVAILABLE
    return code, (f"joining the data plane as rank {spec.dist_rank} at {spec.dist_master_addr}:{spec.dist_master_port} "
                  f"(timeout {timeout_s:g} s) failed: {first}")


class RejoinHandler:
    """The Rejoin RPC ([Note: superseded rejoin]). The servicer that inherits it provides `stage_index`,
    `_lock`, `executor`, `spec`, `loop`, `failure`, `join_error`, `_rejoined`, `_join_data_plane(spec, connect_timeout_s=)`
    and `_start_loop(spec, group)`, and calls `_init_rejoins()` in its __init__."""

    def _init_rejoins(self) -> None:
        self._join_epoch = 0  # bumped by every accepted Rejoin
        self._join_ended = threading.Event()  # set when the latest Rejoin's join ended or was superseded
        self._newest_attempt = 0  # the highest RejoinRequest.attempt seen

    def Rejoin(self, request, context):
        """Retire the data-plane loop, clear the KV cache, join the group at request.dist_master_port.
        FAILED_PRECONDITION if not loaded, INVALID_ARGUMENT for a bad port, ABORTED if superseded or
        older than an attempt already seen, DEADLINE_EXCEEDED / UNAVAILABLE if the rendezvous failed."""
        with self._lock:
            if self.executor is None or self.spec is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.stage_index} is not loaded")
            if not 0 < request.dist_master_port < 65536:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dist_master_port {request.dist_master_port} is not a port")
            if request.attempt and request.attempt < self._newest_attempt:  # 0: not numbered
                context.abort(grpc.StatusCode.ABORTED, f"stage {self.stage_index}: the Rejoin of fail-over attempt "
                              f"{request.attempt} (port {request.dist_master_port}) arrived after attempt "
                              f"{self._newest_attempt}'s: refused as stale")
            self._newest_attempt = max(self._newest_attempt, request.attempt)
            old = self.loop
            if old is not None:
                old.retired = True
                old.stopped.wait(timeout=1.0)  # a loop in the middle of a step finishes it first
                old.sends.abandon()  # nothing may hold the old group ([Note: posted sends])
                old.channel.group.close()  # its sockets: no leaked port per fail-over
            self._rejoined.set()
            self.executor.clear()
            self._supersede_rejoins()
            epoch, ended, outcome = self._join_epoch, threading.Event(), {}
            self._join_ended = ended
            spec = dataclasses.replace(self.spec, dist_master_port=request.dist_master_port)
        timeout_s = request.join_timeout_s or JOIN_TIMEOUT_S
        threading.Thread(target=self._join_for_rejoin, args=(spec, epoch, timeout_s, ended, outcome), name="rejoin",
                         daemon=True).start()
        ended.wait()
        if "error" in outcome:
            code, message = join_failure(outcome["error"], spec, timeout_s=timeout_s)
            context.abort(code, f"stage {self.stage_index}: {message}")
        if not outcome.get("joined"):
            context.abort(grpc.StatusCode.ABORTED, f"stage {self.stage_index}: the rejoin at port "
                          f"{request.dist_master_port} was superseded by a newer Rejoin or a Load")
        log.info("[Stage %d] rejoined the data plane at port %d", self.stage_index, request.dist_master_port)
        return pb.RejoinResponse()

    def _supersede_rejoins(self) -> None:
        """A newer Rejoin, or a Load (caller holds the lock): a Rejoin still waiting at an earlier
        rendezvous answers ABORTED now, and its group, should it form, is closed, not run."""
        self._join_epoch += 1
        self._join_ended.set()

    def _join_for_rejoin(self, spec: StageLoadSpec, epoch: int, timeout_s: float, ended: threading.Event, outcome: dict):
        """A Rejoin's join, in its own thread: outcome "joined" or "error", then `ended`."""
        try:
            group = self._join_data_plane(spec, connect_timeout_s=timeout_s, refused_is_abandoned=True)
            with self._lock:
                if epoch != self._join_epoch:
                    group.close()
                else:
                    self._start_loop(spec, group)
                    self.spec, self.failure = spec, None
                    outcome["joined"] = True
        except Exception as exc:  # noqa: BLE001 - the Rejoin answers it (a RuntimeError from torch: timed out)
            outcome["error"] = exc
            with self._lock:
                if epoch == self._join_epoch:  # not superseded: the stage is in no group now (its Health says so)
                    self.join_error = join_failure(exc, spec, timeout_s=timeout_s)[1]
        finally:
            ended.set()
