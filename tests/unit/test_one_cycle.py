"""The shared one-cycle schedule: every trainer runs for any number of steps >= 1 (10 used to divide by zero)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.speculation.drafting.drafter import DrafterTrainConfig, train_drafter_map
from pipeline.speculation.drafting.layer_drafter import LayerDrafterConfig, train_sequence_model
from pipeline.training.early_exit import ExitTrainConfig, train_exit_map
from pipeline.training.schedule import one_cycle

H, V = 8, 32


def _head_data(rows: int = 64):
    gen = torch.Generator().manual_seed(0)
    return dict(hidden=torch.randn(rows, H, generator=gen), targets=torch.randint(0, V, (rows,), generator=gen),
                norm_weight=torch.ones(H), lm_head_weight=torch.randn(V, H, generator=gen), eps=1e-5)


@pytest.mark.parametrize("steps", range(1, 31))
def test_schedule_runs_every_step_count_with_a_sane_rate(steps):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = one_cycle(opt, max_lr=1e-3, steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert all(math.isfinite(r) and 0 < r <= 1e-3 * (1 + 1e-9) for r in rates)
    assert max(rates) > 1e-3 / 30  # the run trains: some step is near the peak, not all at the final rate


def test_schedule_refuses_zero_steps():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        one_cycle(opt, max_lr=1e-3, steps=0)


@pytest.mark.parametrize("steps", [1, 9, 10, 11])
def test_exit_map_and_drafter_train_for_short_runs(steps):
    """Schedules of 1..11 steps (warm-up of 0 or 1 step) train: finite weights that moved."""
    data = _head_data()
    for trained in (train_exit_map(**data, config=ExitTrainConfig(steps=steps, batch_size=4)),
                    train_drafter_map(**data, config=DrafterTrainConfig(steps=steps, batch_size=4, mlp_size=4))):
        params = [p for p in trained.parameters()] if hasattr(trained, "parameters") else []
        assert params and all(torch.isfinite(p).all() for p in params), type(trained).__name__


@pytest.mark.parametrize("steps", [1, 10])
def test_sequence_drafter_trains_for_short_runs(steps):
    data = _head_data()
    model = torch.nn.Linear(H, H)
    train = [(torch.randn(5, H), torch.randint(0, V, (5,))) for _ in range(3)]
    before = model.weight.detach().clone()
    train_sequence_model(model, train=train, val=[], norm_weight=data["norm_weight"],
                         lm_head_weight=data["lm_head_weight"], eps=1e-5,
                         settings=LayerDrafterConfig(steps=steps, batch_size=2))
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight, before)  # trained, in place
