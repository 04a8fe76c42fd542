"""`train-predictor --data self-distill`: fit an early-exit head on self-distilled data and measure it.

Owns fitting the chosen arch (affine | mlp: pipeline/training/early_exit.py; swiglu: the drafter of
pipeline/speculation/drafting/drafter.py) on the training states, the held-out evaluation on each held-out set (top-1
chain acceptance on the model's own greedy continuations, over the full and the draft vocabulary,
beside the logit lens and the shipped head for the same layer), the over-fitting warning, and the
metadata that goes into the predictor file. Must not: generate data or write files.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from launcher.cli.training.distill_data import EVAL_SETS, DistillData, DistillSpec, distill_sequences
from pipeline.model.config import ModelConfig
from pipeline.model.rope import config_inv_freq
from pipeline.speculation.drafting.drafter import (
    DRAFTER_ARCH,
    DrafterTrainConfig,
    train_drafter_map,
    validation_split,
)
from pipeline.speculation.drafting.exit_tensors import exit_map_from_tensors
from pipeline.speculation.drafting.layer_drafter import (
    NEXT_LAYER_ARCH,
    LayerDrafterConfig,
    SequenceDrafter,
    file_tensors,
    sequence_top1,
    train_layer_drafter,
)
from pipeline.speculation.predictor_file import load_predictor, shipped_predictor
from pipeline.training.data import load_full_model
from pipeline.training.early_exit import ExitTrainConfig, draft_vocabulary, top1_agreement, train_exit_map
from pipeline.training.self_distill import sequence_states

log = logging.getLogger("speedpipe.train")

GAP_WARNING = 0.10  # warn when held-out agreement is this far below training agreement


def fit_map(arch: str, args: argparse.Namespace, hidden: torch.Tensor, targets: torch.Tensor, head: dict, *,
            teacher: tuple[torch.Tensor, torch.Tensor], progress: bool):
    """Train a map of `arch` on hidden [rows, H] / targets [rows] (teacher: the base model's top-k
    ids and probabilities per row, for the swiglu drafter's --soft-weight) with args' settings.
    Returns it (eval mode)."""
    from tqdm import tqdm

    with tqdm(total=args.steps, desc=f"train {arch} @ layer {args.exit_layer}", disable=not progress,
              file=sys.stderr) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")

        if arch == DRAFTER_ARCH:
            config = DrafterTrainConfig(steps=args.steps, lr=args.lr, seed=args.seed, mlp_size=args.mlp_size,
                                        num_blocks=args.blocks, dropout=args.dropout,
                                        weight_decay=args.weight_decay, batch_size=args.batch_size,
                                        soft_weight=args.soft_weight)
            is_val = validation_split(targets.numel(), fraction=args.val_fraction, seed=args.seed)
            fit = ~is_val
            return train_drafter_map(hidden=hidden[fit], targets=targets[fit], config=config,
                                     teacher=(teacher[0][fit], teacher[1][fit]),
                                     val=(hidden[is_val], targets[is_val]) if bool(is_val.any()) else None,
                                     on_step=on_step, **head)
        config = ExitTrainConfig(arch=arch, steps=args.steps, lr=args.lr, seed=args.seed, rank=args.rank,
                                 weight_decay=args.weight_decay, batch_size=args.batch_size)
        return train_exit_map(hidden=hidden, targets=targets, config=config, on_step=on_step, **head)


def _shipped_map(identity, layer: int):
    """The shipped early-exit head for this model and layer as (map, draft vocab), or None."""
    path = shipped_predictor(identity, kind="early-exit", exit_layer=layer)
    if path is None:
        return None
    pred = load_predictor(path, expect=identity, exit_layer=layer, kind="early-exit")
    return exit_map_from_tensors(pred.tensors, arch=pred.meta.get("arch", "affine")), pred.draft_vocab, path.name


def baselines(sets: dict[str, tuple[torch.Tensor, torch.Tensor]], head: dict, shipped=None) -> dict[str, dict]:
    """Per held-out set (hidden [rows, H], targets [rows]): "logit_lens" top-1 agreement and, when
    `shipped` = (map, draft vocab, name) is given, the shipped head's ("shipped", over its vocab)."""
    out = {}
    for name, (h, t) in sets.items():
        out[name] = {"logit_lens": top1_agreement(hidden=h, targets=t, **head)}
        if shipped is not None:
            out[name]["shipped"] = top1_agreement(hidden=h, targets=t, exit_map=shipped[0], vocab_ids=shipped[1],
                                                  **head)
    return out


def evaluate(exit_map, vocab: torch.Tensor | None, sets: dict[str, tuple[torch.Tensor, torch.Tensor]], head: dict,
             base: dict[str, dict]) -> dict[str, dict]:
    """Per held-out set: "acceptance" (top-1 agreement over the draft vocabulary, what the exit
    stage runs), "top1_agreement" (full vocabulary), the `baselines` and "tokens"."""
    held = {}
    for name, (h, t) in sets.items():
        row = {"acceptance": top1_agreement(hidden=h, targets=t, exit_map=exit_map, vocab_ids=vocab, **head),
               "top1_agreement": top1_agreement(hidden=h, targets=t, exit_map=exit_map, **head), **base[name]}
        held[name] = {k: round(v, 4) for k, v in row.items()} | {"tokens": int(t.numel())}
    return held


def _mean_acceptance(held: dict[str, dict]) -> float:
    return sum(r["acceptance"] for r in held.values()) / max(1, len(held))


def train_self_distilled(args: argparse.Namespace, data: DistillData, identity, *,
                         progress: bool) -> tuple[dict[str, torch.Tensor], dict, str]:
    """Fit every arch of `args.arch` (comma-separated) on the training rows, evaluate each on every
    held-out set, keep the one with the best mean held-out acceptance, warn if it over-fits.
    Rows whose target is outside the draft vocabulary are left out of training (the exit head can
    never draft them). Returns (tensors, metadata, report)."""
    layer = args.exit_layer
    head = dict(norm_weight=data.norm_weight, lm_head_weight=data.lm_head_weight, eps=data.rms_norm_eps)
    train_h, train_t = data.train.hidden, data.train.targets
    teacher = (data.train.teacher_ids, data.train.teacher_probs)
    vocab = draft_vocabulary(train_t, max_size=args.draft_vocab) if args.draft_vocab else None
    if vocab is not None:
        keep = torch.isin(train_t, vocab)
        train_h, train_t, teacher = train_h[keep], train_t[keep], (teacher[0][keep], teacher[1][keep])
    sets = {name: (data.evals[name].hidden, data.evals[name].targets) for name in EVAL_SETS if name in data.evals}
    shipped = _shipped_map(identity, layer)
    base = baselines(sets, head, shipped)
    # training agreement on rows drawn from all training rows (as the held-out rows: a target outside
    # the draft vocabulary counts as a miss), so the over-fitting gap compares like with like
    sample = torch.randperm(data.train.num_rows, generator=torch.Generator().manual_seed(0))[:4096]
    sample_h, sample_t = data.train.hidden[sample], data.train.targets[sample]
    results = []
    for arch in args.arch.split(","):
        exit_map = fit_map(arch, args, train_h, train_t, head, teacher=teacher, progress=progress)
        train_acc = top1_agreement(hidden=sample_h, targets=sample_t, exit_map=exit_map, vocab_ids=vocab, **head)
        results.append((arch, exit_map, train_acc, evaluate(exit_map, vocab, sets, head, base)))
    arch, exit_map, train_acc, held = max(results, key=lambda r: _mean_acceptance(r[3]))
    header = (f"eval (held-out; the model's own greedy continuations; {train_t.numel()} training rows"
              + (f", {vocab.numel()}-token draft vocabulary" if vocab is not None else "") + f"; layer {layer}"
              + (f"; shipped head: {shipped[2]}" if shipped is not None else "") + "):")
    lines = report_lines(header, [(c, t, h) for c, _, t, h in results], kept=arch)
    for cand, cand_map, _, _ in results:
        if getattr(cand_map, "early_stop", None) is not None:
            lines.append(f"  {cand} early stop: kept step {cand_map.early_stop[0]} of {args.steps} (validation "
                         f"agreement {cand_map.early_stop[1]:.1%} over the candidate vocabulary)")
    for warning in overfit_warnings(train_acc, held):
        print(warning, file=sys.stderr)
    first = held[next(iter(held))] if held else {}
    meta = {"arch": arch, "data": "self-distill", "steps": args.steps, "lr": args.lr,
            "weight_decay": args.weight_decay,
            "eval": {"top1_agreement": first.get("top1_agreement"), "acceptance": first.get("acceptance"),
                     "draft_vocab_top1_agreement": first.get("acceptance") if vocab is not None else None,
                     "train_top1_agreement": round(train_acc, 4), "eval_tokens": first.get("tokens"),
                     "held_out": held,
                     "candidates": {c: {n: r["acceptance"] for n, r in h.items()} for c, _, _, h in results}}}
    meta["eval"] = {k: v for k, v in meta["eval"].items() if v is not None}
    if arch == DRAFTER_ARCH:
        meta |= {"mlp_size": args.mlp_size, "blocks": args.blocks, "dropout": args.dropout,
                 "soft_weight": args.soft_weight, "val_fraction": args.val_fraction}
        if exit_map.early_stop is not None:
            meta |= {"early_stop_step": exit_map.early_stop[0], "val_agreement": round(exit_map.early_stop[1], 4)}
    tensors = dict(exit_map.state_dict())
    if vocab is not None:
        tensors["draft_vocab"] = vocab
        meta["draft_vocab_size"] = int(vocab.numel())
    return tensors, meta, "\n".join(lines)


def report_lines(header: str, results: list[tuple[str, float, dict[str, dict]]], *, kept: str) -> list[str]:
    """The eval report: `header`, then per candidate (arch, train agreement, held-out rows) a line
    and one line per held-out set."""
    lines = [header]
    for cand, cand_train, cand_held in results:
        lines.append(f"  {cand}{' (kept)' if cand == kept else ''}: train {cand_train:.1%}, mean held-out "
                     f"acceptance {_mean_acceptance(cand_held):.1%}")
        for name, row in cand_held.items():
            shipped_note = f", shipped head {row['shipped']:.1%}" if "shipped" in row else ""
            lines.append(f"    {name:9s} acceptance {row['acceptance']:.1%} (full vocab {row['top1_agreement']:.1%}, "
                         f"logit lens {row['logit_lens']:.1%}{shipped_note}; {row['tokens']} tokens)")
    return lines


def overfit_warnings(train_acc: float, held: dict[str, dict]) -> list[str]:
    """One warning line per held-out set whose acceptance is more than GAP_WARNING below `train_acc`
    (both shares in [0, 1]; held: {set name: {"acceptance": share, ...}})."""
    return [f"[speedpipe] warning: held-out {name} acceptance {row['acceptance']:.1%} is "
            f"{(train_acc - row['acceptance']) * 100:.0f} points below training ({train_acc:.1%}): the head "
            f"over-fits; generate more data (--text-prompts, --sampled) or regularise (--dropout, --weight-decay)"
            for name, row in held.items() if train_acc - row["acceptance"] > GAP_WARNING]


def _whole_sequence_states(model, layer: int, seqs: dict[str, list], *, progress: bool) -> dict[str, list]:
    """{set: [(exit states [T, H], targets [T], prompt), ...]} of every cached continuation
    (`distill_sequences`' triples), one prefill each."""
    from tqdm import tqdm

    states: dict[str, list] = {}
    with tqdm(total=sum(map(len, seqs.values())), desc="exit states of whole sequences", disable=not progress,
              file=sys.stderr) as bar:
        for name, triples in seqs.items():
            states[name] = [(*sequence_states(model, layer, p, c, t), tuple(p)) for p, c, t in triples if len(c) >= 2]
            bar.update(len(triples))
    return states


def _split_by_prompt(seqs: list) -> tuple[list, list]:
    """(training, validation) sequences: every 10th distinct prompt validates, with all of its
    continuations (a greedy and a sampled continuation of one prompt share their context)."""
    order = {p: i for i, p in enumerate(dict.fromkeys(s[2] for s in seqs))}
    val = [s[:2] for s in seqs if order[s[2]] % 10 == 0]
    train = [s[:2] for s in seqs if order[s[2]] % 10 != 0]
    return (train, val) if train else (val, [])


def _next_layer_held_out(drafter: SequenceDrafter, states: dict[str, list], vocab: torch.Tensor | None,
                         data: DistillData, base: dict[str, dict]) -> dict[str, dict]:
    """Per held-out set, as `evaluate` reports the row drafters: acceptance over the draft
    vocabulary, full-vocabulary agreement, the baselines, and the number of draft rows."""
    full = data.norm_weight[None] * data.lm_head_weight  # [V, H], the norm weight folded in
    local = None
    if vocab is not None:
        local = torch.full((full.shape[0],), -100, dtype=torch.int64)
        local[vocab] = torch.arange(vocab.numel())
    held = {}
    for name in base:
        seqs = states[name]
        row = {"acceptance": sequence_top1(drafter, seqs, full if vocab is None else full[vocab], data.rms_norm_eps,
                                           local),
               "top1_agreement": sequence_top1(drafter, seqs, full, data.rms_norm_eps), **base[name]}
        held[name] = {k: round(v, 4) for k, v in row.items()} | {"tokens": sum(int((t >= 0).sum()) for _, t in seqs)}
    return held


def train_next_layer(args: argparse.Namespace, data: DistillData, spec: DistillSpec, identity, *,
                     progress: bool) -> tuple[dict[str, torch.Tensor], dict, str]:
    """`--arch next-layer` ([Note: next-layer drafter] in pipeline/speculation/drafting/layer_drafter.py):
    every cached continuation's states by one prefill, a fine-tuned copy of layer exit+1 plus the
    swiglu map trained on whole sequences (every 10th training prompt validates), evaluated per
    held-out set like the row drafters. Returns (tensors, metadata, report)."""
    from tqdm import tqdm

    layer, config = args.exit_layer, ModelConfig.from_model_dir(spec.model_dir)
    model = load_full_model(spec.model_dir)
    states = _whole_sequence_states(model, layer, distill_sequences(spec, layer=layer, seed=args.seed,
                                                                    cache_dir=args.cache_dir), progress=progress)
    train, val = _split_by_prompt(states.pop("train"))
    states = {name: [s[:2] for s in seqs] for name, seqs in states.items()}
    with tqdm(total=args.steps, desc=f"train next-layer @ layer {layer}", disable=not progress, file=sys.stderr) as bar:
        draft_layer, exit_map = train_layer_drafter(
            train=train, val=val, init_layer=model.layers[str(layer + 1)], config=config,
            norm_weight=data.norm_weight, lm_head_weight=data.lm_head_weight,
            settings=LayerDrafterConfig(steps=args.steps, seed=args.seed), on_step=lambda s, loss: bar.update(1))
    train_t = torch.cat([t[t >= 0] for _, t in train])
    vocab = draft_vocabulary(train_t, max_size=args.draft_vocab) if args.draft_vocab else None
    drafter = SequenceDrafter(draft_layer, exit_map, config_inv_freq(config, local=False))
    rows = {name: (data.evals[name].hidden, data.evals[name].targets) for name in EVAL_SETS if name in data.evals}
    head = dict(norm_weight=data.norm_weight, lm_head_weight=data.lm_head_weight, eps=data.rms_norm_eps)
    held = _next_layer_held_out(drafter, states, vocab, data, baselines(rows, head, _shipped_map(identity, layer)))
    train_acc = _next_layer_held_out(drafter, {"train": train[:24]}, vocab, data, {"train": {}})["train"]["acceptance"]
    lines = report_lines(f"eval (held-out; the model's own greedy continuations; {train_t.numel()} training rows "
                         f"in {len(train)} sequences; layer {layer}; next-layer drafter from layer {layer + 1}):",
                         [(NEXT_LAYER_ARCH, train_acc, held)], kept=NEXT_LAYER_ARCH)
    for warning in overfit_warnings(train_acc, held):
        print(warning, file=sys.stderr)
    first = held[next(iter(held))] if held else {}
    meta = {"arch": NEXT_LAYER_ARCH, "data": "self-distill", "steps": args.steps, "train_tokens": int(train_t.numel()),
            "eval": {"top1_agreement": first.get("top1_agreement"), "acceptance": first.get("acceptance"),
                     "train_top1_agreement": train_acc, "eval_tokens": first.get("tokens"), "held_out": held}}
    if exit_map.early_stop is not None:
        meta |= {"early_stop_step": exit_map.early_stop[0], "val_agreement": round(exit_map.early_stop[1], 4)}
    tensors = file_tensors(draft_layer, exit_map)
    if vocab is not None:
        tensors["draft_vocab"], meta["draft_vocab_size"] = vocab, int(vocab.numel())
    return tensors, meta, "\n".join(lines)
