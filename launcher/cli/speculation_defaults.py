"""What a launch speculates with when the user does not say: `--speculate auto`, and the draft
threshold it reports.

Owns the rule that turns the CLI's default `--speculate auto` into `speed` or `none` (before any
RunConfig exists: RunConfig never sees `auto`), and the one-line notes `launch` prints about it
and about the draft gate's threshold.
Must not: resolve or load models (the rule only looks for shipped predictor files by name), or
start processes.

[Note: speculation default]
Issue 14: once a mode is faster than plain decode on every held-out set, `--speculate` defaults
to it. Measured on 2026-12-05 (Intel Xeon, `--stages 2`, one stage per vCPU, held-out chat /
speeches / code, README "The draft gate was too strict"): `speed` with the shipped drafter ran
1.10 / 1.61 / 1.33× plain decode in float32, 1.09–1.11 / 1.38–1.50 / 1.34–1.47× in bfloat16 and
1.20 / 1.47 / 1.21× under `--quantization auto`, with output token-identical. Where local CPU
stages outnumber the CPUs it is about even (0.95–1.10× on chat and code at `--stages 3` and `4` on
2 CPUs, README "More stages than CPUs"), and with one stage nothing runs ahead. An untrained
logit lens was not measured as a default. So `auto` means `speed` when
- there are at least 2 stages and every one computes on its own cores or device
  (launcher/backends/placement.py `parallel_stages` == num_stages), and
- a trained exit head ships for the model (pipeline/assets/predictors/), or the user named one
  (`--predictor FILE.safetensors`, `--exit-predictor FILE`);
and `none` otherwise. Greedy output is the same either way (ARCHITECTURE.md §5).
"""

from __future__ import annotations

from pathlib import Path

from launcher.backends.placement import PlacementOptions, parallel_stages
from launcher.coordinator.pipeline_options import PipelineOptions
from pipeline.speculation.predictor_file import ships_predictors_for
from pipeline.speculation.predictors import is_predictor_file
from pipeline.weights.registry import CHUNKED_REGISTRY, REGISTRY

AUTO = "auto"


def model_family_name(model: str) -> str:
    """The name shipped predictor files start with, from a `--model` value without resolving it:
    a registered name as is, a `.gguf` file's stem (its converted folder's name less the hash), else
    the folder's name (pipeline/speculation/predictor_file.py `model_name`)."""
    if model in REGISTRY or model in CHUNKED_REGISTRY:
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def auto_speculate(*, model: str, num_stages: int, placement: PlacementOptions, device: str, threads_per_stage: int,
                   predictor: str, exit_predictor: str | None) -> tuple[str, str]:
    """(`speed` or `none`, why) for `--speculate auto` ([Note: speculation default])."""
    parallel = parallel_stages(placement, num_stages=num_stages, device=device, threads_per_stage=threads_per_stage)
    if num_stages < 2:
        return "none", "one stage: nothing to run ahead"
    if parallel < num_stages:
        return "none", (f"{parallel} of {num_stages} stages compute at once on this machine's CPUs, where "
                        f"speculation was measured to break about even")
    named = is_predictor_file(predictor) or (exit_predictor not in (None, "none"))
    if not named and not ships_predictors_for(model_family_name(model)):
        return "none", f"no trained exit head ships for {model_family_name(model)} (pass --speculate speed to try one)"
    return "speed", f"{num_stages} stages, each on its own cores, with a trained exit head"


def draft_gate_note(options: PipelineOptions) -> str:
    """The `--min-acceptance auto` threshold in force and why ([Note: adaptive drafting] in
    pipeline/speculation/draft_gate.py)."""
    parallel = options.parallel_stages
    why = (f"{parallel} of {options.num_stages} stages compute at once on this machine's CPUs"
           if parallel < options.num_stages else f"{options.num_stages} stages, each on its own cores")
    return (f"draft gate: drafts sent while drafts like them are accepted >= "
            f"{options.draft_min_acceptance(parallel):.0%} ({why}; --min-acceptance sets it)")
