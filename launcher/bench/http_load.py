"""`speedpipe bench serve`: load-test any OpenAI-compatible server with vLLM's `bench serve` options.

Owns the flags (vLLM's spellings: `--base-url`, `--model`, `--num-prompts`, `--max-concurrency`,
`--request-rate` with Poisson/gamma arrivals and `--burstiness`, `--dataset-name random|prompts-file`,
`--random-input-len/--random-output-len/--random-range-ratio`, `--percentile-metrics`,
`--metric-percentiles`, `--save-result`/`--result-dir`/`--result-filename`), the datasets, the
open-loop client (streaming `/v1/completions` or `/v1/chat/completions`, one tqdm bar) and the
command. Metrics and the summary block: launcher/bench/serve_report.py. Works against this server or
another (vLLM, SGLang, TGI's OpenAI route): only standard fields plus vLLM's `ignore_eos`.
Must not: start servers or pipelines.

[Note: arrivals] As vLLM: with `--request-rate R` (requests/s) the gaps between request sends are
drawn from a gamma distribution with shape `--burstiness` B and scale 1/(R·B) (B = 1: a Poisson
process, exponential gaps of mean 1/R), from a generator seeded by `--seed`; sends are scheduled
at absolute times (start + cumulative gaps), so a slow send does not shift later ones. `inf` sends
all at once. `--max-concurrency` caps requests in flight; an arrival waits for a free slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from launcher.bench.serve_report import (
    RequestOutput,
    format_block,
    parse_metric_list,
    parse_percentiles,
    summarize,
)
from launcher.cli.output_paths import check_output_dir, dumps_strict

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_http_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of `speedpipe bench serve` (vLLM's names)."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server base URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    g.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS, help="API route")
    g.add_argument("--model", help="model name sent in requests (default: the first of GET /v1/models)")
    g.add_argument("--tokenizer", help="speedpipe model (registered name, folder or .gguf) whose tokenizer "
                   "makes the random dataset's token ids (default: --model)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=("random", "prompts-file"),
                   help="random token ids, or prompts from --dataset-path")
    d.add_argument("--dataset-path", help="prompts-file: one prompt per line, or JSONL with a 'prompt' field")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    d.add_argument("--random-input-len", type=int, default=128, help="prompt tokens per random request")
    d.add_argument("--random-output-len", "--max-new-tokens", type=int, default=64,
                   help="max_tokens of each request (every dataset)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths are drawn uniformly from [len·(1-r), len·(1+r)]")
    d.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: exactly max_tokens each")
    d.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    d.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times")
    t = p.add_argument_group("load")
    t.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (inf = all at once)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    t.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    t.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request timeout")
    t.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    r = p.add_argument_group("report")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to report: ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", default="99", help="comma list of percentiles to report, e.g. 50,90,99")
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--result-dir", default=".", help="folder of --save-result's file")
    r.add_argument("--result-filename", help="file name of --save-result (default: bench-serve-MODEL-DATE.json)")


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag for a bad value (before any request is sent)."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.dataset_name == "prompts-file" and not args.dataset_path:
        raise ValueError("--dataset-name prompts-file needs --dataset-path FILE")
    if not 0 < args.request_timeout_s < math.inf:
        raise ValueError(f"--request-timeout-s must be a positive number of seconds, got {args.request_timeout_s}")
    if args.save_result:  # found now, not after the whole run (its results would be lost)
        check_output_dir("--result-dir", args.result_dir)


def arrival_offsets_s(num: int, *, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times of `num` requests, seconds after the start (see [Note: arrivals]); [0] is 0."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num]


def _lengths(rng: np.random.Generator, length: int, ratio: float, num: int) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=num).tolist()


def random_dataset(args: argparse.Namespace, model: str) -> list[tuple[list[int] | str, int, int]]:
    """(prompt, prompt tokens, max_tokens) per request: uniform token ids of the tokenizer's
    vocabulary (special tokens excluded), sent as token ids (completions) or decoded text (chat)."""
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.weights.registry import resolve_model

    spec = args.tokenizer or model
    try:
        tok = Tokenizer(resolve_model(spec, progress=False))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ValueError(f"--dataset-name random needs a tokenizer: --tokenizer {spec!r} is not a speedpipe "
                         f"model ({exc}); pass --tokenizer, or use --dataset-name prompts-file") from None
    special = set(tok.eos_token_ids) | ({tok.bos_token_id} if tok.bos_token_id is not None else set())
    allowed = np.array([i for i in range(tok.vocab_size) if i not in special])
    rng = np.random.default_rng(args.seed)
    ins = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    outs = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    data = []
    for n_in, n_out in zip(ins, outs, strict=True):
        ids = rng.choice(allowed, size=n_in).tolist()
        data.append((ids if args.endpoint == ENDPOINTS[0] else tok.decode(ids), n_in, n_out))
    return data


def prompts_file_dataset(args: argparse.Namespace) -> list[tuple[list[int] | str, int, int]]:
    """The file's prompts in order, repeated to --num-prompts; prompt tokens come from usage."""
    from launcher.cli.parsing import read_prompts_file

    prompts = read_prompts_file(args.dataset_path, flag="--dataset-path")
    return [(prompts[i % len(prompts)], 0, args.random_output_len) for i in range(args.num_prompts)]


def request_body(args: argparse.Namespace, model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """The streaming request of one prompt: token ids or text (completions) or one user message (chat)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == ENDPOINTS[1]:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send_one(client, url: str, body: dict, prompt_len: int) -> RequestOutput:
    """Send one streaming request and time it (see launcher/bench/serve_report.py)."""
    out = RequestOutput(ok=False, sent_s=time.perf_counter(), prompt_len=prompt_len)
    last, texts, chunks, done = out.sent_s, [], 0, False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if line.strip() == "data: [DONE]":
                    done = True
                if not line.startswith("data:") or done:
                    continue
                obj = json.loads(line[5:])
                if obj.get("error"):  # the server failed mid-stream (an error event, then [DONE])
                    error = obj["error"]
                    out.error = f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
                    return out
                if obj.get("usage"):
                    out.prompt_len = obj["usage"].get("prompt_tokens", out.prompt_len)
                    out.output_len = obj["usage"].get("completion_tokens", 0)
                for choice in obj.get("choices") or []:
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            out.ttft_s = now - out.sent_s
                        else:
                            out.itl_s.append(now - last)
                        last, chunks = now, chunks + 1
                        texts.append(text)
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if not done:
        out.error = "the stream ended without data: [DONE] (cut off)"
        return out
    out.latency_s = time.perf_counter() - out.sent_s
    out.output_len = out.output_len or chunks
    out.generated_text, out.ok = "".join(texts), True
    return out


async def run_benchmark(args: argparse.Namespace, url: str, model: str, dataset: list) -> tuple[list, float]:
    """Send every request at its arrival time (at most --max-concurrency at once); returns
    (RequestOutput per request in dataset order, benchmark duration in seconds)."""
    import httpx
    from tqdm import tqdm

    offsets = arrival_offsets_s(len(dataset), request_rate=args.request_rate, burstiness=args.burstiness,
                                seed=args.seed)
    limit = args.max_concurrency or len(dataset)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(dataset), disable=args.disable_tqdm, file=sys.stderr, unit="req")
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            prompt, prompt_len, max_tokens = dataset[i]
            async with semaphore:
                result = await send_one(client, url, request_body(args, model, prompt, max_tokens), prompt_len)
            bar.update()
            return result

        outputs = await asyncio.gather(*(one(i) for i in range(len(dataset))))
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def first_model(base_url: str, *, timeout_s: float = 10.0) -> str:
    """The first model id of GET {base_url}/v1/models. Raises ValueError naming --base-url."""
    import httpx

    try:
        resp = httpx.get(base_url + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--base-url {base_url}: no OpenAI-compatible server answers /v1/models ({exc})") from None


def cmd_http_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print the summary block, write --save-result. Exit 2 for bad flags or an
    unreachable server, 1 if any request failed."""
    check_args(args)
    metrics, percentiles = parse_metric_list(args.percentile_metrics), parse_percentiles(args.metric_percentiles)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    dataset = prompts_file_dataset(args) if args.dataset_name != "random" else None  # a bad file: before any request
    served = first_model(base_url)  # also with --model: an unreachable server is exit 2, not a report of zeros
    model = args.model or served
    dataset = dataset if dataset is not None else random_dataset(args, model)
    outputs, duration = asyncio.run(run_benchmark(args, base_url + args.endpoint, model, dataset))
    result = summarize(outputs, duration_s=duration, metrics=metrics, percentiles=percentiles)
    print(format_block(result, metrics=metrics, percentiles=percentiles, request_rate=args.request_rate,
                       max_concurrency=args.max_concurrency))
    if args.save_result:
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        settings = {"date": date, "backend": "openai-chat" if args.endpoint == ENDPOINTS[1] else "openai",
                    "base_url": base_url, "endpoint": args.endpoint, "model_id": model,
                    "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
                    "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                    "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed}
        name = args.result_filename or f"bench-serve-{Path(model).name}-{date}.json"
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps_strict({**settings, **result}, indent=1))
        print(f"[speedpipe] result written to {path}", file=sys.stderr)
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        print(f"[speedpipe] bench serve: {len(failed)} request(s) failed, e.g. {failed[0]}", file=sys.stderr)
    return 1 if failed else 0
