"""The `launch` job: submit prompts to a running session, stream or collect, and report stats.

Owns the JSON report of `launch --json` (outputs; overall tokens/s, TTFT, TPOT and ITL percentiles,
acceptance (null when no draft was verified); per stage busy / useful / wasted / idle (bubble)
fractions from the timeline, RSS and weight memory; the handoff latencies (pipeline/measure/handoffs.py); the item timeline itself with
`timeline=True`).
Must not: start or stop processes (PipelineSession does).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.backends.placement import usable_cpus
from launcher.cli.cpu_meter import MAX_FOREIGN, CpuMeter
from launcher.cli.parsing import UsageError
from launcher.coordinator.request_handle import NoTokenLeftError, TextOptions
from launcher.coordinator.session import PipelineSession
from pipeline.engine.records import SpecCounters
from pipeline.measure.handoffs import handoff_latency, plain_decode_estimate
from pipeline.measure.metrics import inter_token_gaps_s, latency_summary
from pipeline.speculation.sampling import SamplingParams


def openai_finish_reason(reason) -> str:
    """The finish reason as OpenAI and vLLM name it: EOS and stop strings are both `stop`."""
    value = getattr(reason, "value", reason)
    return "stop" if value == "eos" else value


BUSY_SLACK = 0.25  # load above the CPUs that still counts as a quiet host (this run's coordinator)

def run_launch(session: PipelineSession, prompts: Sequence[str] | Sequence[Sequence[int]],
               params: Sequence[SamplingParams], *, stream: bool = False, timeline: bool = False,
               speculate_reason: str = "", text: TextOptions = TextOptions()) -> dict:
    """Run all prompts concurrently; returns {"outputs": [...], "stats": {...}} (see README).
    prompts: texts or token-id lists; timeline: also return the recorded slices under "timeline"
    (stage, start/end ns relative to the run's start, items with seq, positions, epoch, kind, outcome);
    speculate_reason: why `--speculate auto` chose the session's mode ("" when the user chose it); text: how
    the tokens become text (--no-skip-special-tokens, --include-stop-str-in-output);
    stats "speculate" is the mode in force, "speculate_reason" this reason (null when "")."""
    coord = session.coordinator
    coord.reset_stats()
    meter = CpuMeter()  # [Note: foreign load]: other work on this host during the run
    meter.start()
    start_ns = time.perf_counter_ns()
    handles = [coord.submit(p, sp, text=text) for p, sp in zip(prompts, params, strict=True)]
    if stream:
        sys.stdout.write(handles[0].prompt)
        try:  # a failed request raises here, after the text before its failure
            for chunk in handles[0]:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        finally:
            sys.stdout.write("\n")
    results = [h.result(raise_request_error=False) for h in handles]  # one failed request: the others still count
    end_ns = time.perf_counter_ns()
    foreign = meter.foreign_fraction() if session.processes is not None else None  # local stages only
    wall_s = (end_ns - start_ns) / 1e9
    times, spec = coord.timeline, coord.spec
    stages = _stage_rows(session, times.fractions(start_ns, end_ns) if coord.record_timeline else None)
    idle = [s["idle_fraction"] for s in stages]
    summary = latency_summary(num_tokens=[len(r.token_ids) for r in results], ttft_s=[r.ttft_s for r in results],
                              e2e_s=[r.e2e_s for r in results], wall_s=wall_s,
                              itl_s=inter_token_gaps_s(coord.commit_events))
    report = {
        "outputs": [{"prompt": r.prompt, "text": r.text, "token_ids": r.token_ids,
                     "finish_reason": openai_finish_reason(r.finish_reason),
                     "ttft_s": round(r.ttft_s, 4), "e2e_s": round(r.e2e_s, 4),
                     **({"error": str(h.error)} if h.error is not None else {}),
                     **({"error_param": h.error.param} if isinstance(h.error, NoTokenLeftError) else {})}
                    for r, h in zip(results, handles, strict=True)],
        "stats": {"wall_s": round(wall_s, 4), **summary, "speculate": session.options.speculate,
                  "speculate_reason": speculate_reason or None,
                  "bubble_fraction": round(sum(idle) / len(idle), 4),
                  **speculation_stats(spec),
                  **coord.tree.to_json(),
                  "timeline_recorded": coord.record_timeline,
                  "foreign_cpu_fraction": None if foreign is None else round(foreign, 3),
                  **times.draft_gap(0), "stages": stages},
    }
    if coord.record_timeline:
        report["stats"]["handoffs"] = handoff_latency(times.slices, len(stages))
    report["stats"].update(_speedup_estimate(session, results, foreign))
    report["stats"]["speculation"] = speculation_summary(report["stats"],
                                                         notes=speculation_notes(session, speculate_reason))
    if timeline:
        report["timeline"] = times.to_json(start_ns, end_ns, commits=coord.commit_events)
    return report


def speculation_stats(spec: SpecCounters) -> dict:
    """The speculation counters of a run as `launch --json` reports them. `acceptance_rate` is
    accepted / verified drafts, rounded, and null (None) when no draft was verified (plain decode, or
    every draft gated or squashed before its check): such a run has no rate, and a 0.0 would be
    averaged in as "every draft rejected" (vLLM's spec-decode metrics leave it out too)."""
    return {"acceptance_rate": round(spec.acceptance_rate, 4) if spec.verified_drafts else None,
            "drafted_tokens": spec.drafted_tokens,
            "verified_drafts": spec.verified_drafts, "accepted_tokens": spec.accepted_tokens,
            "squashed_items": spec.squashed_items, "gated_drafts": spec.gated_drafts,
            "stage_drafted": spec.stage_drafted, "withdrawn_drafts": spec.withdrawn_drafts,
            "fed_items": spec.fed_items, "fed_withdrawn": spec.fed_withdrawn,  # pipeline/engine/decode_feed.py
            "firp_drafted": spec.firp_drafted, "firp_verified": spec.firp_verified,
            "firp_accepted": spec.firp_accepted, "tokens_per_pass": round(spec.tokens_per_pass, 4),
            "exit_rows": spec.exit_rows, "exit_rows_skipped": spec.exit_rows_skipped,
            # [Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py
            "grammar_forced": spec.grammar_forced, "grammar_replaced": spec.grammar_replaced,
            "grammar_dropped": spec.grammar_dropped, "grammar_jump_tokens": spec.grammar_jump_tokens,
            # their share of verified_drafts / accepted_tokens (always accepted: acceptance_rate less them is SPEED's and FIRP's)
            "jump_verified": spec.jump_verified, "jump_accepted": spec.jump_accepted,
            # [Note: speculation under load] in pipeline/engine/row_budget.py
            "spec_disabled_steps": spec.spec_disabled_steps}


def speculation_notes(session: PipelineSession, speculate_reason: str = "") -> list[str]:
    """The notes on speculation that `launch` prints on stderr before a run without --json (why
    `--speculate auto` chose the mode, what the exit head is, the draft gate in force), in that order."""
    from launcher.cli.speculation_defaults import draft_gate_note

    options, notes = session.options, []
    if speculate_reason:
        notes.append(f"speculation: {options.speculate} (--speculate auto: {speculate_reason})")
    if session.model.predictor_note:
        notes.append(session.model.predictor_note)
    if options.uses_speed and options.min_acceptance is None:
        notes.append(draft_gate_note(options))
    return notes


def speculation_text(stats: dict) -> str:
    """The speculation part of the summary line (acceptance, squashes, tokens per pass; the speed-up
    estimate; token trees), parts joined by "; "; "" when the run drafted nothing and has no estimate.
    stats: `launch --json`'s."""
    parts = []
    if stats["drafted_tokens"]:
        rate = stats["acceptance_rate"]  # None: no draft was verified
        parts.append(f"acceptance {'-' if rate is None else f'{rate:.0%}'} ({stats['accepted_tokens']}/"
                     f"{stats['verified_drafts']} drafts), {plural(stats['squashed_items'], 'item')} squashed, "
                     f"{stats['tokens_per_pass']:.2f} tokens per pass")
    if stats.get("speedup_estimate"):
        head = ", exit head included" if stats["estimate_includes_exit_head"] else ""
        parts.append(f"about {stats['speedup_estimate']:.2f}x plain decode (estimated from this run's passes{head})")
    jump = stats.get("grammar_jump_tokens")  # (sent rows: a riding run counts no forced draft item)
    if stats.get("grammar_forced") or stats.get("grammar_replaced") or stats.get("grammar_dropped") or jump:
        parts.append(f"grammar drafts: {stats['grammar_forced']} forced, {stats['grammar_replaced']} replaced, "
                     f"{stats['grammar_dropped']} dropped" + (f", {jump} jump-forward rows" if jump else ""))
    if stats.get("tree_verified"):
        parts.append(f"tree acceptance {stats['tree_acceptance']:.0%} ({stats['tree_hits']}/{stats['tree_verified']}), "
                     f"{plural(stats['rescues'], 'rescue')}, {stats['rows_per_tree_draft']:.2f} rows per tree draft")
    return "; ".join(parts)


def speculation_summary(stats: dict, *, notes: Sequence[str] = ()) -> dict:
    """`launch --json`'s stats["speculation"]: what the human output says about speculation, as data.
    mode; acceptance_rate (accepted / verified drafts; null when none was verified); drafts_sent,
    drafts_verified, drafts_committed (accepted), drafts_rejected (verified, not accepted);
    items_squashed; tokens_per_pass (committed tokens per verifying result); speedup_estimate
    (null where none is given, `_speedup_estimate`); summary (`speculation_text`, null when empty);
    notes (`speculation_notes`)."""
    return {"mode": stats.get("speculate"), "acceptance_rate": stats["acceptance_rate"],
            "drafts_sent": stats["drafted_tokens"], "drafts_verified": stats["verified_drafts"],
            "drafts_committed": stats["accepted_tokens"],
            "drafts_rejected": stats["verified_drafts"] - stats["accepted_tokens"],
            "items_squashed": stats["squashed_items"], "tokens_per_pass": stats["tokens_per_pass"],
            "speedup_estimate": stats.get("speedup_estimate"), "summary": speculation_text(stats) or None,
            "notes": list(notes)}


def _stage_rows(session: PipelineSession, fractions) -> list[dict]:
    """Per stage: busy / useful / wasted / idle fractions (from the timeline's `fractions`, or, with
    none, busy from the stage's own counters), its layers, RSS and weight memory."""
    rows = []
    for i, (st, r) in enumerate(zip(session.coordinator.stage_stats(), session.model.ranges, strict=True)):
        if fractions is not None:
            row = fractions[i].to_json()
        else:  # no timeline: busy from the stage's own counters, no useful/wasted split
            busy = st.busy_ns / (st.wall_ns or 1)
            row = {"stage": i, "busy_fraction": round(busy, 4), "idle_fraction": round(1 - busy, 4)}
        rows.append({**row, "layers": [r.start, r.stop], "rss_mb": round(st.rss_bytes / 2**20, 1),
                     "weights_mb": round(st.weights_bytes / 2**20, 2)})
    return rows


def _speedup_estimate(session: PipelineSession, results, foreign: float | None) -> dict:
    """`plain_tpot_ms_estimate`, `speedup_estimate` (over it) and `estimate_includes_exit_head` of a
    single speculative sequence, from the timeline; {} where [Note: plain decode estimate] (in
    pipeline/measure/handoffs.py) says it would mislead: stages sharing CPUs, several nodes, a busy
    host (other work took more than MAX_FOREIGN of the CPU during the run, `foreign`, or the load
    average is above the CPUs: `_host_busy`), several sequences."""
    options, coord = session.options, session.coordinator
    if (options.speculate == "none" or len(results) != 1 or not coord.record_timeline
            or len(results[0].token_ids) < 2 or options.placement.multi_node
            or options.parallel_stages < options.num_stages or foreign is None or foreign > MAX_FOREIGN
            or _host_busy()):
        return {}
    exit_stage = session.model.exit_stage if options.needs_exit_head else None
    est = plain_decode_estimate(coord.timeline.slices, len(session.model.ranges), exit_stage=exit_stage,
                                exit_head_ms=session.exit_head_ms)
    tpot_ms = (results[0].e2e_s - results[0].ttft_s) / (len(results[0].token_ids) - 1) * 1e3
    if est is None or tpot_ms <= 0:
        return {}
    return {"plain_tpot_ms_estimate": est["plain_tpot_ms"], "speedup_estimate": round(est["plain_tpot_ms"] / tpot_ms, 3),
            "estimate_includes_exit_head": est["exit_head_included"]}


def _host_busy() -> bool:
    """Whether other work competed for this host's CPUs: the 1-minute load average (this run's
    stages included) above the CPUs + BUSY_SLACK. Measured on 2 vCPUs: at loads of 1.9–2.9 a
    `speed` run was 0.57x `none` while the estimate said 1.17–1.26x (the passes it prices were
    slowed by the contention that speculation's extra compute adds to)."""
    if not hasattr(os, "getloadavg"):
        return False
    return os.getloadavg()[0] > usable_cpus() + BUSY_SLACK


def trace_events(session: PipelineSession) -> dict:
    """The session's stage timeline as Chrome trace-event JSON (pipeline/measure/trace.py)."""
    from pipeline.measure.trace import chrome_trace

    coord = session.coordinator
    return chrome_trace(coord.timeline, commits=list(coord.commit_events))


def write_trace(trace: dict, path: str) -> None:
    """Write `trace` (trace_events) to `path`, creating its folder. `launch` calls it after the
    results are printed, so that a failed write loses no output. Raises UsageError (one line naming
    --trace) when the file cannot be written (the path was checked before the run: a full disk, a
    folder removed meanwhile)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(trace))
    except OSError as exc:
        raise UsageError(f"--trace {path}: the trace could not be written ({exc.strerror or exc})") from None


def plural(n: int, word: str) -> str:
    """`1 item`, `2 items`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_report(report: dict, *, streamed: bool) -> None:
    """The outputs (unless one was streamed) on stdout, then the one-line summary on stderr: tokens,
    tokens/s, stage busy fractions and handoffs, acceptance, the speed-up estimate, token trees."""
    if not streamed:
        for i, out in enumerate(report["outputs"]):
            print(f"=== [{i}] {out['prompt']}")
            print(out["text"])
    stats = report["stats"]
    busy = ", ".join(f"{s['stage']}: {s['busy_fraction']:.0%}" for s in stats["stages"])
    ring = stats.get("handoffs", {}).get("ring_return", {})
    if ring.get("count"):
        links = "/".join(f"{h['p50_ms']:.1f}" for h in stats["handoffs"]["stage_handoff"])
        busy += f" ({'handoff p50 ' + links + ' ms, ' if links else ''}ring return p50 {ring['p50_ms']:.1f} ms)"
    spec = speculation_text(stats)
    spec = f"; {spec}" if spec else ""
    print(f"[speedpipe] {stats['generated_tokens']} tokens in {stats['wall_s']:.2f} s "
          f"({stats['tokens_per_s']:.1f} tokens/s); stage busy {busy}{spec}", file=sys.stderr)
