"""Up-front checks of `speedpipe train-predictor`'s flags, before any model is read or generated.

Owns the rules for the output path (`check_out_path`) and the numeric training flags
(`check_training_flags`): each failure is a ValueError whose one-line message names the flag, so
the command exits 2 before minutes of data generation and training rather than after them.
Must not: read a model, train, or write the predictor file.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from launcher.cli.output_paths import check_output_file


def check_out_path(out: Path) -> None:
    """Refuse an `--out` the predictor file cannot be written to: not a .safetensors file path, or a
    place `check_output_file` (launcher/cli/output_paths.py) refuses. Raises ValueError naming --out."""
    if out.is_dir() or out.suffix != ".safetensors":
        raise ValueError(f"--out {out} must be a file path ending in .safetensors")
    check_output_file("--out", out)


def check_training_flags(args: argparse.Namespace) -> None:
    """Refuse out-of-range numeric training flags (steps, batch size, learning rate, weight decay,
    self-distillation sampling, swiglu sizes). Raises ValueError naming the flag and the value."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a number > 0, got {args.lr}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a number >= 0, got {args.weight_decay}")
    if args.rank < 0:
        raise ValueError(f"--rank must be >= 0 (0 = full), got {args.rank}")
    if args.sampled < 0:
        raise ValueError(f"--sampled must be >= 0, got {args.sampled}")
    if args.sampled and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature must be a number > 0 (with --sampled {args.sampled}), got {args.temperature}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2, got {args.new_tokens}")
    for flag, value in (("--text-prompts", args.text_prompts), ("--prompts", args.prompts),
                        ("--eval-prompts", args.eval_prompts)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.mlp_size < 1 or args.blocks < 1:
        raise ValueError(f"--mlp-size and --blocks must be >= 1, got {args.mlp_size}, {args.blocks}")
    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if not 0 <= args.soft_weight <= 1:
        raise ValueError(f"--soft-weight must be in [0, 1], got {args.soft_weight}")
