"""Per-run records of a bench sweep: each run's timeline in a compact, lossless form, in timelines.json.

Owns the record format (`compact_timeline` / `expand_timeline`, [Note: timeline record]), the file
of every run's record beside results.json (`write_records`, RECORDS_FILE: one line per run), and
reading the measured runs of a results.json back with their timelines (`load_bench_runs`): from
the records, or from runs/ for sweeps written before records existed. With the records, a committed
study is re-calibrated from results.json and timelines.json alone (`simulate --calibrate`,
`tests/benchmarks/throughput_study.py --recalibrate-from`), without its runs/ folder of traces.
Must not: fit or simulate (pipeline/measure/calibrate.py, pipeline/engine/simulator.py).

[Note: timeline record]
A run's timeline JSON (`Timeline.to_json`: start/end ns, stages, slices with their items, commits)
is what calibration reads, and it is verbose: every slice and item repeats its field names. The
record keeps every value and drops the names, with times as ns offsets from the run's start:

    {"format": RECORD_FORMAT, "start_ns", "end_ns", "num_stages", "kinds": [kind names],
     "slices": [[stage, batch, start_off_ns, end_off_ns, useful_share,
                 [[seq_id, first_pos, end_pos, epoch, kind_index, committed 0|1, {extras}?], ...]], ...],
     "commits": [[time_off_ns, seq_id, token], ...]}

`extras` holds an item's optional fields (`num_pseudo`, `want_exit`, `siblings`) and is left out
when it has none. `expand_timeline(compact_timeline(t)) == t` for every timeline `bench` writes;
a field this format does not know is a ValueError, never dropped. About a third of the timeline's size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pipeline.run_config import RunConfig

RECORD_FORMAT = "speedpipe-timeline-record/1"
RECORDS_FILE = "timelines.json"  # beside results.json
_TIMELINE_KEYS = {"start_ns", "end_ns", "num_stages", "slices", "commits"}
_SLICE_KEYS = {"stage", "batch", "start_ns", "end_ns", "useful_share", "items"}
_ITEM_KEYS = {"seq_id", "positions", "epoch", "kind", "outcome"}
_ITEM_EXTRAS = {"num_pseudo", "want_exit", "siblings"}
_OUTCOMES = ("squashed", "committed")  # index = the record's committed flag


def _unknown(what: str, keys, known) -> None:
    extra = sorted(set(keys) - set(known))
    if extra:
        raise ValueError(f"timeline record: {what} has fields the record format does not keep: {', '.join(extra)}")


def compact_timeline(timeline: dict) -> dict:
    """The record of one timeline (`Timeline.to_json` form; [Note: timeline record]). Raises
    ValueError for a field or outcome the format does not keep (nothing is dropped silently)."""
    _unknown("the timeline", timeline, _TIMELINE_KEYS)
    t0 = timeline["start_ns"]
    kinds: list[str] = []
    slices = []
    for s in timeline["slices"]:
        _unknown("a slice", s, _SLICE_KEYS)
        items = []
        for it in s["items"]:
            _unknown("an item", it, _ITEM_KEYS | _ITEM_EXTRAS)
            if it["outcome"] not in _OUTCOMES:
                raise ValueError(f"timeline record: item outcome {it['outcome']!r} is not one of {', '.join(_OUTCOMES)}")
            if it["kind"] not in kinds:
                kinds.append(it["kind"])
            row = [it["seq_id"], *it["positions"], it["epoch"], kinds.index(it["kind"]), _OUTCOMES.index(it["outcome"])]
            extras = {k: it[k] for k in sorted(_ITEM_EXTRAS) if k in it}
            items.append(row + [extras] if extras else row)
        slices.append([s["stage"], s["batch"], s["start_ns"] - t0, s["end_ns"] - t0, s["useful_share"], items])
    return {"format": RECORD_FORMAT, "start_ns": t0, "end_ns": timeline["end_ns"], "num_stages": timeline["num_stages"],
            "kinds": kinds, "slices": slices,
            "commits": [[c[0] - t0, *c[1:]] for c in timeline.get("commits", ())]}


def expand_timeline(record: dict) -> dict:
    """The timeline JSON (`Timeline.to_json` form) of a record. Raises ValueError for another format."""
    if record.get("format") != RECORD_FORMAT:
        raise ValueError(f"timeline record: format {record.get('format')!r}, expected {RECORD_FORMAT!r}")
    t0, kinds = record["start_ns"], record["kinds"]
    slices = []
    for stage, batch, start, end, share, items in record["slices"]:
        rows = []
        for row in items:
            seq_id, first, stop, epoch, kind, committed = row[:6]
            rows.append({"seq_id": seq_id, "positions": [first, stop], "epoch": epoch, "kind": kinds[kind],
                         "outcome": _OUTCOMES[committed], **(row[6] if len(row) > 6 else {})})
        slices.append({"stage": stage, "batch": batch, "start_ns": start + t0, "end_ns": end + t0,
                       "useful_share": share, "items": rows})
    return {"start_ns": t0, "end_ns": record["end_ns"], "num_stages": record["num_stages"], "slices": slices,
            "commits": [[c[0] + t0, *c[1:]] for c in record["commits"]]}


def write_records(runs: Iterable[dict], folder: Path) -> Path:
    """Write folder/RECORDS_FILE: the record of each of `runs` (bench runs, each with its runs/
    timeline path under "timeline", relative to `folder`), keyed by that path, one line per run.
    Returns the path. Raises OSError for a missing timeline file, ValueError as `compact_timeline`."""
    lines = []
    for run in runs:
        record = compact_timeline(json.loads((folder / run["timeline"]).read_text()))
        lines.append(f"{json.dumps(run['timeline'])}:{json.dumps(record, separators=(',', ':'))}")
    path = folder / RECORDS_FILE
    body = ",\n".join(lines)
    path.write_text(f'{{"format":{json.dumps(RECORD_FORMAT)},"records":{{\n{body}}}}}\n')
    return path


def read_records(folder: Path) -> dict[str, dict]:
    """The records of folder/RECORDS_FILE by timeline path; {} when there is no such file. Raises
    ValueError for another format, OSError or json.JSONDecodeError for an unreadable file."""
    path = folder / RECORDS_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {RECORD_FORMAT!r}")
    return data["records"]


def run_timeline(run: dict, folder: Path, records: dict[str, dict]) -> dict:
    """One run's timeline: from its record in `records` (read_records), else from its runs/ file
    under `folder`. Raises FileNotFoundError (neither), ValueError for a bad record."""
    if run["timeline"] in records:
        return expand_timeline(records[run["timeline"]])
    return json.loads((folder / run["timeline"]).read_text())


def load_bench_runs(path: str | Path, *, flag: str = "--calibrate") -> list[dict]:
    """Every measured run of a bench results.json with its timeline (`run_timeline`), as
    pipeline.measure.calibrate.calibrate takes them. Raises ValueError naming `flag` and the file:
    not a results.json, neither a record nor a runs/ file for a run, no runs."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        results = json.loads(path.read_text())
        records = read_records(path.parent)
        runs = []
        for cfg in results["configs"]:
            for run in cfg["runs"]:
                tl = run_timeline(run, path.parent, records)
                exit_head = (cfg["speculate"] != "none"  # a run without speculation records predictor "-"
                             and RunConfig(speculate=cfg["speculate"], predictor=cfg["predictor"] if cfg["predictor"] != "-"
                                           else "hybrid").needs_exit_head)
                runs.append({"config": cfg["name"], "num_stages": cfg["stages"], "speculate": cfg["speculate"],
                             "exit_head": exit_head, "concurrency": cfg["concurrency"], "stats": run["stats"],
                             "num_tokens": run["num_tokens"], "timeline": tl})
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not a speedpipe bench results.json (it, or a timeline file of "
                         f"its runs/ folder, is not UTF-8 text)") from None
    except FileNotFoundError as exc:
        raise ValueError(f"{flag} {path}: no {RECORDS_FILE} beside it holds this run's timeline (a sweep "
                         f"written before records existed) and its runs/ file is not there ({exc.filename}): "
                         f"nothing to calibrate from") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as exc:
        raise ValueError(f"{flag} {path}: not a speedpipe bench results.json with its runs' timelines ({exc})") from None
    if not runs:
        raise ValueError(f"{flag} {path}: no measured runs")
    return runs
