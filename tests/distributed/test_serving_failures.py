"""A server whose pipeline breaks, and a server told to stop (issue 16 parts 1-3, 5), on the tiny model.

- In-process (`serve_until_stopped` on a thread, as `serve` runs it): a stage SIGKILLed, SIGSTOPped
  or told to Shut down (with the session secret) while a stream is open: the stream ends with an
  error event and `[DONE]`, /health is 503 with the reason, a new request gets 503 at once (not
  after the data-plane timeout), the server keeps answering and stops cleanly; no stage is left.
- The control plane refuses callers without the session secret (UNAUTHENTICATED) and every
  listener of the pipeline binds loopback (psutil).
- `speedpipe serve` as a child process: a stage killed with kill -9 does not crash it; SIGTERM
  drains (in-flight streams finish with their final event and `[DONE]`, exit 0, no traceback), a
  second SIGTERM ends the rest with an error event.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from launcher.backends.ports import free_port
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.drain import DrainSignals, serve_until_stopped
from launcher.serving.serve import ServeOptions, ServingStack
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from tests.conftest import wait_for
from tests.distributed.conftest import env_with_tag, pid_alive, session_options, stage_worker_processes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
FAST_S = 15.0  # "at once": far below the 60 s data-plane timeout these sessions run with (margin for load)


def sse_events(response: httpx.Response, after_first=None) -> list[str]:
    """The `data: ` payloads of a stream; `after_first(...)` runs once the first one arrived."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
            if len(events) == 1 and after_first is not None:
                after_first()
    return events


@pytest.mark.parametrize("breakage", ["kill-9", "sigstop", "shutdown-rpc"])
def test_a_broken_stage_fences_the_server_which_keeps_answering(tiny_model_dir: Path, breakage: str):
    options = session_options(tiny_model_dir, 3, max_model_len=4096, stage_timeout_s=60.0)
    session = PipelineSession(options, resolve(options)).__enter__()
    pids = list(session.processes.pids)
    signals, crashed = DrainSignals(), []
    try:
        serve = ServeOptions(port=0, grpc_port=-1, stats_interval_s=0, stage_heartbeat_timeout_s=1.5,
                             shutdown_grace_s=5)
        with ServingStack(session, serve) as stack:
            def run() -> None:
                try:
                    serve_until_stopped(session, stack, signals)
                except BaseException as exc:  # noqa: BLE001 - the finding: the server loop crashed
                    crashed.append(exc)

            loop = threading.Thread(target=run, daemon=True)
            loop.start()
            url = f"http://127.0.0.1:{stack.http_port}"

            def do_break() -> None:
                if breakage == "kill-9":
                    os.kill(pids[1], signal.SIGKILL)
                elif breakage == "sigstop":
                    os.kill(pids[1], signal.SIGSTOP)
                else:
                    session.coordinator.stubs[1].Shutdown(pb.ShutdownRequest(reason="stray"), timeout=5)

            with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=60) as r:
                events = sse_events(r, after_first=do_break)
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
            message = json.loads(events[-2])["error"]["message"]
            assert "stage 1" in message, message
            if breakage == "sigstop":
                assert "heartbeat" in message, message
            health = httpx.get(url + "/health", timeout=FAST_S)
            assert health.status_code == 503 and "stage 1" in health.json()["error"]["message"]
            start = time.monotonic()
            late = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
            assert late.status_code == 503 and time.monotonic() - start < FAST_S
            assert wait_for(lambda: session.processes.stopping, timeout_s=30), "the server loop did not stop the stages"
            assert httpx.get(url + "/v1/models", timeout=FAST_S).status_code == 200
            assert loop.is_alive() and not crashed, crashed
            signals.request()
            loop.join(timeout=30)
            assert not loop.is_alive() and not crashed, crashed
    finally:
        for pid in pids:  # a stopped stage must not survive as a stopped process
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
        session.close()
    assert not [p for p in pids if pid_alive(p)]


def test_control_calls_without_the_session_secret_are_unauthenticated_and_listeners_are_loopback(
        tiny_model_dir: Path):
    options = session_options(tiny_model_dir, 2)
    with PipelineSession(options, resolve(options)) as session:
        addresses = list(session.processes.addresses)
        for address in addresses:
            for secret in (None, "wrong"):
                with grpc.insecure_channel(address) as channel:
                    stub = pb_grpc.StageServiceStub(channel)
                    metadata = None if secret is None else [("x-speedpipe-control-secret", secret)]
                    for call, request in ((stub.Shutdown, pb.ShutdownRequest(reason="stray")),
                                          (stub.Reset, pb.ResetRequest(clear_kv_cache=True)),
                                          (stub.Health, pb.HealthRequest())):
                        with pytest.raises(grpc.RpcError) as info:
                            call(request, timeout=5, metadata=metadata)
                        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert all(h.status == pb.HealthResponse.SERVING for h in session.coordinator.health())
        out = session.coordinator.submit("abc", session_sampling()).result(60)
        assert len(out.token_ids) == 4  # the stray calls changed nothing
        listening = []
        for proc in [psutil.Process(), *(psutil.Process(p) for p in session.processes.pids)]:
            listening += [(proc.pid, c.laddr) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening
        outside = [(pid, addr) for pid, addr in listening if not is_loopback(addr.ip)]
        assert not outside, outside


def is_loopback(ip: str) -> bool:
    """Loopback, IPv4-mapped IPv6 loopback (`::ffff:127.0.0.1`) included."""
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


def session_sampling():
    from pipeline.speculation.sampling import SamplingParams

    return SamplingParams(max_new_tokens=4, ignore_eos=True)


class ServeCli:
    """`speedpipe serve` on the tiny model as a child process (stderr collected)."""

    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.tag = ("SPEEDPIPE_TEST_TAG", f"serve-failures-{os.getpid()}-{self.port}")
        env = env_with_tag(*self.tag)
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli.main", "serve", "--model", str(model_dir), "--stages", "2",
             "--port", str(self.port), "--grpc-port", "-1", "--max-model-len", "4096", "--served-model-name",
             "tiny", "--stats-interval-s", "0", *extra],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr = ""

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        def healthy() -> bool:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(healthy, timeout_s=timeout_s, step_s=0.2):
            pytest.fail("serve did not become healthy")

    def workers(self):
        return stage_worker_processes(env_tag=self.tag)

    def finish(self, timeout_s: float = 60.0) -> int:
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        wait_for(lambda: not self.workers(), timeout_s=5)
        assert self.workers() == []
        return self.proc.returncode


def test_serve_cli_survives_kill_9_of_a_stage_and_exits_0_on_sigterm(tiny_model_dir: Path):
    cli = ServeCli(tiny_model_dir, "--max-stage-restarts", "0")  # fenced, not restarted (test_failover.py)
    cli.wait_healthy()
    pids = [w.pid for w in cli.workers()]
    with httpx.stream("POST", cli.url + "/v1/completions", json=LONG, timeout=60) as r:
        events = sse_events(r, after_first=lambda: os.kill(pids[1], signal.SIGKILL))
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    # the finding: the server crashed just after it stopped its stages; it must outlive that
    assert wait_for(lambda: not cli.workers(), timeout_s=30), "the server did not stop its stages after the kill"
    assert cli.proc.poll() is None, cli.proc.stderr.read()
    assert httpx.get(cli.url + "/health", timeout=FAST_S).status_code == 503
    assert httpx.post(cli.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      timeout=FAST_S).status_code == 503
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.finish() == 0, cli.stderr[-3000:]
    assert "Traceback" not in cli.stderr, cli.stderr[-3000:]


def test_sigterm_to_every_process_at_once_drains_and_stops_without_restarting_stages(tiny_model_dir: Path):
    """systemd, `timeout` and `kill -- -PGID` signal the stages with the server: the stages leave
    shutdown to the server, so the stream in flight drains to its normal end (it used to end in an
    error: the stages died of the signal) and nothing is restarted (it was restarted, twice)."""
    cli = ServeCli(tiny_model_dir, "--shutdown-grace-s", "120")
    cli.wait_healthy()
    workers = cli.workers()

    def signal_everyone() -> None:
        for w in workers:
            os.kill(w.pid, signal.SIGTERM)
        cli.proc.send_signal(signal.SIGTERM)

    with httpx.stream("POST", cli.url + "/v1/completions", json={**LONG, "max_tokens": 150}, timeout=120) as r:
        events = sse_events(r, after_first=signal_everyone)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-3:]
    assert cli.finish() == 0, cli.stderr[-3000:]
    assert "restarting" not in cli.stderr and "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert wait_for(lambda: not any(pid_alive(w.pid) for w in workers), timeout_s=10), "stages left running"


def test_sigterm_drains_in_flight_streams_and_a_second_sigterm_ends_the_rest(tiny_model_dir: Path):
    cli = ServeCli(tiny_model_dir, "--shutdown-grace-s", "120")
    cli.wait_healthy()
    results: dict[str, list[str]] = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def run(name: str, max_tokens: int) -> None:
        body = {**LONG, "max_tokens": max_tokens}
        with httpx.stream("POST", cli.url + "/v1/completions", json=body, timeout=120) as r:
            results[name] = sse_events(r, after_first=started[name].set)

    threads = [threading.Thread(target=run, args=("short", 150)), threading.Thread(target=run, args=("long", 4000))]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(60)
    cli.proc.send_signal(signal.SIGTERM)
    threads[0].join(timeout=60)
    short = results["short"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short[-3:]
    health = httpx.get(cli.url + "/health", timeout=FAST_S)
    assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
    refused = httpx.post(cli.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=FAST_S)
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert threads[1].is_alive()  # still generating within the grace period
    cli.proc.send_signal(signal.SIGTERM)
    threads[1].join(timeout=60)
    long = results["long"]
    assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"], long[-3:]
    assert cli.finish() == 0, cli.stderr[-3000:]
    assert "Traceback" not in cli.stderr and "CancelledError" not in cli.stderr, cli.stderr[-3000:]


def test_long_prefills_are_not_a_hang(tiny_model_dir: Path):
    """12 concurrent ~3000-token prefills: every heartbeat is answered, /health stays 200 throughout
    and every request completes (default --stage-heartbeat-timeout-s)."""
    options = session_options(tiny_model_dir, 2, max_model_len=4096, max_num_seqs=12)
    with PipelineSession(options, resolve(options)) as session, \
            ServingStack(session, ServeOptions(port=0, grpc_port=-1, stats_interval_s=0)) as stack:
        url = f"http://127.0.0.1:{stack.http_port}"
        codes: list[int] = []

        def post(i: int) -> None:
            body = {"prompt": f"{i} " + "lorem ipsum " * 250, "max_tokens": 4, "ignore_eos": True}
            codes.append(httpx.post(url + "/v1/completions", json=body, timeout=170).status_code)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        health = []
        while any(t.is_alive() for t in threads):
            health.append(httpx.get(url + "/health", timeout=30).status_code)
            time.sleep(0.1)
        for t in threads:
            t.join()
        assert codes == [200] * 12 and health and set(health) == {200}, (codes, health)
        assert stack.heartbeat.hung is None


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (subjectAltName IP) and its key, made by openssl."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=speedpipe",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0, reason="no openssl")
def test_control_plane_over_tls(tiny_model_dir: Path, tmp_path: Path):
    from workers.rpc.control_auth import TlsFiles

    cert, key = self_signed_cert(tmp_path)
    with pytest.raises(ValueError, match="--tls-key"):
        TlsFiles(cert_file=str(cert), key_file=str(cert))
    tls = TlsFiles(cert_file=str(cert), key_file=str(key))
    options = session_options(tiny_model_dir, 2)
    with PipelineSession(options, resolve(options), tls=tls) as session:
        out = session.coordinator.submit("abc", session_sampling()).result(60)
        assert len(out.token_ids) == 4
        address = session.processes.addresses[0]
        with grpc.insecure_channel(address) as plain:  # plain TCP to a TLS port: no answer
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.StageServiceStub(plain).Health(pb.HealthRequest(), timeout=5)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        with grpc.secure_channel(address, tls.channel_credentials()) as secure:  # TLS alone is not enough
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.StageServiceStub(secure).Health(pb.HealthRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
