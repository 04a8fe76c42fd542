"""PNG plots of throughput studies (matplotlib, Agg backend): Gantt charts, summary bars, sweeps.

Owns the look of every figure `bench` and `simulate` write: a pipeline Gantt chart (stages x time,
useful / wasted / partly wasted slices, idle gaps left blank on a grey track), bars of tokens/s and
bubble fraction per configuration, acceptance per predictor, and simulator sweep curves. Every
figure has a fixed size in pixels (FIG_PX) so tests can check the PNG. Inputs are the plain JSON
dicts of bench/simulate results. matplotlib is the `plots` extra: `pip install 'speedpipe[plots]'`.
Must not: run pipelines or compute metrics (pipeline/measure/timeline.py and pipeline/measure/metrics.py do).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

FIG_IN = (10.0, 4.0)
DPI = 100
FIG_PX = (int(FIG_IN[0] * DPI), int(FIG_IN[1] * DPI))
COLOURS = {"useful": "#2e7d32", "wasted": "#c62828", "partly": "#f9a825", "idle": "#eceff1"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'speedpipe[plots]' (or matplotlib), or pass --no-plots") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.set_size_inches(*FIG_IN)
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the pixel size stays FIG_PX
    fig.clf()
    _pyplot().close(fig)
    return path


def gantt(timeline: dict, path: str | Path, *, title: str, max_ms: float | None = None) -> Path:
    """Gantt chart of one run. timeline: {"start_ns", "end_ns", "num_stages", "slices": [{"stage",
    "start_ns", "end_ns", "useful_share"}, ...]} (the `launch`/`bench` timeline JSON). Time axis in ms
    from the run's start, cut at max_ms if given. Returns the path."""
    plt = _pyplot()
    fig, ax = plt.subplots()
    t0, num_stages = timeline["start_ns"], timeline["num_stages"]
    end_ms = (timeline["end_ns"] - t0) / 1e6 if max_ms is None else max_ms
    for stage in range(num_stages):
        ax.broken_barh([(0, end_ms)], (stage - 0.4, 0.8), facecolors=COLOURS["idle"])
    bars: dict[str, list] = {"useful": [], "wasted": [], "partly": []}
    for s in timeline["slices"]:
        start = (s["start_ns"] - t0) / 1e6
        if start > end_ms:
            continue
        share = s["useful_share"]
        key = "useful" if share >= 1.0 else "wasted" if share <= 0.0 else "partly"
        bars[key].append((s["stage"], start, max((s["end_ns"] - s["start_ns"]) / 1e6, 1e-3)))
    for key, rows in bars.items():
        for stage in range(num_stages):
            spans = [(start, dur) for st, start, dur in rows if st == stage]
            if spans:
                ax.broken_barh(spans, (stage - 0.4, 0.8), facecolors=COLOURS[key])
    ax.set_yticks(range(num_stages), [f"stage {i}" for i in range(num_stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms)
    ax.set_xlabel("time since submit (ms)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in ("useful", "partly", "wasted", "idle")]
    fig.legend(handles, ["useful (committed)", "partly squashed", "wasted (squashed)", "idle (bubble)"],
               loc="lower center", fontsize=8, ncols=4, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path)


def summary_bars(configs: Sequence[dict], path: str | Path, *, title: str = "") -> Path:
    """Bars of median tokens/s (whiskers: min..max over repeats) and median bubble fraction per
    configuration. configs: [{"name", "summary": {"tokens_per_s": {"median","min","max"},
    "bubble_fraction": {...}}}]."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2)
    names = [c["name"] for c in configs]
    x = range(len(configs))
    for ax, metric, label, colour in ((ax1, "tokens_per_s", "tokens/s", "#1565c0"),
                                      (ax2, "bubble_fraction", "bubble (idle) fraction", "#90a4ae")):
        med = [c["summary"][metric]["median"] for c in configs]
        lo = [m - c["summary"][metric]["min"] for m, c in zip(med, configs, strict=True)]
        hi = [c["summary"][metric]["max"] - m for m, c in zip(med, configs, strict=True)]
        several = [len(c["summary"][metric].get("samples", [0, 0])) > 1 for c in configs]
        ax.bar(x, med, yerr=_whiskers(lo, hi, several), color=colour, capsize=3)
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label)
    ax2.set_ylim(0, 1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _whiskers(lo: list[float], hi: list[float], several: list[bool]) -> list[list[float]] | None:
    """min..max whiskers, zeroed for bars measured once (one repeat has no spread to show)."""
    if not any(several):
        return None
    return [[v if s else 0.0 for v, s in zip(lo, several, strict=True)],
            [v if s else 0.0 for v, s in zip(hi, several, strict=True)]]


def percent_label(fraction: float) -> str:
    """`+12%`, `-3%`, and `0%` (never `-0%`) for a signed fraction."""
    value = round(fraction * 100)
    return "0%" if value == 0 else f"{value:+d}%"


def acceptance_bars(by_predictor: dict[str, dict], path: str | Path) -> Path:
    """Acceptance rate per predictor: {predictor: {"pooled", "median", "min", "max", "samples"}} (0..1):
    bars at the pooled rate (accepted / verified drafts of all its runs; the median where no pooled
    rate is given), whiskers from the lowest to the highest run, over the runs that verified at
    least one draft (a run that drafted nothing has no acceptance rate)."""
    plt = _pyplot()
    fig, ax = plt.subplots()
    names = list(by_predictor) or ["(no speculation)"]
    med = [by_predictor[n].get("pooled", by_predictor[n]["median"]) for n in by_predictor] or [0.0]
    lo = [m - by_predictor[n]["min"] for m, n in zip(med, by_predictor, strict=False)] or [0.0]
    hi = [by_predictor[n]["max"] - m for m, n in zip(med, by_predictor, strict=False)] or [0.0]
    several = [len(by_predictor[n].get("samples", [0, 0])) > 1 for n in by_predictor] or [False]
    ax.bar(range(len(names)), med, yerr=_whiskers(lo, hi, several), color="#6a1b9a", capsize=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1)
    ax.set_ylabel("acceptance rate (accepted / verified drafts)")
    ax.set_title("draft acceptance per predictor")
    fig.tight_layout()
    return _save(fig, path)


def sweep_lines(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str | Path, *, xlabel: str,
                ylabel: str, title: str, logx: bool = False, ylim: tuple[float, float] | None = None) -> Path:
    """One line per series: {label: (xs, ys)}."""
    plt = _pyplot()
    fig, ax = plt.subplots()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ticks = sorted({x for xs, _ in series.values() for x in xs})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # 1, 2, 4, 8 rather than 2^0 ... 2^3
        ax.minorticks_off()
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk. Raises ValueError if not a PNG."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def measured_vs_predicted(checks: Sequence[dict], path: str | Path) -> Path:
    """Side-by-side bars of measured and simulated tokens/s per configuration, error in the label.
    checks: [{"config", "measured_tokens_per_s", "predicted_tokens_per_s", "error"}]."""
    plt = _pyplot()
    fig, ax = plt.subplots()
    x = list(range(len(checks)))
    ax.bar([i - 0.2 for i in x], [c["measured_tokens_per_s"] for c in checks], 0.4, label="measured", color="#1565c0")
    ax.bar([i + 0.2 for i in x], [c["predicted_tokens_per_s"] for c in checks], 0.4, label="simulated",
           color="#ef6c00")
    ax.set_xticks(x, [f"{c['config']}\n{percent_label(c['error'])}" for c in checks], fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title("calibrated simulator vs measured (median over repeats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)
