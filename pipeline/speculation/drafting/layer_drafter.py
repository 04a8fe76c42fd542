"""The next-layer drafter (arch "next-layer"): a fine-tuned copy of the model's layer after the exit
layer, run at the exit stage with its own keys and values, followed by the swiglu drafter.

Owns the draft layer's file tensors, building it for a stage, its differentiable training forward
and its self-distillation training loop. Pure torch: no files, no CLI, no processes.

[Note: next-layer drafter]
Offline, on the same self-distilled data (tests/benchmarks/drafter_arch.py, layer 16 of the
default model), layer 17's attention and MLP copied from the model and fine-tuned ahead of the
swiglu block agree with the model's greedy token more often than the swiglu drafter alone on every
held-out set (chat 31.4 vs 29.6 %, speeches 53.1 vs 39.6 %, code 45.3 vs 41.5 %). The same shape
trained from scratch (Kangaroo's adapter, arXiv 2404.18911 §3.1) over-fits and loses; starting
from the next real layer is what pays (EAGLE, arXiv 2401.15077 §3, drafts with a decoder layer).
In the pipeline it is not faster than the shipped head yet (README "Self-distilled drafter": each
stage-0 pass pays one more layer), so it is an option (`train-predictor --arch next-layer`), not the default.

At the exit stage the draft layer runs right after the exit layer on every real row of every pass
(prefills, decodes, drafts, token-tree siblings, whether or not an item wants a guess) and keeps
its keys and values as one extra layer of the stage's own KV cache. So whatever keeps the stage's
cache right keeps the draft layer's right as well: a squashed item's entries are overwritten when
the real token re-runs at that position, a kept token-tree sibling's scratch entry is copied on
every layer, truncation and slot reuse are shared. Its output at each item's last row is what the
swiglu map, final norm and LM head turn into the guess. Guesses only decide what is drafted:
committed tokens never depend on the draft layer.
Scope: families whose layers have no sliding window, q/k norm, sandwich norms or experts (the
training forward mirrors DecoderLayer.forward for those); not with FIRP pseudo rows.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.model.config import ModelConfig
from pipeline.model.family_blocks import rms_normalize
from pipeline.model.rope import config_inv_freq, rope_cos_sin, rotate, rotation_tables
from pipeline.model.stage_model import MLP, Attention, DecoderLayer
from pipeline.speculation.drafting.drafter import DrafterMap
from pipeline.training.schedule import one_cycle

NEXT_LAYER_ARCH = "next-layer"
DRAFT_LAYER_PREFIX = "draft_layer."


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why `config`'s family cannot run the next-layer drafter, or None when it can."""
    if any(config.is_sliding(i) for i in range(config.num_hidden_layers)) or config.rope_local_theta is not None:
        return "sliding-window layers"
    if config.qk_norm or config.sandwich_norms or config.query_pre_attn_scalar is not None \
            or config.attn_logit_softcapping is not None:
        return "q/k norms, sandwich norms, a query scale or an attention soft-cap"
    if config.num_experts:
        return "mixture-of-experts layers"
    if config.rope_scaling is not None and not config.rope_scaling.frequencies_only:
        return "YaRN or LongRoPE scaling (the training forward has no attention factor or long factors)"
    return None


def split_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A next-layer predictor file's tensors -> (draft layer's state dict, swiglu map's tensors)."""
    layer = {n[len(DRAFT_LAYER_PREFIX):]: t for n, t in tensors.items() if n.startswith(DRAFT_LAYER_PREFIX)}
    rest = {n: t for n, t in tensors.items() if not n.startswith(DRAFT_LAYER_PREFIX)}
    return layer, rest


def fused_layer(config: ModelConfig, layer: int) -> DecoderLayer:
    """An empty DecoderLayer of absolute index `layer` with q/k/v and gate/up fused, as loaded stages run."""
    module = DecoderLayer(config, layer)
    module.self_attn.fuse()
    if isinstance(module.mlp, MLP):
        module.mlp.fuse()
    return module


def build_draft_layer(config: ModelConfig, exit_layer: int, tensors: dict[str, torch.Tensor], *,
                      dtype: torch.dtype, device: torch.device | str) -> DecoderLayer:
    """The draft layer of a next-layer file (`split_tensors`' first part), in eval mode, no gradients.
    Raises ValueError for an unsupported family or tensors that do not fit the model's layer."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"the next-layer drafter does not support {config.model_type} ({reason})")
    module = fused_layer(config, exit_layer + 1)
    try:
        module.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"draft layer tensors do not fit the model: {str(exc).splitlines()[0]}") from None
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def sequence_attention(attn: Attention, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Differentiable causal grouped-query attention of `attn` (its projections, RoPE, no KV cache, no
    q/k norms: `unsupported_reason`) over whole sequences: x [B, T, H] (normed inputs, each sequence
    from position 0, right-padded) -> o_proj output [B, T, H]."""
    b, t, _ = x.shape
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn._qkv(x)
    cos, sin = rope_cos_sin(torch.arange(t, device=x.device), inv_freq, x.dtype)
    cos, signed_sin = rotation_tables(cos.repeat(b, 1), sin.repeat(b, 1))
    q = rotate(q.reshape(b * t, h, d), cos, signed_sin).reshape(b, t, h, d).transpose(1, 2)
    k = rotate(k.reshape(b * t, kvh, d), cos, signed_sin).reshape(b, t, kvh, d).transpose(1, 2)
    v = v.reshape(b, t, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1),
                                         is_causal=True)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, h * d))


def train_forward(layer: DecoderLayer, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Differentiable DecoderLayer.forward over whole sequences: x [B, T, H] (each from position 0,
    right-padded) -> [B, T, H], `sequence_attention` then the MLP, both residual."""
    x = x + sequence_attention(layer.self_attn, layer.input_layernorm(x), inv_freq)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerDrafterConfig:
    """AdamW, one-cycle schedule: `steps` batches of `batch_size` whole sequences at peak `lr`,
    `weight_decay`, `seed`; the state best on the validation sequences, scored every `val_every`
    steps, is kept ([Note: early stop] in pipeline/speculation/drafting/drafter.py)."""

    steps: int = 600
    batch_size: int = 6
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    val_every: int = 100

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.val_every < 1 or not self.lr > 0:
            raise ValueError("next-layer drafter: steps, batch size and val_every must be >= 1, lr > 0")


Sequence = tuple[torch.Tensor, torch.Tensor]  # exit states [T, H], targets [T] int64 (-100: not a draft row)


class SequenceDrafter(torch.nn.Module):
    """The draft layer's training forward, then the swiglu map: forward(x: [B, T, H] exit states of
    whole sequences) -> [B, T, H], what the exit stage computes row by row with its KV cache."""

    def __init__(self, layer: DecoderLayer, exit_map: DrafterMap, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.exit_map = layer, exit_map
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit_map(train_forward(self.layer, x, self.inv_freq))


def _batch(seqs: list[Sequence], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t_max = max(seqs[i][0].shape[0] for i in idx)
    x = torch.zeros(len(idx), t_max, seqs[0][0].shape[1])
    tg = torch.full((len(idx), t_max), -100, dtype=torch.int64)
    for j, i in enumerate(idx):
        x[j, :seqs[i][0].shape[0]], tg[j, :seqs[i][1].shape[0]] = seqs[i][0].float(), seqs[i][1]
    return x, tg


def sequence_top1(drafter: torch.nn.Module, seqs: list[Sequence], head: torch.Tensor, eps: float,
                  local: torch.Tensor | None = None) -> float:
    """Top-1 agreement over the draft rows of `seqs`; head: [C, H] norm-folded LM head rows (all of
    the vocabulary, or candidates with `local` mapping token id -> row, -100 outside)."""
    hits = total = 0
    with torch.no_grad():
        for h, t in seqs:
            rows = t >= 0
            y = drafter(h.float()[None])[0][rows]
            pred = rms_normalize(y, eps) @ head.T
            want = t[rows] if local is None else local[t[rows]]
            hits, total = hits + int((pred.argmax(-1) == want).sum()), total + int(rows.sum())
    return hits / max(total, 1)


def train_layer_drafter(*, train: list[Sequence], val: list[Sequence], init_layer: DecoderLayer, config: ModelConfig,
                        norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, settings: LayerDrafterConfig,
                        on_step: Callable[[int, float], None] | None = None) -> tuple[DecoderLayer, DrafterMap]:
    """Fine-tune a copy of `init_layer` (the model's layer exit+1) plus a swiglu DrafterMap so that
    argmax(lm_head(norm(map(layer(h))))) matches the targets (`train_sequence_model`). Returns both in
    eval mode, float32, gradients off; the map's `early_stop` holds (step kept, validation agreement).
    Raises ValueError for an unsupported family or no training rows."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"the next-layer drafter does not support {config.model_type} ({reason})")
    torch.manual_seed(settings.seed)
    layer = copy.deepcopy(init_layer).float().requires_grad_(True)
    drafter = SequenceDrafter(layer, DrafterMap(config.hidden_size, eps=config.rms_norm_eps), config_inv_freq(config, local=False))
    drafter.exit_map.early_stop = train_sequence_model(
        drafter, train=train, val=val, norm_weight=norm_weight, lm_head_weight=lm_head_weight,
        eps=config.rms_norm_eps, settings=settings, on_step=on_step)
    return drafter.layer, drafter.exit_map


def train_sequence_model(model: torch.nn.Module, *, train: list[Sequence], val: list[Sequence],
                         norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float,
                         settings: LayerDrafterConfig,
                         on_step: Callable[[int, float], None] | None = None) -> tuple[int, float] | None:
    """Train `model` (forward: [B, T, F] states of whole sequences -> [B, T, H]) in place so that
    argmax(lm_head(norm(model(x)))) matches the targets, over the candidate vocabulary of the
    training targets ([Note: candidate vocabulary] in pipeline/training/early_exit.py): AdamW,
    one-cycle schedule, `settings.steps` batches of `batch_size` sequences; the state best on `val`
    (scored every `val_every` steps, `sequence_top1`) is kept ([Note: early stop] in
    pipeline/speculation/drafting/drafter.py). Leaves `model` in eval mode, gradients off; returns (step kept,
    validation agreement), or None without `val`. Raises ValueError for no training rows."""
    targets = torch.cat([t[t >= 0] for _, t in train]) if train else torch.empty(0, dtype=torch.int64)
    if not targets.numel():
        raise ValueError("a sequence drafter needs training rows")
    candidates = torch.unique(targets)
    local = torch.full((lm_head_weight.shape[0],), -100, dtype=torch.int64)
    local[candidates] = torch.arange(candidates.numel())
    head = (lm_head_weight[candidates] * norm_weight[None, :]).float()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr,
                            weight_decay=settings.weight_decay)
    sched = one_cycle(opt, max_lr=settings.lr, steps=settings.steps)
    gen, best = torch.Generator().manual_seed(settings.seed), (-1.0, 0, None)
    for step in range(1, settings.steps + 1):
        model.train()
        x, tg = _batch(train, torch.randint(0, len(train), (settings.batch_size,), generator=gen).tolist())
        rows = tg >= 0
        y = model(x)[rows]
        loss = F.cross_entropy(rms_normalize(y, eps) @ head.T, local[tg[rows]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
        if val and (step % settings.val_every == 0 or step == settings.steps):
            model.eval()
            score = sequence_top1(model, val, head, eps, local)
            if score > best[0]:
                best = (score, step, copy.deepcopy(model.state_dict()))
    if best[2] is not None:
        model.load_state_dict(best[2])
    model.eval().requires_grad_(False)
    return (best[1], best[0]) if best[2] is not None else None


def file_tensors(layer: DecoderLayer, exit_map: DrafterMap) -> dict[str, torch.Tensor]:
    """The predictor-file tensors of a trained next-layer drafter (pipeline/speculation/predictor_file.py)."""
    return {**{DRAFT_LAYER_PREFIX + n: t for n, t in layer.state_dict().items()}, **exit_map.state_dict()}
