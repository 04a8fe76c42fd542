"""`--backend ray --ray-address` against a cluster that requires a Ray token ([Note: Ray token
authentication] in launcher/backends/ray_cluster/connect.py): a missing or wrong token is one line
naming the remedy (exit 2), at once, never "no Ray cluster there" after 20 s of retries, and never
an abort of the process.

No Ray cluster is started: a gRPC server on this machine answers every call as a token-auth GCS
answers a bad token (UNAUTHENTICATED, with the detail Ray's GCS sends; a real `ray start --head`
with RAY_AUTH_MODE=token gave the same message), so the exceptions are the ones Ray's own client
code raises from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")
from ray._raylet import GcsClient  # noqa: E402

from launcher.backends.placement import PlacementError  # noqa: E402
from launcher.backends.ray_cluster import connect  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GCS_REFUSAL = "InvalidAuthToken: Authentication token is missing or incorrect"  # Ray 2.60's GCS


class _Refuse(grpc.GenericRpcHandler):
    def service(self, handler_call_details):
        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, GCS_REFUSAL)

        return grpc.unary_unary_rpc_method_handler(refuse)


def start_refusing_gcs(host: str = "127.0.0.1") -> tuple[grpc.Server, str]:
    """A GCS stand-in on `host` that refuses every token; returns (server, HOST:PORT)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((_Refuse(),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"


@pytest.fixture
def refusing_gcs():
    server, address = start_refusing_gcs()
    yield address
    server.stop(0)


def _one_line_naming_the_remedy(message: str, address: str) -> None:
    assert message.startswith(f"--ray-address {address}: Ray authentication failed"), message
    assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN" in message
    assert "\n" not in message and "no Ray cluster there" not in message


def test_a_refused_token_fails_at_once_with_one_line_naming_the_remedy_before_ray_init(refusing_gcs, monkeypatch):
    address = refusing_gcs
    with pytest.raises(ray.exceptions.AuthenticationError):  # what Ray's own GCS client raises
        GcsClient(address=address)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init retries a refused token for ~20 s"))
    with pytest.raises(PlacementError) as info:
        connect.join_ray(address, num_cpus=1, probe_timeout_s=10.0)
    _one_line_naming_the_remedy(str(info.value), address)


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`code` in a child Python with `env`, and no Ray token variables but those in `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env})


def test_ray_init_s_own_refusal_a_connection_error_is_named_as_authentication_not_as_no_cluster(tmp_path):
    """What `ray.init` raises for a wrong token: ConnectionError("Failed to connect to Ray cluster at
    ...") whose cause's text holds the AuthenticationError. Ray connects to the node's address for a
    loopback one, so the stand-in listens there; one retry instead of 20 (a child process: ray.init
    is process-wide)."""
    proc = _run('''
        import sys
        from ray._private.services import resolve_ip_for_localhost
        from tests.unit.test_ray_token_auth import start_refusing_gcs
        from launcher.backends.ray_cluster.messages import connect_failure
        import ray
        server, address = start_refusing_gcs(resolve_ip_for_localhost("127.0.0.1"))
        try:
            ray.init(address=address, include_dashboard=False)
        except ConnectionError as exc:
            print(type(exc).__name__, "|", address, "|", connect_failure(address, exc))
    ''', {"RAY_gcs_server_port_wait_time_s": "1", "HOME": str(tmp_path), "RAY_AUTH_MODE": "token",
          "RAY_AUTH_TOKEN": "0" * 64})
    kind, address, message = proc.stdout.strip().split(" | ")
    assert kind == "ConnectionError", proc.stderr[-2000:]
    _one_line_naming_the_remedy(message, address)


def test_token_mode_without_any_token_is_the_same_line_not_an_abort_of_the_process(tmp_path):
    """RAY_AUTH_MODE=token and no token anywhere: Ray's GCS client aborts the process (a failed C++
    check) unless the token check comes first, as in ray.init."""
    proc = _run('''
        from tests.unit.test_ray_token_auth import start_refusing_gcs
        from launcher.backends.placement import PlacementError
        from launcher.backends.ray_cluster import connect
        server, address = start_refusing_gcs()
        try:
            connect.check_token(address, timeout_s=10.0)
        except PlacementError as exc:
            print(address, "|", exc)
    ''', {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    address, message = proc.stdout.strip().split(" | ")
    _one_line_naming_the_remedy(message, address)
