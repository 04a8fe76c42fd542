"""`--speculate auto`, the CLI default (launcher/cli/speculation_defaults.py, [Note:
speculation default]): `speed` only with 2+ stages that each compute on their own cores or device
and a trained exit head for the model; `none` otherwise, with a reason the user sees.

What breaks when these fail: a default launch speculates where it was measured to lose (more local
CPU stages than CPUs, one stage, an untrained head), or never speculates where it pays.
"""

from __future__ import annotations

import pytest

from launcher.backends.placement import PlacementOptions
from launcher.cli.main import build_parser
from launcher.cli.options import options_and_reason, speculation_choice
from launcher.cli.parsing import UsageError, min_acceptance_arg
from launcher.cli.speculation_defaults import (
    FIRP_TUNING,
    SPEED_TUNING,
    auto_speculate,
    check_auto_flags,
    model_family_name,
    tuned_flags,
)

LOCAL, RAY = PlacementOptions(), PlacementOptions(backend="ray", ray_address="10.0.0.10:6379")  # a cluster


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 2)


def _auto(model="smollm2-135m", *, stages=2, placement=LOCAL, device="cpu", threads=1, predictor="hybrid",
          exit_predictor=None):
    return auto_speculate(model=model, num_stages=stages, placement=placement, device=device, threads_per_stage=threads,
                          predictor=predictor, exit_predictor=exit_predictor)


def _options(args):
    """launch's / serve's PipelineOptions from parsed flags (`--speculate auto` decided)."""
    return options_and_reason(args, progress=False)[0]


def test_speed_where_every_stage_has_its_own_cpu_and_a_head_ships(two_cpus):
    mode, why = _auto(stages=2)
    assert mode == "speed" and "each on its own cores" in why
    assert _auto(stages=4, placement=RAY)[0] == "speed"  # a Ray cluster's bundles reserve their own CPUs
    private = PlacementOptions(backend="ray")  # a Ray instance of its own, on this machine's 2 CPUs
    assert _auto(stages=4, placement=private) == _auto(stages=4) and _auto(stages=4)[0] == "none"


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"stages": 1}, "one stage"),
    ({"stages": 3}, "2 of 3 stages compute at once"),
    ({"stages": 2, "threads": 2}, "1 of 2 stages compute at once"),
    ({"model": "qwen2.5-coder-1.5b"}, "no trained exit head ships for qwen2.5-coder-1.5b"),
    ({"model": "/tmp/some/tiny-model"}, "no trained exit head ships for tiny-model"),
    ({"device": "cuda"}, "measured on CPU stages only"),
    ({"placement": RAY, "device": "cuda"}, "measured on CPU stages only"),
    ({"predictor": "logit-lens"}, "--predictor logit-lens without a trained exit head"),
    ({"predictor": "ngram"}, "--predictor ngram without a trained exit head"),
    ({"exit_predictor": "none"}, "without a trained exit head"),
])
def test_none_where_speculation_was_not_measured_to_pay(two_cpus, kwargs, reason):
    mode, why = _auto(**kwargs)
    assert mode == "none" and reason in why, why


def test_a_head_the_user_names_counts_as_trained(two_cpus):
    assert _auto(model="/tmp/tiny", predictor="/tmp/head.safetensors")[0] == "speed"
    assert _auto(model="/tmp/tiny", exit_predictor="/tmp/head.safetensors")[0] == "speed"
    assert _auto(model="/tmp/tiny", exit_predictor="none")[0] == "none"


def test_model_family_names_match_the_shipped_files_without_resolving():
    assert model_family_name("smollm2-135m") == "smollm2-135m"
    assert model_family_name("/models/SmolLM2-135M Instruct.GGUF") == "smollm2-135m-instruct"  # as converted
    assert model_family_name("/models/my-model") == "my-model"


def test_the_cli_default_is_auto_and_it_is_decided_before_the_options_exist(two_cpus):
    parser = build_parser()
    args = parser.parse_args(["launch", "--stages", "2", "--prompt", "x"])
    assert args.speculate == "auto"
    assert _options(args).speculate == "speed"
    mode, why = speculation_choice(args, 2)
    assert mode == "speed" and "2 stages, each on its own cores" in why
    four = parser.parse_args(["launch", "--stages", "4", "--prompt", "x"])
    assert _options(four).speculate == "none"
    explicit = parser.parse_args(["launch", "--stages", "4", "--speculate", "speed", "--prompt", "x"])
    assert _options(explicit).speculate == "speed"
    assert speculation_choice(explicit, 4) == ("speed", "")  # the user's choice needs no reason



@pytest.mark.parametrize(("flags", "named"), [
    (["--draft-tree", "3"], "--draft-tree tunes SPEED drafts"),
    (["--draft-at", "stage"], "--draft-at tunes SPEED drafts"),
    (["--min-acceptance", "0.2", "--max-inflight", "2"], "--min-acceptance, --max-inflight tune SPEED drafts"),
    (["--deep-draft-min-acceptance", "0.9"], "--deep-draft-min-acceptance tunes"),
    (["--grammar-drafting", "off"], "--grammar-drafting tunes SPEED drafts"),
    (["--grammar-drafting", "drafts"], "--grammar-drafting tunes SPEED drafts"),
])
def test_auto_refuses_speed_flags_where_it_chose_none(two_cpus, flags, named):
    """A flag that only tunes drafts does nothing under `none`: auto says so (exit 2 in the CLI)
    instead of ignoring it, or failing on RunConfig's `draft_tree needs speculate speed`."""
    parser = build_parser()
    with pytest.raises(UsageError) as err:
        _options(parser.parse_args(["launch", "--stages", "4", *flags, "--prompt", "x"]))
    message = str(err.value)
    assert named in message and "--speculate auto chose none here (2 of 4 stages" in message, message
    assert "pass --speculate speed" in message
    two = _options(parser.parse_args(["launch", "--stages", "2", *flags, "--prompt", "x"]))
    assert two.speculate == "speed"  # where auto chooses speed the flags apply
    mine = parser.parse_args(["launch", "--stages", "4", "--speculate", "speed", *flags, "--prompt", "x"])
    assert _options(mine).speculate == "speed"


def test_auto_refuses_firp_flags_since_it_never_chooses_firp(two_cpus):
    parser = build_parser()
    for flags in (["--firp-k", "2"], ["--firp-min-prob", "0.3"], ["--firp-file", "/tmp/maps.safetensors"]):
        with pytest.raises(UsageError, match=f"{flags[0]} tunes FIRP.*--speculate firp or speed\\+firp"):
            _options(parser.parse_args(["launch", "--stages", "2", *flags, "--prompt", "x"]))


def test_flag_defaults_match_the_options_defaults_so_untouched_flags_pass():
    """tuned_flags compares against PipelineOptions' defaults: the CLI's own defaults must equal them,
    or every default launch would be refused."""
    from launcher.cli.options import grammar_drafting_fields

    args = build_parser().parse_args(["launch", "--prompt", "x"])
    values = {field: getattr(args, field) for field in (*SPEED_TUNING, *FIRP_TUNING) if hasattr(args, field)}
    values |= grammar_drafting_fields(args.grammar_drafting)
    values["min_acceptance"] = min_acceptance_arg(values["min_acceptance"])
    assert tuned_flags(values, {**SPEED_TUNING, **FIRP_TUNING}) == []
    check_auto_flags(values | {"draft_tree": 3}, speculate="none", why="")  # the user's own mode: not auto's business


def test_a_bad_stage_count_gets_its_own_error_before_the_flag_check(two_cpus):
    args = build_parser().parse_args(["launch", "--stages", "0", "--draft-tree", "3", "--prompt", "x"])
    with pytest.raises(ValueError, match="num_stages must be >= 1") as err:
        _options(args)
    assert not isinstance(err.value, UsageError)  # RunConfig's message, not auto's


def test_a_multi_node_member_runs_node_0s_choice_and_does_not_judge_the_flags(two_cpus):
    """A member (--node-rank > 0) only runs its stages; node 0 decides the mode and checks the flags."""
    parser = build_parser()
    def node(rank: int) -> list[str]:  # 2 threads a stage on 2 CPUs a node: 2 of 4 stages compute at once
        return ["launch", "--stages", "4", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                "--threads-per-stage", "2", "--draft-at", "stage", "--prompt", "x"]

    assert _options(parser.parse_args(node(1))).num_stages == 4
    with pytest.raises(UsageError, match="--draft-at tunes SPEED drafts.*2 of 4 stages"):
        _options(parser.parse_args(node(0)))


def test_speculate_none_notes_the_predictor_flags_and_still_checks_a_named_file(two_cpus, tmp_path, capsys):
    """`--speculate none --predictor FILE` must neither run a typo unnoticed nor stay silent about
    flags that have no effect (as it says for the tuning flags)."""
    parser = build_parser()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    args = parser.parse_args(["launch", "--speculate", "none", "--predictor", str(garbage), "--prompt", "x"])
    with pytest.raises(UsageError, match=rf"--predictor {garbage}: .*not a safetensors file"):
        _options(args)
    missing = parser.parse_args(["launch", "--speculate", "none", "--exit-predictor", str(tmp_path / "no.safetensors"),
                                 "--prompt", "x"])
    with pytest.raises(UsageError, match="--exit-predictor .*no.safetensors: .*does not exist"):
        _options(missing)
    capsys.readouterr()
    named = parser.parse_args(["launch", "--speculate", "none", "--predictor", "ngram", "--firp-k", "2",
                               "--prompt", "x"])
    assert _options(named).speculate == "none"
    assert "note: --firp-k, --predictor have no effect with --speculate none" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["launch", "--prompt", "x"], ["serve"]])
@pytest.mark.parametrize(("mode", "drafts", "jump"), [("jump", True, True), ("drafts", True, False), ("off", False, False)])
def test_grammar_drafting_reaches_the_run_config_of_launch_and_serve(two_cpus, command, mode, drafts, jump):
    """`--grammar-drafting jump|drafts|off` ([Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py):
    drafts that follow the grammar with forced runs as one item, without jump-forward, or the predictor's
    as they are, on `launch` and `serve` alike, down to the scheduler's view; jump, the behaviour before the
    flag, is the default (RunConfig's own defaults)."""
    from pipeline.run_config import RunConfig

    parser = build_parser()
    options = _options(parser.parse_args([*command, "--stages", "2", "--speculate", "speed", "--grammar-drafting", mode]))
    assert (options.grammar_drafts, options.grammar_jump) == (drafts, jump)
    view = options.scheduler_config(eos_token_ids=(2,), firp_k=0)
    assert (view.grammar_drafts, view.grammar_jump) == (drafts, jump)
    default = _options(parser.parse_args([*command, "--stages", "2", "--speculate", "speed"]))
    assert (default.grammar_drafts, default.grammar_jump) == (RunConfig().grammar_drafts, RunConfig().grammar_jump)
    assert (default.grammar_drafts, default.grammar_jump) == (True, True)
