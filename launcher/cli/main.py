"""Command line: `speedpipe <command>` and its short form `launch`.

Owns argument parsing, mapping errors to exit codes (2 for bad input, 1 for a pipeline failure,
130 for Ctrl-C, 143 for SIGTERM), logging set-up, and printing results. Must not hold pipeline logic.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import time

from launcher.backends.placement_options import add_placement_args, placement_from_args
from launcher.backends.stage_group import StageStartupError
from launcher.bench.http_load import add_http_bench_args, cmd_http_bench
from launcher.cli.errors import flag_message
from launcher.cli.flag_groups import add_sampling_args, add_speculation_args
from launcher.cli.flag_notes import idle_flag_notes
from launcher.cli.parsing import (
    CliParser,
    UsageError,
    add_vllm_aliases,
    check_vllm_args,
    mark_model_given,
    min_acceptance_arg,
    read_prompts,
    shorten_help,
    version_string,
)
from launcher.cli.speculation_defaults import (
    auto_speculate,
    check_auto_flags,
    draft_gate_note,
    settle_auto,
)
from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.request_handle import RequestError
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.serve import add_serve_args, cmd_serve, restart_budget
from pipeline.measure.row_cost import ratio_line
from pipeline.run_config import check_prompt_length
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.dense_layout import DENSE_LAYOUTS
from pipeline.weights.quant import QUANTIZATION_CHOICES
from pipeline.weights.registry import DEFAULT_MODEL, model_key
from workers.heap import freeze_startup_heap

PROG = "speedpipe"


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts a pipeline."""
    g = p.add_argument_group("pipeline")
    g.add_argument("--stages", "-pp", "--pipeline-parallel-size", type=_stages_arg, default=2, metavar="N",
                   help="number of pipeline stages (worker processes; vLLM's -pp; default 2), or 'auto': the fewest "
                   "whose weights + KV each fit --stage-memory-gib, which auto needs")
    g.add_argument("--stage-memory-gib", type=float,
                   help="per-stage budget of weights + KV cache for --stages auto (GiB; each stage process adds "
                   "0.25-0.35 GiB of its own)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, HF model folder or .gguf file (default {DEFAULT_MODEL})")
    g.add_argument("--layer-split", help="layers per stage, e.g. 8,8,7,7 (default: balanced)")
    g.add_argument("--dtype", default="float32", type=_dtype_arg,
                   help="float32 | bfloat16 | float16 (default float32)")
    g.add_argument("--device", default="cpu", help="cpu | cuda (one GPU per stage; default cpu)")
    g.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="weights: auto (a GGUF's own Q4/Q8 blocks) | none (dense --dtype) | int8 | int4 (default none)")
    g.add_argument("--dense-layout", default=DENSE_LAYOUTS[0], choices=DENSE_LAYOUTS,
                   help="float32 dense weights on CPU: reference (transformers' op order, default) | fast (wide "
                   "weights stored transposed: faster one-row decode, last-bit differences in the logits)")
    g.add_argument("--max-model-len", type=int, default=2048, help="max prompt + generated tokens per sequence")
    g.add_argument("--max-num-seqs", type=int, default=8, help="KV-cache slots: sequences decoded at once")
    g.add_argument("--threads-per-stage", type=int, default=1, help="torch threads in each stage process")
    g.add_argument("--stage-timeout-s", type=float, default=120.0,
                   help="deadline for any data-plane wait; a stage silent this long is a failure")
    g.add_argument("--cache-dir", help="where converted models are cached (default ~/.cache/speedpipe)")
    g.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING | ERROR")
    add_vllm_aliases(g)


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    """`bench sweep` (also plain `bench`): a sweep of pipeline configurations (launcher/bench/sweep.py)."""
    from launcher.bench.sweep import cmd_bench
    return cmd_bench(args)


def _launch_parser(sub) -> argparse.ArgumentParser:
    launch = sub.add_parser("launch", help="run prompts through an N-stage pipeline and print the outputs",
                            description="Spawn N stage workers on this machine, generate, print, stop everything.")
    launch.add_argument("--version", action="version", version=version_string())
    add_pipeline_args(launch)
    add_placement_args(launch)
    add_speculation_args(launch)
    add_sampling_args(launch)
    g = launch.add_argument_group("prompts and output")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; run concurrently)")
    g.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field per line")
    g.add_argument("--json", action="store_true", help="print one JSON object (outputs + stats) as the last line")
    g.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace (JSON trace events) of the "
                   "stage timelines: open it in ui.perfetto.dev or chrome://tracing")
    g.add_argument("--no-timeline", action="store_true", help="do not record per-item stage timings (no "
                   "useful/wasted split, no trace); for measuring the recording overhead")
    g.add_argument("--no-progress", action="store_true", help="no progress bar while converting a model")
    launch.set_defaults(func=cmd_launch)
    add_serve_args(launch, switch=True)
    shorten_help(launch)
    return launch


def _serve_parser(sub) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API and gRPC",
                           description="Start an N-stage pipeline and serve it until Ctrl-C. "
                           "`speedpipe serve MODEL` is the same as `--model MODEL` (vLLM's spelling).")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
    add_pipeline_args(serve)
    add_placement_args(serve)
    add_speculation_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    shorten_help(serve, hidden_groups=("placement",))
    return serve


def _bench_parser(sub) -> argparse.ArgumentParser:
    from launcher.bench.sweep import add_bench_args

    bench = sub.add_parser("bench", help="benchmarks: `bench serve` load-tests a server like `vllm bench serve`; "
                           "`bench sweep` (or plain `bench`) measures pipeline configurations side by side",
                           description="`speedpipe bench serve --help` and `speedpipe bench sweep --help` list "
                           "each benchmark's flags; `speedpipe bench FLAGS` runs the sweep.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,sweep}")
    sweep = kinds.add_parser("sweep", help="sweep configurations side by side; write results.json/.csv, traces, "
                             "plots", description="Measure pipeline configurations side by side (paired repeats).")
    add_bench_args(sweep)
    sweep.set_defaults(func=cmd_bench_sweep)
    serve = kinds.add_parser("serve", help="load-test an OpenAI-compatible server (vLLM's `bench serve` flags)",
                             description="Load-test any OpenAI-compatible server with vLLM's `bench serve` "
                             "options and summary.")
    add_http_bench_args(serve)
    serve.set_defaults(func=cmd_http_bench)
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog=PROG, description="Pipeline-parallel LLM inference with speculative "
                       "pipelined execution (SPEED) and FIRP.")
    parser.add_argument("--version", action="version", version=version_string())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CliParser)
    commands = {"launch": _launch_parser(sub), "serve": _serve_parser(sub), "bench": _bench_parser(sub)}
    from launcher.cli.simulate import add_simulate_args, cmd_simulate
    simulate = sub.add_parser("simulate", help="discrete-event simulation of the pipeline (optionally calibrated)")
    add_simulate_args(simulate)
    simulate.set_defaults(func=cmd_simulate)
    from launcher.cli.training.train_predictor import add_train_args, cmd_train

    train = sub.add_parser("train-predictor", help="train an early-exit head or FIRP maps for a model (frozen)",
                           description="Self-distil a predictor from the base model's own outputs on a corpus.")
    add_train_args(train)
    train.set_defaults(func=cmd_train)
    parser.set_defaults(subparsers={**commands, "simulate": simulate, "train-predictor": train})
    return parser


# vLLM's --dtype spellings: `auto` is this project's exact default (float32), `half` / `float` as vLLM.
DTYPE_ALIASES = {"auto": "float32", "half": "float16", "float": "float32"}


def _dtype_arg(text: str) -> str:
    """--dtype: a model dtype name, or one of vLLM's spellings (DTYPE_ALIASES); RunConfig checks it."""
    return DTYPE_ALIASES.get(text, text)


def _stages_arg(text: str) -> int | str:
    """--stages: a positive count or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from None


def _auto_stages(args: argparse.Namespace, progress: bool) -> tuple[int, str | None]:
    """(--stages, --layer-split) from the flags; for --stages auto, the fewest stages that fit the
    budget (pipeline/weights/stage_memory.py), printing each stage's need against it. Raises UsageError."""
    if args.stages != "auto":
        return args.stages, args.layer_split
    if args.stage_memory_gib is None or not 0 < args.stage_memory_gib < math.inf or args.layer_split:
        raise UsageError("--stages auto needs a finite --stage-memory-gib > 0 (and no --layer-split)")
    from pipeline.run_config import MODEL_DTYPES
    from pipeline.weights.registry import resolve_model
    from pipeline.weights.stage_memory import plan_stages_for_budget

    dtype = MODEL_DTYPES.get(args.dtype)
    if dtype is None:
        raise UsageError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {args.dtype!r}")
    model_dir = resolve_model(args.model, cache_dir=args.cache_dir, progress=progress)
    exit_bytes = 0
    if args.speculate in ("speed", "speed+firp", "auto"):  # a trained exit head's file and a draft layer's KV
        from launcher.coordinator.predictor_select import given_exit_bytes
        from pipeline.model.config import ModelConfig
        from pipeline.weights.stage_memory import kv_bytes_per_layer
        kv = kv_bytes_per_layer(ModelConfig.from_model_dir(model_dir), dtype=dtype, max_num_seqs=args.max_num_seqs,
                                max_model_len=args.max_model_len)
        exit_bytes = given_exit_bytes(predictor=args.predictor, exit_predictor=args.exit_predictor, kv_layer_bytes=kv)
    plan = plan_stages_for_budget(model_dir, budget_bytes=int(args.stage_memory_gib * 2**30), dtype=dtype,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  exit_bytes=exit_bytes, exit_layer=args.exit_layer)
    for line in plan.lines():
        logging.getLogger(__name__).info("%s", line)
        if progress:
            say(line)
    return len(plan.ranges), plan.layer_split()


def speculation_choice(args: argparse.Namespace, num_stages: int) -> tuple[str, str]:
    """(the --speculate mode, why: "" unless `auto` chose it; [Note: speculation default] in
    launcher/cli/speculation_defaults.py)."""
    if args.speculate != "auto":
        return args.speculate, ""
    return auto_speculate(model=args.model, num_stages=num_stages, placement=placement_from_args(args),
                          device=args.device, threads_per_stage=args.threads_per_stage, predictor=args.predictor,
                          exit_predictor=args.exit_predictor)


def options_and_reason(args: argparse.Namespace, *, progress: bool = True) -> tuple[PipelineOptions, str]:
    """(PipelineOptions from launch's / serve's flags, why `--speculate auto` chose the mode: "" when
    the flag named it). Raises UsageError, or ValueError naming the parameter (RunConfig)."""
    num_stages, layer_split = _auto_stages(args, progress)
    speculate, why = speculation_choice(args, num_stages)
    tuning = dict(max_inflight=args.max_inflight, min_acceptance=min_acceptance_arg(args.min_acceptance),
                  draft_at=args.draft_at, deep_draft_min_acceptance=args.deep_draft_min_acceptance,
                  firp_k=args.firp_k, firp_file=args.firp_file, firp_min_prob=args.firp_min_prob,
                  draft_tree=args.draft_tree)
    placement = placement_from_args(args)
    if num_stages >= 1 and not (placement.multi_node and placement.node_rank > 0):  # RunConfig names bad counts;
        check_auto_flags(tuning, speculate=speculate, why=why)  # members run node 0's choice, not their own
        for note in idle_flag_notes(args, tuning, speculate=speculate, why=why):
            say(note)
    options = PipelineOptions(
        num_stages=num_stages, model=args.model, layer_split=layer_split, dtype=args.dtype, device=args.device,
        quantization=args.quantization, dense_layout=args.dense_layout, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, threads_per_stage=args.threads_per_stage,
        stage_timeout_s=args.stage_timeout_s, log_level=args.log_level.upper(), cache_dir=args.cache_dir,
        progress=progress, speculate=speculate, predictor=args.predictor, exit_layer=args.exit_layer,
        exit_predictor=args.exit_predictor, row_cost_file=args.row_cost_file, row_cost=args.row_cost, **tuning,
        placement=placement, record_timeline=not getattr(args, "no_timeline", False))
    return options, why


def sampling_params(args: argparse.Namespace, index: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=None if args.seed is None else args.seed + index, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def cmd_launch(args: argparse.Namespace) -> int:
    from launcher.cli.launch import print_report, run_launch, trace_events, write_trace  # keeps --help fast
    from launcher.cli.output_paths import check_output_file

    if args.serve:
        given = [flag for flag, value in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file),
                                          ("--json", args.json), ("--trace", args.trace)) if value]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be used with --serve: the server takes its prompts over "
                             f"HTTP/gRPC (drop --serve to run the prompts)")
        return cmd_serve(args)
    if args.trace and args.no_timeline:
        raise UsageError("--trace needs the timeline: drop --no-timeline")
    if args.trace:
        check_output_file("--trace", args.trace)
    options, why = options_and_reason(args, progress=not args.no_progress and not args.json)
    if options.placement.multi_node and options.placement.node_rank > 0:
        return run_member(options)
    prompts = read_prompts(args)
    params = [sampling_params(args, i) for i in range(len(prompts))]
    options, model, why = settle_auto(options, resolve(options), why)
    for i, p in enumerate(prompts):  # length limits before anything is spawned
        check_prompt_length(num_prompt_tokens=len(model.tokenizer.encode(p)), max_new_tokens=params[i].max_new_tokens,
                            max_model_len=options.max_model_len, what=f"prompt {i}")
    freeze_startup_heap()  # before the pipeline's objects exist: [Note: the collector on the per-token path]
    session = PipelineSession(options, model, restart_budget=restart_budget(args))
    if not args.json:
        if why:
            say(f"speculation: {options.speculate} (--speculate auto: {why})")
        say(f"{options.num_stages} stage(s) of {model.model_dir.name}: " + "; ".join(session.placement()))
        if model.predictor_note:
            say(model.predictor_note)
        if options.uses_speed and options.min_acceptance is None:
            say(draft_gate_note(options))
    start = time.perf_counter()
    with session:
        if session.row_costs is not None and options.calibrates_row_costs:  # stderr, so also with --json
            head_ms = session.exit_head_ms
            say(f"row costs calibrated at start-up (sum of {options.num_stages} stages): {ratio_line(session.row_costs)}"
                + (f"; exit head {head_ms:.2f} ms a row" if head_ms else ""))
        if not args.json:
            say(f"pipeline ready in {time.perf_counter() - start:.1f} s; generating {len(prompts)} prompt(s)")
        report = run_launch(session, prompts, params, stream=not args.json and len(prompts) == 1,
                            speculate_reason=why)
        trace = trace_events(session) if args.trace else None
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(report, streamed=len(prompts) == 1)
    if trace is not None:  # after the results: a failed write loses none of them
        write_trace(trace, args.trace)
        if not args.json:
            say(f"trace written to {args.trace}")
    failed = [(i, o["error"]) for i, o in enumerate(report["outputs"]) if "error" in o]
    for i, error in failed:  # [Note: non-finite logits]: the others were printed above
        print(f"{PROG} launch: request failed: prompt {i}: {error}", file=sys.stderr)
    return 1 if failed else 0


def run_member(options: PipelineOptions) -> int:
    """`launch --nnodes N --node-rank R` with R > 0: run this node's stages for node 0 (no prompts)."""
    from launcher.backends.multinode import run_member_node

    folder = resolve(options).model_dir  # the model and split are valid here too, before anything starts
    return run_member_node(options.placement, num_stages=options.num_stages, log_level=options.log_level,
                           threads_per_stage=options.threads_per_stage, say=say, model=(model_key(folder), folder.name))


def say(text: str) -> None:
    """A progress line for people, on stderr (stdout carries only results)."""
    print(f"[speedpipe] {text}", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM: unwinds as Ctrl-C does (every stage stopped), then exit 143 (128 + SIGTERM)."""


def _sigterm(signum, frame):  # turn SIGTERM into the same clean teardown as Ctrl-C
    raise Terminated("terminated (SIGTERM)")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv; unknown flags are reported with the usage of the command they were given to."""
    implicit_sweep = argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in ("serve", "sweep", "-h", "--help"))
    if implicit_sweep:
        argv = ["bench", "sweep", *argv[1:]]  # plain `bench FLAGS` is the sweep
    args, extras = parser.parse_known_args(argv)
    args.label = args.command
    if args.command == "bench" and not implicit_sweep:
        args.label = f"bench {args.bench_command}"
    if extras:
        target = args.subparsers.get(args.command, parser)
        if args.command == "bench":
            target = target._subparsers._group_actions[0].choices[args.bench_command]  # noqa: SLF001
        target.error(f"unrecognized arguments: {' '.join(extras)}")
    args.model_given = mark_model_given(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    """`speedpipe` entry point. Returns the process exit code."""
    parser = build_parser()
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    level = getattr(args, "log_level", "WARNING").upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _sigterm)
    command = args.label
    try:
        check_vllm_args(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{PROG} {command}: error: {flag_message(str(exc))}", file=sys.stderr)
        return 2
    except (PipelineError, StageStartupError) as exc:  # a RequestError: one request's logits were not finite
        print(f"{PROG} {command}: {'request' if isinstance(exc, RequestError) else 'pipeline'} failed: {exc}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        stages = command not in ("train-predictor", "bench serve", "simulate")  # these start no stages
        terminated = isinstance(exc, Terminated)
        print(f"{PROG} {command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}"
              + ("; all stages stopped" if stages else ""), file=sys.stderr)
        return 143 if terminated else 130


def launch_main() -> int:
    """`launch` entry point: the short form of `speedpipe launch`."""
    return main(["launch", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
