"""`--speculative-disable-by-batch-size` on real stage processes (gloo on loopback).

What breaks when this fails: pausing speculation under load (or resuming it when the load falls)
changes greedy output on a real pipeline, e.g. a draft in flight when the pause begins is dropped
instead of verified, or the paused steps are not counted in `launch --json`.
See [Note: speculation under load] in pipeline/engine/row_budget.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli.launch import run_launch
from pipeline.speculation.sampling import SamplingParams
from tests.distributed.conftest import full_model, reference_generate, session_options, started_session

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

PROMPTS = ("Once upon a time", "def f(x):\n    return", "1, 2, 3, 5, 8,")
BUDGETS = (24, 9, 5)  # 3 running at limit 2: paused; once two have finished the first speculates again


def test_three_concurrent_requests_at_limit_2_keep_greedy_output(tiny_model_dir: Path):
    model, tokenizer = full_model(tiny_model_dir)
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in BUDGETS]
    expected = [reference_generate(model, tokenizer.encode(p), sp) for p, sp in zip(PROMPTS, params, strict=True)]
    options = session_options(tiny_model_dir, 2, layer_split="2,2", speculate="speed", predictor="logit-lens",
                              speculative_disable_by_batch_size=2)
    with started_session(options) as session:
        report = run_launch(session, list(PROMPTS), params)
    assert [out["token_ids"] for out in report["outputs"]] == expected, "pausing speculation changed greedy output"
    stats = report["stats"]
    assert stats["spec_disabled_steps"] > 0, stats
    assert stats["drafted_tokens"] > 0, "no draft after the load fell: speculation never resumed"
