"""`speedpipe train-predictor --kind firp`: fit FIRP maps and report accepted drafts per pass.

Called by launcher/cli/training/train_predictor.py (`firp_trainer()`), which prepares the data (hidden states
of the frozen model over the corpus, document-level split) and writes the file. Owns the FIRP
progress output, the held-out evaluation (greedy continuations of held-out windows, real
pseudo-row forward; pipeline/training/firp.py) and the file's FIRP metadata.
Must not: start a pipeline.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pipeline.training.firp import firp_acceptance, fit_firp_maps

EVAL_PROMPT_TOKENS = 64
EVAL_NEW_TOKENS = 64
EVAL_SEQUENCES = 8


def train_firp(args: argparse.Namespace, data, identity) -> tuple[dict[str, torch.Tensor], dict, str]:
    """Fit args.firp_k maps at args.exit_layer on data.train, evaluate on data.eval.

    data: launcher.cli.training.train_predictor.TrainingSet; identity: the model's ModelIdentity.
    Returns (tensors "maps.{i}.weight"/"maps.{i}.bias", metadata {"k", "eval", ...}, eval line).
    """
    from tqdm import tqdm

    from pipeline.training.data import load_full_model
    from pipeline.weights.registry import resolve_model

    layer, k = args.exit_layer, args.firp_k
    progress = not getattr(args, "no_progress", False)
    hidden = data.train.hidden[layer]
    with tqdm(total=k, desc=f"fit FIRP maps @ layer {layer}", disable=not progress, file=sys.stderr) as bar:
        maps, fit = fit_firp_maps(hidden, k=k, on_map=lambda i, mse: (bar.update(1), bar.set_postfix(val_mse=f"{mse:.3g}")))
    model = load_full_model(resolve_model(args.model, cache_dir=getattr(args, "cache_dir", None), progress=False))
    windows = data.eval.token_ids
    prompts = [w[:EVAL_PROMPT_TOKENS].tolist() for w in windows[:EVAL_SEQUENCES]]
    with tqdm(total=len(prompts), desc="eval FIRP (held-out greedy continuations)", disable=not progress,
              file=sys.stderr) as bar:
        result = firp_acceptance(model, maps, layer, prompts, num_new_tokens=EVAL_NEW_TOKENS,
                                 on_sequence=lambda: bar.update(1))
    eval_meta = {"accepted_per_pass": {str(j): round(v, 4) for j, v in result.accepted_per_pass.items()},
                 "tokens_per_pass": {str(j): round(v, 4) for j, v in result.tokens_per_pass.items()},
                 "accepted_per_anchor": {str(j): round(v, 4) for j, v in result.accepted_per_anchor.items()},
                 "eval_sequences": result.num_sequences, "eval_new_tokens": result.num_new_tokens,
                 "eval_prompt_tokens": EVAL_PROMPT_TOKENS, "hidden_val_mse": fit["val_mse"],
                 "identity_hidden_val_mse": fit["identity_val_mse"]}
    meta = {"k": k, "eval": eval_meta, "fit": "ridge least squares (closed-form MSE optimum)", "ridge": fit["ridge"]}
    per_k = ", ".join(f"k={j}: {v:.2f}" for j, v in result.accepted_per_pass.items())
    line = (f"eval (held-out {args.corpus}, {result.num_sequences} greedy continuations of {result.num_new_tokens} "
            f"tokens): FIRP @ layer {layer} accepted drafts per pass {per_k} "
            f"(tokens per pass = 1 + accepted)")
    return maps.to_tensors(), meta, line
