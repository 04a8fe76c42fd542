"""Stage fail-over with replay (issue 16 part 1; launcher/coordinator/stage_failover.py), on the tiny model.

What breaks when these fail: a stage that dies or hangs under load takes every running request
down with it (or the server), a restarted pipeline continues from KV caches no stage holds any
more (wrong tokens), restarted processes or KV slots leak, or the restart budget does not bound
the restarts.

- A session (the pipeline `launch` runs) with 3 stages: stage 1 SIGKILLed, or SIGSTOPped (hung:
  found by the data-plane deadline, then killed), while requests decode: every request completes
  with exactly the tokens of the single-process reference; the dead stage has a new process.
- `speedpipe launch --stages 3` as a child process, a stage killed mid-generation: the same tokens
  as an undisturbed `launch`.
- The chaos test: `serve` with 3 stages, greedy requests at concurrency, `kill -9` (or SIGSTOP) of
  random stages at random times: every response 200 with the reference text, /health 200 again
  after each restart, no leaked process, listening port or KV slot.
- Past --max-stage-restarts: today's behaviour (every request fails, naming the budget).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.coordinator.stage_restarts import RestartBudget
from launcher.serving.drain import DrainSignals, serve_until_stopped
from launcher.serving.serve import ServeOptions, ServingStack
from pipeline.speculation.sampling import SamplingParams
from tests.conftest import wait_for
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
POLICY = RestartBudget(max_restarts=3, window_s=600)
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


def _live_workers_of(pid: int) -> dict[int, int]:
    """{stage index: pid} of the live stage-worker processes among the children of `pid`."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
            if WORKER_MODULE in " ".join(cmdline) and child.status() != psutil.STATUS_ZOMBIE:
                found[int(cmdline[cmdline.index("--stage-index") + 1])] = child.pid
        except (psutil.NoSuchProcess, ValueError, IndexError):
            continue
    return found


@pytest.mark.parametrize("breakage", ["kill-9", "sigstop"])
def test_a_stage_broken_mid_generation_is_restarted_and_every_request_completes_with_the_same_tokens(
        tiny_model_dir: Path, breakage: str):
    expected = _references(tiny_model_dir, PROMPTS[:3], GREEDY)
    options = session_options(tiny_model_dir, 3, stage_timeout_s=3.0 if breakage == "sigstop" else 60.0)
    session = PipelineSession(options, resolve(options), restart_budget=POLICY).__enter__()
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
        # RELEASE travels in-band after the last result: every slot frees, maybe a little later
        wait_for(lambda: not any(s.kv_slots_in_use for s in coord.stage_stats()), timeout_s=10.0)
        assert [s.kv_slots_in_use for s in coord.stage_stats()] == [0, 0, 0]
    finally:
        if pid_alive(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
        all_pids = {*pids, *session.processes.pids}
        session.close()
    assert not [p for p in all_pids if pid_alive(p)]


def test_past_the_restart_budget_every_request_fails_naming_it(tiny_model_dir: Path):
    options = session_options(tiny_model_dir, 2)
    policy = RestartBudget(max_restarts=1, window_s=600)
    with PipelineSession(options, resolve(options), restart_budget=policy) as session:
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


def _launch(model_dir: Path, *, kill_stage: int | None) -> tuple[str, str]:
    """`speedpipe launch --stages 3` streaming one long greedy prompt; kills stage `kill_stage` once
    text streams. Returns (the streamed line, stderr)."""
    command = [sys.executable, "-m", "launcher.cli.main", "launch", "--model", str(model_dir), "--stages", "3",
               "--prompt", PROMPTS[0], "--max-new-tokens", "1500", "--max-model-len", "2048", "--ignore-eos"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=lambda s=s, b=b: [b.extend(c) for c in iter(lambda: s.read1(4096), b"")],
                                daemon=True) for s, b in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        if kill_stage is not None:
            deadline = time.monotonic() + 120
            while len(out) < len(PROMPTS[0]) + 16:
                assert proc.poll() is None and time.monotonic() < deadline, err.decode(errors="replace")[-3000:]
                time.sleep(0.02)
            workers = _live_workers_of(proc.pid)
            assert sorted(workers) == [0, 1, 2], workers
            os.kill(workers[kill_stage], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, err.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=5)
    return out.decode().splitlines()[0], err.decode(errors="replace")


def test_launch_with_a_stage_killed_mid_generation_prints_the_same_tokens(tiny_model_dir: Path):
    undisturbed, _ = _launch(tiny_model_dir, kill_stage=None)
    killed, stderr = _launch(tiny_model_dir, kill_stage=1)
    assert "pipeline restored" in stderr, stderr[-3000:]
    assert killed == undisturbed


def _wait_healthy(url: str, timeout_s: float) -> float:
    """Seconds until /health answers 200 (bounded polling); fails the test after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"/health not 200 within {timeout_s} s")


def _listening_ports(session: PipelineSession, *, front_end: set[int]) -> dict[str, list[int]]:
    """Listening TCP ports of the server's process tree (this process, "coordinator", and each live
    stage worker, "stage i"), without the `front_end` ports (the front end's, and this process's
    listeners from before the session)."""
    pids = dict(enumerate(session.processes.pids))
    roles = {os.getpid(): "coordinator", **{pid: f"stage {i}" for i, pid in pids.items()}}
    found = {}
    for pid, role in roles.items():
        sockets = psutil.Process(pid).net_connections(kind="inet")
        found[role] = sorted(c.laddr.port for c in sockets
                             if c.status == psutil.CONN_LISTEN and c.laddr.port not in front_end)
    return found


def _same_counts(before, after) -> bool:
    return {r: len(p) for r, p in after.items()} == {r: len(p) for r, p in before.items()}


def _check_no_leaked_port(before: dict[str, list[int]], after: dict[str, list[int]], session) -> None:
    """Every process listens on as many ports as before the chaos (a data-plane group re-formed
    after a restart has new ports, the old group's are closed), and each stage on its current
    control-plane address; a leak (an old ring's TCPStore or gloo listener) adds ports."""
    assert _same_counts(before, after), (before, after)
    for i, address in enumerate(session.processes.addresses):
        assert int(address.rsplit(":", 1)[1]) in after[f"stage {i}"], (address, after)


def _offline(coord, prompts, params: SamplingParams, concurrency: int) -> dict:
    """The undisturbed outputs of `prompts` (at most `concurrency` at a time)."""
    unique, out = sorted(set(prompts)), {}
    for i in range(0, len(unique), concurrency):
        handles = {p: coord.submit(p, params) for p in unique[i:i + concurrency]}
        out.update({p: h.result(timeout_s=600) for p, h in handles.items()})
    return out


def _break_and_time(session, url: str, victim: int, sig: int, recovered: list, n: int) -> float:
    """Send `sig` to stage `victim`; seconds until the `n`-th recovery is done (`recovered` holds
    one entry per finished recovery) and /health answers 200 again (a stopped stage is found by
    the heartbeat first, a killed one at once)."""
    start = time.monotonic()
    os.kill(session.processes.pids[victim], sig)
    while len(recovered) < n:
        assert time.monotonic() - start < 90 and session.coordinator.failure is None, session.coordinator.failure
        time.sleep(0.05)
    return time.monotonic() - start + _wait_healthy(url, 90)


def _post_under_breaks(session, stack, prompts, params: SamplingParams, *, concurrency: int, breaks, rng,
                       recovered: list, seen_pids: set) -> tuple[list, list[float]]:
    """POST every prompt (greedy, `concurrency` at a time) while sending each signal of `breaks` to a
    random stage at a random time; returns (the responses, seconds until /health was 200 after each)."""
    url = f"http://127.0.0.1:{stack.http_port}"

    def post(prompt: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=900, json={
            "prompt": prompt, "max_tokens": params.max_new_tokens, "ignore_eos": True, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(post, p) for p in prompts]
        back_s = []
        for n, sig in enumerate(breaks, start=1):
            while stack.engine.num_outstanding == 0 and not all(f.done() for f in futures):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            seen_pids.update(session.processes.pids)
            back_s.append(_break_and_time(session, url, rng.randrange(3), sig, recovered, n))
            seen_pids.update(session.processes.pids)
        return [f.result() for f in futures], back_s


def test_chaos_serve_kill_9_of_random_stages_every_request_completes_with_the_offline_text(tiny_model_dir: Path):
    """16 greedy requests at concurrency 4, 2 kill -9 and 1 SIGSTOP of random stages at random times
    (scaled down from the issue's 64 / 8 / 3 for the shared 2-core machine; `chaos` runs any size)."""
    back_s = chaos(tiny_model_dir, num_requests=16, concurrency=4, num_kills=2, num_stops=1)
    print(f"/health back to 200 {', '.join(f'{t:.1f}' for t in back_s)} s after the breaks")


def chaos(model_dir: Path | str, *, num_requests: int, concurrency: int, num_kills: int, num_stops: int = 0,
          max_new_tokens: int = 160, check_reference: bool = True) -> list[float]:
    """The chaos run: `num_kills` kill -9 and `num_stops` SIGSTOP of random stages at random times
    (in random order); asserts its outcome (every response 200 with the offline text; no leaked
    process, port or KV slot) and returns the seconds until /health was 200 again after each.
    model_dir: a model folder or name; check_reference: also check the offline text against the
    single-process reference (needs a folder)."""
    rng = random.Random(16)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(num_requests)]
    breaks = rng.sample([signal.SIGKILL] * num_kills + [signal.SIGSTOP] * num_stops, num_kills + num_stops)
    options = session_options(model_dir, 3, max_model_len=1024, max_num_seqs=concurrency)
    policy = RestartBudget(max_restarts=max(1, len(breaks)), window_s=600)
    # Listeners this (pytest) process held before the session: earlier tests' groups, closed whenever
    # the collector frees them, so they may vanish mid-run; they are not the server's and are not counted.
    earlier = {c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    session = PipelineSession(options, resolve(options), restart_budget=policy).__enter__()
    seen_pids, signals, loop = set(session.processes.pids), DrainSignals(), None
    try:
        coord = session.coordinator
        offline = _offline(coord, prompts, params, concurrency)  # undisturbed
        if check_reference:
            assert [offline[p].token_ids for p in PROMPTS] == _references(model_dir, PROMPTS, params)
        ports_before = _listening_ports(session, front_end=earlier)
        recovered = []
        coord.recovery_listeners.append(lambda phase, _why: phase == "done" and recovered.append(phase))
        serve = ServeOptions(port=0, grpc_port=-1, stats_interval_s=0, stage_heartbeat_timeout_s=5.0)
        with ServingStack(session, serve) as stack:
            loop = threading.Thread(target=serve_until_stopped, args=(session, stack, signals), daemon=True)
            loop.start()
            responses, back_s = _post_under_breaks(session, stack, prompts, params, concurrency=concurrency,
                                                   breaks=breaks, rng=rng, recovered=recovered, seen_pids=seen_pids)
            assert [r.status_code for r in responses] == [200] * num_requests, [r.text for r in responses]
            assert [r.json()["choices"][0]["text"] for r in responses] == [offline[p].text for p in prompts]
            assert coord.num_restarts == len(breaks) and coord.failure is None, back_s
            assert coord.sync(10)
            wait_for(lambda: not any(st.kv_slots_in_use for st in coord.stage_stats()), timeout_s=10.0)  # in-band RELEASE
            assert [st.kv_slots_in_use for st in coord.stage_stats()] == [0, 0, 0]
            live = [p for p in seen_pids if pid_alive(p)]
            assert sorted(live) == sorted(session.processes.pids)  # every killed or stopped stage was reaped
            wait_for(lambda: _same_counts(ports_before, _listening_ports(session, front_end={stack.http_port, *earlier})),
                     timeout_s=15, step_s=0.2)  # a replaced ring's sockets close as its peers' do
            _check_no_leaked_port(ports_before, _listening_ports(session, front_end={stack.http_port, *earlier}), session)
            signals.request()
            loop.join(timeout=60)
            assert not loop.is_alive()
    finally:
        signals.request()
        if loop is not None:
            loop.join(timeout=60)
        seen_pids.update(session.processes.pids)
        session.close()
        for pid in seen_pids:  # a stopped stage a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert not [p for p in seen_pids if pid_alive(p)]
    return back_s


def test_serve_with_a_stage_sigstopped_restarts_it_and_streams_complete_with_the_offline_text(tiny_model_dir: Path):
    """A hung stage (SIGSTOP) under `serve`: declared hung by the heartbeat, killed, restarted."""
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    options = session_options(tiny_model_dir, 3, max_model_len=1024)
    session = PipelineSession(options, resolve(options), restart_budget=POLICY).__enter__()
    pids, signals, loop = list(session.processes.pids), DrainSignals(), None
    try:
        coord = session.coordinator
        offline = [coord.submit(p, params).result(timeout_s=120).text for p in PROMPTS[:3]]
        serve = ServeOptions(port=0, grpc_port=-1, stats_interval_s=0, stage_heartbeat_timeout_s=1.5)
        with ServingStack(session, serve) as stack:
            loop = threading.Thread(target=serve_until_stopped, args=(session, stack, signals), daemon=True)
            loop.start()
            url = f"http://127.0.0.1:{stack.http_port}"
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(httpx.post, url + "/v1/completions", timeout=300, json={
                    "prompt": p, "max_tokens": params.max_new_tokens, "ignore_eos": True, "temperature": 0})
                    for p in PROMPTS[:3]]
                while stack.engine.num_outstanding == 0 and not all(f.done() for f in futures):
                    time.sleep(0.01)
                os.kill(pids[1], signal.SIGSTOP)
                responses = [f.result() for f in futures]
            assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
            assert [r.json()["choices"][0]["text"] for r in responses] == offline
            _wait_healthy(url, 90)
            assert coord.num_restarts == 1 and not pid_alive(pids[1])
    finally:
        signals.request()
        if loop is not None:
            loop.join(timeout=60)
        if pid_alive(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
        all_pids = {*pids, *session.processes.pids}
        session.close()
    assert not [p for p in all_pids if pid_alive(p)]
