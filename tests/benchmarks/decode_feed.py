"""Self-fed decode: `--decode-feed coordinator` and `stage` side by side in one process, at --stages N.

Both sessions stay up; each repeat runs one greedy stream in each, alternating which goes first.
Per run: decode tokens/s, TPOT, the timeline's ring return ([Note: handoff latency] in
pipeline/measure/handoffs.py), fed items, and CPU ms per token of the coordinator (this process)
and of the stage process. Every run checks that the two modes generated the same tokens.

    python tests/benchmarks/decode_feed.py [--stages 1] [--repeats 3] [--max-new-tokens 200] [--quantization auto]
                                           [--out tests/benchmarks/results/decode_feed.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import psutil

from launcher.cli.launch import run_launch
from launcher.cli.main import build_parser
from launcher.cli.options import options_and_reason
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession, settle_coordinator_process
from pipeline.speculation.sampling import SamplingParams

MODES = ("coordinator", "stage")
PROMPT = "Once upon a time"


def _run(session: PipelineSession, params: SamplingParams) -> dict:
    stages = [psutil.Process(p) for p in session.processes.pids]
    cpu0, stage0 = time.process_time(), [sum(p.cpu_times()[:2]) for p in stages]
    report = run_launch(session, [PROMPT], [params])
    cpu1, stage1 = time.process_time(), [sum(p.cpu_times()[:2]) for p in stages]
    st, n = report["stats"], params.max_new_tokens
    return {"tokens_per_s": st["tokens_per_s"], "tpot_ms_p50": st["tpot_ms_p50"],
            "ring_return": st["handoffs"]["ring_return"], "fed_items": st["fed_items"],
            "coordinator_cpu_ms_per_token": round((cpu1 - cpu0) * 1e3 / n, 3),
            "stage_cpu_ms_per_token": round((sum(stage1) - sum(stage0)) * 1e3 / n, 3),
            "load_1m": psutil.getloadavg()[0], "token_ids": report["outputs"][0]["token_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--out", default="tests/benchmarks/results/decode_feed.json")
    a = ap.parse_args()
    args = build_parser().parse_args(["launch", "--stages", str(a.stages), "--quantization", a.quantization, "--speculate",
                                      "none", "--prompt", PROMPT, "--no-progress"])
    options, _ = options_and_reason(args, progress=False)
    plan = resolve(options)
    settle_coordinator_process()
    sessions = {m: PipelineSession(dataclasses.replace(options, decode_feed=m), plan) for m in MODES}
    rows = []
    try:
        for s in sessions.values():
            s.__enter__()
            run_launch(s, [PROMPT], [SamplingParams(max_new_tokens=16, ignore_eos=True)])  # warm-up
        params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
        for r in range(a.repeats):
            runs = {m: _run(sessions[m], params) for m in (MODES if r % 2 == 0 else MODES[::-1])}
            assert runs["stage"].pop("token_ids") == runs["coordinator"].pop("token_ids"), "outputs differ"
            for m, row in runs.items():
                rows.append({"mode": m, "repeat": r, **row})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in sessions.values():
            s.__exit__(None, None, None)
    by = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    summary = {"paired_tokens_per_s_ratio": [round(s["tokens_per_s"] / c["tokens_per_s"], 3)
                                             for s, c in zip(by["stage"], by["coordinator"], strict=True)],
               **{f"{m}_ring_return_p50_ms": statistics.median(r["ring_return"]["p50_ms"] for r in by[m]) for m in MODES}}
    print(json.dumps(summary))
    Path(a.out).write_text(json.dumps({"rows": rows, "summary": summary, "max_new_tokens": a.max_new_tokens,
                                       "quantization": a.quantization, "stages": a.stages}, indent=1) + "\n")


if __name__ == "__main__":
    main()
