"""`--row-cost calibrate` end to end on the tiny random model: real stage processes, gloo on loopback.

What breaks when these fail: a stage's start-up calibration fails or is not reported in its Load
response, the coordinator does not combine the stages' tables or does not hand the result to the
scheduler, or the table-driven choices (run-ahead depth, FIRP chain lengths) change greedy output.
The oracle is `--row-cost none` on the same prompts and the single-process reference
(tests/distributed/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.sampling import SamplingParams
from tests.distributed.conftest import full_model, reference_generate, session_options
from tests.tiny_model import write_firp_file

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

PROMPTS = ("Once upon a time", "1, 2, 3, 5, 8,")
BUDGET = 20


def _tokens(options, prompts) -> tuple[list[list[int]], PipelineSession]:
    with PipelineSession(options, resolve(options)) as session:
        report = run_launch(session, list(prompts), [SamplingParams(max_new_tokens=BUDGET, ignore_eos=True)] * len(prompts))
        return [o["token_ids"] for o in report["outputs"]], session


@pytest.mark.parametrize("num_stages", [2, 3])
def test_calibrated_row_costs_give_the_tokens_of_no_table(tiny_model_dir: Path, num_stages: int):
    model, tokenizer = full_model(tiny_model_dir)
    reference = [reference_generate(model, tokenizer.encode(p), SamplingParams(max_new_tokens=BUDGET, ignore_eos=True))
                 for p in PROMPTS]
    split = {2: "2,2", 3: "1,2,1"}[num_stages]
    common = dict(layer_split=split, speculate="speed", predictor="logit-lens")
    plain, uncalibrated = _tokens(session_options(tiny_model_dir, num_stages, row_cost="none", **common), PROMPTS[:1])
    calibrated, session = _tokens(session_options(tiny_model_dir, num_stages, row_cost="calibrate", **common), PROMPTS)
    assert plain[0] == calibrated[0] == reference[0], "row-cost calibration changed greedy output"
    assert calibrated == reference
    table = session.row_costs
    assert table is not None and table.num_rows[0] == 1 and min(table.pass_s) > 0
    assert all(r.row_costs and r.row_cost_mode == "fp32" and r.calibrate_s > 0 for r in session.load_responses)
    # the exit stage (stage 0: the logit lens after its last layer) also timed its exit head; no other stage has one
    assert session.load_responses[0].exit_head_row_s > 0
    assert all(r.exit_head_row_s == 0 for r in session.load_responses[1:])
    # without calibration the exit head is still timed: launch's speed-up estimate takes it off
    assert not uncalibrated.load_responses[0].row_costs and uncalibrated.load_responses[0].exit_head_row_s > 0
    # the pipeline's table is the sum of the stages' (pipeline/measure/row_cost.py [Note: combining stage tables])
    one_row = sum(r.row_costs[0].pass_s for r in session.load_responses)
    assert table.pass_s[0] == pytest.approx(one_row)


def test_calibrated_row_costs_size_firp_chains_without_changing_tokens(tiny_model_dir: Path, tmp_path: Path):
    model, tokenizer = full_model(tiny_model_dir)
    reference = reference_generate(model, tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=BUDGET,
                                                                                       ignore_eos=True))
    firp = write_firp_file(tiny_model_dir, tmp_path / "firp.safetensors", layer=1, k=3, seed=5)
    options = session_options(tiny_model_dir, 2, layer_split="2,2", speculate="speed+firp", predictor="logit-lens",
                              firp_file=str(firp), row_cost="calibrate")
    tokens, session = _tokens(options, PROMPTS[:1])
    assert tokens[0] == reference, "FIRP chains sized by the calibrated table changed greedy output"
    # the stages timed what a FIRP pass may hold: 4 slots x (1 + 3) rows (session_options: max_num_seqs 4)
    assert session.row_costs.num_rows[-1] == 16
