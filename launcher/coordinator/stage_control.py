"""The coordinator's control-plane calls to its stages: Load every stage while joining the data
plane (the first failure winning), and stop them all.

Owns running the blocking start-up calls in daemon threads, naming the stage that failed, and
the Shutdown round. Must not: serve requests (launcher/coordinator/coordinator.py does) or spawn processes.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from launcher.coordinator.request_handle import PipelineError, StageLoadError
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.load_spec_codec import StageLoadSpec, spec_to_proto
from workers.rpc.request_parse import UNPARSABLE_REQUEST
from workers.rpc.status_details import error_reason

DEAD_POLL_S = 0.5  # wait_reachable: how often it asks whether a stage it waits for has died
# The answers of a stage's Load that blame the user's input (a model file, a setting: `launch` exits 2).
# Not FAILED_PRECONDITION (a Load meant for another stage, or a second Load: the coordinator's own
# bookkeeping) nor INTERNAL / UNKNOWN (an unexpected exception in the stage): those exit 1. Nor an
# INVALID_ARGUMENT whose ErrorInfo reason is in INTERNAL_REASONS: a Load request the stage could not
# parse (workers/rpc/request_parse.py) means the coordinator and the stage disagree on the protocol.
USER_INPUT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
INTERNAL_REASONS = frozenset({UNPARSABLE_REQUEST})


def in_daemon_thread(fn, *args, **kwargs) -> concurrent.futures.Future:
    """Run fn(*args, **kwargs) in a daemon thread; its outcome lands in the returned Future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=run, name=getattr(fn, "__name__", "start-up"), daemon=True).start()
    return fut


def wait_reachable(channels: Sequence[grpc.Channel], *, timeout_s: float = 30.0,
                   dead: Callable[[], Sequence[int]] = tuple) -> None:
    """Wait for every stage's control plane, at most `timeout_s` in all. `dead()`: indices of stages
    whose process has exited, asked twice a second, so a stage that died meanwhile fails the wait
    at once instead of after the timeout. Raises PipelineError naming the first such stage."""
    deadline = time.monotonic() + timeout_s
    for i, channel in enumerate(channels):
        ready = grpc.channel_ready_future(channel)
        while True:
            try:
                ready.result(timeout=max(0.0, min(DEAD_POLL_S, deadline - time.monotonic())))
                break
            except grpc.FutureTimeoutError:
                if i in dead():
                    raise PipelineError(f"stage {i} died while the pipeline was being restored") from None
                if time.monotonic() >= deadline:
                    raise PipelineError(f"stage {i} control plane is not reachable") from None


def load_and_join(stubs: Sequence[pb_grpc.StageServiceStub], specs: Sequence[StageLoadSpec],
                  join: Callable[[], None], *, timeout_s: float,
                  abandon: Callable[[], None] = lambda: None) -> list[pb.LoadStageResponse]:
    """Load every stage (one Load RPC each) while `join` joins the data plane; returns the Load
    responses in stage order. Raises StageLoadError naming the stage (or the coordinator) that
    failed first, once ("stage 1 failed to load: <the stage's message>"; "stage 1 failed to load the
    model: TypeError: ..." for an unexpected exception in the stage), its `user_input` set for the
    USER_INPUT_CODES but not INTERNAL_REASONS; PipelineError on timeout. Before raising, calls
    `abandon`, which ends a `join` still waiting and frees its port ([Note: abandoned rendezvous]
    in workers/channel.py; before, it waited out its 600 s)."""
    # Daemon threads, not a ThreadPoolExecutor: after a failed start a join may stay blocked in
    # the rendezvous, and the interpreter must still be able to exit.
    loads = {in_daemon_thread(stub.Load, spec_to_proto(spec), timeout=timeout_s): i
             for i, (stub, spec) in enumerate(zip(stubs, specs, strict=True))}
    joined = in_daemon_thread(join)
    # The first failure wins: a stage whose weights are bad fails its Load at once, while the
    # others would only time out later waiting for it to join the data plane.
    done, pending = concurrent.futures.wait([*loads, joined], timeout=timeout_s,
                                            return_when=concurrent.futures.FIRST_EXCEPTION)
    loading = sorted(loads[f] for f in pending if f in loads)  # stages whose Load has not returned
    if pending or any(f.exception() for f in done):
        abandon()
    if pending and not any(f.exception() for f in done):
        if loading:
            raise PipelineError(f"{_stages(loading)} did not finish loading within {timeout_s:g} s "
                                "(hung, or too slow: see that stage's log)")
        raise PipelineError(f"every stage loaded, but the data plane was not joined within {timeout_s:g} s")
    failed = sorted((loads.get(f, len(specs)), f) for f in done if f.exception() is not None)
    if failed:
        index, fut = failed[0]
        exc = fut.exception()
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        # One line: an exception's message may span several (torch's "Error(s) in loading ...:\n\t...").
        detail = " ".join(line.strip() for line in (detail or "").splitlines() if line.strip())
        internal = error_reason(exc) in INTERNAL_REASONS
        if internal:
            detail = ("the coordinator and the stage disagree on the control protocol (different speedpipe "
                      f"versions?): {detail}")
        who = f"stage {index}" if index < len(specs) else "coordinator"
        # A stage hung in its Load makes its neighbours fail their rendezvous with it: name it too.
        others = [i for i in loading if i != index]
        hint = f" ({_stages(others)} {'was' if len(others) == 1 else 'were'} still loading then)" if others else ""
        # INTERNAL: an unexpected exception in the stage ("<ExceptionType>: <message>"); UNKNOWN: the same
        # from a stage that does not catch it (gRPC's "Exception calling application: ...").
        what = "the model" if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else ""
        raise StageLoadError(f"{who} failed to load{' ' + what if what else ''}: {detail}{hint}",
                             user_input=code in USER_INPUT_CODES and not internal)
    return [f.result() for f in sorted(loads, key=loads.get)]


def _stages(indices: Sequence[int]) -> str:
    return f"stage {indices[0]}" if len(indices) == 1 else f"stages {', '.join(map(str, indices))}"


def shutdown_stages(stubs: Sequence[pb_grpc.StageServiceStub], channels: Sequence[grpc.Channel], *,
                    reason: str) -> None:
    """Ask every stage to shut down (a stage already gone is fine) and close the channels."""
    for stub in stubs:
        try:
            stub.Shutdown(pb.ShutdownRequest(reason=reason), timeout=5)
        except grpc.RpcError:
            pass
    for ch in channels:
        ch.close()
