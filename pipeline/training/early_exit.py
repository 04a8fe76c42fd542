"""Training an early-exit head by self-distillation, and measuring its agreement with the model.

Owns the training loop of an `ExitMap` (the frozen final norm + LM head stay fixed) and the
held-out top-1 agreement metric. Pure torch on in-memory tensors: no files, no CLI.

[Note: candidate vocabulary]
The loss is cross-entropy against the base model's own argmax (self-distillation: the draft is
accepted exactly when the exit head's argmax equals it, so this is what maximises acceptance). A
full-vocabulary softmax costs H x V per row (576 x 49152 on the default model) forward and
backward, which dominates training on CPU. The loss is therefore taken over the candidate
vocabulary: every token that occurs as a target in the training data (a few thousand), which is
the sampled-softmax approximation (Jean et al., arXiv 1412.2007) with a fixed sample. Evaluation
always uses the full vocabulary, so the reported agreement is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.model.family_blocks import rms_normalize
from pipeline.speculation.predictors import ExitMap
from pipeline.training.schedule import one_cycle


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExitTrainConfig:
    """Optimiser settings: AdamW (`lr`, `weight_decay` pulling the map towards the identity),
    `steps` of `batch_size` rows, `arch` affine | mlp, `mlp_size` hidden units, `seed`, and `rank`:
    0 trains the affine map's full H x H change from the identity, r > 0 a rank-r change U V
    (fewer parameters, less over-fitting on small corpora; the file still stores the full matrix)."""

    arch: str = "affine"
    steps: int = 1000
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.0
    mlp_size: int = 512
    seed: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("affine", "mlp"):
            raise ValueError(f"arch must be affine or mlp, got {self.arch!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def train_exit_map(*, hidden: torch.Tensor, targets: torch.Tensor, norm_weight: torch.Tensor,
                   lm_head_weight: torch.Tensor, eps: float, config: ExitTrainConfig,
                   on_step: Callable[[int, float], None] | None = None) -> ExitMap:
    """Train an ExitMap so that argmax(lm_head(norm(map(h)))) matches `targets`.

    hidden: [num_rows, H] exit-layer states (any float dtype); targets: [num_rows] int64 base-model
    argmax; norm_weight: [H]; lm_head_weight: [V, H]. on_step(step, loss) after each step.
    Loss over the candidate vocabulary, see [Note: candidate vocabulary]. Returns the map in eval
    mode, float32, gradients off. Raises ValueError for mismatched shapes.
    """
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != norm_weight.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit targets {tuple(targets.shape)} / "
                         f"hidden size {norm_weight.shape[0]}")
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    candidates, local_targets = torch.unique(targets, return_inverse=True)
    head = (lm_head_weight[candidates] * norm_weight[None, :]).float()  # [C, H], norm weight folded in
    h_size = hidden.shape[1]
    exit_map = ExitMap(h_size, arch=config.arch, mlp_size=config.mlp_size, eps=eps)
    # The affine part is trained as identity + delta so that weight decay pulls towards the logit lens.
    if config.rank:
        u = torch.zeros(h_size, config.rank, requires_grad=True)  # zero: starts at the identity
        v = (torch.randn(config.rank, h_size, generator=gen) / h_size ** 0.5).requires_grad_(True)
        factors = [u, v]
    else:
        factors = [torch.zeros(h_size, h_size, requires_grad=True)]

    def delta() -> torch.Tensor:
        return factors[0] @ factors[1] if config.rank else factors[0]

    params = [*factors, exit_map.proj.bias] + ([] if exit_map.mlp is None else list(exit_map.mlp.parameters()))
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    sched = one_cycle(opt, max_lr=config.lr, steps=config.steps)
    exit_map.proj.weight.requires_grad_(False)
    eye = torch.eye(h_size)
    for step in range(config.steps):
        rows = torch.randint(0, hidden.shape[0], (config.batch_size,), generator=gen)
        x = hidden[rows].float()
        y = F.linear(x, eye + delta(), exit_map.proj.bias)
        if exit_map.mlp is not None:
            y = y + exit_map.mlp["down"](F.silu(exit_map.mlp["up"](rms_normalize(x, eps))))
        loss = F.cross_entropy(rms_normalize(y, eps) @ head.T, local_targets[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.detach().item())
    with torch.no_grad():
        exit_map.proj.weight.copy_(eye + delta())
    return exit_map.eval().requires_grad_(False)


def draft_vocabulary(targets: torch.Tensor, *, max_size: int) -> torch.Tensor:
    """The draft vocabulary of a trained head: the distinct `targets` (base-model argmax tokens of
    the training data, any shape, int64), most frequent first (ties: lower id first), at most
    `max_size` of them. Returns [V'] int64. See pipeline/speculation/predictors.py [Note: draft vocabulary].
    Raises ValueError when max_size < 1 or there are no targets."""
    if max_size < 1:
        raise ValueError(f"draft_vocab must be >= 1, got {max_size}")
    if targets.numel() == 0:
        raise ValueError("no training targets to build a draft vocabulary from")
    ids, counts = torch.unique(targets.reshape(-1), return_counts=True)  # ids ascending
    order = torch.argsort(counts, descending=True, stable=True)
    return ids[order[:max_size]].to(torch.int64)


@torch.no_grad()
def top1_agreement(*, hidden: torch.Tensor, targets: torch.Tensor, norm_weight: torch.Tensor,
                   lm_head_weight: torch.Tensor, eps: float, exit_map: ExitMap | None = None,
                   vocab_ids: torch.Tensor | None = None, chunk_rows: int = 1024) -> float:
    """Share of rows whose argmax of lm_head(norm([map](h))) equals `targets`.

    hidden: [num_rows, H]; targets: [num_rows]. Without `exit_map` this is the logit lens. The
    argmax is over the full vocabulary, or over `vocab_ids` ([V'] int64, a draft vocabulary) when
    given, as the exit stage computes it."""
    head = lm_head_weight if vocab_ids is None else lm_head_weight[vocab_ids]
    hits = 0
    for lo in range(0, hidden.shape[0], chunk_rows):
        x = hidden[lo:lo + chunk_rows].float()
        if exit_map is not None:
            x = exit_map(x)
        pred = ((rms_normalize(x, eps) * norm_weight) @ head.T).argmax(-1)
        if vocab_ids is not None:
            pred = vocab_ids[pred]
        hits += int((pred == targets[lo:lo + chunk_rows]).sum())
    return hits / max(1, hidden.shape[0])
