"""Which trained early-exit head a launch uses, decided before any process is spawned.

Owns the rules that map `--predictor` / `--exit-predictor` to the bytes of a validated predictor
file for the exit stage (or none: the untrained logit lens), and the note a user sees about it.
Must not: start processes or build torch modules.

Rules (speculation on, predictor that needs an exit head):
  --predictor PATH.safetensors      the trained head in PATH, alone (drafts = its argmax)
  --exit-predictor PATH             the trained head in PATH, for early-exit or hybrid
  --predictor early-exit            the shipped head for this model and exit layer; error if none
  --predictor hybrid (default)      the shipped head when one exists, else the logit lens (with a note)
  --predictor logit-lens            never a trained head (nor --exit-predictor none)
Every file is checked against the running model (hash, every tensor's name and shape for its arch)
and the exit layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeline.model.config import ModelConfig
from pipeline.speculation.drafting.exit_tensors import check_exit_tensors
from pipeline.speculation.drafting.layer_drafter import NEXT_LAYER_ARCH
from pipeline.speculation.predictor_file import (
    SHIPPED_DIR,
    load_predictor,
    model_identity,
    model_name,
    read_predictor_meta,
    shipped_predictor,
    shipped_predictors,
    ships_predictors_for,
)
from pipeline.speculation.predictors import is_predictor_file
from pipeline.weights.registry import model_key
from pipeline.weights.stage_memory import exit_head_bytes


@dataclasses.dataclass(frozen=True)
class ExitPredictorChoice:
    """file_bytes: the predictor file sent to the exit stage (b"" = logit lens); source: its path or "";
    note: one line for the user (what is used, and its measured held-out agreement)."""

    file_bytes: bytes = b""
    source: str = ""
    note: str = ""


def choose_exit_predictor(*, predictor: str, exit_predictor: str | None, model_dir: Path, config: ModelConfig,
                          exit_layer: int) -> ExitPredictorChoice:
    """Apply the rules of the module docstring. Raises ValueError / FileNotFoundError (user errors,
    one line, naming the flag) for a bad, missing or mismatching file."""
    if exit_predictor is not None and predictor not in ("early-exit", "hybrid"):
        raise ValueError(f"--exit-predictor needs --predictor early-exit or hybrid, not {predictor!r}")
    if predictor == "logit-lens" or exit_predictor == "none":
        return ExitPredictorChoice(note="exit head: untrained logit lens")
    path = given_predictor_file(predictor, exit_predictor)
    name = model_name(model_dir)
    if path is not None:
        identity = model_identity(model_dir, config)
    else:
        # Hash the model only when some head ships for its name (hashing a large HF folder costs seconds).
        identity = model_identity(model_dir, config) if ships_predictors_for(name) else None
        path = shipped_predictor(identity, kind="early-exit", exit_layer=exit_layer) if identity else None
        if path is None:
            if predictor == "early-exit":
                raise ValueError(f"--predictor early-exit: no trained head ships for model {name!r} at exit "
                                 f"layer {exit_layer}; train one with `speedpipe train-predictor --exit-layer "
                                 f"{exit_layer} --out FILE.safetensors` and pass --predictor FILE.safetensors")
            return ExitPredictorChoice(note=f"no trained early-exit head for {name} at exit layer {exit_layer}; "
                                            f"{predictor} uses the untrained logit lens")
    pred = load_predictor(path, expect=identity, exit_layer=exit_layer, kind="early-exit")
    check_exit_tensors(pred, config=config, where=f"predictor file {path}")  # before any stage loads it
    evals = pred.meta.get("eval", {})
    agreement, drafted = evals.get("top1_agreement"), evals.get("draft_vocab_top1_agreement")
    held = evals.get("held_out")
    if isinstance(held, dict) and held:  # self-distilled: acceptance per held-out set, over the draft vocabulary
        measured = " (held-out acceptance " + ", ".join(f"{n} {r['acceptance']:.0%}" for n, r in held.items()) + ")"
    elif isinstance(drafted, float) and pred.draft_vocab is not None:  # what the exit stage runs
        measured = f" (held-out top-1 agreement {drafted:.0%} over its {pred.draft_vocab.numel()}-token draft vocabulary)"
    else:
        measured = f" (held-out top-1 agreement {agreement:.0%})" if isinstance(agreement, float) else ""
    return ExitPredictorChoice(file_bytes=path.read_bytes(), source=str(path),
                               note=f"exit head: trained early-exit {path.name}{measured}")


@dataclasses.dataclass(frozen=True)
class ExitHeadShape:
    """What the exit head at one layer adds to its stage's decode pass, for the split's cost
    ([Note: partition cost] in pipeline/model/partition.py): `rows` LM-head rows it scores (its draft
    vocabulary, or the whole vocabulary) and `draft_layers` decoder layers it runs (1 for a next-layer
    drafter, [Note: next-layer drafter] in pipeline/speculation/drafting/layer_drafter.py; else 0);
    `trained`: a trained file serves the layer (else the whole-vocabulary logit lens would)."""

    rows: int
    draft_layers: int = 0
    trained: bool = False


def given_predictor_file(predictor: str, exit_predictor: str | None) -> Path | None:
    """The predictor file the user named (`--exit-predictor PATH` or `--predictor PATH`), else None."""
    if exit_predictor == "none" or predictor == "logit-lens":
        return None
    if exit_predictor:
        return Path(exit_predictor)
    return Path(predictor) if is_predictor_file(predictor) else None


def _file_meta(path: Path | None) -> dict | None:
    """The header of predictor file `path`, or None when there is no path or it cannot be read
    (choose_exit_predictor reports a bad file). Never raises."""
    if path is None:
        return None
    try:
        return read_predictor_meta(path)
    except (OSError, ValueError):
        return None


def given_exit_layer(*, predictor: str, exit_predictor: str | None) -> int | None:
    """The exit layer a user-named predictor file was trained at (its header), or None when no file is
    named or its header cannot be read (choose_exit_predictor reports a bad file). Never raises."""
    layer = (_file_meta(given_predictor_file(predictor, exit_predictor)) or {}).get("exit_layer")
    return layer if isinstance(layer, int) else None


def given_exit_memory(*, predictor: str, exit_predictor: str | None) -> tuple[int, int]:
    """(bytes, KV cache layers) a user-named predictor file adds to its exit stage: the file's size (its
    tensors, about), and 1 KV layer for a next-layer drafter's own (the memory plan charges it as a
    decoder layer's, token-tree scratch positions included); (0, 0) without a readable file (the
    shipped heads are under 1 MB; choose_exit_predictor reports a bad file). Never raises."""
    path = given_predictor_file(predictor, exit_predictor)
    meta = _file_meta(path)
    if meta is None:
        return 0, 0
    return path.stat().st_size, int(meta.get("arch") == NEXT_LAYER_ARCH)


def exit_head_shape(*, predictor: str, exit_predictor: str | None, model_dir: Path, config: ModelConfig,
                    exit_layer: int, folder: Path = SHIPPED_DIR) -> ExitHeadShape:
    """The `ExitHeadShape` of the exit head at `exit_layer` under the rules above: the draft
    vocabulary size (pipeline/speculation/predictors.py [Note: draft vocabulary]) and draft layer of the
    trained file that would run there, else the whole vocabulary and no layer (also for a given file
    trained at another layer). Reads file headers only and never raises: choose_exit_predictor
    reports bad files."""
    full = ExitHeadShape(rows=config.vocab_size)
    if predictor == "logit-lens" or exit_predictor == "none":
        return full
    path = given_predictor_file(predictor, exit_predictor)
    if path is None:  # the shipped head: by the converted GGUF's hash too (cheap, model_key); a plain
        # folder would have to be hashed (seconds), so there the name alone finds it
        key = model_key(model_dir)
        digest = key.removeprefix("sha256:")[:12] if key.startswith("sha256:") else None
        path = shipped_predictors(model_name(model_dir), kind="early-exit", hash12=digest, folder=folder).get(exit_layer)
    meta = _file_meta(path) or {}
    if meta.get("exit_layer") != exit_layer:  # not the head that would run at this layer
        return full
    return ExitHeadShape(rows=int(meta.get("draft_vocab_size", config.vocab_size)),
                         draft_layers=int(meta.get("arch") == NEXT_LAYER_ARCH), trained=True)


def exit_head_memory(*, predictor: str, exit_predictor: str | None, model_dir: Path, config: ModelConfig,
                     exit_layer: int | None, dtype: torch.dtype, trained_only: bool = False) -> int:
    """Bytes the exit head's copies of the final norm and LM head rows hold on the exit stage
    (pipeline/weights/stage_memory.py `exit_head_bytes` of `exit_head_shape`'s rows, in `dtype`: the
    stage's activation dtype) when the run has an exit head (the caller checks). exit_layer None: not
    known yet (`--stages auto` picks stage 0's last layer), so the most any layer before the last would
    hold. trained_only: only a layer a trained head serves holds one (`--speculate auto` runs `none`
    elsewhere: launcher/cli/speculation_defaults.py `settle_auto`); 0 when none does. A trained head's
    own tensors are its file's (`given_exit_memory`). Never raises."""
    layers = range(config.num_hidden_layers - 1) if exit_layer is None else [exit_layer]
    shapes = [exit_head_shape(predictor=predictor, exit_predictor=exit_predictor, model_dir=model_dir,
                              config=config, exit_layer=layer) for layer in layers]
    rows = max((s.rows for s in shapes if s.trained or not trained_only), default=0)
    return exit_head_bytes(config, rows=rows, dtype=dtype) if rows else 0
