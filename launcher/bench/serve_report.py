"""Measurements and the summary of `speedpipe bench serve`, in vLLM's `bench serve` layout.

Owns one request's record (`RequestOutput`), the metric definitions, the JSON result (vLLM's field
names: `completed`, `total_input_tokens`, `request_throughput`, `mean_ttft_ms`, `median_itl_ms`,
`p99_e2el_ms`, ...) and the text block vLLM users know. Must not: send requests.

Definitions (as vLLM's benchmarks/serve): TTFT = request sent -> first generated text; ITL = the
gaps between successive streamed chunks of one request (all requests pooled); TPOT = (E2EL - TTFT)
/ (output tokens - 1), per request with more than one output token; E2EL = request sent -> stream
closed. Output tokens: the usage chunk's `completion_tokens`, else the number of text chunks.
Percentiles: numpy's linear interpolation; median = the 50th percentile. `launch --json`, `bench
sweep` and the server's histograms use the same definitions ([Note: latency metrics] in
pipeline/measure/metrics.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                 "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


@dataclasses.dataclass
class RequestOutput:
    """One request's measurements (seconds). ok=False with `error` when it failed."""

    ok: bool
    sent_s: float = 0.0  # perf_counter when the request was sent
    prompt_len: int = 0
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else None


def parse_metric_list(text: str, *, flag: str = "--percentile-metrics") -> list[str]:
    """"ttft,tpot" -> ["ttft", "tpot"]. Raises ValueError naming the flag and the allowed names."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if not names or bad:
        raise ValueError(f"{flag} {text!r}: choose from {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0]. Raises ValueError naming --metric-percentiles."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: expected comma-separated numbers in (0, 100]")
    return values


def _label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def metric_values_ms(outputs: list[RequestOutput], metric: str) -> list[float]:
    """All samples of one metric over the successful requests, in milliseconds."""
    ok = [o for o in outputs if o.ok]
    if metric == "ttft":
        return [o.ttft_s * 1e3 for o in ok]
    if metric == "tpot":
        return [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None]
    if metric == "itl":
        return [g * 1e3 for o in ok for g in o.itl_s]
    return [o.latency_s * 1e3 for o in ok]


def summarize(outputs: list[RequestOutput], *, duration_s: float, metrics: list[str],
              percentiles: list[float]) -> dict:
    """vLLM's result fields for the run (see the module docstring). duration_s > 0."""
    ok = [o for o in outputs if o.ok]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    sent = sorted(o.sent_s for o in outputs)
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    result = {
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "measured_request_rate": (len(sent) - 1) / span if span > 0 else None,
    }
    for m in metrics:
        values = metric_values_ms(outputs, m) or [0.0]
        result[f"mean_{m}_ms"] = float(np.mean(values))
        result[f"median_{m}_ms"] = float(np.median(values))
        result[f"std_{m}_ms"] = float(np.std(values))
        for p in percentiles:
            result[f"p{_label(p)}_{m}_ms"] = float(np.percentile(values, p))
    result["input_lens"] = [o.prompt_len for o in outputs]
    result["output_lens"] = [o.output_len for o in outputs]
    result["ttfts"] = [o.ttft_s for o in outputs]
    result["itls"] = [o.itl_s for o in outputs]
    result["generated_texts"] = [o.generated_text for o in outputs]
    result["errors"] = [o.error for o in outputs]
    return result


def format_block(result: dict, *, metrics: list[str], percentiles: list[float], request_rate: float,
                 max_concurrency: int | None) -> str:
    """The text summary, line for line as vLLM's `bench serve` prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value, fmt: str = "") -> None:
        lines.append(f"{name:<40} {format(value, fmt) if value is not None else 'n/a':<10}")

    row("Successful requests:", result["completed"])
    if result["failed"]:
        row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", request_rate, ".2f")
    row("Request rate measured (RPS):", result["measured_request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for m in metrics:
        title, short = METRIC_TITLES[m]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{m}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{m}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_label(p)} {short} (ms):", result[f"p{_label(p)}_{m}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
