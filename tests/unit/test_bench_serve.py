"""`speedpipe bench serve` against the real HTTP front end over a fake coordinator (no model run).

What breaks if these fail: the vLLM-style summary block or its JSON fields, the arrival process
(`--request-rate` must give Poisson arrivals at that rate, and the client must keep to the
schedule), `--max-concurrency`, failed requests (HTTP errors, error events mid-stream, cut-off
streams) or the flag checks. The serving stack with a real model is tested in
tests/integration/test_serving.py; bench serve needs only an OpenAI-compatible server.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from launcher.bench.http_load import arrival_offsets_s
from launcher.bench.serve_report import RequestOutput, parse_percentiles, summarize
from launcher.cli.main import main
from tests.unit.test_serving_http import served, tokenizer  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.timeout(120)

BLOCK_LINES = ("Successful requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
               "Request throughput (req/s):", "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
               "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):",
               "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):", "Mean E2EL (ms):",
               "Median E2EL (ms):", "P99 E2EL (ms):")


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    offsets = np.array(arrival_offsets_s(20001, request_rate=4.0, burstiness=1.0, seed=3))
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps > 0)
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets_s(20001, request_rate=4.0, burstiness=4.0, seed=3))
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: CV 1/2
    assert arrival_offsets_s(3, request_rate=float("inf"), burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]


def test_summary_metrics_follow_vllm_definitions():
    outs = [RequestOutput(True, sent_s=0.0, prompt_len=4, output_len=3, ttft_s=0.1, latency_s=0.5, itl_s=[0.2, 0.2]),
            RequestOutput(True, sent_s=1.0, prompt_len=6, output_len=1, ttft_s=0.3, latency_s=0.3),
            RequestOutput(False, sent_s=2.0, error="HTTP 500")]
    r = summarize(outs, duration_s=2.0, metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 99])
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 10, 4)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0 and r["total_token_throughput"] == 7.0
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(200.0)  # only the request with > 1 output token
    assert r["mean_itl_ms"] == pytest.approx(200.0) and r["p99_e2el_ms"] == pytest.approx(498.0)
    assert r["measured_request_rate"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="--metric-percentiles"):
        parse_percentiles("0,101")


def _bench(url: str, tokenizer, tmp_path, *extra: str) -> tuple[int, dict]:  # noqa: F811
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", url, "--tokenizer", str(tokenizer.model_dir), "--disable-tqdm",
                 "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", out.name, *extra])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_block_and_json_have_vllm_fields(served, tokenizer, tmp_path, capsys):  # noqa: F811
    _, _, url = served
    code, result = _bench(url, tokenizer, tmp_path, "--num-prompts", "6", "--max-concurrency", "2",
                          "--metric-percentiles", "50,99")
    printed = capsys.readouterr().out
    assert code == 0, printed
    for line in BLOCK_LINES:
        assert line in printed, line
    assert "P50 ITL (ms):" in printed
    assert result["completed"] == 6 and result["failed"] == 0 and result["total_output_tokens"] == 18
    assert result["total_input_tokens"] == 48 and result["max_concurrency"] == 2
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{m}_ms"] <= result[f"p99_{m}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]


def test_request_rate_4_sends_on_the_poisson_schedule(served, tokenizer, tmp_path):  # noqa: F811
    _, _, url = served
    n, seed = 24, 5
    code, result = _bench(url, tokenizer, tmp_path, "--num-prompts", str(n), "--request-rate", "4",
                          "--seed", str(seed), "--max-concurrency", "2")
    assert code == 0 and result["completed"] == n
    scheduled = (n - 1) / arrival_offsets_s(n, request_rate=4.0, burstiness=1.0, seed=seed)[-1]
    assert result["measured_request_rate"] == pytest.approx(scheduled, rel=0.10)


def test_bad_flags_exit_2_before_sending(capsys):
    for flags, needle in ((["--request-rate", "0"], "--request-rate"), (["--num-prompts", "0"], "--num-prompts"),
                          (["--percentile-metrics", "ttft,xyz"], "--percentile-metrics"),
                          (["--dataset-name", "prompts-file"], "--dataset-path"),
                          (["--max-concurrency", "0"], "--max-concurrency")):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("speedpipe bench serve: error: ") and needle in err, err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9"]) == 2  # nothing answers /v1/models
    assert "--base-url" in capsys.readouterr().err


def test_an_unreachable_server_is_exit_2_with_model_given_and_a_missing_file_is_named_first(capsys, tmp_path):
    """With --model the reachability check was skipped: a report of zeros, then exit 1."""
    for base in ("http://127.0.0.1:9", "notaurl"):
        assert main(["bench", "serve", "--base-url", base, "--model", "m", "--num-prompts", "1"]) == 2
        out, err = capsys.readouterr()
        assert "no OpenAI-compatible server answers /v1/models" in err and "Serving Benchmark Result" not in out
    missing = str(tmp_path / "missing.jsonl")
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset-name", "prompts-file",
                 "--dataset-path", missing]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_stream_that_ends_with_an_error_event_is_a_failed_request(served, tokenizer, tmp_path, capsys):  # noqa: F811
    """A server that fails mid-stream answers 200, then an error event and [DONE]: bench serve
    counted such requests as successful (with their cut-off token counts in TPOT and throughput)."""
    coord, _, url = served
    coord.error_at = 1  # every request's second token fails ([Note: non-finite logits])
    code, result = _bench(url, tokenizer, tmp_path, "--num-prompts", "3", "--max-concurrency", "3")
    assert code == 1 and result["completed"] == 0 and result["failed"] == 3, result
    assert "error event: the model's logits are not finite" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--result-dir", "FILE"], "--result-dir"),  # a regular file: found after the whole run before
    (["--request-timeout-s", "0"], "--request-timeout-s"),
    (["--request-timeout-s", "-1"], "--request-timeout-s"),
])
def test_output_and_timeout_flags_are_checked_before_any_request(served, tokenizer, tmp_path, capsys,  # noqa: F811
                                                                 flags, needle):
    coord, _, url = served
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    dirs = [] if "--result-dir" in flags else ["--result-dir", str(tmp_path)]  # never the working folder
    code = main(["bench", "serve", "--base-url", url, "--tokenizer", str(tokenizer.model_dir), "--disable-tqdm",
                 "--num-prompts", "2", "--save-result", *dirs, *flags])
    out, err = capsys.readouterr()
    assert code == 2 and needle in err and "Serving Benchmark Result" not in out, err
