"""LocalLaunchConfig (launcher/backends/worker_command.py): validation and the worker contract's command
line and environment, plus free_port. Pure: nothing is spawned (process tests: tests/distributed/test_local_backend.py)."""

from __future__ import annotations

import re
import socket

import pytest

from launcher.backends.ports import free_port
from launcher.backends.worker_command import LocalLaunchConfig


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"num_stages": 0}, "num_stages must be an integer >= 1, got 0"),
        ({"num_stages": True}, "num_stages"),
        ({"startup_timeout_s": 0.0}, "startup_timeout_s must be > 0, got 0.0"),
        ({"threads_per_stage": 0}, "threads_per_stage must be None or an integer >= 1, got 0"),
        ({"log_level": "LOUD"}, "got 'LOUD'"),
        ({"host": ""}, "host"),
        ({"env": {"A=B": "1"}}, "env"),
        ({"extra_args": "--flag"}, "extra_args"),
    ],
)
def test_config_rejects_bad_values_naming_value_and_limit(overrides, fragment):
    kwargs = {"num_stages": 2, **overrides}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        LocalLaunchConfig(**kwargs)


def test_config_command_and_env_follow_worker_contract():
    config = LocalLaunchConfig(num_stages=2, log_level="INFO", threads_per_stage=3, env={"X_TAG": "v"})
    assert config.command(1)[1:] == [
        "-m", "workers.stage_worker", "--stage-index", "1", "--host", "127.0.0.1", "--port", "0",
        "--log-level", "INFO",
    ]
    env = config.child_env()
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["X_TAG"]) == ("3", "3", "v")


def test_free_port_returns_a_bindable_port():
    port = free_port("127.0.0.1")
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- start / stop ---------------------------------------------------------------------------------


def test_the_start_up_deadline_grows_with_stages_beyond_the_cpus():
    """30 stages on 2 CPUs missed a flat 60 s deadline: each stage beyond the CPUs gets 4 s more."""
    from launcher.backends.worker_command import default_startup_timeout_s

    assert default_startup_timeout_s(2, cpus=2) == default_startup_timeout_s(1, cpus=16) == 60.0
    assert default_startup_timeout_s(30, cpus=2) == 60.0 + 4.0 * 28
    assert LocalLaunchConfig(num_stages=2).startup_timeout_s >= 60.0
    assert LocalLaunchConfig(num_stages=2, startup_timeout_s=5.0).startup_timeout_s == 5.0
