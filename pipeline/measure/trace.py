"""Chrome / Perfetto trace export of a pipeline timeline (JSON trace-event format).

Owns turning `pipeline.measure.timeline.Timeline` slices and committed-token instants into the trace-event
JSON that chrome://tracing and ui.perfetto.dev load: one process ("pipeline"), one thread track per
stage plus one for the coordinator's commits, one complete ("X") event per micro-batch slice
(category = committed / squashed / partly squashed; args: each item's sequence, positions, epoch,
kind and outcome), and an
instant ("i") event per committed token. Times are microseconds from the first slice.
Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
Pure: builds a dict; the caller writes it.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.measure.timeline import Timeline

PID = 1
COMMIT_TID = 1000


def outcome(useful_share: float) -> str:
    """Slice category: all work committed, all squashed, or a mix."""
    if useful_share >= 1.0:
        return "committed"
    return "squashed" if useful_share <= 0.0 else "partly-squashed"


_COLOURS = {"committed": "good", "squashed": "terrible", "partly-squashed": "bad"}


def chrome_trace(timeline: Timeline, *, commits: Iterable[tuple[int, int, int]] = ()) -> dict:
    """Trace-event JSON object for `timeline`.

    commits: (time_ns, seq_id, token_id) of committed tokens, drawn as instant events.
    Raises nothing; an empty timeline gives a trace with only the track names.
    """
    slices = sorted(timeline.slices, key=lambda s: (s.start_ns, s.stage))
    commits = sorted(commits)
    t0 = min([s.start_ns for s in slices] + [c[0] for c in commits], default=0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "pipeline"}}]
    for stage in range(timeline.num_stages):
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": stage, "args": {"name": f"stage {stage}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": stage, "args": {"sort_index": stage}})
    events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": COMMIT_TID, "args": {"name": "commits"}})
    for s in slices:
        cat = outcome(s.useful_share)
        kinds = sorted({k.name.lower() for k in s.kinds})
        events.append({
            "name": "+".join(kinds) or "empty", "cat": cat, "ph": "X", "pid": PID, "tid": s.stage,
            "ts": (s.start_ns - t0) / 1e3, "dur": s.duration_ns / 1e3, "cname": _COLOURS[cat],
            "args": {"seq_ids": list(s.seq_ids), "kinds": kinds, "useful_share": round(s.useful_share, 3),
                     "items": [it.to_json() for it in s.items]},
        })
    for time_ns, seq_id, token in commits:
        events.append({"name": f"commit seq {seq_id}", "cat": "commit", "ph": "i", "s": "t", "pid": PID,
                       "tid": COMMIT_TID, "ts": (time_ns - t0) / 1e3, "args": {"seq_id": seq_id, "token_id": token}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
