"""The run configuration: what a pipeline runs and with which limits, validated once.

Owns `RunConfig` (the one frozen configuration every front end builds from its arguments) and the
prompt-length rule (the model dtypes it accepts: `MODEL_DTYPES` of pipeline/model/config.py). Lower layers get views of the run
configuration (the scheduler's limits, each stage's load spec) or the booleans they need
(`needs_exit_head`), never the user's flag names to re-derive them.
Must not: resolve models, read files or know about processes (launcher/coordinator/run_plan.py resolves the
model, the split and the predictor files; launcher/coordinator/session.py starts the stages).

[Note: parameter names in errors]
Errors raised here (and elsewhere in pipeline/) name the parameter (`max_num_seqs`), not a
command-line flag: the same config is built by the CLI, the HTTP server, benchmarks and tests. The
CLI turns parameter names into its flag names when it prints the one-line error
(launcher/cli/errors.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pipeline.engine.records import SchedulerConfig
from pipeline.engine.row_budget import check_disable_by_batch_size
from pipeline.measure.row_cost import RowCostTable, numeric_mode_name
from pipeline.model.config import MODEL_DTYPES
from pipeline.speculation.draft_gate import DraftGate
from pipeline.speculation.items import MAX_TREE_SCRATCH
from pipeline.speculation.predictors import PREDICTORS, is_predictor_file, make_predictor
from pipeline.speculation.tree import MAX_DRAFT_TREE, scratch_positions
from pipeline.weights.dense_layout import validate_dense_layout
from pipeline.weights.quant import validate_quantization
from pipeline.weights.registry import DEFAULT_MODEL

SPECULATE_MODES = ("none", "speed", "firp", "speed+firp")
ROW_COST_SOURCES = ("auto", "none", "calibrate")  # besides file:PATH


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where and how to run the pipeline (everything except the requests and their placement).

    Validated once, in `__post_init__`: raises ValueError naming the parameter, the value and the
    limit ([Note: parameter names in errors]). Derived values are properties, so that no layer
    below works them out again.
    """

    num_stages: int = 2
    model: str = DEFAULT_MODEL  # registered name, HF model folder or .gguf file
    cache_dir: str | None = None  # where converted models are cached (None: the default cache)
    layer_split: str | None = None  # layers per stage, e.g. "8,8,7,7"; None = balanced
    dtype: str = "float32"  # a key of MODEL_DTYPES
    quantization: str = "none"  # weights: auto | none | int8 | int4 (pipeline/weights/quant.py [Note: numeric modes])
    dense_layout: str = "reference"  # float32 dense: reference | fast (pipeline/weights/dense_layout.py)
    device: str = "cpu"
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_seqs: int = 8  # KV-cache slots: sequences decoded at once
    threads_per_stage: int = 1
    stage_timeout_s: float = 120.0  # deadline of any data-plane wait
    speculate: str = "none"  # one of SPECULATE_MODES
    predictor: str = "hybrid"  # a name in PREDICTORS or a trained predictor file (*.safetensors)
    exit_predictor: str | None = None  # trained early-exit file for early-exit / hybrid (default: shipped)
    exit_layer: int | None = None  # None = last layer of stage 0
    max_inflight: int = 0  # items of one sequence in flight; 0 = num_stages
    min_acceptance: float | None = None  # adaptive drafting threshold; None = the break-even (draft_min_acceptance)
    record_timeline: bool = True  # per-item stage timings (off: measure the recording overhead)
    firp_k: int | None = None  # FIRP drafts per chain; None = chosen from the FIRP file's eval
    firp_file: str | None = None  # None = the shipped file for the model
    firp_min_prob: float = 0.0  # FIRP drafts carried only while at least this probable
    row_cost_file: str | None = None  # row_cost.py JSON report: FIRP chain lengths follow its table
    draft_tree: int = 1  # candidates per SPEED draft position, siblings included (pipeline/speculation/tree.py); 1 = off
    grammar_drafts: bool = True  # constrained drafts follow the grammar (pipeline/engine/grammar_drafts.py)
    grammar_jump: bool = True  # with grammar_drafts: a forced run goes as extra rows (jump-forward; where
    # `rows_pass_alone`, else one token per item: `scheduler_config`)
    # of this run's numeric mode (`row_cost_mode`; [Note: row-cost-driven chains] in pipeline/engine/row_budget.py)
    row_cost: str = "auto"  # where the row-cost table comes from: none | calibrate (every stage times
    # itself at start-up) | file:PATH (= row_cost_file PATH) | auto (calibrate when FIRP is on and no
    # file is named, else none); with a table and max_inflight 0, the run-ahead depth follows it too
    # ([Note: run-ahead depth] in pipeline/measure/row_cost.py)
    # no new drafts while this many sequences or more run (vLLM's speculative disable_by_batch_size; None: never;
    # [Note: speculation under load] in pipeline/engine/row_budget.py)
    speculative_disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_speculation()

    def _check_shape(self) -> None:
        """The model, device and limits."""
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        validate_quantization(self.quantization)
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for, but torch sees no CUDA device on this machine")
        validate_dense_layout(self.dense_layout, quantization=self.quantization, dtype=self.dtype, device=self.device)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.threads_per_stage < 1:
            raise ValueError(f"threads_per_stage must be >= 1, got {self.threads_per_stage}")
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s must be > 0, got {self.stage_timeout_s}")

    def _check_speculation(self) -> None:
        """The speculation mode, predictor and FIRP limits."""
        if self.speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.speculate!r}")
        if self.predictor not in PREDICTORS and not is_predictor_file(self.predictor):
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)} or a trained predictor file "
                             f"(*.safetensors), got {self.predictor!r}")
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0 (0: chosen for you), got {self.max_inflight}")
        if self.min_acceptance is not None and not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be 'auto' or in [0, 1], got {self.min_acceptance}")
        check_disable_by_batch_size(self.speculative_disable_by_batch_size)
        if self.firp_k is not None and self.firp_k < 1:
            raise ValueError(f"firp_k must be >= 1, got {self.firp_k}")
        if not 0.0 <= self.firp_min_prob <= 1.0:
            raise ValueError(f"firp_min_prob must be in [0, 1], got {self.firp_min_prob}")
        if self.row_cost not in ROW_COST_SOURCES and not self.row_cost.startswith("file:"):
            raise ValueError(f"row_cost must be auto, none, calibrate or file:PATH, got {self.row_cost!r}")
        if self.row_cost not in ("auto", "none") and self.row_cost_file is not None:
            raise ValueError(f"row_cost {self.row_cost} and row_cost_file {self.row_cost_file} both name a "
                             f"row-cost table: give one")
        path = self.row_cost_path
        if path is not None and not path.endswith(".json"):
            what = "row_cost_file" if self.row_cost_file is not None else "row_cost file:PATH"
            raise ValueError(f"{what} must be a .json report of tests/benchmarks/row_cost.py, got {path!r}")
        if not 1 <= self.draft_tree <= MAX_DRAFT_TREE or (self.draft_tree > 1 and self.speculate != "speed"):
            raise ValueError(f"draft_tree must be between 1 (off) and {MAX_DRAFT_TREE} candidates, with "
                             f"speculate speed when above 1, got {self.draft_tree}")
        if scratch_positions(self.draft_tree, self.max_inflight or self.num_stages) > MAX_TREE_SCRATCH:
            raise ValueError(f"draft_tree {self.draft_tree} with max_inflight {self.max_inflight} needs more than "
                             f"{MAX_TREE_SCRATCH} KV scratch positions per slot: lower max_inflight")
        if self.draft_tree > 1 and not self.rows_pass_alone:
            # [Note: token trees] in pipeline/speculation/tree.py: dense half-precision GEMM rounds a
            # row of a multi-row pass differently from a 1-row pass, often enough to flip greedy ties
            raise ValueError(f"draft_tree {self.draft_tree} needs float32 or an int mode (quantization "
                             f"auto/int8/int4): in dense {self.dtype} tree rows would change greedy output")
        if self.uses_firp and not self.rows_pass_alone:
            # the same for a FIRP chain's k + 1-row verify pass: a bfloat16 story prompt whose two best
            # logits are one bfloat16 step apart changed at its second token with --firp-k 4
            raise ValueError(f"speculate {self.speculate} needs float32 or an int mode (quantization "
                             f"auto/int8/int4): in dense {self.dtype} its multi-row verify passes would change "
                             f"greedy output")

    @property
    def rows_pass_alone(self) -> bool:
        """A row of a multi-row pass computes what a 1-row pass computes: bitwise in the int modes,
        within rounding in float32; not in dense bfloat16/float16, whose GEMM rounds a row by the pass's
        row count ([Note: batch invariance] in pipeline/weights/quant.py) often enough to flip greedy
        ties. Where False, token trees and FIRP are refused and jump-forward is off (`scheduler_config`)."""
        return self.quantization != "none" or self.dtype == "float32"

    @property
    def uses_speed(self) -> bool:
        """SPEED run-ahead drafts are on (`speed` or `speed+firp`)."""
        return self.speculate in ("speed", "speed+firp")

    @property
    def uses_firp(self) -> bool:
        """FIRP chains are on (`firp` or `speed+firp`)."""
        return self.speculate in ("firp", "speed+firp")

    @property
    def needs_exit_head(self) -> bool:
        """The exit stage runs an exit head and reports exit guesses: SPEED is on and its predictor
        drafts from the exit hidden state (ngram drafts from the context alone, at send time)."""
        return self.uses_speed and make_predictor(self.predictor).needs_exit_head

    def draft_min_acceptance(self, parallel_stages: int | None = None) -> float:
        """The adaptive-drafting threshold in force: `min_acceptance`, or when it is None the
        break-even acceptance for `num_stages` of which `parallel_stages` can compute at once (None:
        all; pipeline/speculation/draft_gate.py)."""
        if self.min_acceptance is not None:
            return self.min_acceptance
        return DraftGate.break_even(self.num_stages, parallel_stages=parallel_stages)

    @property
    def row_cost_path(self) -> str | None:
        """The row-cost report to read (`row_cost` file:PATH or `row_cost_file`), or None."""
        if self.row_cost.startswith("file:"):
            return self.row_cost[len("file:"):]
        return self.row_cost_file

    @property
    def calibrates_row_costs(self) -> bool:
        """Every stage times its own passes at start-up: `row_cost` calibrate, or auto with FIRP on
        and no file. Fixed FIRP chains cost more than they save wherever a multi-row pass is dear
        (`--quantization auto`, float32: [Note: row-cost-driven chains] in pipeline/engine/row_budget.py),
        so a FIRP run sizes them from a measured table unless told `none`."""
        if self.row_cost == "auto":
            return self.uses_firp and self.row_cost_path is None
        return self.row_cost == "calibrate"

    @property
    def row_cost_mode(self) -> str:
        """The numeric mode's name in a row_cost.py report: fp32 / bf16 / fp16 for dense weights
        (fp32-fast with the fast layout), else the quantization (int8, int4, auto)."""
        return numeric_mode_name(dtype=self.dtype, quantization=self.quantization, dense_layout=self.dense_layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of `dtype`."""
        return MODEL_DTYPES[self.dtype]

    def scheduler_config(self, *, eos_token_ids: tuple[int, ...], firp_k: int, row_costs: RowCostTable | None = None,
                         firp_pseudo_weight: float = 1.0, parallel_stages: int | None = None,
                         primary_eos: bool = True) -> SchedulerConfig:
        """The scheduler's view of this run (its limits are validated here, not again there).
        eos_token_ids / primary_eos: the tokenizer's (`SchedulerConfig.primary_eos`); firp_k: the FIRP chain length the run plan chose (0 = off);
        row_costs: the table loaded from `row_cost_file` (None: fixed chains); firp_pseudo_weight:
        the share of the model's layers a pseudo row runs through; parallel_stages: how many stages
        can compute at once (None: all), for the draft gate's break-even."""
        return SchedulerConfig(
            num_stages=self.num_stages, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            eos_token_ids=tuple(eos_token_ids), primary_eos=primary_eos, speculate=self.uses_speed, max_inflight=self.max_inflight,
            min_acceptance=self.draft_min_acceptance(parallel_stages), firp_k=firp_k, firp_min_prob=self.firp_min_prob,
            row_costs=row_costs, firp_pseudo_weight=firp_pseudo_weight, draft_tree=self.draft_tree,
            # jump-forward's rows (a forced run's last row gives a free token) are a multi-row verify pass
            grammar_drafts=self.grammar_drafts, grammar_jump=self.grammar_jump and self.rows_pass_alone,
            disable_by_batch_size=self.speculative_disable_by_batch_size or 0,
            run_ahead_from_table=self.max_inflight == 0 and (self.calibrates_row_costs or self.row_cost_path is not None))


def check_prompt_length(*, num_prompt_tokens: int, max_new_tokens: int, max_model_len: int,
                        what: str = "prompt", budget: str = "max_new_tokens") -> None:
    """The one rule for a request's length: at least one prompt token, and prompt + new tokens
    within `max_model_len` (the KV slot). Every front end (CLI, coordinator, HTTP and gRPC
    servers, benchmarks) calls this; the scheduler and KV cache only assert it.
    Raises ValueError naming the parameters; `what` names the prompt in the message (e.g.
    "prompt 3"), `budget` the new-token limit (e.g. "'max_tokens'" for the OpenAI API)."""
    if num_prompt_tokens < 1:
        raise ValueError(f"{what} is empty (0 tokens)")
    need = num_prompt_tokens + max_new_tokens
    if need > max_model_len:
        raise ValueError(f"{what} ({num_prompt_tokens} tokens) + {budget} ({max_new_tokens}) = {need} "
                         f"exceeds max_model_len {max_model_len}")
