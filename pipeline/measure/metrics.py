"""Run metrics: latency percentiles and the per-request / overall summary of a generation run.

Owns the definitions of the numbers every report uses (ARCHITECTURE.md §8), so `launch --json`,
`bench` and the simulator agree, and agree with `bench serve` (launcher/bench/serve_report.py) and
the server's Prometheus histograms: [Note: latency metrics]. Pure: numbers in, numbers out.

[Note: latency metrics]
One definition per name, vLLM's (its benchmarks/serve and its v1 metrics), in every tool:
- tokens/s = generated tokens / wall seconds (prefill included);
- TTFT = submit -> first token (launch, bench: first commit; bench serve: first streamed text);
- TPOT = (E2EL - TTFT) / (output tokens - 1) per request (requests with one token have none);
- ITL = the gaps between successive *chunks* of one request: tokens committed together (one
  result verifying several drafts, a FIRP chain) arrive in one streamed chunk and make one gap,
  not one gap per token plus zeros (`inter_token_gaps_s`). With speculation ITL is therefore not
  TPOT: TPOT spreads the decode time over the tokens, ITL is what a reader of the stream waits.
  Before this rule, `launch`/`bench` counted a gap per committed token (a 3-token commit gave
  gaps of x, 0, 0) while `bench serve` counted per chunk, so their `itl` disagreed under
  speculation; `speedpipe:inter_token_latency_seconds` observed every token's share of a gap.
- E2EL = submit -> last token (bench serve: stream closed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (NumPy's
    default); 0.0 for no values. Raises ValueError for q outside [0, 100]."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def inter_token_gaps_s(commits: Iterable[tuple[int, int, int]]) -> list[float]:
    """ITL samples of a commit log ([Note: latency metrics]): the gaps in seconds between successive
    commit events of each sequence, a commit event being the tokens of one sequence committed at
    one time (one streamed chunk). commits: (time_ns, seq_id, token), one per token, any order."""
    last: dict[int, int] = {}
    gaps = []
    for time_ns, seq_id in sorted({(t, s) for t, s, _ in commits}):
        if seq_id in last:
            gaps.append((time_ns - last[seq_id]) / 1e9)
        last[seq_id] = time_ns
    return gaps


def latency_summary(*, num_tokens: Sequence[int], ttft_s: Sequence[float], e2e_s: Sequence[float],
                    wall_s: float, itl_s: Sequence[float] = ()) -> dict:
    """Overall numbers of one run of concurrent requests (one entry per request in each list):
    tokens_per_s, ttft_ms_p50/p99, tpot_ms_p50/p99 and, when given, itl_ms_p50/p99 over the ITL
    samples `itl_s` of all requests ([Note: latency metrics])."""
    tpot = [(e - t) / (n - 1) for n, t, e in zip(num_tokens, ttft_s, e2e_s, strict=True) if n > 1]
    generated = sum(num_tokens)
    out = {"generated_tokens": generated, "tokens_per_s": round(generated / wall_s, 3) if wall_s > 0 else 0.0,
           "ttft_ms_p50": round(1e3 * percentile(ttft_s, 50), 3), "ttft_ms_p99": round(1e3 * percentile(ttft_s, 99), 3),
           "tpot_ms_p50": round(1e3 * percentile(tpot, 50), 3), "tpot_ms_p99": round(1e3 * percentile(tpot, 99), 3)}
    if itl_s:
        out.update(itl_ms_p50=round(1e3 * percentile(itl_s, 50), 3), itl_ms_p99=round(1e3 * percentile(itl_s, 99), 3))
    return out
