"""The configuration strings of tests/benchmarks/speculation.py: parsed into launch's options, and
rejected with one line (exit 2) before any pipeline starts."""

from __future__ import annotations

import pytest

from tests.benchmarks.speculation import main, options


def test_a_full_configuration_string_sets_every_option_it_names():
    opts = options("speed/ngram@0.3#2", 2, None)
    assert (opts.speculate, opts.predictor, opts.min_acceptance, opts.draft_tree) == ("speed", "ngram", 0.3, 2)
    opts = options("speed+firp/early-exit:stage!0.7", 3, None)
    assert (opts.speculate, opts.predictor, opts.num_stages) == ("speed+firp", "early-exit", 3)
    assert (opts.draft_at, opts.deep_draft_min_acceptance) == ("stage", 0.7)


def test_a_bare_mode_gets_the_defaults():
    opts = options("firp", 3, None)
    assert (opts.speculate, opts.predictor, opts.min_acceptance, opts.draft_tree, opts.draft_at) == \
        ("firp", "hybrid", None, 1, "coordinator")


@pytest.mark.parametrize("config, named", [("sped", "speculate"), ("speed@x", "'x'"),
                                           ("speed:stage!1.1", "deep_draft_min_acceptance"),
                                           ("speed#2:stage", "draft_tree")])
def test_a_bad_configuration_exits_2_naming_it_before_any_pipeline_starts(config, named, capsys, monkeypatch):
    monkeypatch.setattr("tests.benchmarks.speculation.run", lambda args: pytest.fail("a pipeline was started"))
    with pytest.raises(SystemExit) as exc:
        main(["--configs", f"none,{config}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--configs: {config!r}" in err and named in err
