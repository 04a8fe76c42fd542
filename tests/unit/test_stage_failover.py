"""The restart budget of stage fail-over (launcher/stage_failover.py).

What breaks when these fail: a crash-looping stage is restarted forever (the server never settles
into its fenced 503 state), or a stage that fails once a day is refused a restart weeks later.
"""

from __future__ import annotations

import pytest

from launcher.stage_failover import RestartBudget, RestartPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_allows_max_restarts_within_the_window_then_refuses():
    clock = Clock()
    budget = RestartBudget(RestartPolicy(max_stage_restarts=3, restart_window_s=600), clock=clock)
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    clock.now = 599.0
    assert not budget.take()


def test_restarts_older_than_the_window_no_longer_count():
    clock = Clock()
    budget = RestartBudget(RestartPolicy(max_stage_restarts=2, restart_window_s=10), clock=clock)
    assert [budget.take() for _ in range(3)] == [True, True, False]
    clock.now = 10.5
    assert [budget.take() for _ in range(3)] == [True, True, False]  # the earlier two left the window
    clock.now = 21.0
    assert budget.take()


def test_zero_restarts_never_allows_one():
    assert not RestartBudget(RestartPolicy(max_stage_restarts=0)).take()


@pytest.mark.parametrize(("kwargs", "flag"), [({"max_stage_restarts": -1}, "--max-stage-restarts"),
                                              ({"restart_window_s": 0}, "--restart-window-s")])
def test_bad_policies_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RestartPolicy(**kwargs)
