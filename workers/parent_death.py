"""Die with the launcher: a stage worker arms `PR_SET_PDEATHSIG` itself, right after it starts.

[Note: no preexec_fn]
The launcher used to arm the parent-death signal in a `preexec_fn`, i.e. between fork and exec.
Any `preexec_fn` makes Python fork the whole launcher (instead of vfork), and a fork runs gRPC's
`pthread_atfork` child handler, which since grpcio 1.81 restarts the EventEngine poller in the
child; `close_fds=True` then closes the poller's epoll fd before exec and the child aborts
("epoll_wait error: Bad file descriptor", SIGABRT; grpc/grpc issue 43055). It struck at random
when a process that already had gRPC channels (a running pipeline) started stages. Now the
launcher spawns with no `preexec_fn` (vfork: no fork handlers run) and passes its pid in
`SPEEDPIPE_PARENT_PID`; the worker arms the signal first thing, then checks that its parent is
still that pid, which closes the window in which the launcher died before the signal was armed.
Standard library only (the fake stage worker of the launcher tests uses it too). Linux only;
elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Mapping

PARENT_PID_ENV = "SPEEDPIPE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(environ: Mapping[str, str] = os.environ) -> bool:
    """SIGKILL this process when the launcher thread that spawned it dies; SIGKILL it now if the
    launcher (pid in `SPEEDPIPE_PARENT_PID`) is already gone. Returns whether the signal was armed
    (False: no launcher pid given, not Linux, or prctl unavailable)."""
    parent = environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True
