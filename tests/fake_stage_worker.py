"""A stand-in for `workers.stage_worker` that follows only its process contract (for launcher tests).

It accepts the real worker's flags (`--stage-index`, `--host`, `--port`, `--log-level`), binds a real TCP
port, logs one line to stderr, prints `SPEEDPIPE_STAGE_READY port=<N>` to stdout and then waits until
its stdin reaches EOF, exiting 0. It serves nothing. Standard library only, so it starts in ~30 ms.

Misbehaviour flags take a stage selector (`all` or a comma list such as `1,2`) so one shared command
line can make only some stages misbehave:

  --die-before-ready STAGES   log "simulated startup failure" to stderr and exit with --exit-code
  --never-ready STAGES        never print the ready line (still exits on stdin EOF)
  --delay-ready STAGES        sleep --delay-ready-s seconds before the ready line
  --die-after STAGES          exit with --exit-code --die-after-s seconds after the ready line
  --ignore-sigterm STAGES     ignore SIGTERM (installed before the ready line)
  --ignore-stdin-eof STAGES   keep running after stdin EOF
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from workers.parent_death import arm_parent_death_signal


def _selects(selector: str, stage_index: int) -> bool:
    if selector == "all":
        return True
    return stage_index in {int(part) for part in selector.split(",") if part}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage-index", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--die-before-ready", default="")
    parser.add_argument("--never-ready", default="")
    parser.add_argument("--delay-ready", default="")
    parser.add_argument("--delay-ready-s", type=float, default=0.5)
    parser.add_argument("--die-after", default="")
    parser.add_argument("--die-after-s", type=float, default=0.3)
    parser.add_argument("--ignore-sigterm", default="")
    parser.add_argument("--ignore-stdin-eof", default="")
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args(argv)
    arm_parent_death_signal()  # as the real worker does
    stage = args.stage_index

    def log(message: str) -> None:
        print(f"fake worker stage {stage}: {message}", file=sys.stderr, flush=True)

    if _selects(args.ignore_sigterm, stage):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _selects(args.die_before_ready, stage):
        log("simulated startup failure")
        return args.exit_code

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((args.host, args.port))
    listener.listen()
    port = listener.getsockname()[1]
    log(f"listening on port {port} log_level={args.log_level} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
        f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')} "
        f"FAKE_WORKER_TAG={os.environ.get('FAKE_WORKER_TAG')}")
    if _selects(args.delay_ready, stage):
        time.sleep(args.delay_ready_s)
    if not _selects(args.never_ready, stage):
        print(f"SPEEDPIPE_STAGE_READY port={port}", flush=True)
    if _selects(args.die_after, stage):
        def die() -> None:
            log(f"simulated crash after {args.die_after_s} s")
            os._exit(args.exit_code)

        timer = threading.Timer(args.die_after_s, die)
        timer.daemon = True
        timer.start()

    sys.stdin.buffer.read()  # returns at EOF: the launcher closed our stdin or died
    if _selects(args.ignore_stdin_eof, stage):
        threading.Event().wait()  # until a signal ends us
    log("stdin closed, exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
