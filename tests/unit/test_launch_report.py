"""When `launch` prints a speed-up estimate (launcher/cli/launch.py `_speedup_estimate`; [Note: plain
decode estimate] in pipeline/measure/handoffs.py), and what it reports.

What breaks when these fail: `launch` tells a user their run was faster than plain decode where the
estimate is known to read high (stages sharing CPUs, a busy host, several nodes), or estimates a
multi-prompt run as if it were one stream.
"""

from __future__ import annotations

import types

import pytest

from launcher.cli import launch
from pipeline.measure.timeline import StageTiming, Timeline
from pipeline.speculation.items import Item, ItemKind

MS = 1_000_000


def _session(*, speculate="speed", parallel=2, multi_node=False, head_s=0.0, record=True) -> types.SimpleNamespace:
    """A finished 2-stage single-stream run: 4 one-row passes of 10 + 6 ms, no waits, 3 of them
    without the exit head; the exit head is on stage 0."""
    tl = Timeline(2)
    for pos in range(4):
        item = Item(seq_id=0, slot=0, start=5 + pos, num_tokens=1, epoch=0, kind=ItemKind.DECODE, want_exit=pos == 0)
        t = pos * 16 * MS
        tl.record([StageTiming(0, t, t + 10 * MS), StageTiming(1, t + 10 * MS, t + 16 * MS)], [item], 1.0)
    options = types.SimpleNamespace(speculate=speculate, parallel_stages=parallel, num_stages=2, needs_exit_head=True,
                                    placement=types.SimpleNamespace(multi_node=multi_node))
    return types.SimpleNamespace(options=options, coordinator=types.SimpleNamespace(record_timeline=record, timeline=tl),
                                 model=types.SimpleNamespace(exit_stage=0, ranges=[range(0, 15), range(15, 30)]),
                                 exit_head_ms=head_s * 1e3)


def _result(tokens=33, decode_s=0.4):  # 32 decode steps of 12.5 ms
    return types.SimpleNamespace(token_ids=list(range(tokens)), ttft_s=0.1, e2e_s=0.1 + decode_s)


@pytest.fixture
def quiet_host(monkeypatch):
    monkeypatch.setattr(launch, "_host_busy", lambda: False)


def test_one_stream_on_own_cores_gets_the_estimate_and_its_ratio(quiet_host):
    out = launch._speedup_estimate(_session(), [_result()], 0.02)
    assert out == {"plain_tpot_ms_estimate": 16.0, "speedup_estimate": pytest.approx(16 / 12.5, abs=1e-3),
                   "estimate_includes_exit_head": False}


@pytest.mark.parametrize(("session", "results"), [
    (dict(speculate="none"), 1),  # plain decode: nothing to compare
    (dict(parallel=1), 1),  # stages share CPUs: the passes are slower than plain decode's
    (dict(multi_node=True), 1),  # each host its own clock
    (dict(record=False), 1),  # --no-timeline
    ({}, 2),  # two streams: plain decode pipelines them too
])
def test_no_estimate_where_it_would_mislead(quiet_host, session, results):
    assert launch._speedup_estimate(_session(**session), [_result()] * results, 0.0) == {}


def test_a_busy_host_gets_no_estimate(monkeypatch):
    monkeypatch.setattr(launch.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    assert launch._host_busy()
    assert launch._speedup_estimate(_session(), [_result()], 0.0) == {}
    monkeypatch.setattr(launch.os, "getloadavg", lambda: (2.2, 2.0, 2.0))  # its own 2 stages: not busy
    assert not launch._host_busy()
    monkeypatch.setattr(launch.os, "getloadavg", lambda: (2.6, 2.0, 2.0))  # 0.57x measured where 1.2x was claimed
    assert launch._host_busy()


def test_other_work_during_the_run_gets_no_estimate(quiet_host):
    """The 1-minute load average lags: a sweep started at load 0.36 on a host that became busy got
    estimates of 1.34x where 0.72x was measured. Other work's CPU during the run itself decides too
    (launcher/cli/cpu_meter.py); None: stages that are not this process's children (Ray)."""
    assert launch._speedup_estimate(_session(), [_result()], 0.09) != {}
    assert launch._speedup_estimate(_session(), [_result()], 0.11) == {}
    assert launch._speedup_estimate(_session(), [_result()], None) == {}


def test_the_cpu_meter_counts_its_children_even_after_they_exited():
    """[Note: foreign load]: CPU of this process's children is ours, also once they exited and were
    waited for (a stage restarted mid-run): psutil lists live children only, and an exited child's
    CPU moved to our `children_user` / `children_system` (it was counted as foreign)."""
    import subprocess
    import sys

    from launcher.cli.cpu_meter import CpuMeter

    spin = "import time\nwhile time.process_time() < 0.5: pass"  # 0.5 s of CPU, however busy the host
    meter = CpuMeter()
    before = meter._ours_s()
    subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
    assert meter._ours_s() - before >= 0.45


def test_the_summary_line_says_it_is_an_estimate(capsys):
    stats = {"generated_tokens": 33, "wall_s": 0.5, "tokens_per_s": 66.0, "drafted_tokens": 0,
             "stages": [{"stage": 0, "busy_fraction": 0.9}], "speedup_estimate": 1.28,
             "estimate_includes_exit_head": True}
    launch.print_report({"outputs": [], "stats": stats}, streamed=True)
    assert "about 1.28x plain decode (estimated from this run's passes, exit head included)" in capsys.readouterr().err


@pytest.mark.parametrize(("links", "expected"), [
    ([], "stage busy 0: 90% (ring return p50 3.0 ms)"),  # one stage: no link to name
    ([1.25, 0.5], "stage busy 0: 90% (handoff p50 1.2/0.5 ms, ring return p50 3.0 ms)"),
])
def test_the_summary_line_names_the_handoffs_a_run_has(capsys, links, expected):
    stats = {"generated_tokens": 4, "wall_s": 0.5, "tokens_per_s": 8.0, "drafted_tokens": 0,
             "stages": [{"stage": 0, "busy_fraction": 0.9}],
             "handoffs": {"stage_handoff": [{"p50_ms": ms} for ms in links],
                          "ring_return": {"p50_ms": 3.0, "mean_ms": 3.0, "count": 4}}}
    launch.print_report({"outputs": [], "stats": stats}, streamed=True)
    assert expected in capsys.readouterr().err


def test_acceptance_is_null_when_no_draft_was_verified():
    from pipeline.engine.records import SpecCounters
    assert launch.speculation_stats(SpecCounters())["acceptance_rate"] is None  # plain decode
    assert launch.speculation_stats(SpecCounters(drafted_tokens=3))["acceptance_rate"] is None  # none verified
    rejected = launch.speculation_stats(SpecCounters(drafted_tokens=3, verified_drafts=3))
    assert rejected["acceptance_rate"] == 0.0 and rejected["verified_drafts"] == 3
    assert launch.speculation_stats(SpecCounters(verified_drafts=3, accepted_tokens=1))["acceptance_rate"] == 0.3333


def test_the_summary_line_survives_drafts_that_were_never_verified(capsys):
    stats = {"generated_tokens": 4, "wall_s": 0.5, "tokens_per_s": 8.0, "drafted_tokens": 2, "verified_drafts": 0,
             "accepted_tokens": 0, "acceptance_rate": None, "squashed_items": 0, "tokens_per_pass": 1.0,
             "stages": [{"stage": 0, "busy_fraction": 0.9}]}
    launch.print_report({"outputs": [], "stats": stats}, streamed=True)
    assert "acceptance - (0/0 drafts)" in capsys.readouterr().err


def test_a_trace_that_cannot_be_written_is_a_one_line_error_naming_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(launch.UsageError, match=rf"--trace {blocker}/t.json: the trace could not be written"):
        launch.write_trace({"traceEvents": []}, str(blocker / "t.json"))
    launch.write_trace({"traceEvents": []}, str(tmp_path / "sub" / "t.json"))
    assert (tmp_path / "sub" / "t.json").read_text() == '{"traceEvents": []}'


SPEC_STATS = {"generated_tokens": 12, "wall_s": 1.0, "tokens_per_s": 12.0, "speculate": "speed", "drafted_tokens": 10,
              "verified_drafts": 10, "accepted_tokens": 2, "acceptance_rate": 0.2, "squashed_items": 8,
              "tokens_per_pass": 1.0, "stages": [{"stage": 0, "busy_fraction": 0.8}], "speedup_estimate": 1.25,
              "estimate_includes_exit_head": False, "tree_verified": 0}


def test_launch_json_states_the_speculation_facts_of_the_summary_line(capsys):
    """`launch --json` printed no speculation summary: the acceptance, squash and speed-up sentence
    of the human output, and the notes printed before the run, were in no field."""
    summary = launch.speculation_summary(SPEC_STATS, notes=["draft gate: ..."])
    launch.print_report({"outputs": [], "stats": SPEC_STATS}, streamed=True)
    line = capsys.readouterr().err
    assert summary["summary"] and f"; {summary['summary']}" in line
    assert summary["summary"].startswith("acceptance 20% (2/10 drafts), 8 items squashed, 1.00 tokens per pass; about 1.25x")
    assert summary == {"mode": "speed", "acceptance_rate": 0.2, "drafts_sent": 10, "drafts_verified": 10,
                       "drafts_committed": 2, "drafts_rejected": 8, "items_squashed": 8, "tokens_per_pass": 1.0,
                       "speedup_estimate": 1.25, "summary": summary["summary"], "notes": ["draft gate: ..."]}
    plain = {**SPEC_STATS, "speculate": "none", "drafted_tokens": 0, "verified_drafts": 0, "accepted_tokens": 0,
             "acceptance_rate": None, "squashed_items": 0}
    del plain["speedup_estimate"]
    out = launch.speculation_summary(plain)
    assert out["summary"] is None and out["acceptance_rate"] is None and out["speedup_estimate"] is None
    assert out["notes"] == [] and out["drafts_rejected"] == 0


def test_speculation_notes_are_the_lines_launch_prints_before_a_run():
    from launcher.cli.speculation_defaults import draft_gate_note

    options = types.SimpleNamespace(speculate="speed", uses_speed=True, min_acceptance=None, parallel_stages=2,
                                    num_stages=2, draft_min_acceptance=lambda parallel: 0.09)
    session = types.SimpleNamespace(options=options, model=types.SimpleNamespace(predictor_note="exit head: trained"))
    assert launch.speculation_notes(session, "one stream on 2 stages") == [
        "speculation: speed (--speculate auto: one stream on 2 stages)", "exit head: trained", draft_gate_note(options)]
    options.min_acceptance = 0.3  # --min-acceptance given: no gate note, as on stderr
    session.model.predictor_note = ""
    assert launch.speculation_notes(session) == []
