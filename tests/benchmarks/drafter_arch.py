"""Benchmark: which drafter architecture at the exit layer agrees best with the model (issue 14, item 1).

Measures held-out top-1 agreement (the share of draft positions where the drafter's argmax equals
the base model's greedy next token, over the full vocabulary) of five drafters on the same
self-distilled data, the model's own greedy continuations of `train-predictor --data self-distill`'s
prompts (launcher/cli/distill_data.py; generated once and cached):

    logit-lens      the frozen final norm + LM head on the exit hidden state, untrained
    swiglu          the swiglu drafter (pipeline/speculation/drafter.py, [Note: drafter arch];
                    `train-predictor --arch swiglu`), trained on single rows
    kangaroo        Kangaroo's adapter (arXiv 2404.18911 §3.1): RMSNorm + one multi-head
                    attention layer with RoPE over the sequence's exit states (its own KV in a
                    pipeline), output projection zero-initialised, then the swiglu block
    next-layer      the same shape with the attention (and its norm) initialised from the model's
                    layer exit+1, plus that layer's MLP as a residual block, then the swiglu block:
                    a fine-tuned copy of the next real layer
    fusion          EAGLE-3's feature fusion (arXiv 2503.01840 §3): the states of a low, a middle
                    and the exit layer (exit/4, exit/2, exit: all on the exit stage when it is
                    stage 0), RMS-normalised, concatenated and mapped by a zero-initialised
                    3H -> H layer added to the exit state, then the swiglu block; no attention

The adapters attend over whole sequences, so every position's exit state is taken by one teacher-
forced prefill of prompt + continuation (a forward hook on the exit layer); the scored rows are the
ones SPEED drafts from (each fed generated token, as in pipeline/training/self_distill.py). The
three sequence models (kangaroo, next-layer, fusion) train on whole sequences with the candidate-vocabulary loss ([Note: candidate vocabulary]
in pipeline/training/early_exit.py) and keep their best state on a validation tenth of the training
sequences, as the swiglu drafter does ([Note: early stop]).
Must not: change the shipped drafter; this only measures.

Usage: python tests/benchmarks/drafter_arch.py [--exit-layer 16] [--steps 600] [--threads 2]
       [--archs swiglu,kangaroo,next-layer,fusion] [--out tests/benchmarks/results/drafter_arch.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from launcher.cli.distill_data import DistillSpec, distill_sequences, prepare_distill_data
from pipeline.model.config import ModelConfig
from pipeline.model.rope import apply_rope, config_inv_freq, rope_cos_sin
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import RMSNorm, StageModel
from pipeline.speculation.drafter import DrafterTrainConfig, SwiGLUBlock, train_drafter_map, validation_split
from pipeline.training.data import load_full_model
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

SETS = ("chat", "speeches", "code")
ARCHS = ("swiglu", "kangaroo", "next-layer", "fusion")
Seq = tuple[torch.Tensor, torch.Tensor]  # states [T, 3H] float16 (low, middle, exit layer), targets [T] int64 (-100: not scored)


def feature_layers(exit_layer: int) -> tuple[int, int, int]:
    """The low, middle and exit layers whose states the fusion drafter reads."""
    return exit_layer // 4, exit_layer // 2, exit_layer


@torch.inference_mode()
def exit_states(model: StageModel, layer: int, prompt: list[int], cont: list[int]) -> Seq:
    """Every position's output of the `feature_layers(layer)` over prompt + continuation[:-1] (one
    prefill), concatenated [T, 3H] with the exit layer's last, and the targets: the next
    continuation token at each fed generated token, -100 elsewhere."""
    captured = {}
    hooks = [model.layers[str(i)].register_forward_hook(lambda m, inp, out, i=i: captured.__setitem__(i, out))
             for i in feature_layers(layer)]
    try:
        tokens = prompt + cont[:-1]
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(tokens) + 1)
        model(torch.tensor(tokens), [Span(0, 0, len(tokens))], kv)
    finally:
        for hook in hooks:
            hook.remove()
    targets = torch.full((len(tokens),), -100, dtype=torch.int64)
    targets[len(prompt):] = torch.tensor(cont[1:], dtype=torch.int64)
    return torch.cat([captured[i] for i in feature_layers(layer)], dim=-1).to(torch.float16).clone(), targets


def exit_only(drafter: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A drafter of the exit state alone, fed [B, T, 3H] states: it sees the last H columns."""
    return lambda x: drafter(x[..., -x.shape[-1] // 3:])


class FrozenHead:
    """The model's final norm + LM head over the full vocabulary (scoring) or a candidate subset (loss)."""

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float) -> None:
        self.norm_weight, self.lm_head_weight, self.eps = norm_weight.float(), lm_head_weight.float(), eps

    def logits(self, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """y: [rows, H] -> [rows, V] (or [rows, C] with a folded candidate `weight` [C, H])."""
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed @ weight.T if weight is not None else (normed * self.norm_weight) @ self.lm_head_weight.T


def top1(drafter: Callable[[torch.Tensor], torch.Tensor], seqs: list[Seq], head: FrozenHead) -> float:
    """Held-out top-1 agreement of `drafter` ([1, T, H] -> [1, T, H]) over the scored rows of `seqs`."""
    hits = total = 0
    with torch.no_grad():
        for h, t in seqs:
            scored = t >= 0
            y = drafter(h.float()[None])[0][scored]
            hits += int((head.logits(y).argmax(-1) == t[scored]).sum())
            total += int(scored.sum())
    return hits / total


class AttentionAdapter(nn.Module):
    """y = x + o(attn(rope(q n), rope(k n), v n)), n = rmsnorm(x), then residual blocks.

    forward(x: [B, T, H] exit states of B sequences from position 0, right-padded) -> [B, T, H];
    causal grouped-query attention with the model's head layout and RoPE. `init_layer`: copy that
    decoder layer's attention, norm and MLP (as a residual block) from `model`; None: Kangaroo's
    adapter with a zero output projection (starts as the identity). Source: Kangaroo (arXiv
    2404.18911) §3.1; EAGLE (arXiv 2401.15077) §3 for the decoder-layer-shaped drafter.
    """

    def __init__(self, config: ModelConfig, eps: float, *, model: StageModel | None = None,
                 init_layer: int | None = None) -> None:
        super().__init__()
        h, kvh, d, size = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.h, self.kvh, self.d = h, kvh, d
        self.norm = RMSNorm(size, eps)
        self.q, self.k = nn.Linear(size, h * d, bias=False), nn.Linear(size, kvh * d, bias=False)
        self.v, self.o = nn.Linear(size, kvh * d, bias=False), nn.Linear(h * d, size, bias=False)
        self.layer_mlp: nn.Module | None = None
        self.blocks = nn.ModuleList([SwiGLUBlock(size, 768, eps)])
        self.register_buffer("inv_freq", config_inv_freq(config, local=False))
        with torch.no_grad():
            if init_layer is None:
                self.o.weight.zero_()
            else:
                self._copy_layer(model.layers[str(init_layer)], config)

    def _copy_layer(self, layer: nn.Module, config: ModelConfig) -> None:
        attn = layer.self_attn
        if attn.qkv_proj is not None:
            q, k, v = attn.qkv_proj.weight.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d])
        else:
            q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        for dst, src in ((self.q, q), (self.k, k), (self.v, v), (self.o, attn.o_proj.weight)):
            dst.weight.copy_(src)
        self.norm.weight.copy_(layer.input_layernorm.weight)
        mlp_norm = RMSNorm(config.hidden_size, self.norm.eps)
        mlp_norm.weight.data.copy_(layer.post_attention_layernorm.weight)
        mlp = copy.deepcopy(layer.mlp).float().requires_grad_(True)  # the model's own (possibly fused) MLP
        self.layer_mlp = nn.Sequential(mlp_norm, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        n = self.norm(x)
        cos, sin = rope_cos_sin(torch.arange(t), self.inv_freq, x.dtype)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
        q = apply_rope(self.q(n).reshape(b * t, self.h, self.d), cos, sin).reshape(b, t, self.h, self.d)
        k = apply_rope(self.k(n).reshape(b * t, self.kvh, self.d), cos, sin).reshape(b, t, self.kvh, self.d)
        v = self.v(n).reshape(b, t, self.kvh, self.d)
        rep = self.h // self.kvh
        k, v = k.transpose(1, 2).repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        y = x + self.o(a.transpose(1, 2).reshape(b, t, self.h * self.d))
        if self.layer_mlp is not None:
            y = y + self.layer_mlp(y)
        for block in self.blocks:
            y = block(y)
        return y


class FusionDrafter(nn.Module):
    """y = x_exit + fuse([n(x_low); n(x_mid); n(x_exit)]), n = RMS normalisation, `fuse` [H, 3H]
    zero-initialised (starts as the logit lens), then the swiglu block. forward(x: [B, T, 3H]) ->
    [B, T, H], row by row. Source: EAGLE-3 (arXiv 2503.01840) §3, feature fusion."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fuse = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.fuse.weight)
        self.blocks = nn.ModuleList([SwiGLUBlock(hidden_size, 768, eps)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.unflatten(-1, (3, -1))
        normed = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)
        y = parts[..., 2, :] + self.fuse(normed.flatten(-2))
        for block in self.blocks:
            y = block(y)
        return y


def _batch(seqs: list[Seq], idx: list[int], hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T, `hidden_size`] states and [B, T] targets (-100 on padding)."""
    t_max = max(seqs[i][0].shape[0] for i in idx)
    x = torch.zeros(len(idx), t_max, hidden_size)
    tg = torch.full((len(idx), t_max), -100, dtype=torch.int64)
    for j, i in enumerate(idx):
        h, t = seqs[i]
        x[j, :h.shape[0]], tg[j, :t.shape[0]] = h.float(), t
    return x, tg


def train_adapter(adapter: nn.Module, train: list[Seq], head: FrozenHead, *, steps: int, batch_size: int = 6,
                  lr: float = 1e-3, log: Callable[[str], None] = print) -> Callable[[torch.Tensor], torch.Tensor]:
    """AdamW, one-cycle schedule, `steps` batches of whole sequences; the state best on the
    validation tenth of `train` (scored every 100 steps) is kept. Returns the drafter of [B, T, 3H]
    states (an AttentionAdapter sees the exit layer's columns only)."""
    forward = exit_only(adapter) if isinstance(adapter, AttentionAdapter) else adapter
    val, fit = train[:max(len(train) // 10, 1)], train[max(len(train) // 10, 1):]
    candidates = torch.unique(torch.cat([t[t >= 0] for _, t in fit]))
    local = torch.full((head.lm_head_weight.shape[0],), -100, dtype=torch.int64)
    local[candidates] = torch.arange(candidates.numel())
    weight = head.lm_head_weight[candidates] * head.norm_weight[None]
    opt = torch.optim.AdamW([p for p in adapter.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen, best, best_state, start = torch.Generator().manual_seed(0), -1.0, None, time.perf_counter()
    for step in range(1, steps + 1):
        x, tg = _batch(fit, torch.randint(0, len(fit), (batch_size,), generator=gen).tolist(), fit[0][0].shape[1])
        scored = tg >= 0
        loss = F.cross_entropy(head.logits(forward(x)[scored], weight), local[tg[scored]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            adapter.eval()
            score = top1(forward, val, head)
            adapter.train()
            log(f"  step {step}: loss {loss.item():.3f}, validation top-1 {score:.3f} ({time.perf_counter() - start:.0f} s)")
            if score > best:
                best, best_state = score, {k: v.clone() for k, v in adapter.state_dict().items()}
    adapter.load_state_dict(best_state)
    adapter.eval()
    return forward


def train_swiglu(train: list[Seq], head: FrozenHead) -> Callable[[torch.Tensor], torch.Tensor]:
    """The swiglu drafter, trained on the scored rows with `DrafterTrainConfig`'s
    defaults (2000 steps of 512 rows, lr 2e-3, weight decay 0.01, dropout 0.1; on this data 1-7
    points above `train-predictor`'s 1000 steps of 256 rows at lr 3e-3), a tenth of the rows for early stopping."""
    hidden = torch.cat([h[t >= 0, -h.shape[1] // 3:] for h, t in train])
    targets = torch.cat([t[t >= 0] for _, t in train])
    is_val = validation_split(targets.numel(), fraction=0.1)
    config = DrafterTrainConfig()
    drafter = train_drafter_map(hidden=hidden[~is_val], targets=targets[~is_val], norm_weight=head.norm_weight,
                                lm_head_weight=head.lm_head_weight, eps=head.eps, config=config,
                                val=(hidden[is_val], targets[is_val]))
    return exit_only(lambda x: drafter(x[0])[None])


def run(args: argparse.Namespace) -> dict:
    """Prepare the data, train every drafter of `args.archs`, score it on every held-out set."""
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    spec = DistillSpec(model_dir=model_dir, sampled=0)
    data = prepare_distill_data(spec, layer=args.exit_layer)
    sequences = distill_sequences(spec, layer=args.exit_layer)
    config = ModelConfig.from_model_dir(model_dir)
    model = load_full_model(model_dir)
    start = time.perf_counter()
    states = {name: [exit_states(model, args.exit_layer, p, c) for p, c, _ in seqs if len(c) > 1]
              for name, seqs in sequences.items()}
    print(f"exit states of {sum(map(len, states.values()))} sequences in {time.perf_counter() - start:.0f} s")
    head = FrozenHead(data.norm_weight, data.lm_head_weight, data.rms_norm_eps)
    size = config.hidden_size
    makers = {"logit-lens": lambda: exit_only(lambda x: x), "swiglu": lambda: train_swiglu(states["train"], head),
              "kangaroo": lambda: train_adapter(AttentionAdapter(config, head.eps), states["train"], head,
                                                steps=args.steps),
              "next-layer": lambda: train_adapter(AttentionAdapter(config, head.eps, model=model,
                                                                   init_layer=args.exit_layer + 1),
                                                  states["train"], head, steps=args.steps),
              "fusion": lambda: train_adapter(FusionDrafter(size, head.eps), states["train"], head, steps=args.steps)}
    results = {}
    for arch in ["logit-lens", *args.archs.split(",")]:
        start = time.perf_counter()
        drafter = makers[arch]()
        results[arch] = {name: top1(drafter, states[name], head) for name in SETS if name in states}
        results[arch]["train_s"] = time.perf_counter() - start
        print(f"{arch:12s} " + "  ".join(f"{n} {results[arch][n]:.3f}" for n in SETS if n in results[arch]))
    rows = {name: sum(int((t >= 0).sum()) for _, t in seqs) for name, seqs in states.items()}
    return {"model": args.model, "exit_layer": args.exit_layer, "steps": args.steps, "scored_rows": rows,
            "top1": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    p.add_argument("--exit-layer", type=int, default=16, help="exit layer (default 16: --stages 2's)")
    p.add_argument("--steps", type=int, default=600, help="adapter training steps of 6 sequences (default 600)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--archs", default=",".join(ARCHS),
                   help=f"comma-separated drafters to train besides the logit lens, of {', '.join(ARCHS)} (default all)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "drafter_arch.json"),
                   help="JSON report path (default: the committed tests/benchmarks/results/drafter_arch.json)")
    args = p.parse_args()
    unknown = set(args.archs.split(",")) - set(ARCHS)
    if unknown:
        p.error(f"unknown --archs {', '.join(sorted(unknown))} (of {', '.join(ARCHS)})")
    report = run(args)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
