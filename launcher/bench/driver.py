"""Child process of `speedpipe bench`: holds one pipeline session and runs what the parent asks.

One process per session, because a coordinator joins the default torch.distributed group of its
process. Line protocol (launcher/bench/driver_protocol.py): the driver prints {"ready": true} once the
session is up, then for each JSON request line {"prompts": [str], "max_new_tokens": int, "trace":
path|null, "timeline": path|null} runs the prompts concurrently (greedy, ignore_eos), writes the Chrome trace and the
timeline JSON where asked, and prints one reply line: the `launch --json` stats, or {"error": str}.
Stdin EOF stops the session and ends the driver; so does Ctrl-C (SIGINT), quietly, with exit code 130. Anything else printed goes to stderr.
Usage (by launcher/bench/sweep.py only): python -m launcher.bench.driver OPTIONS_JSON
Must not: decide what to measure (launcher/bench/sweep.py does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.bench.driver_protocol import driver_main, serve_requests, take_stdout_for_replies
from launcher.cli.launch import run_launch
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession, settle_coordinator_process
from pipeline.measure.trace import chrome_trace
from pipeline.speculation.sampling import SamplingParams


def serve(options_json: str) -> int:
    """Hold one session with PipelineOptions from `options_json` and answer run requests until stdin EOF."""
    replies = take_stdout_for_replies()
    options = PipelineOptions(**json.loads(options_json), progress=False)
    model = resolve(options)
    settle_coordinator_process()  # as launch does: one torch thread, frozen start-up heap
    with PipelineSession(options, model) as session:
        return serve_requests(replies, lambda request: run_request(session, request))


def run_request(session: PipelineSession, request: dict) -> dict:
    """Run the request's prompts concurrently (greedy, ignore_eos); write its trace and timeline files."""
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
    return {"stats": report["stats"], "num_tokens": [len(o["token_ids"]) for o in report["outputs"]]}


if __name__ == "__main__":
    sys.exit(driver_main(lambda: serve(sys.argv[1])))
