"""The child processes of tests/benchmarks/core_speed.py and their parent-side handle.

Owns the drivers ([Note: one long-lived driver per configuration] in core_speed.py): `hf_driver`
(transformers `generate`), `speedpipe_driver` (a PipelineSession), the `Driver` handle that starts
one as `core_speed.py --driver ...` (`CpuMeter`, [Note: foreign load], lives in
launcher/cli/cpu_meter.py). Must not: compute
ratios or write reports (core_speed_report.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.bench.driver_protocol import DriverProcess, serve_requests, take_stdout_for_replies
from launcher.cli.cpu_meter import CpuMeter  # noqa: F401 (core_speed.py imports it from here)

CORE_SPEED_SCRIPT = Path(__file__).resolve().with_name("core_speed.py")  # the script that serves --driver
DRIVER_START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0


# -- drivers (child processes) ---------------------------------------------------------------------
def _serve(handle_request) -> int:
    """Line protocol of a driver (launcher/bench/driver_protocol.py) with this benchmark's requests.

    A request is {"prompt_ids": [[int, ...], ...], "max_new_tokens": int}; the reply is
    {"requests": [{"num_tokens", "submit_s", "first_token_s", "finish_s", "token_ids"}], "stages": [...]}
    (times in seconds on the driver's perf_counter) or {"error": str}. Stdin EOF ends the driver.
    Everything else the driver or its libraries print goes to stderr.
    """
    return serve_requests(take_stdout_for_replies(),
                          lambda request: handle_request(request["prompt_ids"], int(request["max_new_tokens"])))


def hf_driver(model_dir: str) -> int:
    """Serve HF `generate` (greedy, float32, 1 thread) of the converted model folder."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """Records when each `put` happens: once with the prompt, then once per generated token."""

        def __init__(self) -> None:
            self.times_s: list[float] = []

        def put(self, value) -> None:
            self.times_s.append(time.perf_counter())

        def end(self) -> None:
            pass

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id

    def handle(prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
        if len(prompt_ids) != 1:
            raise ValueError(f"the HF driver runs one prompt at a time, got {len(prompt_ids)}")
        ids = torch.tensor([prompt_ids[0]], dtype=torch.int64)
        clock = TokenClock()
        submit_s = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=eos, streamer=clock)
        finish_s = time.perf_counter()
        token_ids = out[0, ids.shape[1]:].tolist()
        if len(clock.times_s) != len(token_ids) + 1:
            raise RuntimeError(f"streamer saw {len(clock.times_s)} puts for {len(token_ids)} tokens + the prompt")
        return {"requests": [{"num_tokens": len(token_ids), "submit_s": submit_s, "first_token_s": clock.times_s[1],
                              "finish_s": finish_s, "token_ids": token_ids}], "stages": []}

    return _serve(handle)


def speedpipe_driver(model_dir: str, num_stages: int, layer_split: str | None = None,
                     quantization: str = "none", dense_layout: str = "reference") -> int:
    """Serve a speedpipe session with `num_stages` stages (1 thread each) of the converted model folder,
    with `--quantization quantization --dense-layout dense_layout` (a benchmark mode's `mode_flags`).

    layer_split: `--layer-split` of a multi-stage session (None: the runtime's default split).
    """
    import psutil
    import torch

    from launcher.coordinator.pipeline_options import PipelineOptions
    from launcher.coordinator.run_plan import resolve
    from launcher.coordinator.session import PipelineSession
    from pipeline.speculation.sampling import SamplingParams

    torch.set_num_threads(1)
    options = PipelineOptions(num_stages=num_stages, model=model_dir, threads_per_stage=1, progress=False,
                              layer_split=layer_split if num_stages > 1 else None, quantization=quantization,
                              dense_layout=dense_layout)
    with PipelineSession(options, resolve(options)) as session:
        coord = session.coordinator
        procs = [psutil.Process(), *(psutil.Process(pid) for pid in session.processes.pids)]

        def cpu_s() -> list[float]:  # user + system seconds of [coordinator, stage 0, stage 1, ...]
            return [sum(p.cpu_times()[:2]) for p in procs]

        def handle(prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            coord.reset_stats()
            cpu0 = cpu_s()
            handles = [coord.submit(ids, params) for ids in prompt_ids]
            for h in handles:
                h.result(timeout_s=REQUEST_TIMEOUT_S)
            cpu = [b - a for a, b in zip(cpu0, cpu_s(), strict=True)]
            stages = [{"busy_ns": st.busy_ns, "wall_ns": st.wall_ns, "items_processed": st.items_processed,
                       "tokens_processed": st.tokens_processed, "cpu_s": cpu[i + 1]}
                      for i, st in enumerate(coord.stage_stats())]
            return {"requests": [{"num_tokens": len(h.token_ids), "submit_s": h.submitted_at,
                                  "first_token_s": h.first_token_at, "finish_s": h.finished_at,
                                  "token_ids": list(h.token_ids)} for h in handles], "stages": stages,
                    "coordinator_cpu_s": cpu[0]}

        return _serve(handle)


class Driver(DriverProcess):
    """Parent side of one driver process. Raises RuntimeError if it fails, dies or times out."""

    def __init__(self, name: str, model_dir: Path, *, layer_split: str | None = None) -> None:
        kind, _, mode = name.partition(":")
        cmd = [sys.executable, str(CORE_SPEED_SCRIPT), "--driver", kind, "--model-dir",
               str(model_dir), "--quantization", mode or "none"]
        if layer_split:
            cmd += ["--layer-split", layer_split]
        super().__init__(cmd, name=f"driver {name}")

    def wait_ready(self) -> None:
        self.reply(DRIVER_START_TIMEOUT_S)

    def run(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
        return self.request({"prompt_ids": [list(p) for p in prompt_ids], "max_new_tokens": max_new_tokens},
                            REQUEST_TIMEOUT_S)
