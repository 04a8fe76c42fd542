"""Notes for flags that a run accepts but that do nothing in the mode it runs in.

Owns `idle_flag_notes`: speculation tuning with `--speculate none` (`--speculative-disable-by-batch-size`
also where `auto` chose none), `--stage-memory-gib` without
`--stages auto`, `--decode-feed stage` where it cannot apply, Ray's placement flags without `--backend ray`, and `--dtype` under the int
kernels (which compute in bfloat16). A user who sets one of these expects it to act; saying it
does not is better than silently ignoring it, and it is only a note (vLLM warns the same way).
Must not: refuse a flag for its value (launcher/cli/options.py and RunConfig do that); the one
exception is a `--predictor` / `--exit-predictor` file named with `--speculate none`, whose header
is still read (`idle_speculation_flags`), so a wrong path fails as it would with speculation on.
"""

from __future__ import annotations

import argparse

from launcher.cli.speculation_defaults import idle_speculation_flags


def _note(flags: list[str], what: str) -> list[str]:
    return [f"note: {', '.join(flags)} {'has' if len(flags) == 1 else 'have'} no effect {what}"] if flags else []


def idle_flag_notes(args: argparse.Namespace, tuning: dict, *, speculate: str, why: str) -> list[str]:
    """One line per group of `launch` / `serve` flags in `args` that do nothing in this run.
    tuning: the speculation tuning values as RunConfig takes them; speculate: the mode chosen
    (why: "" when `--speculate` named it, else why `auto` chose it: flags are then not idle by choice)."""
    notes = []
    # nothing to pause ([Note: speculation under load] in pipeline/engine/row_budget.py); < 1 is RunConfig's error
    pause = ["--speculative-disable-by-batch-size"] if (getattr(args, "speculative_disable_by_batch_size", None) or 0) >= 1 else []
    if speculate == "none" and not why:
        idle = idle_speculation_flags({**tuning, "predictor": args.predictor, "exit_predictor": args.exit_predictor})
        notes += _note(idle + pause, "with --speculate none")
    elif speculate == "none":  # (auto's choice: its tuning flags are refused instead, check_auto_flags)
        notes += _note(pause, f"where --speculate auto chose none ({why})")
    if args.stages != "auto" and args.stage_memory_gib is not None:
        notes += _note(["--stage-memory-gib"], "without --stages auto")
    if args.backend != "ray":
        notes += _note([flag for flag, given in (("--ray-address", args.ray_address),
                                                 ("--stage-resources", args.stage_resources),
                                                 ("--placement-strategy", args.placement_strategy != "PACK")) if given],
                       "without --backend ray")
    if args.decode_feed == "stage" and speculate != "none":
        notes += _note(["--decode-feed stage"], f"with --speculate {speculate}: plain decode only (pipeline/engine/decode_feed.py)")
    if args.dtype != "float32" and args.quantization in ("int8", "int4"):
        notes.append(f"note: --quantization {args.quantization} computes in bfloat16 whatever --dtype says")
    return notes
