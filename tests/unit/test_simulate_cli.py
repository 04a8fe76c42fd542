"""`speedpipe simulate`'s flags and simulate.json, in process: every bad flag is one line with exit
code 2 before anything is simulated, and simulate.json is strict JSON with only the real settings.

What breaks when these fail: `--row-cost bogus` or an all-zero cost model is silently accepted
(tokens/s 0.0, bubble 1.0), a binary --calibrate file gives an error that names no file, an existing
file as --out is a traceback, and `jq` or a browser rejects simulate.json (`Infinity`, argparse reprs).
"""

from __future__ import annotations

import json

import pytest

from launcher.bench.simulate import SETTINGS
from launcher.cli.main import main

pytestmark = pytest.mark.timeout(60)

FAST = ["--stages", "1,2", "--alpha", "none,0.5", "--max-new-tokens", "4", "--no-plots"]


def test_simulate_json_is_strict_with_only_the_flags_as_settings(tmp_path, capsys):
    assert main(["simulate", "--out", str(tmp_path / "o"), *FAST]) == 0
    text = (tmp_path / "o" / "simulate.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"simulate.json holds {c}"))
    assert sorted(data["settings"]) == sorted(SETTINGS)
    assert data["settings"]["link_bandwidth_bytes_per_s"] is None  # unlimited
    plain = next(r for r in data["sweep"] if r["alpha_requested"] == "none")
    assert plain["alpha_realised"] is None  # plain decode verified no draft


def test_settings_are_the_flags_of_simulate():
    from launcher.cli.main import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices["simulate"]  # noqa: SLF001
    dests = {a.dest for a in sub._actions if a.option_strings and a.dest != "help"}  # noqa: SLF001
    assert dests == set(SETTINGS)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--row-cost", "bogus"], "--row-cost must be none or file:PATH, got 'bogus'"),
    (["--row-cost", "file:/nonexistent/table.json"], "--row-cost file:/nonexistent/table.json: "),
    (["--model-ms", "0", "--stage-overhead-ms", "0", "--coordinator-ms", "0"], "are all 0"),
    (["--replay"], "--replay needs --calibrate"),
    (["--model-ms", "inf"], "--model-ms must be a number of milliseconds >= 0, got inf"),  # was a traceback
    (["--coordinator-ms", "nan"], "--coordinator-ms must be a number of milliseconds >= 0, got nan"),
    (["--link-bandwidth-bytes-per-s", "nan"], "--link-bandwidth-bytes-per-s must be a number > 0 (got nan)"),
    (["--max-new-tokens", "100000000"], "--max-new-tokens must be in [1, 1000000], got 100000000"),
])
def test_bad_cost_flags_are_one_line_errors_without_calibrate(tmp_path, capsys, argv, needle):
    assert main(["simulate", "--out", str(tmp_path / "o"), *FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_a_binary_calibrate_file_is_named(tmp_path, capsys):
    binary = tmp_path / "results.json"
    binary.write_bytes(b"\x8a\x00\xff\xfe")
    assert main(["simulate", "--out", str(tmp_path / "o"), "--calibrate", str(binary)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"speedpipe simulate: error: --calibrate {binary}: ") and "UTF-8" in err, err


def test_an_existing_file_as_out_is_a_one_line_error(tmp_path, capsys):
    target = tmp_path / "o"
    target.write_text("")
    assert main(["simulate", "--out", str(target), *FAST]) == 2
    assert capsys.readouterr().err.strip() == (f"speedpipe simulate: error: --out {target}: exists and is not a "
                                               f"directory (give a folder)")


def test_calibration_flags_are_not_in_the_synthetic_cost_group(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    synthetic = text[text.index("synthetic cost model"):]
    synthetic = synthetic[:synthetic.index("\n\n")]
    flags = [line.split()[0] for line in synthetic.splitlines() if line.startswith("  --")]
    assert "--model-ms" in flags
    assert not [f for f in ("--calibrate", "--replay", "--row-cost") if f in flags], flags


def test_the_realised_alpha_is_reported_beside_the_requested_one(tmp_path, capsys, monkeypatch):
    """[Note: requested and realised alpha] in launcher/bench/simulate.py: curves and rows labelled
    only with the requested α (0.5) came from runs that realised 0.39 (2 stages, 128 tokens, seed 0).
    Every output names both: the rows (with the counts the realised α is made of), the pooled α per
    requested one in simulate.json and on stderr, and the plot legends."""
    from launcher.bench import plots, simulate

    legends = []
    monkeypatch.setattr(plots, "sweep_lines", lambda series, path, **kw: legends.append(list(series)) or path)
    assert main(["simulate", "--out", str(tmp_path / "o"), "--stages", "1,2,4", "--alpha", "none,0.5",
                 "--max-new-tokens", "128"]) == 0
    data = json.loads((tmp_path / "o" / "simulate.json").read_text())
    spec = [r for r in data["sweep"] if r["alpha_requested"] == 0.5]
    assert len(spec) == 2 and all(r["verified_drafts"] > 100 for r in spec)
    for r in spec:
        assert r["alpha_realised"] == round(r["accepted_drafts"] / r["verified_drafts"], 4)
    assert abs(spec[0]["alpha_realised"] - 0.5) > 0.05  # the case of the issue: 2 stages, seed 0
    pooled = round(sum(r["accepted_drafts"] for r in spec) / sum(r["verified_drafts"] for r in spec), 4)
    assert data["alpha_realised"] == {"0.5": {"pooled": pooled, "rows": 2, "verified_rows": 2,
                                              "min": min(r["alpha_realised"] for r in spec),
                                              "max": max(r["alpha_realised"] for r in spec)}}
    assert f"α requested 0.5, realised {pooled} " in capsys.readouterr().err
    with (tmp_path / "o" / "simulate.csv").open() as f:
        header = f.readline().strip().split(",")
    assert {"alpha_requested", "alpha_realised", "accepted_drafts", "verified_drafts"} <= set(header)
    label = f"SPEED, α requested 0.5, realised {pooled:.2f} (pooled; "
    assert legends and all(any(name.startswith(label) for name in names) for names in legends), legends
    assert simulate.alpha_label(0.5, {0.5: {"pooled": None, "min": None, "max": None, "rows": 1}}) == (
        "SPEED, α requested 0.5 (no draft verified)")


def test_the_realised_alpha_line_counts_only_configurations_that_verified_drafts_and_the_csv_has_plain_line_ends(
        tmp_path, capsys):
    """With speculation paused under load (5 streams on 2 stages, the default limit 3), one of the two
    SPEED configurations verifies no draft: the stderr line said "of its 2 configurations; 0.x..0.x in
    one", as if both were pooled. simulate.csv was written with csv's \\r\\n line ends, so the README's
    `cut | column` recipe printed ^M."""
    assert main(["simulate", "--out", str(tmp_path / "o"), "--stages", "2", "--alpha", "none,0.9",
                 "--concurrency", "1,5", "--max-new-tokens", "64", "--no-plots"]) == 0
    data = json.loads((tmp_path / "o" / "simulate.json").read_text())
    r = data["alpha_realised"]["0.9"]
    assert (r["rows"], r["verified_rows"]) == (2, 1)
    assert (f"pooled over the 1 of its 2 configurations that verified any; per configuration {r['min']}..{r['max']})"
            in capsys.readouterr().err)
    raw = (tmp_path / "o" / "simulate.csv").read_bytes()
    assert b"\r" not in raw and raw.count(b"\n") == 1 + 4  # header + 4 configurations


NONE_SPECULATES = ("--speculative-disable-by-batch-size has no effect: no configuration speculates "
                   "(--alpha none only, or --stages 1 only)")


@pytest.mark.parametrize(("flags", "note"), [
    (["--alpha", "none"], NONE_SPECULATES),
    (["--stages", "1"], NONE_SPECULATES),
    (["--concurrency", "1,2"], "--speculative-disable-by-batch-size 3 has no effect: above every --concurrency "
                               "(at most 2 streams), no step pauses"),
    (["--concurrency", "1,4"], None),  # 4 streams >= the limit 3: it acts
])
def test_simulate_notes_a_speculation_limit_that_acts_on_no_configuration(tmp_path, capsys, flags, note):
    """As `launch` notes an idle flag: a limit given where no configuration speculates, or above every
    concurrency, ran silently as if it had been applied."""
    args = ["simulate", "--out", str(tmp_path / "o"), "--stages", "2", "--alpha", "none,0.9", "--concurrency", "1",
            "--max-new-tokens", "16", "--no-plots", "--speculative-disable-by-batch-size", "3"]
    args[args.index(flags[0]) + 1] = flags[1]
    assert main(args) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "simulate: note:" in line]
    assert notes == ([] if note is None else [f"[speedpipe] simulate: note: {note}"])


def test_without_matplotlib_simulate_stops_before_the_sweep_naming_no_plots(tmp_path, monkeypatch, capsys):
    """The runtime image installs no plots extra: simulate ran its whole sweep, then exited 2 with
    nothing written."""
    import sys

    from launcher.bench import simulate

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(simulate, "Simulator", lambda *a, **k: pytest.fail("simulated before the plot check"))
    assert main(["simulate", "--out", str(tmp_path / "o"), *[a for a in FAST if a != "--no-plots"]]) == 2
    err = capsys.readouterr().err
    assert "plots need matplotlib" in err and "--no-plots" in err
    assert not (tmp_path / "o" / "simulate.json").exists()


def _sweep(tmp_path, *argv) -> list[dict]:
    assert main(["simulate", "--out", str(tmp_path / "o"), "--max-new-tokens", "8", "--no-plots", *argv]) == 0
    return json.loads((tmp_path / "o" / "simulate.json").read_text())["sweep"]


def _row(rows, alpha, concurrency) -> dict:
    return next(r for r in rows if r["alpha_requested"] == alpha and r["concurrency"] == concurrency)


def test_speculating_rows_pause_from_stages_plus_one_streams_by_default(tmp_path):
    """[Note: speculation under load] in pipeline/engine/row_budget.py: as `launch --speculate auto`,
    3 streams on 2 stages pause speculation; 1 stream does not; plain decode has no limit."""
    rows = _sweep(tmp_path, "--stages", "2", "--alpha", "none,1", "--concurrency", "1,3")
    loaded, single = _row(rows, 1.0, 3), _row(rows, 1.0, 1)
    assert loaded["speculative_disable_by_batch_size"] == single["speculative_disable_by_batch_size"] == 3
    assert loaded["spec_disabled_steps"] > 0 and loaded["verified_drafts"] == 0
    assert loaded["tokens_per_s"] == _row(rows, "none", 3)["tokens_per_s"]
    assert single["spec_disabled_steps"] == 0
    assert single["tokens_per_s"] > _row(rows, "none", 1)["tokens_per_s"]
    assert _row(rows, "none", 3)["speculative_disable_by_batch_size"] is None
    assert _row(rows, "none", 3)["spec_disabled_steps"] == 0


def test_the_flag_sets_the_limit_of_every_speculating_row(tmp_path):
    """2 streams on 4 stages leave free slots: speculation pays unless the flag's limit (2) pauses it."""
    argv = ("--stages", "4", "--alpha", "none,1", "--concurrency", "2")
    free = _row(_sweep(tmp_path, *argv), 1.0, 2)
    paused = _sweep(tmp_path, *argv, "--speculative-disable-by-batch-size", "2")
    assert free["spec_disabled_steps"] == 0 and free["speculative_disable_by_batch_size"] == 5
    assert _row(paused, 1.0, 2)["speculative_disable_by_batch_size"] == 2
    assert _row(paused, 1.0, 2)["spec_disabled_steps"] == 16  # 2 streams x (prefill + 7 decode items)
    plain = _row(paused, "none", 2)["tokens_per_s"]
    assert _row(paused, 1.0, 2)["tokens_per_s"] == plain < free["tokens_per_s"]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_limit_below_1_is_launchs_one_line_error_with_status_2(tmp_path, capsys, value):
    argv = [*FAST, "--speculative-disable-by-batch-size", value]
    assert main(["simulate", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("speedpipe simulate: error: --speculative-disable-by-batch-size must be >= 1 (running "
                   f"sequences from which on speculation pauses), got {value}"), err
    assert not (tmp_path / "o").exists()
