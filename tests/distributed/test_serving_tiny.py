"""Serving on the tiny model over loopback: a stage killed under a live server, and the `serve` CLI.

- A stage SIGKILLed while a stream is open: the stream ends with an error event, /health turns 503
  naming the stage, new requests get 503, the server keeps answering, and closing leaves no stage
  process behind.
- `speedpipe serve --speculate speed` as a child process: concurrent streaming greedy requests,
  admitted while others decode and with drafts filling idle stage slots, each give the tokens of
  the single-process reference; SIGTERM stops it and every stage worker.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from launcher.backends.ports import free_port
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.serve import ServeOptions, ServingStack
from pipeline.speculation.sampling import SamplingParams
from tests.conftest import wait_for
from tests.distributed.conftest import (
    env_with_tag,
    full_model,
    pid_alive,
    reference_generate,
    session_options,
    stage_worker_processes,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]


def test_stage_killed_under_a_live_server(tiny_model_dir: Path):
    options = session_options(tiny_model_dir, 2)
    session = PipelineSession(options, resolve(options)).__enter__()
    pids = list(session.processes.pids)
    try:
        with ServingStack(session, ServeOptions(port=0, grpc_port=-1, stats_interval_s=0)) as stack:
            url = f"http://127.0.0.1:{stack.http_port}"
            assert httpx.get(url + "/health").status_code == 200
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(pids[1], signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][6:]), rest[-3:]
            assert "stage 1" in json.loads(rest[-2][6:])["error"]["message"]
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "stage 1" in health.json()["error"]["message"]
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503
            assert httpx.get(url + "/v1/models").status_code == 200  # still answering
    finally:
        session.close()
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout_s=5)
    assert not [p for p in pids if pid_alive(p)]


def test_serve_cli_serves_reference_tokens_and_stops_on_sigterm(tiny_model_dir: Path):
    port = free_port()
    tag = ("SPEEDPIPE_TEST_TAG", f"serve-{os.getpid()}-{port}")
    env = env_with_tag(*tag)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "serve", "--model", str(tiny_model_dir),
                             "--stages", "2", "--port", str(port), "--grpc-port", "-1", "--max-model-len", "512",
                             "--served-model-name", "tiny", "--speculate", "speed", "--predictor", "ngram",
                             "--max-num-seqs", "4"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        def healthy() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(healthy, timeout_s=120, step_s=0.2), "serve did not become healthy"
        model, tokenizer = full_model(tiny_model_dir)

        def stream(prompt: str) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": True}
            ids = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
            return ids

        prompts = [f"Hello {i}" * (1 + i % 3) for i in range(6)]  # 6 requests on 4 slots: 2 wait, then join
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(stream, prompts))
        for prompt, ids in zip(prompts, got, strict=True):
            want = reference_generate(model, tokenizer.encode(prompt), SamplingParams(max_new_tokens=12, ignore_eos=True))
            assert ids == want, prompt
        # alone on 2 stages, a request leaves a stage idle: drafts fill it, tokens unchanged
        alone = "Hello Hello Hello"
        assert stream(alone) == reference_generate(model, tokenizer.encode(alone),
                                                   SamplingParams(max_new_tokens=12, ignore_eos=True))
        metrics = httpx.get(url + "/metrics").text
        drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("speedpipe:spec_decode_num_draft_tokens_total"))
        assert drafted > 0
        assert len(stage_worker_processes(env_tag=tag)) == 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert "serving tiny (2 stage(s))" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not stage_worker_processes(env_tag=tag), timeout_s=5)
    assert stage_worker_processes(env_tag=tag) == []
