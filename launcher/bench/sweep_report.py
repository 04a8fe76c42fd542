"""`speedpipe bench sweep`'s outputs: the summary of the measured runs and where it is written.

Owns the per-configuration summary (medians and min/max over repeats of METRICS, per-stage
fractions, paired tokens/s ratios), the acceptance rule (only runs that verified drafts have a rate:
`acceptance_samples`), and results.json (strict JSON), results.csv, the table on stdout and the
plots. Must not: start drivers or decide what is measured (launcher/bench/sweep.py).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.cli.cpu_meter import MAX_FOREIGN
from launcher.cli.output_paths import dumps_strict
from pipeline.speculation.predictors import is_predictor_file

if TYPE_CHECKING:
    import argparse

    from launcher.bench.sweep import BenchConfig

METRICS = ("tokens_per_s", "bubble_fraction", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "acceptance_rate")


def predictor_label(predictor: str) -> str:
    """A predictor as configuration names and plots show it: a trained file by its stem."""
    return Path(predictor).stem if is_predictor_file(predictor) else predictor


def spread(values: Sequence[float]) -> dict:
    """Median, min, max of the repeats."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0, "samples": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": list(values)}


def acceptance_samples(runs: Sequence[dict]) -> list[float]:
    """The acceptance rates of the runs that verified drafts. A run that verified none has no rate
    (`launch --json` reports null; results.json of older versions 0.0): it is left out, not averaged
    in as 0, in the table, results.csv, results.json and plots/acceptance.png alike."""
    return [r["stats"]["acceptance_rate"] for r in runs
            if r["stats"].get("verified_drafts", 0) > 0 and r["stats"]["acceptance_rate"] is not None]


def pooled_acceptance(runs: Sequence[dict]) -> float | None:
    """α of a set of runs as ARCHITECTURE.md §1 defines it: all their accepted drafts over all their
    verified drafts (a median of per-run rates gives a run that verified 1 draft the weight of one
    that verified 400); None when no run verified a draft."""
    verified = sum(r["stats"].get("verified_drafts", 0) for r in runs)
    return sum(r["stats"].get("accepted_tokens", 0) for r in runs) / verified if verified else None


def _metric_spread(metric: str, runs: Sequence[dict]) -> dict:
    """spread() of one METRICS entry over the runs; acceptance over acceptance_samples only, with
    median/min/max None where no run verified a draft, plus `pooled` (pooled_acceptance)."""
    if metric != "acceptance_rate":
        return spread([r["stats"][metric] for r in runs])
    samples = acceptance_samples(runs)
    per_run = spread(samples) if samples else {"median": None, "min": None, "max": None, "samples": []}
    return {**per_run, "pooled": pooled_acceptance(runs)}


def summarise(configs: list[BenchConfig], runs: dict[str, list[dict]]) -> list[dict]:
    """Per configuration: medians and spread of METRICS, per-stage fractions, and paired ratios of
    tokens/s (within a repeat) over the first configuration and over its plain counterpart
    (same stages and concurrency, --speculate none)."""
    base = configs[0].name
    out = []
    for cfg in configs:
        rs = runs[cfg.name]
        row = {"name": cfg.name, **dataclasses.asdict(cfg), "repeats": len(rs),
               "summary": {m: _metric_spread(m, rs) for m in METRICS},
               "stages_fractions": [{k: statistics.median(r["stats"]["stages"][i][k] for r in rs)
                                     for k in ("busy_fraction", "useful_fraction", "wasted_fraction", "idle_fraction")
                                     if k in rs[0]["stats"]["stages"][i]} for i in range(cfg.stages)],
               "runs": rs}
        pairs = {"vs_first": base}
        plain = dataclasses.replace(cfg, speculate="none", predictor="-").name
        if cfg.speculate != "none" and plain in runs:
            pairs["vs_plain"] = plain
        for key, other in pairs.items():
            ratios = [a["stats"]["tokens_per_s"] / b["stats"]["tokens_per_s"]
                      for a, b in zip(rs, runs[other], strict=True) if b["stats"]["tokens_per_s"] > 0]
            row[f"ratio_{key}"] = {"of": other, **spread(ratios)}
        out.append(row)
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    """One line per configuration: identity, repeats, median/min/max of every metric (empty where a
    configuration has none: acceptance without a verified draft), ratios."""
    header = ["name", "stages", "speculate", "predictor", "concurrency", "repeats"]
    header += [f"{m}_{k}" for m in METRICS for k in ("median", "min", "max")]
    header += ["acceptance_rate_pooled", "ratio_vs_first_median", "ratio_vs_plain_median"]
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")  # (csv's default is \r\n)
        w.writerow(header)
        for r in rows:
            w.writerow([r["name"], r["stages"], r["speculate"], r["predictor"], r["concurrency"], r["repeats"]]
                       + [_cell(r["summary"][m][k]) for m in METRICS for k in ("median", "min", "max")]
                       + [_cell(r["summary"]["acceptance_rate"]["pooled"])]
                       + [round(r[k]["median"], 4) if k in r else "" for k in ("ratio_vs_first", "ratio_vs_plain")])


def _cell(value: float | None) -> float | str:
    """A results.csv cell: the value rounded, or empty for None (no value: acceptance without drafts)."""
    return "" if value is None else round(value, 6)


def write_plots(rows: list[dict], out: Path, *, title: str) -> list[str]:
    """Gantt chart per configuration (its first repeat), summary bars, acceptance per predictor."""
    from launcher.bench import plots

    made = []
    for r in rows:
        timeline = json.loads(Path(out / r["runs"][0]["timeline"]).read_text())
        made.append(plots.gantt(timeline, out / "plots" / f"gantt_{r['name']}.png",
                                title=f"{r['name']}: {title}, repeat 0"))
    made.append(plots.summary_bars(rows, out / "plots" / "summary.png", title=title))
    runs_by_pred: dict[str, list[dict]] = {}
    for r in rows:  # runs that verified no draft have no acceptance rate: left out (acceptance_samples)
        if r["speculate"] != "none":
            runs_by_pred.setdefault(predictor_label(r["predictor"]), []).extend(r["runs"])
    by_pred = {k: {**spread(acceptance_samples(v)), "pooled": pooled_acceptance(v)}
               for k, v in runs_by_pred.items() if acceptance_samples(v)}
    made.append(plots.acceptance_bars(by_pred, out / "plots" / "acceptance.png"))
    return [str(Path(p).relative_to(out)) for p in made]


def _code_version() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_results(args: argparse.Namespace, configs: list[BenchConfig], runs: dict[str, list[dict]],
                  notes: list[str], out: Path, *, partial: bool = False) -> None:
    """results.json, results.csv and (unless `partial`: Ctrl-C stopped the sweep) the plots under
    `out`; the table on stdout."""
    rows = summarise(configs, runs)
    title = f"{Path(args.model).name}, {args.max_new_tokens} tokens"
    plots = [] if args.no_plots or partial else write_plots(rows, out, title=title)
    settings = {k: getattr(args, k) for k in ("stages", "speculate", "predictor", "concurrency", "prompts",
                                              "max_new_tokens", "repeats", "model", "dtype", "quantization", "dense_layout",
                                              "threads_per_stage")}
    (out / "results.json").write_text(dumps_strict({"settings": settings, "code": _code_version(), "notes": notes,
                                                    "partial": partial, "configs": rows, "plots": plots}, indent=1))
    write_csv(rows, out / "results.csv")
    print(format_table(rows))
    busy = busy_runs(rows)
    if busy:
        print(f"[speedpipe] bench: {len(busy)} run(s) shared the CPU with other work (foreign_cpu_fraction above "
              f"{MAX_FOREIGN:.0%}, e.g. {busy[0]}): their times and ratios are suspect; rerun on a quiet host",
              file=sys.stderr)
    print(f"[speedpipe] bench: results in {out}/results.json, results.csv" + (", plots/*.png" if plots else ""),
          file=sys.stderr)


def write_partial(args: argparse.Namespace, configs: list[BenchConfig], runs: dict[str, list[dict]],
                  notes: list[str], out: Path) -> None:
    """After Ctrl-C: results.json and results.csv of the repeats that ran every configuration (so
    ratios stay paired), marked `"partial": true`, without plots; or, if no repeat completed, a
    line saying that nothing was written. Runs of an unfinished repeat keep their runs/ files only."""
    done = min(len(rs) for rs in runs.values())
    if done == 0:
        print(f"[speedpipe] bench: interrupted before a repeat completed; no results written to {out}",
              file=sys.stderr)
        return
    kept = {name: rs[:done] for name, rs in runs.items()}
    print(f"[speedpipe] bench: interrupted; writing the {done} of {args.repeats} completed repeat(s) as partial "
          f"results (no plots)", file=sys.stderr)
    write_results(args, configs, kept, notes, out, partial=True)


def busy_runs(rows: list[dict]) -> list[str]:
    """`<config> repeat <r>: <fraction>` for each run during which other work took more than
    MAX_FOREIGN of the CPU (launcher/cli/cpu_meter.py; runs without the field are not judged)."""
    return [f"{r['name']} repeat {run['repeat']}: {run['stats']['foreign_cpu_fraction']:.0%}" for r in rows
            for run in r["runs"] if (run["stats"].get("foreign_cpu_fraction") or 0.0) > MAX_FOREIGN]


def format_table(rows: list[dict]) -> str:
    """The results table for stdout: one line per configuration; acceptance `-` where none was verified."""
    lines = [f"{'configuration':<24} {'tokens/s':>22} {'bubble':>7} {'TTFT ms':>8} {'TPOT ms':>8} {'accept':>7} "
             f"paired tokens/s ratio"]
    for r in rows:
        s = r["summary"]
        tps = s["tokens_per_s"]
        ratio = r.get("ratio_vs_plain") or r["ratio_vs_first"]
        accept = s["acceptance_rate"]["pooled"]  # None: no run verified a draft
        lines.append(f"{r['name']:<24} {tps['median']:8.2f} [{tps['min']:5.1f}-{tps['max']:5.1f}] "
                     f"{s['bubble_fraction']['median']:7.2f} {s['ttft_ms_p50']['median']:8.1f} "
                     f"{s['tpot_ms_p50']['median']:8.1f} {'-' if accept is None else f'{accept:.2f}':>7} "
                     f"{ratio['median']:6.3f} vs {ratio['of']}")
    return "\n".join(lines)
