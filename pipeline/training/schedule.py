"""The learning-rate schedule every trainer here uses: one cycle, valid for any number of steps.

Owns `one_cycle`, the single place that builds the schedule of the early-exit map
(pipeline/training/early_exit.py), the swiglu drafter (pipeline/speculation/drafting/drafter.py) and the
next-layer drafter (pipeline/speculation/drafting/layer_drafter.py). Pure torch: no files, no CLI.

[Note: short one-cycle runs]
torch's OneCycleLR ends its warm-up phase at step `pct_start * total_steps - 1` and divides by that
phase's length: at 10 steps and pct_start 0.1 the length is 0 (ZeroDivisionError), and below it the
phase ends before step 0 (a 1-step run trains at the final, 25e4-times smaller rate). So a run whose
warm-up would be at most one step skips the warm-up: it starts at `max_lr` and anneals it by a cosine
to OneCycleLR's final rate (max_lr / 25 / 1e4) at its last step (momentum is not cycled). Longer runs
are OneCycleLR exactly (Smith and Topin, arXiv 1708.07120).
"""

from __future__ import annotations

import math

import torch

_DIV_FACTOR = 25.0  # OneCycleLR's defaults: initial lr = max_lr / 25, final lr = initial / 1e4
_FINAL_DIV_FACTOR = 1e4


def one_cycle(opt: torch.optim.Optimizer, *, max_lr: float, steps: int,
              pct_start: float = 0.1) -> torch.optim.lr_scheduler.LRScheduler:
    """A one-cycle schedule for `opt` over `steps` optimiser steps (call its step() once after each),
    peaking at `max_lr` after `pct_start` of them; see [Note: short one-cycle runs] for runs too short
    to warm up. Raises ValueError for steps < 1 or pct_start outside (0, 1)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0 < pct_start < 1:
        raise ValueError(f"pct_start must be in (0, 1), got {pct_start}")
    if pct_start * steps > 1:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps, pct_start=pct_start)
    for group in opt.param_groups:
        group["lr"] = max_lr
    final = 1 / (_DIV_FACTOR * _FINAL_DIV_FACTOR)

    def factor(step: int) -> float:
        pct = min(step, steps - 1) / max(1, steps - 1)
        return final + (1 - final) * (1 + math.cos(math.pi * pct)) / 2

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
