"""Command line: `speedpipe <command>` and its short form `launch`.

Owns argument parsing, mapping errors to exit codes (2 for bad input, 1 for a pipeline failure,
130 for Ctrl-C, 143 for SIGTERM), logging set-up, and printing results. Must not hold pipeline logic.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from launcher.backends.placement_options import add_placement_args
from launcher.backends.stage_group import StageStartupError
from launcher.bench.http_load import add_http_bench_args, cmd_http_bench
from launcher.cli.errors import flag_message
from launcher.cli.flag_groups import add_sampling_args, add_speculation_args, sampling_flags_given
from launcher.cli.options import add_pipeline_args, options_and_reason, say
from launcher.cli.parsing import (
    CliParser,
    UsageError,
    check_vllm_args,
    grammar_from_args,
    mark_model_given,
    read_prompts,
    shorten_help,
    structured_output_flags,
    version_string,
)
from launcher.cli.speculation_defaults import settle_auto
from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.request_handle import (
    NoTokenLeftError,
    RequestError,
    StageLoadError,
    TextOptions,
    tokenized_masks,
)
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession, settle_coordinator_process
from launcher.serving.serve import add_serve_args, cmd_serve, restart_budget
from pipeline.engine.stage_assembly import SpecBookkeepingError, is_user_file_error, machine_error
from pipeline.measure.row_cost import ratio_line
from pipeline.run_config import check_prompt_length
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.registry import model_key
from workers.log_config import configure_logging

PROG = "speedpipe"


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
    g.add_argument("--json", action="store_true", help="print one JSON object (outputs, stats) as last line")
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
    from launcher.bench.simulate import add_simulate_args, cmd_simulate
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


def sampling_params(args: argparse.Namespace, index: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=None if args.seed is None else args.seed + index, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos, logit_bias=args.logit_bias or {}, grammar=grammar_from_args(args),
                          min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids,
                          allowed_token_ids=args.allowed_token_ids, bad_words=tuple(args.bad_words))


def text_options(args: argparse.Namespace) -> TextOptions:
    """--no-skip-special-tokens and --include-stop-str-in-output as the coordinator's TextOptions."""
    return TextOptions(skip_special_tokens=args.skip_special_tokens,
                       include_stop_str_in_output=args.include_stop_str_in_output)


def _refuse_prompt_run_flags(args: argparse.Namespace) -> None:
    """`launch --serve`: raise UsageError naming the flags of a prompt run given with it (prompts,
    outputs, sampling settings: a server takes those per request), which it would silently ignore."""
    given = [flag for flag, value in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file),
                                      ("--json", args.json), ("--trace", args.trace)) if value]
    given += sampling_flags_given(args)
    if given:
        raise UsageError(f"{', '.join(given)} cannot be used with --serve: the server takes its prompts over "
                         f"HTTP/gRPC, with their sampling settings (drop --serve to run the prompts)")


def cmd_launch(args: argparse.Namespace) -> int:
    from launcher.cli.launch import (  # keeps --help fast
        print_report,
        run_launch,
        speculation_notes,
        trace_events,
        write_trace,
    )
    from launcher.cli.output_paths import check_output_file

    if args.serve:
        _refuse_prompt_run_flags(args)
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
    tokenized_masks(model.tokenizer, params[0])  # --logit-bias and token mask ids, before anything is spawned
    settle_coordinator_process()  # one torch thread, frozen start-up heap; before the pipeline's objects exist
    session = PipelineSession(options, model, restart_budget=restart_budget(args))
    if not args.json:
        say(f"{options.num_stages} stage(s) of {model.model_dir.name}: " + "; ".join(session.placement()))
        for note in speculation_notes(session, why):  # --json carries them in stats.speculation
            say(note)
    start = time.perf_counter()
    with session:
        if session.row_costs is not None and options.calibrates_row_costs:  # stderr, so also with --json
            head_ms = session.exit_head_ms
            say(f"row costs calibrated at start-up (sum of {options.num_stages} stages): {ratio_line(session.row_costs)}"
                + (f"; exit head {head_ms:.2f} ms a row" if head_ms else ""))
        if not args.json:
            say(f"pipeline ready in {time.perf_counter() - start:.1f} s; generating {len(prompts)} prompt(s)")
        report = run_launch(session, prompts, params, stream=not args.json and len(prompts) == 1,
                            speculate_reason=why, text=text_options(args))
        trace = trace_events(session) if args.trace else None
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print_report(report, streamed=len(prompts) == 1)
    if trace is not None:  # after the results: a failed write loses none of them
        write_trace(trace, args.trace)
        if not args.json:
            say(f"trace written to {args.trace}")
    return _report_failures(report, args)


def request_input_error(message: str, args: argparse.Namespace) -> str:
    """A request's own input that left no token mid-generation (NoTokenLeftError: [Note: no token left] in
    pipeline/speculation/verify.py) in the command line's words: its fields as their flags, `response_format`
    as the structured output flag given."""
    structured = next(iter(structured_output_flags(args)), "--response-format")
    return flag_message(message).replace("response_format", structured)


def _report_failures(report: dict, args: argparse.Namespace) -> int:
    """One stderr line per failed prompt of a `launch` run (the others were printed); the exit code: 0 none
    failed, 2 each failure was the prompt's own input (its masks left no token: [Note: no token left]), else 1
    (a request's logits were not finite: [Note: non-finite logits])."""
    failed = [(i, o) for i, o in enumerate(report["outputs"]) if "error" in o]
    for i, out in failed:
        if "error_param" in out:
            print(f"{PROG} launch: error: prompt {i}: {request_input_error(out['error'], args)}", file=sys.stderr)
        else:
            print(f"{PROG} launch: request failed: prompt {i}: {out['error']}", file=sys.stderr)
    return 0 if not failed else 2 if all("error_param" in out for _, out in failed) else 1


def run_member(options: PipelineOptions) -> int:
    """`launch --nnodes N --node-rank R` with R > 0: run this node's stages for node 0 (no prompts)."""
    from launcher.backends.multinode import run_member_node

    folder = resolve(options).model_dir  # the model and split are valid here too, before anything starts
    return run_member_node(options.placement, num_stages=options.num_stages, log_level=options.log_level,
                           threads_per_stage=options.threads_per_stage, say=say, model=(model_key(folder), folder.name))


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
    signal.signal(signal.SIGTERM, _sigterm)
    command = args.label
    try:
        args.log_level = configure_logging(getattr(args, "log_level", None))  # --log-level, $SPEEDPIPE_LOG_LEVEL
        check_vllm_args(args)
        return args.func(args)
    except SpecBookkeepingError as exc:  # a ValueError, but the coordinator's own (a stage's Load gets it too)
        print(f"{PROG} {command}: internal error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as exc:
        print(f"{PROG} {command}: error: {flag_message(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # [Note: the user's files or the machine] in pipeline/engine/stage_assembly.py
        if is_user_file_error(exc):
            print(f"{PROG} {command}: error: {flag_message(str(exc))}", file=sys.stderr)
            return 2
        print(f"{PROG} {command}: internal error: {machine_error(exc)}", file=sys.stderr)
        return 1
    except StageLoadError as exc:  # the user's input (a model file a stage refused) or an unexpected error
        print(f"{PROG} {command}: {'error' if exc.user_input else 'pipeline failed'}: {exc}", file=sys.stderr)
        return 2 if exc.user_input else 1
    except NoTokenLeftError as exc:  # the request's own masks left no token: bad input found mid-generation
        words = request_input_error(str(exc), args) if args.command == "launch" else flag_message(str(exc))
        print(f"{PROG} {command}: error: {words}", file=sys.stderr)
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
