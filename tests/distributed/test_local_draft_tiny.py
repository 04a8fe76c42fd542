"""Stage-local drafting (`--draft-at stage`) end to end: real stage processes, gloo on loopback.

What breaks when these fail: a draft the exit stage made itself changes greedy output (a stale
self-made draft's keys left in a KV cache, its result applied to the wrong sequence or twice), the
coordinator never registers such drafts (the stage did not draft, or announced nothing), a
self-made micro-batch's result is never matched (the run hangs), or the exit layer on a later
stage does not fall back to coordinator drafting.

Predictors: the built-in ones the stage rebuilds by name, `logit-lens` (on the tiny random model
its guesses are mostly wrong: squashes) and `hybrid` (n-gram + logit lens), with every draft sent
(`min_acceptance` 0). The adversarial predictors of tests/adversarial_predictors.py are objects in
the test process, which a stage process cannot run: tests/unit/test_local_draft.py drives them
through the same stage-side code in one process. The oracle is the single-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.sampling import SamplingParams
from tests.distributed.conftest import full_model, reference_generate, session_options

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PROMPTS = ("Once upon a time", "def f(x):\n    return", "1, 2, 3, 5, 8,", "The quick brown fox")
BUDGETS = (24, 10, 17, 6)
SHAPES = {
    "2-stage": dict(num_stages=2, layer_split="2,2"),
    "3-stage": dict(num_stages=3, layer_split="2,1,1"),
    # exit layer at the end of stage 1: the coordinator drafts (stage-local needs stage 0)
    "3-stage-exit-in-stage-1": dict(num_stages=3, layer_split="1,1,2", exit_layer=1),
}


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[str, list[int]]:
    model, tokenizer = full_model(tiny_model_dir)
    return {p: reference_generate(model, tokenizer.encode(p), SamplingParams(max_new_tokens=max(BUDGETS),
                                                                              ignore_eos=True)) for p in PROMPTS}


@pytest.mark.parametrize("predictor", ["logit-lens", "hybrid"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_stage_drafting_keeps_greedy_output(tiny_model_dir: Path, references, shape: str, predictor: str):
    untrained = {"exit_predictor": "none"} if predictor == "hybrid" else {}  # no shipped head for the tiny model
    options = session_options(tiny_model_dir, speculate="speed", predictor=predictor, draft_at="stage",
                              **untrained, **SHAPES[shape])
    with PipelineSession(options, resolve(options)) as session:
        for prompts, budgets in ((PROMPTS[:1], BUDGETS[:1]), (PROMPTS, BUDGETS)):
            params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
            report = run_launch(session, list(prompts), params)
            for prompt, b, out in zip(prompts, budgets, report["outputs"], strict=True):
                assert out["token_ids"] == references[prompt][:b], f"{shape}/{predictor}: output of {prompt!r} changed"
            stats = report["stats"]
            if "exit-in-stage-1" in shape:
                assert stats["stage_drafted"] == 0, "an exit stage other than stage 0 must not draft itself"
            if len(prompts) > 1:
                # Four sequences fill the pipeline; whether the tail after three finish drafts depends
                # on timing and on what the draft gate learned in the first run (a CI run under load
                # verified none there, output exact), so only the output and the rule above are checked.
                continue
            assert stats["verified_drafts"] > 0, stats
            if "exit-in-stage-1" not in shape:
                # a self-made draft a squash made stale before its announcement is not registered
                # (stage_drafted) but is still withdrawn: both are drafts the stage made itself
                made = stats["stage_drafted"] + stats["withdrawn_drafts"]
                assert made > 0, f"the exit stage never drafted itself: {stats}"
        assert session.coordinator.sync(10.0)
        assert session.coordinator.engine.num_inflight == 0, "a self-made micro-batch was never matched"


def test_a_stage_killed_while_the_exit_stage_drafts_replays_to_the_same_tokens(tiny_model_dir: Path):
    """Fail-over with self-made drafts in flight: the replay bumps every epoch, so no draft the
    coordinator does not know survives, and the output is the undisturbed one."""
    import os
    import signal

    from launcher.coordinator.stage_restarts import RestartBudget
    from tests.distributed.conftest import pid_alive
    from tests.distributed.test_failover import _wait_for_tokens

    options = session_options(tiny_model_dir, speculate="speed", predictor="logit-lens", draft_at="stage",
                              **SHAPES["3-stage"])
    session = PipelineSession(options, resolve(options), restart_budget=RestartBudget(max_restarts=3, window_s=600))
    session.__enter__()
    pids = list(session.processes.pids)
    try:
        coord = session.coordinator
        params = SamplingParams(max_new_tokens=48, ignore_eos=True)
        model, tokenizer = full_model(tiny_model_dir)
        expected = [reference_generate(model, tokenizer.encode(p), params) for p in PROMPTS[:2]]
        handles = [coord.submit(p, params) for p in PROMPTS[:2]]
        _wait_for_tokens(handles[0], 4)
        assert coord.spec.stage_drafted > 0, "the exit stage was not drafting when the stage died"
        os.kill(pids[1], signal.SIGKILL)
        assert [h.result(timeout_s=120).token_ids for h in handles] == expected
        assert coord.num_restarts == 1 and coord.failure is None
        assert coord.sync(10.0) and coord.engine.num_inflight == 0
    finally:
        all_pids = {*pids, *session.processes.pids}
        session.close()
    assert not [p for p in all_pids if pid_alive(p)]
