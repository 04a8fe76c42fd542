"""How a local stage-worker process is invoked: the worker contract and LocalLaunchConfig.

Owns the command line, environment and ready line of a stage worker started by the local backend
(launcher/backends/stage_group.py spawns and supervises them). Must not: spawn or watch processes.

Worker contract (`python -m workers.stage_worker --stage-index I --host H --port 0 --log-level L`):

- once its gRPC server listens, the worker prints exactly one line `SPEEDPIPE_STAGE_READY port=<N>`
  to stdout (flushed) and afterwards logs only to stderr;
- it exits by itself when its stdin reaches EOF, so the launcher keeps a pipe open to every stdin.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.log_config import LOG_LEVELS, default_log_level

READY_LINE_RE = re.compile(r"^SPEEDPIPE_STAGE_READY port=(\d+)$")


def default_startup_timeout_s(num_stages: int, cpus: int | None = None) -> float:
    """Seconds all `num_stages` local stages get to report ready: 60, plus 4 per stage beyond the
    machine's CPUs (each stage imports torch and loads its layers, ~2 CPU-seconds on this 2-core
    machine; 30 stages missed a flat 60 s deadline)."""
    from launcher.backends.placement import usable_cpus  # cgroup / affinity aware (a --cpus 2 container)

    cpus = cpus or usable_cpus()
    return 60.0 + 4.0 * max(0, num_stages - cpus)


@dataclass(frozen=True, kw_only=True)
class LocalLaunchConfig:
    """How to spawn the local stage processes.

    `threads_per_stage` sets OMP_NUM_THREADS and MKL_NUM_THREADS in each child (None: inherit).
    `first_stage_index` is the pipeline stage index of the first local process (multi-node mode: a
    node runs stages first_stage_index .. first_stage_index + num_stages - 1); messages and log
    prefixes use pipeline stage indices, the methods of LocalStageProcesses local ones (0-based).
    `env` adds or overrides environment variables of every child. `extra_args` is appended to every
    worker command line. `startup_timeout_s`: the deadline for every stage's ready line; None =
    `default_startup_timeout_s(num_stages)` (stages start at once, and more stages than CPUs
    import torch by turns).
    """

    num_stages: int
    host: str = "127.0.0.1"
    log_level: str = field(default_factory=default_log_level)  # $SPEEDPIPE_LOG_LEVEL, else WARNING
    startup_timeout_s: float | None = None
    python: str = sys.executable
    worker_module: str = "workers.stage_worker"
    env: Mapping[str, str] | None = None
    threads_per_stage: int | None = None
    extra_args: tuple[str, ...] = field(default=())
    first_stage_index: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {self.num_stages!r}")
        if not self.host:
            raise ValueError("host must be a non-empty host name or address, got ''")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.startup_timeout_s is None:
            object.__setattr__(self, "startup_timeout_s", default_startup_timeout_s(self.num_stages))
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s!r}")
        if not self.python:
            raise ValueError("python must be a path to a Python interpreter, got ''")
        if not self.worker_module:
            raise ValueError("worker_module must be a module name, got ''")
        if self.threads_per_stage is not None and (
            isinstance(self.threads_per_stage, bool)
            or not isinstance(self.threads_per_stage, int)
            or self.threads_per_stage < 1
        ):
            raise ValueError(f"threads_per_stage must be None or an integer >= 1, got {self.threads_per_stage!r}")
        for key, value in (self.env or {}).items():
            if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key:
                raise ValueError(f"env entries must be str -> str with a non-empty key without '=', got {key!r}")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"extra_args must be a tuple of str, got {self.extra_args!r}")
        if self.first_stage_index < 0:
            raise ValueError(f"first_stage_index must be >= 0, got {self.first_stage_index!r}")

    def command(self, stage_index: int) -> list[str]:
        """The worker command line for local stage `stage_index` (port 0: the worker picks a free port)."""
        return [
            self.python, "-m", self.worker_module,
            "--stage-index", str(self.first_stage_index + stage_index),
            "--host", self.host,
            "--port", "0",
            "--log-level", self.log_level,
            *self.extra_args,
        ]

    def child_env(self) -> dict[str, str]:
        """The environment of every child: ours, plus `env`, plus the thread-count variables."""
        env = dict(os.environ)
        env.update(self.env or {})
        if self.threads_per_stage is not None:
            env["OMP_NUM_THREADS"] = str(self.threads_per_stage)
            env["MKL_NUM_THREADS"] = str(self.threads_per_stage)
        return env
