"""Benchmark: server memory over many short requests (issue 16, bounded serve buffers). Not a test.

Starts `speedpipe serve` as a child process (default: the tiny random model of tests/tiny_model.py,
2 stages, so the soak measures the server and not the model), sends --warmup short greedy requests,
reads the server process's RSS (psutil), sends --requests more at --concurrency, reads it again and
prints the growth (and its trend after every tenth of the requests). Target: <= 20 MB growth over
10,000 requests after warm-up.

Prompts cycle through 64 texts by default. With --unique-prompts every request has a new number
in it, and the RSS also grows by the Rust tokenizer's BPE word cache filling up (bounded by the
tokenizers library at 10,000 words: a cache, not a leak; measured in-process, a fixed prompt
through the serving engine grows < 0.1 KB per request, a new word per request ~0.6 KB).

Usage: python tests/benchmarks/serving_soak.py [--requests 10000] [--warmup 1000] [--concurrency 8]
       [--model PATH] [--stages 2] [--max-tokens 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launcher.backends.ports import free_port  # noqa: E402
from tests.tiny_model import write_tiny_model  # noqa: E402


def start_server(model: str, stages: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "serve", "--model", model, "--stages", str(stages),
                             "--port", str(port), "--grpc-port", "-1", "--max-model-len", "256",
                             "--served-model-name", "soak", "--stats-interval-s", "0",
                             "--speculate", "none"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy within 180 s")


def send(url: str, n: int, *, concurrency: int, max_tokens: int, start: int = 0, unique: bool = False) -> int:
    """n short non-streamed completions, `concurrency` at a time; returns how many failed."""
    def one(client: httpx.Client, i: int) -> bool:
        prompt = f"Hello number {i if unique else i % 64}"
        r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
        return r.status_code == 200

    with httpx.Client(limits=httpx.Limits(max_connections=concurrency)) as client, \
            concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return sum(not ok for ok in pool.map(lambda i: one(client, i), range(start, start + n)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", help="model folder or name (default: the tiny random model)")
    parser.add_argument("--unique-prompts", action="store_true", help="a new number in every prompt")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_tiny_model(Path(tmp) / "tiny"))
        proc, url = start_server(model, args.stages)
        try:
            server = psutil.Process(proc.pid)
            failed = send(url, args.warmup, concurrency=args.concurrency, max_tokens=args.max_tokens,
                          unique=args.unique_prompts)
            before = server.memory_info().rss
            start, done, trend_mb = time.perf_counter(), 0, []
            while done < args.requests:  # RSS after every tenth of the requests: growth or plateau?
                n = min(max(1, args.requests // 10), args.requests - done)
                failed += send(url, n, concurrency=args.concurrency, max_tokens=args.max_tokens,
                               start=args.warmup + done, unique=args.unique_prompts)
                done += n
                trend_mb.append(round((server.memory_info().rss - before) / 2**20, 2))
            wall_s = time.perf_counter() - start
            after = server.memory_info().rss
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    result = {"model": args.model or "tiny random (tests/tiny_model.py)", "stages": args.stages,
              "unique_prompts": args.unique_prompts,
              "warmup": args.warmup, "requests": args.requests, "concurrency": args.concurrency,
              "failed": failed, "rss_before_mb": round(before / 2**20, 1), "rss_after_mb": round(after / 2**20, 1),
              "rss_growth_mb": round((after - before) / 2**20, 2), "rss_growth_trend_mb": trend_mb,
              "requests_per_s": round(args.requests / wall_s, 1),
              "server_exit_code": proc.returncode}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if failed == 0 and result["rss_growth_mb"] <= 20 else 1


if __name__ == "__main__":
    sys.exit(main())
