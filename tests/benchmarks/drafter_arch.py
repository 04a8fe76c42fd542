"""Benchmark: which drafter architecture at the exit layer agrees best with the model.

Measures held-out top-1 agreement (the share of draft positions where the drafter's argmax equals
the base model's greedy next token, over the full vocabulary) of five drafters on the same
self-distilled data, the model's own greedy continuations of `train-predictor --data self-distill`'s
prompts (launcher/cli/training/distill_data.py; generated once and cached):

    logit-lens      the frozen final norm + LM head on the exit hidden state, untrained
    swiglu          the swiglu drafter (pipeline/speculation/drafting/drafter.py, [Note: drafter arch];
                    `train-predictor --arch swiglu`), trained on single rows
    kangaroo        Kangaroo's adapter (arXiv 2404.18911 §3.1): RMSNorm + one multi-head
                    attention layer with RoPE over the sequence's exit states (its own KV in a
                    pipeline), output projection zero-initialised, then the swiglu block
    next-layer      the shipped next-layer drafter (`train-predictor --arch next-layer`,
                    pipeline/speculation/drafting/layer_drafter.py): the model's layer exit+1 copied and
                    fine-tuned, then the swiglu map
    fusion          EAGLE-3's feature fusion (arXiv 2503.01840 §3): the states of a low, a middle
                    and the exit layer (exit/4, exit/2, exit: all on the exit stage when it is
                    stage 0), RMS-normalised, concatenated and mapped by a zero-initialised
                    3H -> H layer added to the exit state, then the swiglu block; no attention

The adapters attend over whole sequences, so every position's exit state is taken by one teacher-
forced prefill of prompt + continuation (a forward hook on the exit layer); the scored rows are the
ones SPEED drafts from (each fed generated token, as in pipeline/training/self_distill.py). The
three sequence models (kangaroo, next-layer, fusion) train on whole sequences with the product's
trainer (layer_drafter's `train_sequence_model`: the candidate-vocabulary loss, [Note: candidate
vocabulary] in pipeline/training/early_exit.py) and keep their best state on a validation tenth of
the training sequences, as the swiglu drafter does ([Note: early stop]).
Must not: change the shipped drafter; this only measures.

Usage: python tests/benchmarks/drafter_arch.py [--exit-layer 16] [--steps 600] [--threads 2]
       [--archs swiglu,kangaroo,next-layer,fusion] [--out tests/benchmarks/results/drafter_arch.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from launcher.cli.training.distill_data import DistillSpec, distill_sequences, prepare_distill_data
from pipeline.model.config import ModelConfig
from pipeline.model.family_blocks import RMSNorm, rms_normalize
from pipeline.model.rope import config_inv_freq
from pipeline.model.stage_model import Attention, StageModel
from pipeline.speculation.drafting.drafter import (
    DrafterTrainConfig,
    SwiGLUBlock,
    train_drafter_map,
    validation_split,
)
from pipeline.speculation.drafting.layer_drafter import (
    LayerDrafterConfig,
    SequenceDrafter,
    sequence_attention,
    train_layer_drafter,
    train_sequence_model,
)
from pipeline.training.data import load_full_model
from pipeline.training.self_distill import sequence_layer_states
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

SETS = ("chat", "speeches", "code")
ARCHS = ("swiglu", "kangaroo", "next-layer", "fusion")
Seq = tuple[torch.Tensor, torch.Tensor]  # states [T, 3H] float16 (low, middle, exit layer), targets [T] int64 (-100: not scored)


def feature_layers(exit_layer: int) -> tuple[int, int, int]:
    """The low, middle and exit layers whose states the fusion drafter reads."""
    return exit_layer // 4, exit_layer // 2, exit_layer


@torch.inference_mode()
def exit_states(model: StageModel, layer: int, prompt: list[int], cont: list[int], targets: list[int]) -> Seq:
    """Every position's output of the `feature_layers(layer)` over prompt + continuation[:-1] (one
    prefill, pipeline/training/self_distill.py `sequence_layer_states`), concatenated [T, 3H] with the
    exit layer's last, and the targets: the greedy next token at each fed generated token, -100 elsewhere."""
    states, rows = sequence_layer_states(model, feature_layers(layer), prompt, cont, targets)
    return torch.cat(states, dim=-1).to(torch.float16), rows


def exit_only(drafter: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A drafter of the exit state alone, fed [B, T, 3H] states: it sees the last H columns."""
    return lambda x: drafter(x[..., -x.shape[-1] // 3:])


class FrozenHead:
    """The model's final norm + LM head over the full vocabulary (scoring) or a candidate subset (loss)."""

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float) -> None:
        self.norm_weight, self.lm_head_weight, self.eps = norm_weight.float(), lm_head_weight.float(), eps

    def logits(self, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """y: [rows, H] -> [rows, V] (or [rows, C] with a folded candidate `weight` [C, H])."""
        normed = rms_normalize(y, self.eps)
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


class KangarooAdapter(nn.Module):
    """y = x + o(attn(rope(q n), rope(k n), v n)), n = rmsnorm(x), then the swiglu block.

    forward(x: [B, T, H] exit states of B sequences from position 0, right-padded) -> [B, T, H]:
    the model's attention shape (a fresh `Attention`, its output projection zero-initialised, so the
    adapter starts as the identity) run causally by layer_drafter's `sequence_attention`. Source:
    Kangaroo (arXiv 2404.18911) §3.1.
    """

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps)
        self.attn = Attention(config)
        self.blocks = nn.ModuleList([SwiGLUBlock(config.hidden_size, 768, eps)])
        self.register_buffer("inv_freq", config_inv_freq(config, local=False))
        with torch.no_grad():
            self.attn.o_proj.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + sequence_attention(self.attn, self.norm(x), self.inv_freq)
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
        normed = rms_normalize(parts, self.eps)
        y = parts[..., 2, :] + self.fuse(normed.flatten(-2))
        for block in self.blocks:
            y = block(y)
        return y


def train_sequence(make: Callable[[], nn.Module], train: list[Seq], head: FrozenHead, *, steps: int,
                   exit_only_input: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Train `make()` with layer_drafter's `train_sequence_model` (`steps` batches of 6 whole
    sequences, lr 1e-3, the state best on the validation tenth of `train` kept); returns the
    drafter of [B, T, 3H] states (exit_only_input: the model sees the exit layer's columns only)."""
    h = head.norm_weight.numel()
    seqs = [(s[:, -h:], t) for s, t in train] if exit_only_input else train
    n_val = max(len(seqs) // 10, 1)
    model = make()
    train_sequence_model(model, train=seqs[n_val:], val=seqs[:n_val], norm_weight=head.norm_weight,
                         lm_head_weight=head.lm_head_weight, eps=head.eps, settings=LayerDrafterConfig(steps=steps))
    return exit_only(model) if exit_only_input else model


def train_next_layer(model: StageModel, config: ModelConfig, layer: int, train: list[Seq], head: FrozenHead, *,
                     steps: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product's next-layer drafter (`train_layer_drafter`: layer exit+1 copied and fine-tuned, +
    the swiglu map) on the exit columns, the validation tenth of `train` kept aside."""
    h = config.hidden_size
    seqs = [(s[:, -h:], t) for s, t in train]
    n_val = max(len(seqs) // 10, 1)
    draft_layer, exit_map = train_layer_drafter(
        train=seqs[n_val:], val=seqs[:n_val], init_layer=model.layers[str(layer + 1)], config=config,
        norm_weight=head.norm_weight, lm_head_weight=head.lm_head_weight, settings=LayerDrafterConfig(steps=steps))
    return exit_only(SequenceDrafter(draft_layer, exit_map, config_inv_freq(config, local=False)))


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
    states = {name: [exit_states(model, args.exit_layer, p, c, t) for p, c, t in seqs if len(c) > 1]
              for name, seqs in sequences.items()}
    print(f"exit states of {sum(map(len, states.values()))} sequences in {time.perf_counter() - start:.0f} s")
    head = FrozenHead(data.norm_weight, data.lm_head_weight, data.rms_norm_eps)
    size = config.hidden_size
    makers = {"logit-lens": lambda: exit_only(lambda x: x), "swiglu": lambda: train_swiglu(states["train"], head),
              "kangaroo": lambda: train_sequence(lambda: KangarooAdapter(config, head.eps), states["train"], head,
                                                 steps=args.steps, exit_only_input=True),
              "next-layer": lambda: train_next_layer(model, config, args.exit_layer, states["train"], head,
                                                     steps=args.steps),
              "fusion": lambda: train_sequence(lambda: FusionDrafter(size, head.eps), states["train"], head,
                                               steps=args.steps, exit_only_input=False)}
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
