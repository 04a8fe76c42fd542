"""A restarted stage that loads its weights for longer than --stage-timeout-s still rejoins: the stages
that Rejoin at once wait for it up to the join's own deadline, not gloo's ([Note: every rank waits for
all_joined] in workers/channel.py), on the tiny model.

What breaks when this fails: under load (a slow disk, a busy CPU) every fail-over attempt fails in
gloo's constructor ("wait timeout") after --stage-timeout-s, the restart budget is spent and every
request fails, although the restarted stage was only slow.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.coordinator.stage_restarts import RestartBudget
from tests.distributed.conftest import pid_alive, session_options
from tests.distributed.test_failover import GREEDY, PROMPTS, _references, _wait_for_tokens
from workers.stage_worker import LOAD_DELAY_FILE_ENV

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
STAGE_TIMEOUT_S = 3.0
LOAD_DELAY_S = 3 * STAGE_TIMEOUT_S  # the restarted stage's Load waits this long before it loads


def test_a_restarted_stage_loading_longer_than_the_stage_timeout_rejoins_and_the_run_is_exact(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    delay_file = tmp_path / "load_delay_s"
    monkeypatch.setenv(LOAD_DELAY_FILE_ENV, str(delay_file))  # the stage processes inherit it; no file yet
    expected = _references(tiny_model_dir, PROMPTS[:2], GREEDY)
    options = session_options(tiny_model_dir, 3, stage_timeout_s=STAGE_TIMEOUT_S)
    session = PipelineSession(options, resolve(options), restart_budget=RestartBudget(max_restarts=1, window_s=600))
    session.__enter__()
    pids = list(session.processes.pids)
    try:
        coord = session.coordinator
        handles = [coord.submit(p, GREEDY) for p in PROMPTS[:2]]
        _wait_for_tokens(handles[0], 4)
        delay_file.write_text(f"{LOAD_DELAY_S:g}")  # Loads from now on: the restarted stage's
        os.kill(pids[1], signal.SIGKILL)
        outputs = [h.result(timeout_s=180).token_ids for h in handles]
        assert outputs == expected
        assert coord.num_restarts == 1 and coord.failure is None  # one attempt, not a spent budget
    finally:
        all_pids = {*pids, *session.processes.pids}
        session.close()
    assert not [p for p in all_pids if pid_alive(p)]
