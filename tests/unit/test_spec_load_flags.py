"""`--speculative-disable-by-batch-size N` from the command line to the scheduler's view.

What breaks when these fail: `--speculate auto` keeps speculating under any load (its default limit,
stages + 1, is lost), a mode the user named is paused without being asked, the flag's value never
reaches `SchedulerConfig.disable_by_batch_size`, or a bad value starts a pipeline instead of a one-line
error with exit status 2. See [Note: speculation under load] in pipeline/engine/row_budget.py.
"""

from __future__ import annotations

import pytest

from launcher.cli.main import build_parser, main
from launcher.cli.options import options_and_reason


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 2)


def _limit(argv: list[str]) -> tuple[str, int | None, int]:
    """(the mode, RunConfig's limit, the scheduler view's limit) for launch's flags."""
    options = options_and_reason(build_parser().parse_args(["launch", "--prompt", "x", *argv]), progress=False)[0]
    view = options.scheduler_config(eos_token_ids=(2,), firp_k=0)
    return options.speculate, options.speculative_disable_by_batch_size, view.disable_by_batch_size


@pytest.mark.parametrize("stages", [2, 3])
def test_auto_pauses_from_stages_plus_one_running_sequences(two_cpus, monkeypatch, stages):
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: stages)
    assert _limit(["--stages", str(stages)]) == ("speed", stages + 1, stages + 1)


def test_a_named_mode_is_never_paused_unless_the_flag_says(two_cpus):
    assert _limit(["--stages", "2", "--speculate", "speed"]) == ("speed", None, 0)
    assert _limit(["--stages", "2", "--speculate", "speed", "--speculative-disable-by-batch-size", "5"]) == (
        "speed", 5, 5)
    assert _limit(["--stages", "2", "--speculative-disable-by-batch-size", "1"]) == ("speed", 1, 1)  # auto, given


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_limit_below_1_is_a_one_line_error_with_status_2(two_cpus, capsys, value):
    code = main(["launch", "--stages", "2", "--speculate", "speed", "--max-model-len", "64",
                 "--speculative-disable-by-batch-size", value, "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("speedpipe launch: error: --speculative-disable-by-batch-size must be >= 1"), err
    assert err.endswith(f"got {value}"), err


@pytest.mark.parametrize(("argv", "why"), [
    (["--stages", "2", "--speculate", "none"], "with --speculate none"),
    (["--stages", "1"], "where --speculate auto chose none (one stage: nothing to run ahead)"),
])
def test_the_limit_without_speculation_is_named_as_doing_nothing(two_cpus, capsys, argv, why):
    options = options_and_reason(build_parser().parse_args(
        ["launch", "--prompt", "x", *argv, "--speculative-disable-by-batch-size", "2"]), progress=False)[0]
    assert options.speculate == "none"
    assert f"note: --speculative-disable-by-batch-size has no effect {why}" in capsys.readouterr().err


def test_paused_steps_reach_the_json_stats_and_the_serve_metric():
    import types

    from launcher.cli.launch import speculation_stats
    from launcher.serving.prometheus import PREFIX, _PipelineCollector
    from pipeline.engine.records import SpecCounters

    spec = SpecCounters(spec_disabled_steps=7)
    assert speculation_stats(spec)["spec_disabled_steps"] == 7
    coordinator = types.SimpleNamespace(spec=spec, num_restarts=0, failover=None, recovering=None)
    engine = types.SimpleNamespace(fenced="a fenced engine: no stage is asked", heartbeat=None)
    families = {f.name: f for f in _PipelineCollector(coordinator, "m", engine=engine).collect()}
    family = families.get(PREFIX + "spec_decode_disabled_steps")
    assert family is not None, f"no spec_decode_disabled_steps metric among {sorted(families)}"
    assert family.type == "counter" and family.samples[0].value == 7, family
