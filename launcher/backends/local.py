"""Local placement backend: the StageBackend role (launcher/backends/placement.py) for processes on this machine.

Owns the glue between a pipeline session and its local stage processes: start them, pick the
data-plane rendezvous port, describe a stage for error messages, and report a stage that dies.
The pieces it combines: launcher/backends/worker_command.py (how a worker is invoked),
launcher/backends/stage_group.py (spawning and stopping the group, see [Note: no orphan stage processes]
there), launcher/backends/stage_monitor.py (noticing a death) and launcher/backends/ports.py (addresses).
It must not know anything about models, the control-plane RPCs or the data plane.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from launcher.backends.stage_group import LocalStageProcesses
from launcher.backends.stage_monitor import StageProcessMonitor
from launcher.backends.stage_process import describe_returncode
from launcher.backends.worker_command import LocalLaunchConfig
from workers.channel import hold_listener


class LocalStageBackend:
    """The StageBackend role (launcher/backends/placement.py) over LocalStageProcesses and StageProcessMonitor.

    `processes` is the LocalStageProcesses (pids, addresses). Stage indices in `watch` callbacks and
    `describe` are pipeline stage indices (`config.first_stage_index` + local index).
    """

    def __init__(self, config: LocalLaunchConfig, *, log_stream: TextIO | None = None) -> None:
        self.config = config
        self.processes = LocalStageProcesses(config, log_stream=log_stream)
        self.master_addr = config.host
        self.monitor: StageProcessMonitor | None = None

    def start(self) -> list[str]:
        return self.processes.start()

    def data_port(self) -> int:
        return hold_listener(self.master_addr)  # [Note: held rendezvous port]

    def describe(self, stage_index: int) -> str:
        local = stage_index - self.config.first_stage_index
        pids = self.processes.pids
        return f"stage {stage_index} (pid {pids[local]})" if 0 <= local < len(pids) else f"stage {stage_index}"

    def watch(self, on_death: Callable[[int, str], None]) -> None:
        """Call `on_death(stage_index, description)` once when a stage process dies before stop()."""
        def died(local: int, returncode: int) -> None:
            index = self.config.first_stage_index + local
            on_death(index, f"{self.describe(index)} exited unexpectedly with {describe_returncode(returncode)}")

        self.monitor = StageProcessMonitor(self.processes, died).start()

    def dead_stages(self) -> list[int]:
        """Pipeline stage indices of the stage processes that have exited."""
        return [self.config.first_stage_index + local for local, _ in self.processes.dead_stages()]

    def restart_stage(self, stage_index: int) -> str:
        """Kill stage `stage_index` if it still runs and start it again (same command, environment and
        session secret); returns its new control-plane address. Raises StageStartupError."""
        return self.processes.respawn(stage_index - self.config.first_stage_index)

    def unwatch(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    pause_watch = unwatch  # during a fail-over (a new `watch` follows)

    def stop(self) -> None:
        self.unwatch()
        self.processes.stop()
