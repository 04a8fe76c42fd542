"""Child process of `speedpipe bench`: holds one pipeline session and runs what the parent asks.

One process per session, because a coordinator joins the default torch.distributed group of its
process. Line protocol: the driver prints {"ready": true} once the session is up, then for each
JSON request line {"prompts": [str], "max_new_tokens": int, "trace": path|null, "timeline":
path|null} runs the prompts concurrently (greedy, ignore_eos), writes the Chrome trace and the
timeline JSON where asked, and prints one reply line: the `launch --json` stats, or {"error": str}.
Stdin EOF stops the session and ends the driver. Anything else printed goes to stderr.
Usage (by launcher/bench.py only): python -m launcher.bench_driver OPTIONS_JSON
Must not: decide what to measure (launcher/bench.py does).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def serve(options_json: str) -> int:
    import torch

    from launcher.launch import run_launch
    from launcher.session import PipelineOptions, PipelineSession, resolve
    from pipeline.sampling import SamplingParams
    from pipeline.trace import chrome_trace

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(1)
    options = PipelineOptions(**json.loads(options_json), progress=False)
    with PipelineSession(options, resolve(options)) as session:
        replies.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            try:
                params = [SamplingParams(max_new_tokens=int(request["max_new_tokens"]), ignore_eos=True)
                          for _ in request["prompts"]]
                report = run_launch(session, request["prompts"], params, timeline=True)
                timeline = report.pop("timeline")
                if request.get("timeline"):
                    Path(request["timeline"]).write_text(json.dumps(timeline))
                if request.get("trace"):
                    coord = session.coordinator
                    trace = chrome_trace(coord.timeline, commits=list(coord.commit_events))
                    Path(request["trace"]).write_text(json.dumps(trace))
                reply = {"stats": report["stats"], "num_tokens": [len(o["token_ids"]) for o in report["outputs"]]}
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
