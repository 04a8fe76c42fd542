"""The plan of a run, decided before any process is spawned: model folder, layer split, exit head, FIRP file.

Owns resolving a `RunConfig` (pipeline/run_config.py) against the model it names: the model folder
and architecture, the per-stage layer ranges (balanced, costing the LM head and the exit head, or
the user's split), the exit layer, the trained exit head (launcher/coordinator/predictor_select.py) and the
FIRP maps. Everything here can fail on bad user input, so it all runs before anything starts; the
result, `RunPlan`, is what launcher/coordinator/session.py derives the coordinator's and the stages' views from.
Errors name parameters, not flags ([Note: parameter names in errors] in pipeline/run_config.py).
Must not: start processes or hold torch modules.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from launcher.backends.placement import available_memory_bytes, stages_on_this_machine
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.predictor_select import (
    choose_exit_predictor,
    exit_head_memory,
    exit_head_shape,
    given_exit_layer,
    given_exit_memory,
)
from pipeline.measure.row_cost import RowCostTable
from pipeline.model.config import MODEL_DTYPES, ModelConfig
from pipeline.model.partition import (
    LayerRange,
    balanced_split,
    head_cost_layers,
    parse_layer_split,
    split_from_sizes,
)
from pipeline.model.stage_model import checkpoint_shapes
from pipeline.model.tensor_names import head_tensor_name
from pipeline.model.tokenizer import Tokenizer
from pipeline.run_config import RunConfig
from pipeline.speculation.predictor_file import (
    SHIPPED_DIR,
    ModelIdentity,
    load_predictor,
    model_identity,
    shipped_predictors,
)
from pipeline.speculation.tree import scratch_positions
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from pipeline.weights.gguf_blocks import gguf_source_of, requantised_linears
from pipeline.weights.gguf_import import SOURCE_FILE
from pipeline.weights.quant import packed_weight_bytes
from pipeline.weights.quant_load import effective_mode, linear_weight_bytes
from pipeline.weights.registry import resolve_model
from pipeline.weights.stage_memory import (
    kv_bytes_per_layer,
    model_weight_bytes,
    rotation_table_bytes,
    stage_dtype,
)

log = logging.getLogger(__name__)
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class FirpSetup:
    """FIRP maps for the run: the predictor file's bytes, its layer, and how many maps are used."""

    file_bytes: bytes = dataclasses.field(repr=False)
    layer: int = -1
    k: int = 0


def shipped_firp_file(identity: ModelIdentity, exit_layer: int, folder: Path = SHIPPED_DIR) -> Path | None:
    """The shipped FIRP file for this model (pipeline/assets/predictors/<model>-<hash12>-firp-L<layer>-k<k>):
    the one at `exit_layer` if shipped, else the one at the nearest layer; None if none is shipped."""
    layers = shipped_predictors(identity.name, kind="firp", hash12=identity.hash[:12], folder=folder)
    return layers[min(layers, key=lambda layer: (abs(layer - exit_layer), layer))] if layers else None


def default_firp_k(meta: dict) -> int:
    """`firp_k` when not given: the shortest chain whose held-out accepted drafts per pass (the file's
    eval) is within 0.02 of the best (longer chains cost pseudo rows for almost nothing), else all maps."""
    per_pass = {int(k): float(v) for k, v in meta.get("eval", {}).get("accepted_per_pass", {}).items()
                if int(k) <= int(meta["k"])}
    if not per_pass:
        return int(meta["k"])
    best = max(per_pass.values())
    return min(k for k, v in per_pass.items() if v >= best - 0.02)


def resolve_firp(options: RunConfig, model_dir: Path, config: ModelConfig, exit_layer: int) -> FirpSetup:
    """Load and check the FIRP file (`firp_file`, else the shipped one nearest to `exit_layer`).
    Raises ValueError / FileNotFoundError naming the problem (no file, wrong model, too few maps)."""
    identity = model_identity(model_dir, config)
    path = options.firp_file or shipped_firp_file(identity, exit_layer)
    if path is None:
        raise ValueError(f"speculate {options.speculate} needs firp_file PATH: no FIRP maps are shipped for "
                         f"model {identity.name!r} (train them with `speedpipe train-predictor --kind firp`)")
    pred = load_predictor(path, expect=identity, kind="firp")
    k = default_firp_k(pred.meta) if options.firp_k is None else options.firp_k
    if k > int(pred.meta["k"]):
        raise ValueError(f"firp_k {k} is more than the {pred.meta['k']} maps in {path}")
    if not 0 <= pred.exit_layer < config.num_hidden_layers:
        raise ValueError(f"FIRP file {path} has layer {pred.exit_layer}, outside the model's {config.num_hidden_layers}")
    return FirpSetup(Path(path).read_bytes(), pred.exit_layer, k)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A validated run: model folder, architecture, tokenizer, the per-stage layer ranges, the exit
    layer, and what the exit stage and the FIRP stage load. Whether an exit head runs after
    `exit_layer` at all is the run configuration's `needs_exit_head`."""

    model_dir: Path
    config: ModelConfig
    tokenizer: Tokenizer
    ranges: list[LayerRange]
    exit_layer: int
    firp: FirpSetup | None = None
    exit_predictor: bytes = b""  # trained early-exit predictor file for the exit stage; b"" = logit lens
    predictor_note: str = ""  # what the exit head is, for the user
    row_costs: RowCostTable | None = None  # from row_cost_file ([Note: row-cost-driven chains] in pipeline/engine/row_budget.py)

    @property
    def firp_pseudo_weight(self) -> float:
        """Share of the model's layers a FIRP pseudo row runs through (after the FIRP layer); 1 without FIRP."""
        if self.firp is None:
            return 1.0
        return max(1, self.config.num_hidden_layers - self.firp.layer - 1) / self.config.num_hidden_layers

    @property
    def exit_stage(self) -> int:
        """Index of the stage holding the exit layer."""
        return next(i for i, r in enumerate(self.ranges) if self.exit_layer in r)


def layer_param_count(config: ModelConfig) -> int:
    """Weights of one decoder layer's linears (q, k, v, o and a dense SwiGLU MLP)."""
    h, d = config.hidden_size, config.head_dim
    return h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 3 * h * config.intermediate_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadCosts:
    """The decode cost, in decoder-layer units, of the last stage's final norm + LM head (`head`) and of
    a whole-vocabulary exit head on stage 0 (`exit_head`), in the run's numeric mode ([Note: partition
    cost] in pipeline/model/partition.py)."""

    head: float
    exit_head: float


def head_costs(options: RunConfig, config: ModelConfig, model_dir: Path) -> HeadCosts:
    """Cost the LM head and an exit head from the bytes each streams in the run's numeric mode over the
    bytes of an average decoder layer's linears (a mixture-of-experts layer's experts counted at
    num_experts_per_tok / num_experts: a decode row runs that many). The LM head as the last stage
    builds it (pipeline/weights/quant_load.py `linear_weight_bytes`: in `auto` the GGUF's own block
    types); the exit head dense in the stage's activation dtype (pipeline/engine/stage_assembly.py
    `build_exit_head`). Reads no tensor data (the GGUF's tensor table at most). Raises ValueError."""
    n = config.num_hidden_layers
    weights = linear_weight_bytes(config, LayerRange(0, n), is_last=True, quantization=options.quantization,
                                  dtype=options.torch_dtype, model_dir=str(model_dir), device=options.device)
    head_name = head_tensor_name(config)
    expert_share = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    layer_bytes = sum(b * (expert_share if ".experts." in name else 1.0)
                      for name, b in weights.items() if name != head_name) / n
    act = stage_dtype(options.quantization, model_dir, options.torch_dtype, options.device)
    exit_bytes = packed_weight_bytes(act, (config.vocab_size, config.hidden_size))
    return HeadCosts(head=head_cost_layers(head_bytes=weights[head_name], layer_bytes=layer_bytes),
                     exit_head=head_cost_layers(head_bytes=exit_bytes, layer_bytes=layer_bytes))


def stage_extra_cost(options: RunConfig, config: ModelConfig, costs: HeadCosts, *, exit_rows: int | None = None,
                     draft_layers: int = 0) -> list[float]:
    """Per-stage cost beyond its decoder layers, in layer units: the LM head on the last stage, and an
    exit head on stage 0 when speculation uses one there ([Note: partition cost]). costs: `head_costs`
    of the run; exit_rows: the LM-head rows the exit head scores (a trained head's draft vocabulary;
    default the whole vocabulary); draft_layers: decoder layers the exit head runs (`ExitHeadShape`),
    one layer unit each."""
    extra = [0.0] * options.num_stages
    extra[-1] += costs.head
    if _stage0_exit_head(options):
        extra[0] += costs.exit_head * (exit_rows or config.vocab_size) / config.vocab_size + draft_layers
    return extra


def _stage0_exit_head(options: RunConfig) -> bool:
    """The exit head runs on stage 0 (after its last layer, the default exit layer)."""
    return options.needs_exit_head and options.exit_layer is None


def default_split(options: RunConfig, config: ModelConfig, model_dir: Path) -> list[LayerRange]:
    """The balanced split, costing the exit head (its draft vocabulary and draft layer) at the exit
    layer it ends stage 0 with.

    Stage 0's last layer is the exit layer, and which head runs there (a shipped or given trained
    head, or the whole-vocabulary logit lens) sets stage 0's extra cost. So every exit layer is tried:
    stage 0 is [0, layer], the other stages split the rest by water-filling, and the split whose most
    expensive stage is cheapest wins (ties: the earlier exit layer). A given predictor file fixes the
    exit layer to the one it was trained at. Without an exit head on stage 0: plain water-filling
    ([Note: partition cost] in pipeline/model/partition.py)."""
    n, stages = config.num_hidden_layers, options.num_stages
    costs = head_costs(options, config, model_dir)
    if not _stage0_exit_head(options) or stages < 2:
        return balanced_split(n, stages, extra_cost=stage_extra_cost(options, config, costs))
    given = given_exit_layer(predictor=options.predictor, exit_predictor=options.exit_predictor)
    layers = [given] if given is not None and 0 <= given <= n - stages else range(n - stages + 1)
    best = None
    for layer in layers:
        shape = exit_head_shape(predictor=options.predictor, exit_predictor=options.exit_predictor,
                                model_dir=model_dir, config=config, exit_layer=layer)
        extra = stage_extra_cost(options, config, costs, exit_rows=shape.rows, draft_layers=shape.draft_layers)
        rest = balanced_split(n - layer - 1, stages - 1, extra_cost=extra[1:])
        ranges = [LayerRange(0, layer + 1)] + [LayerRange(r.start + layer + 1, r.stop + layer + 1) for r in rest]
        cost = max(len(r) + c for r, c in zip(ranges, extra, strict=True))
        if best is None or cost < best[0]:
            best = (cost, ranges)
    return best[1]


def check_checkpoint(reader: CheckpointReader, config: ModelConfig, ranges: list[LayerRange]) -> None:
    """Before any stage starts: every stage's tensors exist with the shapes its model needs (from
    the safetensors headers). Raises ValueError naming the first missing or mis-shaped tensor.
    Logs a warning for decoder-layer tensors past config.json's `num_hidden_layers`: the weights
    then hold more layers than the config runs (transformers warns of unused weights too), and says
    once that a multimodal checkpoint runs text-only (`_note_text_only`)."""
    for i, r in enumerate(ranges):
        first, last = i == 0, i == len(ranges) - 1
        found = reader.shapes(stage_tensor_names(config, r, is_first=first, is_last=last))
        for name, shape in checkpoint_shapes(config, r, is_first=first, is_last=last).items():
            if found.get(name, shape) != shape:
                raise ValueError(f"checkpoint tensor {name!r} in {reader.model_dir} has shape {found[name]}, "
                                 f"but config.json asks for {shape}")
    if config.text_only_of:
        _note_text_only(reader.model_dir, config.text_only_of, len(reader.skipped_names))
    extra = sorted(n for n in reader.tensor_names
                   if (m := _LAYER_TENSOR.match(n)) and int(m.group(1)) >= config.num_hidden_layers)
    if extra:
        log.warning("%s holds %d tensors of decoder layers past config.json's num_hidden_layers = %d (e.g. %s); "
                    "they are not used, so the output is likely wrong", reader.model_dir, len(extra),
                    config.num_hidden_layers, extra[0])


@functools.cache  # once per folder: `launch` and `--serve` resolve the plan more than once
def _note_text_only(model_dir: Path, architecture: str, num_skipped: int) -> None:
    """Say on stderr that a multimodal checkpoint runs text-only ([Note: text-only multimodal] in
    pipeline/model/family_config.py)."""
    log.warning("%s is a %s checkpoint: speedpipe runs its language model only; the vision tower and projector "
                "(%d tensors) are not loaded, so prompts are text only", model_dir, architecture, num_skipped)


def check_lengths(options: PipelineOptions, config: ModelConfig, model_dir: Path, *, ranges: Sequence[LayerRange],
                  available: int | None = None) -> None:
    """Refuse limits the model or this machine cannot hold, before any stage allocates its KV cache:
    `max_model_len` above the model's context (`ModelConfig.max_context`, as vLLM), and, for CPU stages all
    on this machine (`stages_on_this_machine`), more memory than is available here (it would fail, or
    set off the kernel's out-of-memory killer, only after the stages start): the KV cache for
    `max_num_seqs` x (`max_model_len` + the token-tree scratch positions) of every decoder layer and of a
    given drafter's own KV layer (`given_exit_memory`, with SPEED on), and each stage's RoPE
    rotation tables (of its layers in `ranges`), both in the stages' activation dtype, as the memory
    plan charges them (pipeline/weights/stage_memory.py), plus the weights as the stages hold them in the
    run's numeric mode, as the plan charges them too (`model_weight_bytes`: dense in that dtype, or packed
    linears beside a dense embedding and norms; a tied embedding and LM head twice unless one stage holds
    them as one tensor, `shares_tied_head`), plus a given drafter file's size, plus the exit head's copies of
    the final norm and LM head rows when the run has one (`exit_head_memory`: the rows a trained head's
    draft vocabulary keeps, else the whole vocabulary, in the activation dtype). available: bytes (default:
    `available_memory_bytes()`). Raises ValueError."""
    if options.max_model_len > config.max_context:
        stretched = "" if config.max_context == config.max_position_embeddings else \
            " stretched by YaRN"
        raise ValueError(f"max_model_len {options.max_model_len} is more than the model's context {config.max_context} "
                         f"(max_position_embeddings{stretched}, config.json); lower max_model_len")
    if options.device != "cpu" or not stages_on_this_machine(options.placement):
        return  # stage memory is on other machines or devices: each stage reports its own failure
    dtype = stage_dtype(options.quantization, model_dir, MODEL_DTYPES[options.dtype], options.device)
    scratch = scratch_positions(options.draft_tree, options.max_inflight or options.num_stages)
    drafter_bytes, drafter_kv_layers = given_exit_memory(predictor=options.predictor, exit_predictor=options.exit_predictor) \
        if options.uses_speed else (0, 0)  # (as the CLI's plan: launcher/cli/options.py `_auto_stages`)
    kv = kv_bytes_per_layer(config, dtype=dtype, max_num_seqs=options.max_num_seqs, max_model_len=options.max_model_len,
                            num_scratch=scratch) * (config.num_hidden_layers + drafter_kv_layers)
    tables = sum(rotation_table_bytes(config, r, dtype=dtype, max_model_len=options.max_model_len,
                                      num_scratch=scratch, device=options.device) for r in ranges)
    weights = model_weight_bytes(CheckpointReader(model_dir), dtype=MODEL_DTYPES[options.dtype],
                                 quantization=options.quantization, device=options.device,
                                 dense_layout=options.dense_layout).total(len(ranges)) + drafter_bytes
    if options.needs_exit_head:  # its copies of the final norm and LM head rows
        weights += exit_head_memory(predictor=options.predictor, exit_predictor=options.exit_predictor,
                                    model_dir=model_dir, config=config, dtype=dtype,
                                    exit_layer=ranges[0].stop - 1 if options.exit_layer is None else options.exit_layer)
    available = available_memory_bytes() if available is None else available
    if kv + tables + weights > available:
        dense = effective_mode(options.quantization, str(model_dir), options.device) == "none"
        remedy = ("lower max_model_len or max_num_seqs" if weights < available else
                  "the weights alone do not fit: quantise them (--quantization) or place stages on more machines"
                  if dense else "the weights alone do not fit in this mode: place stages on more machines")
        raise ValueError(f"max_num_seqs {options.max_num_seqs} x max_model_len {options.max_model_len} needs "
                         f"{_size(kv)} of KV cache, plus {_size(weights)} of weights "
                         f"and {_size(tables)} of RoPE tables: more than the {_size(available)} of memory available "
                         f"on this machine; {remedy}")


def note_requantised_blocks(options: PipelineOptions, config: ModelConfig, model_dir: Path) -> None:
    """Warn when `--quantization auto` runs some of the GGUF's projections requantised (int4 groups,
    or int8 rows: pipeline/weights/quant.py; types without a kernel here, e.g. Qwen2.5-Coder's 29 Q6_K tensors): less precise than the file;
    or runs dense because the GGUF a converted folder came from is gone (other tokens, silently)."""
    if options.quantization == "auto" and options.device == "cpu" and (model_dir / SOURCE_FILE).is_file() \
            and gguf_source_of(model_dir) is None:
        log.warning("--quantization auto: the GGUF file %s was converted from is gone (%s), so its blocks cannot be "
                    "used: the weights run dense (as --quantization none); give the registered model name or the "
                    ".gguf file to use them", model_dir, SOURCE_FILE)
    if effective_mode(options.quantization, str(model_dir), options.device) != "gguf":
        return
    counts = requantised_linears(gguf_source_of(model_dir), config, model_dir=model_dir)
    if counts:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        log.warning("--quantization auto: the GGUF's %s weights have no int kernel here and run requantised (int4 "
                    "groups of 32; int8 rows for MoE routers and inputs not a multiple of 32), less precise than the "
                    "file (its Q4_0/Q4_1/Q4_K/Q8_0 weights run as they are); --quantization int8 keeps more of "
                    "their precision, none all of it", kinds)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def resolve(options: PipelineOptions, *, check_limits: bool = True) -> RunPlan:
    """Resolve and validate the model, split, exit head and FIRP file; with `check_limits`, also
    the context length and KV-cache memory (`check_lengths`: off for callers that only want the
    plan, such as the training commands' default exit layer). Raises ValueError /
    FileNotFoundError (user errors, naming the parameter)."""
    model_dir = resolve_model(options.model, cache_dir=options.cache_dir, progress=options.progress)
    config = ModelConfig.from_model_dir(model_dir)
    if options.layer_split:
        ranges = split_from_sizes(parse_layer_split(options.layer_split), config.num_hidden_layers)
        if len(ranges) != options.num_stages:
            raise ValueError(f"layer_split {options.layer_split} has {len(ranges)} stages, but num_stages is "
                             f"{options.num_stages}")
    else:
        ranges = default_split(options, config, model_dir)
    check_checkpoint(CheckpointReader(model_dir), config, ranges)
    if check_limits:
        check_lengths(options, config, model_dir, ranges=ranges)
        note_requantised_blocks(options, config, model_dir)
    exit_layer = ranges[0].stop - 1 if options.exit_layer is None else options.exit_layer
    if options.uses_speed:
        if options.num_stages < 2:
            raise ValueError(f"speculate {options.speculate} needs num_stages >= 2 (one stage has no idle stage "
                             f"for drafts to fill)")
        if not 0 <= exit_layer < config.num_hidden_layers - 1:
            raise ValueError(f"exit_layer {exit_layer} must be in [0, {config.num_hidden_layers - 1}) "
                             f"(a layer before the model's last)")
    choice = None
    if options.needs_exit_head:
        choice = choose_exit_predictor(predictor=options.predictor, exit_predictor=options.exit_predictor,
                                       model_dir=model_dir, config=config, exit_layer=exit_layer)
    firp = resolve_firp(options, model_dir, config, exit_layer) if options.uses_firp else None
    row_costs = None
    if options.row_cost_path is not None:
        try:
            row_costs = RowCostTable.load(options.row_cost_path, options.row_cost_mode)
        except (OSError, ValueError, KeyError) as err:  # a missing file, bad JSON, no table for the mode
            raise ValueError(f"row_cost file {options.row_cost_path}: {err}") from None
    return RunPlan(model_dir, config, Tokenizer(model_dir), ranges, exit_layer, firp,
                   exit_predictor=choice.file_bytes if choice else b"", predictor_note=choice.note if choice else "",
                   row_costs=row_costs)
