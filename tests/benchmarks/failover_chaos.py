"""The issue-16 chaos run at any size: `serve` (in-process, 3 stages), greedy requests at
concurrency, `kill -9` and SIGSTOP of random stages at random times (tests/distributed/test_failover.py
`chaos`), on the sharpened tiny model or any model (`--model`, e.g. smollm2-135m).

    PYTHONPATH=. python tests/benchmarks/failover_chaos.py [--requests 64] [--concurrency 8] [--kills 3]
        [--stops 0] [--model tiny] [--max-tokens 160]

Asserts that every response is 200 with the offline text (on the tiny model also that the offline
text is the single-process reference's), that no process, listening port or KV slot leaks, and
prints how long /health took to answer 200 again after each kill or stop (a stopped stage is found
by the 5 s heartbeat, then killed and restarted). Exit code 1 on a failed check.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kills", type=int, default=3, help="kill -9 of a random stage (default 3)")
    ap.add_argument("--stops", type=int, default=0, help="SIGSTOP of a random stage (default 0)")
    ap.add_argument("--model", default="tiny", help="tiny (the sharpened tiny random model, default) or a "
                    "model name or folder, e.g. smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per request (default 160)")
    args = ap.parse_args(argv)
    from tests.distributed.conftest import sharpen_weights
    from tests.distributed.test_failover import chaos
    from tests.tiny_model import write_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.model == "tiny"
        model = sharpen_weights(write_tiny_model(Path(tmp) / "model")) if tiny else args.model
        try:
            back_s = chaos(model, num_requests=args.requests, concurrency=args.concurrency, num_kills=args.kills,
                           num_stops=args.stops, max_new_tokens=args.max_tokens, check_reference=tiny)
        except AssertionError as exc:
            print(f"FAILED: {exc}")
            return 1
    print(f"{args.model}: {args.requests} requests at concurrency {args.concurrency}, {args.kills} kill -9 and "
          f"{args.stops} SIGSTOP: all 200 with the offline text; no leaked process, port or KV slot; /health 200 "
          f"again {', '.join(f'{t:.1f}' for t in back_s)} s after the breaks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
