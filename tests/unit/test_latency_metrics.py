"""One definition per latency name in every tool ([Note: latency metrics] in pipeline/measure/metrics.py),
checked on synthetic timelines: `launch --json` / `bench sweep` (commit log), `bench serve` (the
streamed chunks it reads) and the server's Prometheus ITL histogram.

What breaks when these fail: under speculation several tokens are committed, and streamed, at
once; `launch` counted a gap per token (x, 0, 0 for a 3-token commit) while `bench serve` counted
one per chunk as vLLM does, so `itl_ms_p50` of the sweep and `median_itl_ms` of bench serve meant
different things (the sweep's median fell towards 0 as acceptance rose).
"""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest

from launcher.bench import http_load
from launcher.bench.serve_report import summarize
from pipeline.measure.metrics import inter_token_gaps_s, latency_summary
from tests.unit.test_serving_http import FakeCoordinator, tokenizer  # noqa: F401 - a pytest fixture

pytestmark = pytest.mark.timeout(60)

MS = 1_000_000
# one request: submitted at 0, chunks of 1, 2, 3 and 1 tokens at 100, 130, 190 and 200 ms
CHUNKS = [(100, "a", 1), (130, "bc", 2), (190, "def", 3), (200, "g", 1)]


def _commit_log(chunks, seq_id=0) -> list[tuple[int, int, int]]:
    """The coordinator's commit log of a stream: one (time_ns, seq_id, token) per token."""
    return [(t * MS, seq_id, ord(c)) for t, text, _ in chunks for c in text]


def test_itl_is_one_gap_per_commit_event_not_per_token():
    log = _commit_log(CHUNKS) + _commit_log([(105, "x", 1), (150, "yz", 2)], seq_id=1)
    assert sorted(inter_token_gaps_s(reversed(log))) == pytest.approx(sorted([0.030, 0.060, 0.010, 0.045]))


class _FakeStream:
    """An SSE stream whose lines arrive at the synthetic times of `events` [(ms, line)]."""

    def __init__(self, events, clock):
        self.events, self.clock, self.status_code = events, clock, 200

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        for ms, line in self.events:
            self.clock.now = ms / 1e3
            yield line


def _bench_serve_output(chunks, monkeypatch):
    """What `bench serve` measures of the stream of `chunks` (its own client, launcher/bench/http_load.py)."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(http_load, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    lines = [f"data: {json.dumps({'choices': [{'text': text}]})}" for _, text, _ in chunks]
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": sum(n for *_, n in chunks)}})
    events = [(t, line) for (t, _, _), line in zip(chunks, lines, strict=True)]
    events += [(chunks[-1][0], f"data: {usage}"), (chunks[-1][0], "data: [DONE]")]
    client = types.SimpleNamespace(stream=lambda *a, **kw: _FakeStream(events, clock))
    return asyncio.run(http_load.send_one(client, "http://fake/v1/completions", {}, 4))


def test_launch_and_bench_serve_report_the_same_itl_and_tpot_for_one_stream(monkeypatch):
    out = _bench_serve_output(CHUNKS, monkeypatch)
    assert out.ok and out.itl_s == pytest.approx([0.030, 0.060, 0.010]) and out.output_len == 7
    served = summarize([out], duration_s=0.2, metrics=["ttft", "tpot", "itl"], percentiles=[50, 99])
    launched = latency_summary(num_tokens=[7], ttft_s=[0.1], e2e_s=[0.2], wall_s=0.2,
                               itl_s=inter_token_gaps_s(_commit_log(CHUNKS)))
    same = {"itl_ms_p50": "median_itl_ms", "itl_ms_p99": "p99_itl_ms", "tpot_ms_p50": "median_tpot_ms",
            "tpot_ms_p99": "p99_tpot_ms", "ttft_ms_p50": "median_ttft_ms"}  # launch's (rounded to µs) vs vLLM's names
    for ours, vllm in same.items():
        assert launched[ours] == pytest.approx(served[vllm], abs=1e-3), (ours, vllm)
    assert launched["itl_ms_p50"] == pytest.approx(30.0) and launched["tpot_ms_p50"] == pytest.approx(100 / 6, abs=1e-3)


def test_the_servers_itl_histogram_counts_one_gap_per_chunk(tokenizer):  # noqa: F811
    """`speedpipe:inter_token_latency_seconds` as vLLM's: one observation per streamed chunk after
    the first (it observed each token's share of the gap: 4 samples for 3 chunks of 2 tokens)."""
    import httpx

    from launcher.serving.http_server import HttpServer
    from launcher.serving.serving_engine import ServingEngine
    from pipeline.engine.records import Commit, FinishReason

    class TwoTokenCommits(FakeCoordinator):
        def _run(self, h) -> None:  # commits of 2 tokens, as a verified draft and its successor
            n = h.params.max_new_tokens
            for i in range(0, n, 2):
                time.sleep(self.step_s)
                ids = tuple(h.prompt_ids[j % len(h.prompt_ids)] for j in range(i, min(n, i + 2)))
                if h.emit(Commit(0, ids, FinishReason.LENGTH if i + 2 >= n else None)):
                    return

    engine = ServingEngine(TwoTokenCommits(tokenizer), model_name="tiny", max_num_seqs=2, max_queue=1, max_model_len=64)
    http = HttpServer(engine, host="127.0.0.1", port=0)
    http.start()
    try:
        url = f"http://127.0.0.1:{http.server.servers[0].sockets[0].getsockname()[1]}"
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        text = httpx.get(url + "/metrics").text
    finally:
        http.stop()
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("speedpipe:inter_token_latency_seconds_count"))
    assert count == 2  # 3 chunks
