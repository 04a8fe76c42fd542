"""The flags every command that starts a pipeline shares, and the PipelineOptions they make.

Owns `add_pipeline_args` (the "pipeline" flag group of `launch` and `serve`), `options_and_reason`
(PipelineOptions from those flags and the speculation and placement groups, with `--stages auto` and
`--speculate auto` decided), `dtype_arg` (what every --dtype accepts: `bench sweep`'s and `bench simulate`'s
too) and `say`, the progress line on stderr. Shared by the CLI entry
(launcher/cli/main.py) and `serve` (launcher/serving/serve.py), which must not import the entry
module. Must not: parse argv, start anything or map errors to exit codes (main.py does).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from launcher.backends.placement_options import placement_from_args
from launcher.cli.flag_notes import idle_flag_notes
from launcher.cli.parsing import UsageError, add_vllm_aliases, min_acceptance_arg
from launcher.cli.speculation_defaults import auto_speculate, check_auto_flags
from launcher.coordinator.pipeline_options import DEFAULT_DECODE_FEED, PipelineOptions
from pipeline.engine.row_budget import default_disable_by_batch_size
from pipeline.model.config import MODEL_DTYPES
from pipeline.weights.dense_layout import DENSE_LAYOUTS
from pipeline.weights.quant import QUANTIZATION_CHOICES
from pipeline.weights.registry import DEFAULT_MODEL
from workers.log_config import LOG_LEVEL_ENV, LOG_LEVELS, resolve_log_level

DEFAULT_MAX_MODEL_LEN = 2048  # KV positions per sequence when --max-model-len is not given
# `--grammar-drafting` mode -> RunConfig's (grammar_drafts, grammar_jump) ([Note: grammar-aware drafting]
# in pipeline/engine/grammar_drafts.py); the first is the default (RunConfig's own).
GRAMMAR_DRAFTING = {"jump": (True, True), "drafts": (True, False), "off": (False, False)}


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts a pipeline."""
    g = p.add_argument_group("pipeline")
    g.add_argument("--stages", "-pp", "--pipeline-parallel-size", type=_stages_arg, default=2, metavar="N",
                   help="number of pipeline stages (worker processes; vLLM's -pp; default 2), or 'auto': the fewest "
                   "whose memory each fits --stage-memory-gib, which auto needs")
    g.add_argument("--stage-memory-gib", type=float,
                   help="per-stage budget of weights + KV cache + RoPE rotation tables for --stages auto (GiB; each stage process adds "
                   "0.25-0.35 GiB of its own)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, HF model folder or .gguf file (default {DEFAULT_MODEL})")
    g.add_argument("--layer-split", help="layers per stage, e.g. 8,8,7,7 (default: balanced)")
    g.add_argument("--dtype", default="float32", type=dtype_arg, metavar="DTYPE", help=f"{DTYPE_HELP} (default float32)")
    g.add_argument("--device", default="cpu", help="cpu | cuda (one GPU per stage; default cpu)")
    g.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="weights: auto (a GGUF's own Q4/Q8 blocks) | none (dense --dtype) | int8 | int4 (default none)")
    g.add_argument("--dense-layout", default=DENSE_LAYOUTS[0], choices=DENSE_LAYOUTS,
                   help="float32 dense weights on CPU: reference (transformers' op order, default) | fast (wide "
                   "weights stored transposed: faster one-row decode, last-bit differences in the logits)")
    g.add_argument("--max-model-len", type=int,
                   help=f"max prompt + generated tokens per sequence (default {DEFAULT_MAX_MODEL_LEN}, or the model's "
                   "context if shorter)")
    g.add_argument("--max-num-seqs", type=int, default=8, help="KV-cache slots: sequences decoded at once")
    g.add_argument("--threads-per-stage", type=int, default=1, help="torch threads in each stage process")
    g.add_argument("--stage-timeout-s", type=float, default=120.0,
                   help="deadline for any data-plane wait; a stage silent this long is a failure")
    g.add_argument("--cache-dir", help="where converted models are cached (default ~/.cache/speedpipe)")
    g.add_argument("--log-level", metavar="LEVEL", help=f"{' | '.join(LOG_LEVELS)} (default: ${LOG_LEVEL_ENV}, "
                   "else WARNING)")
    add_vllm_aliases(g)


# vLLM's --dtype spellings: `auto` is this project's exact default (float32), `half` / `float` as vLLM.
DTYPE_ALIASES = {"auto": "float32", "half": "float16", "float": "float32"}
# Every --dtype value accepted, as vLLM's `ModelDType` (vllm/config/model.py) lists them:
# "auto", "half", "float16", "bfloat16", "float", "float32" (the model dtypes, then the aliases).
DTYPE_CHOICES = (*MODEL_DTYPES, *DTYPE_ALIASES)
DTYPE_HELP = "float32 (= auto, float) | bfloat16 | float16 (= half)"  # every --dtype's values


def dtype_arg(text: str) -> str:
    """--dtype: a model dtype name (MODEL_DTYPES), or one of vLLM's spellings (DTYPE_ALIASES); the dtype name.
    Raises argparse.ArgumentTypeError (exit 2, naming the flag) listing DTYPE_CHOICES for any other text."""
    if text not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPE_CHOICES)}, got {text[:80]!r}")
    return DTYPE_ALIASES.get(text, text)


def _stages_arg(text: str) -> int | str:
    """--stages: a positive count or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from None


def settle_max_model_len(args: argparse.Namespace, progress: bool) -> None:
    """Without `--max-model-len` (None), set its default, lowered to the model's context
    (`ModelConfig.max_context`) where that is shorter: only a length the user asked for is refused
    for exceeding the model's (run_plan.check_lengths). Resolves the model (converting a
    GGUF once); changes `args.max_model_len` in place. Raises what `resolve_model` raises."""
    if args.max_model_len is not None:  # given (in any spelling argparse takes, abbreviations too)
        return
    args.max_model_len = default_max_model_len(args.model, DEFAULT_MAX_MODEL_LEN, cache_dir=args.cache_dir,
                                               progress=progress)


def default_max_model_len(model: str, default: int, *, cache_dir: str | None, progress: bool) -> int:
    """`default`, or the model's context (`ModelConfig.max_context`) where that is shorter (resolving the model,
    converting a GGUF once). Raises what `resolve_model` raises."""
    from pipeline.model.config import ModelConfig
    from pipeline.weights.registry import resolve_model

    config = ModelConfig.from_model_dir(resolve_model(model, cache_dir=cache_dir, progress=progress))
    return min(default, config.max_context)


def _auto_stages(args: argparse.Namespace, progress: bool) -> tuple[int, str | None]:
    """(--stages, --layer-split) from the flags; for --stages auto, the fewest stages that fit the
    budget (pipeline/weights/stage_memory.py), printing each stage's need against it. Raises UsageError,
    and ValueError for a --draft-tree out of range or a budget no split fits."""
    if args.stages != "auto":
        return args.stages, args.layer_split
    if args.stage_memory_gib is None or not 0 < args.stage_memory_gib < math.inf or args.layer_split:
        raise UsageError("--stages auto needs a finite --stage-memory-gib > 0 (and no --layer-split)")
    from pipeline.speculation.tree import scratch_positions, validate_draft_tree
    from pipeline.weights.registry import resolve_model
    from pipeline.weights.stage_memory import plan_stages_for_budget

    dtype = MODEL_DTYPES[args.dtype]  # a name dtype_arg accepted
    validate_draft_tree(args.draft_tree)  # before its scratch positions are charged (no "no split fits" for a typo)
    model_dir = resolve_model(args.model, cache_dir=args.cache_dir, progress=progress)
    exit_bytes = exit_kv_layers = 0
    if args.speculate in ("speed", "speed+firp", "auto"):  # a trained exit head's file and a draft layer's KV
        exit_bytes, exit_kv_layers = _exit_memory(args, model_dir, dtype)
    plan = plan_stages_for_budget(model_dir, budget_bytes=int(args.stage_memory_gib * 2**30), dtype=dtype,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  exit_bytes=exit_bytes, exit_kv_layers=exit_kv_layers, exit_layer=args.exit_layer,
                                  device=args.device, quantization=args.quantization, dense_layout=args.dense_layout,
                                  scratch_of=lambda k: scratch_positions(args.draft_tree, args.max_inflight or k))
    for line in plan.lines():
        logging.getLogger(__name__).info("%s", line)
        if progress:
            say(line)
    return len(plan.ranges), plan.layer_split()


def _exit_memory(args: argparse.Namespace, model_dir, dtype) -> tuple[int, int]:
    """(bytes, KV layers) the exit head adds to its stage when SPEED runs one: a given trained head's file
    and a next-layer drafter's KV layer (`given_exit_memory`), plus the head's copies of the final norm
    and LM head rows (`exit_head_memory`) when the predictor drafts from the exit state, at `--exit-layer`,
    else the given file's layer, else the most any layer would hold (the split picks stage 0's last;
    under `--speculate auto` only a layer a trained head serves, as auto runs `none` elsewhere)."""
    from launcher.coordinator.predictor_select import exit_head_memory, given_exit_layer, given_exit_memory
    from pipeline.model.config import ModelConfig
    from pipeline.speculation.predictors import make_predictor
    from pipeline.weights.stage_memory import stage_dtype

    file_bytes, kv_layers = given_exit_memory(predictor=args.predictor, exit_predictor=args.exit_predictor)
    if not make_predictor(args.predictor).needs_exit_head:
        return file_bytes, kv_layers
    layer = args.exit_layer if args.exit_layer is not None else \
        given_exit_layer(predictor=args.predictor, exit_predictor=args.exit_predictor)
    head = exit_head_memory(predictor=args.predictor, exit_predictor=args.exit_predictor, model_dir=model_dir,
                            config=ModelConfig.from_model_dir(model_dir), exit_layer=layer,
                            dtype=stage_dtype(args.quantization, model_dir, dtype, args.device),
                            trained_only=args.speculate == "auto")
    return file_bytes + head, kv_layers


def speculation_choice(args: argparse.Namespace, num_stages: int) -> tuple[str, str]:
    """(the --speculate mode, why: "" unless `auto` chose it; [Note: speculation default] in
    launcher/cli/speculation_defaults.py)."""
    if args.speculate != "auto":
        return args.speculate, ""
    return auto_speculate(model=args.model, num_stages=num_stages, placement=placement_from_args(args),
                          device=args.device, threads_per_stage=args.threads_per_stage, predictor=args.predictor,
                          exit_predictor=args.exit_predictor)


def options_and_reason(args: argparse.Namespace, *, progress: bool = True) -> tuple[PipelineOptions, str]:
    """(PipelineOptions from launch's / serve's flags, why `--speculate auto` chose the mode: "" when
    the flag named it). Raises UsageError, or ValueError naming the parameter (RunConfig)."""
    settle_max_model_len(args, progress)
    num_stages, layer_split = _auto_stages(args, progress)
    speculate, why = speculation_choice(args, num_stages)
    tuning = dict(max_inflight=args.max_inflight, min_acceptance=min_acceptance_arg(args.min_acceptance),
                  draft_at=args.draft_at, deep_draft_min_acceptance=args.deep_draft_min_acceptance,
                  firp_k=args.firp_k, firp_file=args.firp_file, firp_min_prob=args.firp_min_prob,
                  draft_tree=args.draft_tree, **grammar_drafting_fields(args.grammar_drafting))
    placement = placement_from_args(args)
    if num_stages >= 1 and not (placement.multi_node and placement.node_rank > 0):  # RunConfig names bad counts;
        check_auto_flags(tuning, speculate=speculate, why=why)  # members run node 0's choice, not their own
        for note in idle_flag_notes(args, tuning, speculate=speculate, why=why):
            say(note)
    options = PipelineOptions(
        num_stages=num_stages, model=args.model, layer_split=layer_split, dtype=args.dtype, device=args.device,
        quantization=args.quantization, dense_layout=args.dense_layout, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, threads_per_stage=args.threads_per_stage,
        stage_timeout_s=args.stage_timeout_s, log_level=resolve_log_level(args.log_level), cache_dir=args.cache_dir,
        progress=progress, speculate=speculate, predictor=args.predictor, exit_layer=args.exit_layer,
        exit_predictor=args.exit_predictor, row_cost_file=args.row_cost_file, row_cost=args.row_cost, **tuning,
        placement=placement, record_timeline=not getattr(args, "no_timeline", False),
        decode_feed=args.decode_feed or DEFAULT_DECODE_FEED,
        speculative_disable_by_batch_size=disable_by_batch_size(args, num_stages=num_stages, why=why))
    return options, why


def disable_by_batch_size(args: argparse.Namespace, *, num_stages: int, why: str) -> int | None:
    """`--speculative-disable-by-batch-size` as given; not given, num_stages + 1 when `--speculate auto`
    chose the mode (why != ""), else None (never): [Note: speculation under load] in
    pipeline/engine/row_budget.py says why S + 1."""
    given = getattr(args, "speculative_disable_by_batch_size", None)
    if given is not None or not why:
        return given
    return default_disable_by_batch_size(num_stages)


def grammar_drafting_fields(mode: str) -> dict[str, bool]:
    """PipelineOptions' grammar_drafts / grammar_jump for a `--grammar-drafting` mode (GRAMMAR_DRAFTING)."""
    grammar_drafts, grammar_jump = GRAMMAR_DRAFTING[mode]
    return {"grammar_drafts": grammar_drafts, "grammar_jump": grammar_jump}


def say(text: str) -> None:
    """A progress line for people, on stderr (stdout carries only results)."""
    print(f"[speedpipe] {text}", file=sys.stderr, flush=True)
