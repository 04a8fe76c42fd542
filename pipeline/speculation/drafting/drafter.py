"""The drafter: a stronger trained early-exit map (arch "swiglu") and its self-distillation training.

Owns `DrafterMap` (the module the exit stage runs before its frozen final norm + LM head) and
`train_drafter_map` (its training loop on exit-layer states and the base model's own argmax).
Pure torch on in-memory tensors: no files, no CLI. The file format is pipeline/speculation/predictor_file.py's
(tensor names are this module's parameter names); the exit head is pipeline/speculation/predictors.py's ExitHead.

[Note: drafter arch]
arch "swiglu" = the affine map of the "affine" arch (identity-initialised, so an untrained drafter
is the logit lens) followed by `num_blocks` residual SwiGLU blocks, each the shape of a decoder
layer's MLP (pre-RMSNorm with its own weight, gate/up [M, H], down [H, M], down zero-initialised):

    y_0 = W x + b;   y_i = y_{i-1} + down_i(silu(gate_i(n_i)) * up_i(n_i)),  n_i = rmsnorm_i(y_{i-1}).

It is the feature-level drafter of EAGLE (arXiv 2401.15077 §3: a small decoder-shaped network on the
target model's features, trained to reproduce the target's next token) reduced to what a single
exit row can run without per-sequence state, and Kangaroo's adapter (arXiv 2404.18911 §3.1) with
its attention layer dropped: the exit row already carries the sequence's context from the layers
below it. Trained on the base model's own continuations ([Note: self-distilled data] in
pipeline/training/self_distill.py) with the candidate-vocabulary loss of pipeline/training/early_exit.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.family_blocks import RMSNorm, rms_normalize
from pipeline.training.schedule import one_cycle

DRAFTER_ARCH = "swiglu"


class SwiGLUBlock(nn.Module):
    """Residual block x + down(silu(gate(n)) * up(n)), n = rmsnorm(x) * norm.weight.
    forward(x: [rows, H]) -> [rows, H]; float32 inside."""

    def __init__(self, hidden_size: int, mlp_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.gate = nn.Linear(hidden_size, mlp_size, bias=False)
        self.up = nn.Linear(hidden_size, mlp_size, bias=False)
        self.down = nn.Linear(mlp_size, hidden_size, bias=False)
        self.dropout = 0.0  # training only (train_drafter_map sets it)
        with torch.no_grad():
            self.down.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        a = F.silu(self.gate(n)) * self.up(n)
        if self.training and self.dropout:
            a = F.dropout(a, self.dropout)
        return x + self.down(a)


class DrafterMap(nn.Module):
    """Exit map of arch "swiglu" ([Note: drafter arch]): affine `proj` then `num_blocks` SwiGLUBlocks.

    forward(x: [num_rows, H]) -> [num_rows, H] in x's dtype. Parameter names ("proj.weight" [H, H],
    "proj.bias" [H], "blocks.{i}.norm.weight" [H], "blocks.{i}.gate.weight" / "up.weight" [M, H],
    "blocks.{i}.down.weight" [H, M]) are the predictor file's tensor names.
    Raises ValueError for num_blocks < 1 or mlp_size < 1.
    """

    arch = DRAFTER_ARCH
    early_stop: tuple[int, float] | None = None  # (step kept, its validation agreement), set by training

    def __init__(self, hidden_size: int, *, mlp_size: int = 768, num_blocks: int = 1, eps: float = 1e-5) -> None:
        super().__init__()
        if num_blocks < 1 or mlp_size < 1:
            raise ValueError(f"drafter needs >= 1 block of >= 1 unit, got {num_blocks} blocks of {mlp_size}")
        self.eps = eps
        self.proj = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(hidden_size))
            self.proj.bias.zero_()
        self.blocks = nn.ModuleList(SwiGLUBlock(hidden_size, mlp_size, eps) for _ in range(num_blocks))

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, eps: float = 1e-5) -> DrafterMap:
        """Build from predictor-file tensors (a "draft_vocab" is skipped). Raises ValueError on a
        missing or mis-shaped tensor."""
        tensors = {n: t for n, t in tensors.items() if n != "draft_vocab"}
        num_blocks = len({n.split(".")[1] for n in tensors if n.startswith("blocks.")})
        if "proj.weight" not in tensors or "blocks.0.gate.weight" not in tensors:
            raise ValueError("swiglu drafter tensors need proj.weight and blocks.0.gate.weight")
        mlp_size, hidden_size = tensors["blocks.0.gate.weight"].shape
        drafter = cls(hidden_size, mlp_size=mlp_size, num_blocks=num_blocks, eps=eps)
        try:
            drafter.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"drafter tensors do not fit arch {DRAFTER_ARCH!r}: {str(exc).splitlines()[0]}") from None
        return drafter.eval().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x.to(self.proj.weight.dtype))
        for block in self.blocks:
            y = block(y)
        return y.to(x.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterTrainConfig:
    """AdamW with a one-cycle schedule: `steps` of `batch_size` rows at peak `lr`; `weight_decay` on
    the blocks only (towards the plain affine map); `dropout` on the blocks' hidden units;
    `mlp_size` and `num_blocks` size the drafter; `seed`; `soft_weight` β in [0, 1]: the loss is
    (1 - β) cross-entropy against the argmax + β cross-entropy against the base model's own top-k
    distribution (renormalised over the candidate vocabulary; soft-target distillation, Hinton et
    al. arXiv 1503.02531), which needs teacher tokens and probabilities; `val_every`: with
    validation rows, measure their top-1 agreement every this many steps and keep the best
    drafter seen (early stopping against over-fitting, [Note: early stop])."""

    steps: int = 2000
    batch_size: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    mlp_size: int = 768
    num_blocks: int = 1
    seed: int = 0
    soft_weight: float = 0.0
    val_every: int = 100

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.soft_weight <= 1:
            raise ValueError(f"soft_weight must be in [0, 1], got {self.soft_weight}")
        if self.mlp_size < 1 or self.num_blocks < 1:
            raise ValueError(f"mlp_size and num_blocks must be >= 1, got {self.mlp_size}, {self.num_blocks}")
        if self.val_every < 1:
            raise ValueError(f"val_every must be >= 1, got {self.val_every}")


def train_drafter_map(*, hidden: torch.Tensor, targets: torch.Tensor, norm_weight: torch.Tensor,
                      lm_head_weight: torch.Tensor, eps: float, config: DrafterTrainConfig,
                      teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
                      val: tuple[torch.Tensor, torch.Tensor] | None = None,
                      on_step: Callable[[int, float], None] | None = None) -> DrafterMap:
    """Train a DrafterMap so that argmax(lm_head(norm(drafter(h)))) matches `targets`.

    hidden: [num_rows, H] exit-layer states (any float dtype); targets: [num_rows] int64 base-model
    argmax; norm_weight: [H]; lm_head_weight: [V, H]; teacher: (ids [num_rows, k] int64, probs
    [num_rows, k]) the base model's top-k next tokens, needed when config.soft_weight > 0; val:
    (hidden [rows, H], targets [rows]) validation rows kept out of training, for early stopping
    ([Note: early stop]). The loss is over the candidate vocabulary ([Note: candidate vocabulary]
    in pipeline/training/early_exit.py). on_step(step, loss) after each step. Returns the drafter
    (the best on `val` when given, else the last) in eval mode, float32, gradients off.
    Raises ValueError for mismatched shapes or soft_weight > 0 without a teacher.

    [Note: early stop]
    A head trained on a few thousand self-distilled rows learns them by heart (92-95 % training
    agreement against 30-46 % held out on the default model). Rows held out of training — whole
    blocks of consecutive rows, so that neighbouring positions of one continuation do not sit on
    both sides — measure the drafter every `val_every` steps over the candidate vocabulary, and
    the best state is kept: the step count becomes an upper bound rather than a guess.
    """
    if config.soft_weight > 0 and teacher is None:
        raise ValueError("soft_weight > 0 needs the base model's top-k tokens (self-distilled data)")
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != norm_weight.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit targets {tuple(targets.shape)} / "
                         f"hidden size {norm_weight.shape[0]}")
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    candidates, local_targets = torch.unique(targets, return_inverse=True)
    head = (lm_head_weight[candidates] * norm_weight[None, :]).float()  # [C, H], norm weight folded in
    soft = _soft_targets(teacher, candidates, lm_head_weight.shape[0]) if config.soft_weight > 0 else None
    drafter = DrafterMap(hidden.shape[1], mlp_size=config.mlp_size, num_blocks=config.num_blocks, eps=eps)
    for block in drafter.blocks:
        block.dropout = config.dropout
    opt, sched = _optimiser(drafter, config)
    best = _EarlyStop(val, candidates, head, eps)
    drafter.train()
    for step in range(config.steps):
        rows = torch.randint(0, hidden.shape[0], (config.batch_size,), generator=gen)
        logits = rms_normalize(drafter(hidden[rows].float()), eps) @ head.T
        loss = F.cross_entropy(logits, local_targets[rows])
        if soft is not None:
            q = torch.zeros_like(logits).scatter_add_(1, soft[0][rows], soft[1][rows])
            soft_loss = -(q * F.log_softmax(logits, dim=-1)).sum(-1).mean()
            loss = (1 - config.soft_weight) * loss + config.soft_weight * soft_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.detach().item())
        if (step + 1) % config.val_every == 0 or step + 1 == config.steps:
            best.check(drafter, step + 1)
    for block in drafter.blocks:
        block.dropout = 0.0
    best.restore(drafter)
    return drafter.eval().requires_grad_(False)


def _optimiser(drafter: DrafterMap, config: DrafterTrainConfig):
    """AdamW (weight decay on the blocks' matrices only) and its one-cycle schedule."""
    decay = [p for n, p in drafter.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for n, p in drafter.named_parameters() if not (n.startswith("blocks.") and p.dim() == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=config.lr)
    return opt, one_cycle(opt, max_lr=config.lr, steps=config.steps)


class _EarlyStop:
    """The best drafter state on the validation rows ([Note: early stop]); inert without rows.
    val: (hidden [rows, H], targets [rows]); candidates: [C] token ids; head: [C, H] (norm folded in)."""

    def __init__(self, val: tuple[torch.Tensor, torch.Tensor] | None, candidates: torch.Tensor,
                 head: torch.Tensor, eps: float) -> None:
        self.val, self.candidates, self.head, self.eps = val, candidates, head, eps
        self.best_agreement, self.best_step, self.state = -1.0, 0, None

    @torch.no_grad()
    def check(self, drafter: DrafterMap, step: int) -> None:
        if self.val is None or self.val[1].numel() == 0:
            return
        drafter.eval()
        pred = self.candidates[(rms_normalize(drafter(self.val[0].float()), self.eps) @ self.head.T).argmax(-1)]
        agreement = float((pred == self.val[1]).float().mean())
        drafter.train()
        if agreement > self.best_agreement:
            self.best_agreement, self.best_step = agreement, step
            self.state = {n: t.detach().clone() for n, t in drafter.state_dict().items()}

    def restore(self, drafter: DrafterMap) -> None:
        if self.state is not None:
            drafter.load_state_dict(self.state)
        drafter.early_stop = (self.best_step, self.best_agreement) if self.state is not None else None


def validation_split(num_rows: int, *, fraction: float, block: int = 128, seed: int = 0) -> torch.Tensor:
    """[num_rows] bool mask, True for validation rows: whole blocks of `block` consecutive rows
    (one continuation's neighbouring positions stay on one side), about `fraction` of them, chosen
    with `seed`; at least one block is left for training. Raises ValueError for a fraction outside
    [0, 1)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    num_blocks = -(-num_rows // block)
    take = min(int(round(fraction * num_blocks)), num_blocks - 1)
    chosen = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:take]
    mask = torch.zeros(num_blocks, dtype=torch.bool)
    mask[chosen] = True
    return mask.repeat_interleave(block)[:num_rows]


def _soft_targets(teacher: tuple[torch.Tensor, torch.Tensor], candidates: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher top-k (ids [rows, k], probs [rows, k]) as candidate-local (index [rows, k] int64,
    weight [rows, k] float32): tokens outside `candidates` get weight 0 (index 0), and each row's
    weights are renormalised to sum to 1 (all-zero rows stay zero)."""
    ids, probs = teacher
    lut = torch.full((vocab_size,), -1, dtype=torch.int64)
    lut[candidates] = torch.arange(candidates.numel())
    local = lut[ids]
    weight = torch.where(local >= 0, probs.float(), torch.zeros(()))
    weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-9)
    return local.clamp_min(0), weight
