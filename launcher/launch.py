"""The `launch` job: submit prompts to a running session, stream or collect, and report stats.

Owns the JSON report of `launch --json` (outputs + wall time, tokens/s, per-stage busy fraction,
RSS and weight memory). Must not: start or stop processes (PipelineSession does).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from launcher.session import PipelineSession
from pipeline.sampling import SamplingParams


def run_launch(session: PipelineSession, prompts: Sequence[str], params: Sequence[SamplingParams], *,
               stream: bool = False) -> dict:
    """Run all prompts concurrently; returns {"outputs": [...], "stats": {...}} (see README)."""
    coord = session.coordinator
    coord.reset_stats()
    start = time.perf_counter()
    handles = [coord.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    if stream:
        sys.stdout.write(prompts[0])
        for chunk in handles[0]:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    results = [h.result() for h in handles]
    wall_s = time.perf_counter() - start
    stage_stats = coord.stage_stats()
    generated = sum(len(r.token_ids) for r in results)
    stages = []
    times, spec = coord.timeline, coord.scheduler.spec
    for i, (st, r) in enumerate(zip(stage_stats, session.model.ranges, strict=True)):
        wall = st.wall_ns or 1
        stages.append({
            "stage": i, "layers": [r.start, r.stop],
            "busy_fraction": round(st.busy_ns / wall, 4),
            "useful_fraction": round(times.useful_ns[i] / wall, 4),
            "wasted_fraction": round(times.wasted_ns[i] / wall, 4),
            "rss_mb": round(st.rss_bytes / 2**20, 1), "weights_mb": round(st.weights_bytes / 2**20, 2),
        })
    return {
        "outputs": [{"prompt": r.prompt, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                     "ttft_s": round(r.ttft_s, 4), "e2e_s": round(r.e2e_s, 4)} for r in results],
        "stats": {"wall_s": round(wall_s, 4), "generated_tokens": generated,
                  "tokens_per_s": round(generated / wall_s, 3) if wall_s > 0 else 0.0,
                  "acceptance_rate": round(spec.acceptance_rate, 4), "drafted_tokens": spec.drafted_tokens,
                  "verified_drafts": spec.verified_drafts, "accepted_tokens": spec.accepted_tokens,
                  "squashed_items": spec.squashed_items, "firp_drafted": spec.firp_drafted,
                  "firp_verified": spec.firp_verified, "firp_accepted": spec.firp_accepted,
                  "tokens_per_pass": round(spec.tokens_per_pass, 4), **times.draft_gap(0), "stages": stages},
    }
