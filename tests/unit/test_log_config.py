"""workers/log_config.py: one log level for the launcher and every stage worker, from --log-level,
else SPEEDPIPE_LOG_LEVEL, else WARNING; a bad value is one line and exit 2, wherever it is read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.backends.worker_command import LocalLaunchConfig
from launcher.cli.main import main
from launcher.coordinator.pipeline_options import PipelineOptions
from workers.log_config import LOG_LEVEL_ENV, resolve_log_level
from workers.rpc.control_auth import SECRET_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("flag", "env", "expected"), [
    (None, {}, "WARNING"),
    (None, {LOG_LEVEL_ENV: ""}, "WARNING"),
    (None, {LOG_LEVEL_ENV: "info"}, "INFO"),
    ("debug", {LOG_LEVEL_ENV: "ERROR"}, "DEBUG"),  # the flag wins
])
def test_the_flag_wins_then_the_environment_then_warning(flag, env, expected):
    assert resolve_log_level(flag, env) == expected


@pytest.mark.parametrize(("flag", "env", "named"), [
    ("loud", {}, "--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"),
    (None, {LOG_LEVEL_ENV: "verbose"}, f"{LOG_LEVEL_ENV} must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                                       "got 'verbose'"),
])
def test_a_bad_level_names_where_it_came_from_and_the_allowed_ones(flag, env, named):
    with pytest.raises(ValueError) as info:
        resolve_log_level(flag, env)
    assert str(info.value) == named


def test_settings_made_without_a_level_take_the_environment_s(monkeypatch):
    """train-predictor and ship-predictors build PipelineOptions without a level: their stages too."""
    monkeypatch.setenv(LOG_LEVEL_ENV, "info")
    assert PipelineOptions().log_level == "INFO"
    assert LocalLaunchConfig(num_stages=1).command(0)[-2:] == ["--log-level", "INFO"]


def test_the_cli_refuses_a_bad_environment_level_with_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv(LOG_LEVEL_ENV, "verbose")
    # a model that does not exist: nothing could start, whatever is checked first
    assert main(["launch", "--stages", "1", "--prompt", "x", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"speedpipe launch: error: {LOG_LEVEL_ENV} must be one of DEBUG, INFO, WARNING, ERROR, "
                   "CRITICAL, got 'verbose'")


def _stage_worker(env: dict[str, str]) -> subprocess.CompletedProcess:
    """A real stage worker process: started, its ready line read, then its stdin closed (the launcher's
    way to stop it, logged at INFO)."""
    code = textwrap.dedent("""
        import subprocess, sys
        proc = subprocess.Popen([sys.executable, "-m", "workers.stage_worker", "--stage-index", "3"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()
        proc.stdin.close()
        err = proc.stderr.read()
        print(proc.wait(timeout=60), ready.strip(), sep="|")
        print(err, file=sys.stderr)
    """)
    base = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), SECRET_ENV: "s" * 32, **env})


def test_a_stage_worker_process_logs_at_the_environment_s_level():
    proc = _stage_worker({LOG_LEVEL_ENV: "INFO"})
    code, ready = proc.stdout.strip().split("|")
    assert ready.startswith("SPEEDPIPE_STAGE_READY port="), proc.stderr[-2000:]
    assert "INFO speedpipe.worker: stdin closed" in proc.stderr, proc.stderr[-2000:]
    quiet = _stage_worker({})
    assert quiet.stdout.strip().split("|")[1].startswith("SPEEDPIPE_STAGE_READY")
    assert "INFO" not in quiet.stderr  # WARNING by default


def test_a_stage_worker_refuses_a_bad_environment_level_with_one_line_and_exit_2():
    proc = _stage_worker({LOG_LEVEL_ENV: "verbose"})
    code, ready = proc.stdout.strip().split("|")
    assert (code, ready) == ("2", "")
    assert proc.stderr.strip() == (f"stage worker: {LOG_LEVEL_ENV} must be one of DEBUG, INFO, WARNING, ERROR, "
                                   "CRITICAL, got 'verbose'")


def test_ray_stage_actors_get_the_environment_s_level_in_theirs(monkeypatch):
    """A Ray actor reads SPEEDPIPE_LOG_LEVEL from the environment the driver gives it."""
    pytest.importorskip("ray")
    from launcher.backends.placement import PlacementOptions
    from launcher.backends.ray_cluster.stage_actors import RayStageActors

    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    assert RayStageActors(num_stages=1, placement=PlacementOptions(backend="ray"))._env()[LOG_LEVEL_ENV] == "DEBUG"
