"""What a launch speculates with when the user does not say: `--speculate auto`, and the draft
threshold it reports.

Owns the rule that turns the CLI's default `--speculate auto` into `speed` or `none` (first from
the flags, before any RunConfig exists: RunConfig never sees `auto`; then, in `settle_auto`, from
the resolved run plan's exit head), and the one-line notes `launch` prints about it, about the
draft gate's threshold and about speculation flags that `--speculate none` ignores.
Must not: load models into stages or start processes (launcher/coordinator/session.py does).

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
- the stages run on CPUs (SPEED was never measured on a GPU here), and
- a trained exit head ships for the model at the exit layer the split puts it (pipeline/assets/
  predictors/), or the user named one (`--predictor FILE.safetensors`, `--exit-predictor FILE`);
  `--predictor logit-lens` or `ngram` alone are untrained;
and `none` otherwise. The last rule is settled after the run plan is resolved (`settle_auto`): only
the plan knows the exit layer (no head ships for smollm2-135m at --stages 5 or 6). Greedy output is
the same either way (ARCHITECTURE.md §5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from launcher.backends.placement import PlacementOptions, parallel_stages
from launcher.cli.parsing import UsageError
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import RunPlan, resolve
from pipeline.speculation.predictor_file import read_predictor_meta, ships_predictors_for
from pipeline.speculation.predictors import is_predictor_file
from pipeline.weights.registry import CHUNKED_REGISTRY, REGISTRY, _slug


def model_family_name(model: str) -> str:
    """The name shipped predictor files start with, from a `--model` value without resolving it:
    a registered name as is, a `.gguf` file's stem as its converted folder is named (less the hash;
    pipeline/weights/registry.py), else the folder's name (predictor_file.py `model_name`)."""
    if model in REGISTRY or model in CHUNKED_REGISTRY:
        return model
    path = Path(model)
    return _slug(path.stem) if path.suffix.lower() == ".gguf" else path.name


def auto_speculate(*, model: str, num_stages: int, placement: PlacementOptions, device: str, threads_per_stage: int,
                   predictor: str, exit_predictor: str | None) -> tuple[str, str]:
    """(`speed` or `none`, why) for `--speculate auto` ([Note: speculation default])."""
    if num_stages < 2:  # (0 and below: RunConfig's error comes next)
        return "none", "one stage: nothing to run ahead"
    parallel = parallel_stages(placement, num_stages=num_stages, device=device, threads_per_stage=threads_per_stage)
    if device != "cpu":
        return "none", "speculation was measured on CPU stages only (pass --speculate speed to try it)"
    if parallel < num_stages:
        return "none", (f"{parallel} of {num_stages} stages compute at once on this machine's CPUs, where "
                        f"speculation was measured to break about even")
    if predictor in ("logit-lens", "ngram") or exit_predictor == "none":
        return "none", f"--predictor {predictor} without a trained exit head was not measured as a default"
    named = is_predictor_file(predictor) or exit_predictor is not None
    if not named and not ships_predictors_for(model_family_name(model)):
        return "none", f"no trained exit head ships for {model_family_name(model)} (pass --speculate speed to try one)"
    return "speed", f"{num_stages} stages, each on its own cores, with a trained exit head"


# Flags that only tune speculation, by PipelineOptions field: `auto` refuses them where they would
# do nothing (check_auto_flags), instead of ignoring them or failing on RunConfig's rule for `none`.
# (--grammar-drafting steers SPEED's and FIRP's drafts alike; auto never chooses FIRP, so it sits here.)
SPEED_TUNING = {"draft_tree": "--draft-tree", "draft_at": "--draft-at", "min_acceptance": "--min-acceptance",
                "deep_draft_min_acceptance": "--deep-draft-min-acceptance", "max_inflight": "--max-inflight",
                "grammar_drafts": "--grammar-drafting", "grammar_jump": "--grammar-drafting"}
FIRP_TUNING = {"firp_k": "--firp-k", "firp_file": "--firp-file", "firp_min_prob": "--firp-min-prob"}


def tuned_flags(values: Mapping[str, object], flags: Mapping[str, str]) -> list[str]:
    """The flags of `flags` (field -> flag) whose value in `values` (field -> value, as
    PipelineOptions takes it) differs from PipelineOptions' default, each named once (one flag may
    set several fields)."""
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    return list(dict.fromkeys(flag for field, flag in flags.items() if values[field] != defaults[field]))


# The predictor choice, by PipelineOptions field: like the tuning flags, it does nothing with --speculate none.
PREDICTOR_CHOICE = {"predictor": "--predictor", "exit_predictor": "--exit-predictor"}


def idle_speculation_flags(values: Mapping[str, object]) -> list[str]:
    """The speculation flags given that have no effect with `--speculate none` (the user's choice),
    for launch's note: the tuning flags (SPEED_TUNING, FIRP_TUNING) and the predictor choice
    (PREDICTOR_CHOICE). A predictor file they name is still read (its header only), so that a
    wrong path fails now rather than when speculation is turned on. values: PipelineOptions field ->
    value for those fields. Raises UsageError naming the flag for a missing or unreadable file."""
    for field, flag in PREDICTOR_CHOICE.items():
        path = values[field]
        if isinstance(path, str) and (is_predictor_file(path) or (field == "exit_predictor" and path != "none")):
            try:
                read_predictor_meta(path)
            except (OSError, ValueError) as exc:
                raise UsageError(f"{flag} {path}: {exc}") from None
    return tuned_flags(values, SPEED_TUNING | FIRP_TUNING | PREDICTOR_CHOICE)


def check_auto_flags(values: Mapping[str, object], *, speculate: str, why: str) -> None:
    """Raise UsageError when `--speculate auto` (why != "") chose a mode that a given tuning flag
    does not apply to: FIRP flags always (auto never chooses FIRP), SPEED flags when it chose none.
    values: PipelineOptions field -> value for the fields of SPEED_TUNING and FIRP_TUNING."""
    if not why:
        return
    firp = tuned_flags(values, FIRP_TUNING)
    if firp:
        raise UsageError(f"{', '.join(firp)} {_tune(firp)} FIRP, which --speculate auto never chooses: pass --speculate firp "
                         f"or speed+firp")
    speed = tuned_flags(values, SPEED_TUNING) if speculate == "none" else []
    if speed:
        raise UsageError(f"{', '.join(speed)} {_tune(speed)} SPEED drafts, but --speculate auto chose none here ({why}): "
                         f"pass --speculate speed to use {'it' if len(speed) == 1 else 'them'}")


def _tune(flags: list[str]) -> str:
    return "tunes" if len(flags) == 1 else "tune"


def settle_auto(options: PipelineOptions, plan: RunPlan, why: str) -> tuple[PipelineOptions, RunPlan, str]:
    """`auto`'s last rule, once the plan knows the exit layer: if it chose speed and no trained head
    serves that layer (the plan's exit head is the untrained logit lens), run `none` instead, with
    the plan resolved again (the split prices the exit head). why: auto's reason, "" when the user
    chose the mode (then nothing changes). Returns (options, plan, why). Raises UsageError where a
    SPEED tuning flag was given (check_auto_flags)."""
    if not why or not options.uses_speed or plan.exit_predictor:
        return options, plan, why
    why = f"no trained exit head ships for exit layer {plan.exit_layer} of this split"
    check_auto_flags({field: getattr(options, field) for field in (*SPEED_TUNING, *FIRP_TUNING)},
                     speculate="none", why=why)
    options = dataclasses.replace(options, speculate="none")
    return options, resolve(options), why


def draft_gate_note(options: PipelineOptions) -> str:
    """The `--min-acceptance auto` threshold in force and why ([Note: adaptive drafting] in
    pipeline/speculation/draft_gate.py)."""
    parallel = options.parallel_stages
    why = (f"{parallel} of {options.num_stages} stages compute at once on this machine's CPUs"
           if parallel < options.num_stages else f"{options.num_stages} stages, each on its own cores")
    return (f"draft gate: drafts sent while drafts like them are accepted >= "
            f"{options.draft_min_acceptance(parallel):.0%} ({why}; --min-acceptance sets it)")
