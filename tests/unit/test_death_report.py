"""A data-plane failure is named by the stage death that caused it (`Coordinator._fail`).

What breaks when these fail: when a stage dies, its neighbours' connections break too, and the
error every request gets may name the neighbour ("failed to receive from stage 2: Connection closed
by peer") instead of the stage that died, its pid and node (the backend's report, which can arrive
a moment later: seen under load with the Ray backend).
"""

from __future__ import annotations

import queue
import threading

import pytest

from launcher.coordinator.coordinator import Coordinator, DataPlaneFailure, PipelineError
from launcher.coordinator.stage_receivers import ReceiverError, await_death_report


def _bare(generation: int = 0) -> Coordinator:
    c = Coordinator.__new__(Coordinator)  # only the event queue and generation are used
    c.events, c.generation = queue.SimpleQueue(), generation
    return c


def test_a_death_report_arriving_after_the_receive_error_is_found_and_other_events_are_put_back():
    c = _bare()
    c.events.put(("submit", "first"))
    c.events.put(("error", (0, ReceiverError("failed to receive from stage 2"))))
    timer = threading.Timer(0.2, c.events.put, [("error", (0, PipelineError("stage 1 (pid 7) died: SIGKILL")))])
    timer.start()
    try:
        death = await_death_report(c.events, c.generation, 5.0)
    finally:
        timer.cancel()
    assert death == "stage 1 (pid 7) died: SIGKILL"
    rest = [c.events.get_nowait() for _ in range(c.events.qsize())]
    assert [k for k, _ in rest] == ["submit", "error"] and isinstance(rest[1][1][1], ReceiverError)


def test_no_report_or_one_about_a_replaced_ring_gives_none_within_the_wait():
    c = _bare(generation=2)
    c.events.put(("error", (1, PipelineError("stage 1 died"))))  # the ring a fail-over replaced
    assert await_death_report(c.events, c.generation, 0.2) is None
    assert c.events.qsize() == 1


def test_a_receive_error_reaches_the_engine_loop_as_a_data_plane_failure():
    with pytest.raises(DataPlaneFailure, match="stage 2"):
        _bare()._to_engine_events("error", (0, ReceiverError("failed to receive from stage 2")))
