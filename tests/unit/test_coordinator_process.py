"""The coordinator's process before its session starts: one torch thread and a frozen start-up heap.

[Note: the coordinator's torch threads] in launcher/coordinator/session.py: `launch` and `serve` ran
the coordinator with torch's default of one intra-op thread per core, whose OpenMP workers spin on
the stages' cores after every vocabulary-sized op; the benchmark driver alone set one thread, so
benchmarks did not measure what users ran.
"""

from __future__ import annotations

import gc

import pytest
import torch

from launcher.coordinator.session import PipelineSession
from tests.tiny_model import write_tiny_model


class _Seen(RuntimeError):
    pass


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    gc.unfreeze()


@pytest.mark.parametrize("command", [["launch", "--prompt", "hi", "--no-progress"],
                                     ["serve", "--port", "0", "--grpc-port", "-1"]])
def test_launch_and_serve_start_their_session_with_one_torch_thread_and_a_frozen_heap(
        command, tmp_path, monkeypatch, two_threads):
    from launcher.cli.main import main

    seen: dict[str, int] = {}

    def start(self):
        seen.update(threads=torch.get_num_threads(), frozen=gc.get_freeze_count())
        raise _Seen("stopped before any stage starts")

    monkeypatch.setattr(PipelineSession, "_start", start)
    model_dir = write_tiny_model(tmp_path / "m")
    gc.unfreeze()
    with pytest.raises(_Seen):
        main([command[0], "--model", str(model_dir), "--stages", "2", "--speculate", "none", *command[1:]])
    assert seen["threads"] == 1, seen
    assert seen["frozen"] > 0, seen
