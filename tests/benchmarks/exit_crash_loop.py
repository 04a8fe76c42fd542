"""Count crash messages at exit over many consecutive `launch` runs (issue 17, point 3).

A stage worker's stdin watcher once blocked in a buffered read, and about 2 launches in 30 ended
with `Fatal Python error: _enter_buffered_busy ... at interpreter shutdown` (exit code still 0).
This runs `launch --stages 4 --max-new-tokens 8` N times in a row and counts the runs whose
stderr holds a crash message or a traceback, and (apart) the runs whose exit code is not 0 (on an
overloaded machine a stage can miss its start-up deadline: that is a failure, not a crash).
Expected: 0 and 0.

    python tests/benchmarks/exit_crash_loop.py [--runs 50] [--stages 4] [--max-new-tokens 8]

Prints one line per run (a failing one with its tail of stderr) and a final count line; exit code
1 if any run crashed or failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

CRASH_MARKERS = ("Fatal Python error", "Traceback", "Segmentation fault", "core dumped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="consecutive launches (default 50)")
    ap.add_argument("--stages", type=int, default=4, help="--stages of each launch (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="--max-new-tokens of each launch (default 8)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per-launch timeout (default 300)")
    args = ap.parse_args(argv)
    launch = str(Path(sys.executable).parent / "launch")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    crashes, failures, start = 0, 0, time.perf_counter()
    for i in range(args.runs):
        proc = subprocess.run([launch, "--stages", str(args.stages), "--max-new-tokens", str(args.max_new_tokens),
                               "--speculate", "none", "--prompt", "Once upon a time"], capture_output=True, text=True, env=env,
                              timeout=args.timeout_s, stdin=subprocess.DEVNULL)
        markers = [m for m in CRASH_MARKERS if m in proc.stderr]
        crashes += bool(markers)
        failures += proc.returncode != 0
        status = "ok" if not markers and proc.returncode == 0 else f"exit {proc.returncode}, markers {markers}"
        print(f"run {i}: {status} ({time.perf_counter() - start:.0f} s)", flush=True)
        if status != "ok":
            tail = "\n    ".join(proc.stderr.strip().splitlines()[-6:])
            print(f"    {tail}", flush=True)
    print(f"{crashes} of {args.runs} launches (--stages {args.stages} --max-new-tokens {args.max_new_tokens}) printed "
          f"a crash message; {failures} exited non-zero; {time.perf_counter() - start:.0f} s")
    return 1 if crashes or failures else 0


if __name__ == "__main__":
    sys.exit(main())
