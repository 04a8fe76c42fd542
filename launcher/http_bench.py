"""`speedpipe bench --url http://HOST:PORT`: load-test any OpenAI-compatible server.

Owns the load-test flags, the closed-loop client (at concurrency C, C workers each send streaming
`/v1/completions` (or chat) requests back to back until `--num-requests` are done), the per-request
measurements (TTFT = request sent → first generated text; TPOT = (e2e − TTFT) / (output tokens − 1);
e2e = request sent → stream closed; output tokens from the usage chunk, else counted chunks) and the
report: one table on stdout, everything in results.json. Works against this server or another
(vLLM, SGLang, TGI's OpenAI route): only standard fields plus vLLM's `ignore_eos`.
Must not: start servers or pipelines.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = (
    "Once upon a time, in a small village at the edge of the forest,",
    "The industrial revolution began in Britain in the late eighteenth century, and",
    "Here is a list of fruits:\n1. Apple\n2.",
    "Write a short note to a friend about the weekend:",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "In the year 2050, cities will",
    "The best way to learn a new language is",
)


def add_http_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of the HTTP load test (`--url` selects it). A flag the parser already has (e.g. a shared
    --prompt or --temperature of a merged `bench` command) is kept as is and shared."""
    g = p.add_argument_group("load test of an OpenAI-compatible server (--url)")

    def add(flag: str, **kw) -> None:
        if flag not in p._option_string_actions:  # noqa: SLF001 - argparse has no public lookup
            g.add_argument(flag, **kw)

    add("--url", help="server base URL, e.g. http://127.0.0.1:8000 (selects the load test)")
    add("--served-model-name", help="model name to request (default: the first of GET /v1/models)")
    add("--endpoint", default="completions", choices=("completions", "chat"), help="completions (default) | chat")
    add("--concurrency", default="1,2,4", help="comma-separated concurrency levels (default 1,2,4)")
    add("--num-requests", type=int, default=16, help="requests per concurrency level (default 16)")
    add("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    add("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="ask for exactly --max-tokens tokens (vLLM's ignore_eos; default on)")
    add("--prompt", action="append", default=[], help="prompt (repeatable; default: 8 built-in prompts)")
    add("--warmup", type=int, default=1, help="requests sent (and not measured) before each level (default 1)")
    add("--request-timeout-s", type=float, default=600.0, help="per-request timeout (default 600)")
    add("--output", default="results.json", help="where to write the JSON results (default results.json)")


@dataclasses.dataclass
class RequestResult:
    """One request's measurements in seconds; ok=False with `error` if it failed."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _stats(values: list[float]) -> dict[str, float]:
    """mean, p50, p99 in milliseconds (nearest-rank percentiles); zeros when empty."""
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]

    return {"mean_ms": round(statistics.fmean(s) * 1e3, 3), "p50_ms": round(pct(50) * 1e3, 3),
            "p99_ms": round(pct(99) * 1e3, 3)}


def parse_levels(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]. Raises ValueError naming --concurrency."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


class LoadTester:
    """Closed-loop streaming load against one server (see the module docstring)."""

    def __init__(self, url: str, *, model: str, endpoint: str = "completions", max_tokens: int = 64,
                 temperature: float = 0.0, ignore_eos: bool = True, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
                 request_timeout_s: float = 600.0) -> None:
        self.url, self.model, self.endpoint = url.rstrip("/"), model, endpoint
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos
        self.prompts, self.request_timeout_s = prompts, request_timeout_s

    def _body(self, prompt: str) -> dict:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def one(self, client, prompt: str) -> RequestResult:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        start = time.perf_counter()
        ttft, chunks, usage_tokens = None, 0, None
        try:
            async with client.stream("POST", self.url + path, json=self._body(prompt)) as resp:
                if resp.status_code != 200:
                    return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    obj = json.loads(line[5:])
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens")
                    for choice in obj.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            ttft = ttft if ttft is not None else time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - counted as a failed request
            return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
        e2e = time.perf_counter() - start
        return RequestResult(True, ttft if ttft is not None else e2e, e2e,
                             usage_tokens if usage_tokens is not None else chunks)

    async def level(self, concurrency: int, num_requests: int, *, warmup: int = 0) -> dict:
        """Run one concurrency level; returns its summary (and per-request results under "requests")."""
        import httpx

        limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as client:
            for i in range(warmup):
                await self.one(client, self.prompts[i % len(self.prompts)])
            counter = iter(range(num_requests))
            results: list[RequestResult] = []

            async def worker() -> None:
                for i in counter:
                    results.append(await self.one(client, self.prompts[i % len(self.prompts)]))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            duration = time.perf_counter() - start
        ok = [r for r in results if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        return {
            "concurrency": concurrency, "num_requests": num_requests, "completed": len(ok),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
            "duration_s": round(duration, 4), "output_tokens": tokens,
            "request_throughput": round(len(ok) / duration, 4) if duration else 0.0,
            "output_token_throughput": round(tokens / duration, 3) if duration else 0.0,
            "ttft": _stats([r.ttft_s for r in ok]), "tpot": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
            "e2e": _stats([r.e2e_s for r in ok]),
        }


def first_model(url: str, *, timeout_s: float = 10.0) -> str:
    """The first model id of GET {url}/v1/models. Raises ValueError naming --url if unreachable."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--url {url}: no OpenAI-compatible server answers /v1/models ({exc})") from None


def format_table(levels: list[dict]) -> str:
    """One row per concurrency level."""
    head = (f"{'conc':>4} {'ok':>4} {'fail':>4} {'req/s':>8} {'tok/s':>8} "
            f"{'TTFT mean/p50/p99 ms':>24} {'TPOT mean/p50/p99 ms':>24} {'e2e mean/p50/p99 ms':>26}")
    rows = [head]
    def trio(s: dict) -> str:
        return f"{s['mean_ms']:.0f}/{s['p50_ms']:.0f}/{s['p99_ms']:.0f}"

    for lv in levels:
        rows.append(f"{lv['concurrency']:>4} {lv['completed']:>4} {lv['failed']:>4} {lv['request_throughput']:>8.3f} "
                    f"{lv['output_token_throughput']:>8.2f} {trio(lv['ttft']):>24} {trio(lv['tpot']):>24} "
                    f"{trio(lv['e2e']):>26}")
    return "\n".join(rows)


def cmd_http_bench(args: argparse.Namespace) -> int:
    """Run every concurrency level, print the table, write --output. Exit 2 for bad flags or an
    unreachable server, 1 if any request failed."""
    if not args.url:
        raise ValueError("--url is required: the base URL of an OpenAI-compatible server")
    levels = parse_levels(args.concurrency)
    for flag, value in (("--num-requests", args.num_requests), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    model = args.served_model_name or first_model(args.url)
    tester = LoadTester(args.url, model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                        temperature=args.temperature, ignore_eos=bool(args.ignore_eos),
                        prompts=tuple(args.prompt or ()) or DEFAULT_PROMPTS, request_timeout_s=args.request_timeout_s)
    summaries = []
    for c in levels:
        summaries.append(asyncio.run(tester.level(c, args.num_requests, warmup=args.warmup)))
        print(f"[speedpipe] concurrency {c}: {summaries[-1]['request_throughput']:.3f} req/s", file=sys.stderr)
    print(format_table(summaries))
    results = {"url": args.url, "model": model, "endpoint": args.endpoint, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "ignore_eos": args.ignore_eos, "levels": summaries}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(f"[speedpipe] results written to {args.output}", file=sys.stderr)
    failed = sum(s["failed"] for s in summaries)
    if failed:
        print(f"[speedpipe] bench: {failed} request(s) failed: {summaries[-1]['errors']}", file=sys.stderr)
    return 1 if failed else 0
