"""The issue-16 chaos run at any size: `serve` (in-process, 3 stages, tiny model), greedy requests
at concurrency, `kill -9` of random stages at random times (tests/distributed/test_failover.py `chaos`).

    PYTHONPATH=. python tests/benchmarks/failover_chaos.py [--requests 64] [--concurrency 8] [--kills 3]

Asserts that every response is 200 with the offline text, that no process or KV slot leaks, and
prints how long /health took to answer 200 again after each kill. Exit code 1 on a failed check.
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
    ap.add_argument("--kills", type=int, default=3)
    args = ap.parse_args(argv)
    from tests.distributed.conftest import sharpen_weights
    from tests.distributed.test_failover import chaos
    from tests.tiny_model import write_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = sharpen_weights(write_tiny_model(Path(tmp) / "model"))
        try:
            back_s = chaos(model_dir, num_requests=args.requests, concurrency=args.concurrency, num_kills=args.kills)
        except AssertionError as exc:
            print(f"FAILED: {exc}")
            return 1
    print(f"{args.requests} requests at concurrency {args.concurrency}, {args.kills} kill -9: all 200 with the "
          f"offline text; /health 200 again {', '.join(f'{t:.1f}' for t in back_s)} s after the kills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
