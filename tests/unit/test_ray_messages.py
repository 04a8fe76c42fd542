"""launcher/backends/ray_cluster/messages.py and the Ray backend's use of it, without a Ray cluster: Ray's
driver output goes to stderr (never into the generated text on stdout), a token-auth failure is named
as such, a dead node is named in a stage's death, and a fenced server stops the stages of any backend."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
from ray._private import worker as ray_worker  # noqa: E402

from launcher.backends.placement import PlacementError, PlacementOptions  # noqa: E402
from launcher.backends.ray_cluster import stage_actors as ray_backend  # noqa: E402
from launcher.backends.ray_cluster.messages import connect_failure, death_cause  # noqa: E402
from launcher.serving import drain as drain_module  # noqa: E402

RAYLET_NOTICE = {"lines": ["A worker died or was killed while executing a task (test-notice-4711)"],
                 "pid": "raylet", "is_err": False}


@pytest.fixture
def fake_ray_init(monkeypatch):
    """ray.init recorded instead of run; Ray's print function restored after the test."""
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


def _stages(address: str | None = None) -> ray_backend.RayStageActors:
    return ray_backend.RayStageActors(num_stages=2, placement=PlacementOptions(backend="ray", ray_address=address))


def test_ray_raylet_notices_and_forwarded_stage_logs_print_on_stderr_not_in_the_generated_text(fake_ray_init, capsys):
    _stages()._init_ray()
    assert fake_ray_init and fake_ray_init[0]["log_to_driver"] is True  # the stages' own lines stay visible
    ray_worker.print_to_stdstream(dict(RAYLET_NOTICE), ignore_prefix=False)  # the error-notice thread's call
    ray_worker.print_to_stdstream({"lines": ["stage log line 4712"], "pid": 123, "actor_name": "Stage1",
                                   "ip": "10.0.0.1", "localhost": "10.0.0.1", "is_err": False}, ignore_prefix=False)
    out, err = capsys.readouterr()
    assert out == ""
    assert "test-notice-4711" in err and "stage log line 4712" in err and "(Stage1 pid=123" in err


def test_a_token_auth_cluster_without_the_token_says_authentication_failed(fake_ray_init, monkeypatch):
    """`--ray-address auto` (no pre-flight: Ray finds the address): ray.init's own AuthenticationError,
    with the message Ray 2.60 raises in token mode without a token (more in test_ray_token_auth.py)."""
    from ray._private.authentication.authentication_constants import (
        TOKEN_AUTH_ENABLED_BUT_NO_TOKEN_FOUND_ERROR_MESSAGE,
    )

    def refused(**kwargs):
        raise ray.exceptions.AuthenticationError(TOKEN_AUTH_ENABLED_BUT_NO_TOKEN_FOUND_ERROR_MESSAGE)

    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(PlacementError) as info:
        _stages("auto")._init_ray()
    message = str(info.value)
    assert "authentication failed" in message and "RAY_AUTH_TOKEN" in message and "\n" not in message
    assert "no Ray cluster there" not in message


def test_no_cluster_at_the_address_keeps_its_message_on_one_line():
    message = connect_failure("10.0.0.5:6379", ConnectionError("could not reach GCS\ntraceback ..."))
    assert message.startswith("--ray-address 10.0.0.5:6379: no Ray cluster there (could not reach GCS)")
    assert "\n" not in message and "authentication" not in message


def test_a_stage_whose_node_died_is_reported_as_a_node_death_not_as_a_kill():
    exc = ray.exceptions.RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n"
                                                 "\tclass_name: StageActor\n"
                                                 "The actor is dead because it was killed by `ray.kill`.")
    assert death_cause(exc).startswith("The actor died unexpectedly")
    cause = death_cause(exc, node_ip="10.0.0.7", node_alive=False)
    assert cause.startswith("its node 10.0.0.7 died (Ray: The actor died unexpectedly")
    assert "\n" not in cause and len(cause) <= 300


def test_the_unsatisfiable_placement_hint_is_a_sentence(monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeManagerAddress": "10.0.0.1",
                                                "Resources": {"CPU": 1.0}}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 1.0})
    stages = ray_backend.RayStageActors(num_stages=2, placement=PlacementOptions(
        backend="ray", placement_strategy="STRICT_SPREAD"))
    message = stages._unsatisfiable_message()
    assert "one per stage. Check --stage-resources" in message


def test_a_fenced_server_stops_the_stages_of_every_backend_not_only_local_processes(monkeypatch):
    monkeypatch.setattr(drain_module, "WATCH_S", 0.01)
    signals = drain_module.DrainSignals()
    stopped = threading.Event()

    def stop_stages():
        stopped.set()
        signals.drain.set()

    engine = SimpleNamespace(fence=lambda reason, draining=False: None, num_outstanding=0,
                             coordinator=SimpleNamespace(failure=RuntimeError("stage 1 died")))
    session = SimpleNamespace(coordinator=engine.coordinator, processes=None,  # a Ray (or multi-node) session
                              stop_stages=stop_stages)
    stack = SimpleNamespace(failure=None, engine=engine, on_pipeline_failure=lambda failure: None,
                            options=SimpleNamespace(shutdown_grace_s=0.0))
    loop = threading.Thread(target=drain_module.serve_until_stopped, args=(session, stack, signals), daemon=True)
    loop.start()
    loop.join(5)
    signals.drain.set()
    assert stopped.is_set(), "the serve loop fenced but left the Ray actors and placement group running"


def test_a_fenced_server_still_drains_on_sigterm_after_its_stages_were_stopped():
    """Stopping a Ray backend calls ray.shutdown(), which puts SIGTERM back to its default action:
    the fenced server then died of SIGTERM (exit 143, no drain) instead of draining and exiting 0.
    Run in a child process: on the old code the signal kills it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import os, signal, threading
        from types import SimpleNamespace
        from launcher.serving import drain as d
        d.WATCH_S = 0.01

        def stop_stages():  # as RayStageActors.stop(): ray.shutdown() restores SIGTERM's default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()

        engine = SimpleNamespace(fence=lambda reason, draining=False: None, num_outstanding=0,
                                 coordinator=SimpleNamespace(failure=RuntimeError("stage 1 died")))
        session = SimpleNamespace(coordinator=engine.coordinator, processes=None, stop_stages=stop_stages)
        stack = SimpleNamespace(failure=None, engine=engine, on_pipeline_failure=lambda failure: None,
                                options=SimpleNamespace(shutdown_grace_s=0.0))
        with d.DrainSignals() as signals:
            d.serve_until_stopped(session, stack, signals)
        print("drained")
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "drained" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
