"""Early-exit predictor files of every arch: the module a file's arch runs, and its tensors checked up front.

Owns `exit_map_from_tensors` (the ExitMap of pipeline/speculation/predictors.py, or the DrafterMap of
pipeline/speculation/drafting/drafter.py, that runs before the exit head's norm + LM head) and
`check_exit_tensors`: the module the file's metadata arch describes (ExitMap of
pipeline/speculation/predictors.py, DrafterMap of pipeline/speculation/drafting/drafter.py, the next-layer
draft layer of pipeline/speculation/drafting/layer_drafter.py) is built on the meta device (no memory, no
weights) and its state dict's names and shapes are compared with the file's tensors, so that a
broken file is refused with one line naming the first bad tensor before any stage starts rather
than when the exit stage loads it. Sizes the file chooses (the mlp and swiglu widths, the number of
swiglu blocks) are read from the file. Must not: read files, load weights or know about processes.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.model.config import ModelConfig
from pipeline.speculation.drafting.drafter import DRAFTER_ARCH, DrafterMap
from pipeline.speculation.drafting.layer_drafter import (
    NEXT_LAYER_ARCH,
    fused_layer,
    split_tensors,
    unsupported_reason,
)
from pipeline.speculation.predictor_file import PredictorFile, PredictorFileError
from pipeline.speculation.predictors import ExitMap


def exit_map_from_tensors(tensors: dict[str, torch.Tensor], *, arch: str, eps: float = 1e-5) -> nn.Module:
    """The module an early-exit file of `arch` runs on the exit state ([num_rows, H] -> [num_rows, H]),
    built from its tensors (a "draft_vocab" is the ExitHead's and is skipped): an ExitMap for
    "affine" / "mlp", a DrafterMap for "swiglu". A "next-layer" file's map follows its draft layer,
    which only the exit stage builds (pipeline/engine/stage_assembly.py). Raises ValueError for that,
    another arch, or a missing or mis-shaped tensor."""
    if arch == DRAFTER_ARCH:
        return DrafterMap.from_tensors(tensors, eps=eps)
    if arch == NEXT_LAYER_ARCH:
        raise ValueError("a next-layer drafter runs only at the exit stage, with its draft layer's KV cache")
    return ExitMap.from_tensors(tensors, arch=arch, eps=eps)


def _swiglu(tensors: dict[str, torch.Tensor], hidden_size: int) -> nn.Module:
    """A DrafterMap as wide and deep as the file's blocks say (at least one block)."""
    indices = {int(n.split(".")[1]) for n in tensors if n.startswith("blocks.") and n.split(".")[1].isdigit()}
    gate = tensors.get("blocks.0.gate.weight")
    mlp_size = gate.shape[0] if gate is not None and gate.dim() == 2 and gate.shape[0] > 0 else 1
    return DrafterMap(hidden_size, mlp_size=mlp_size, num_blocks=max(indices, default=0) + 1)


def expected_exit_tensors(tensors: dict[str, torch.Tensor], *, arch: str, config: ModelConfig,
                          exit_layer: int) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} an early-exit file of `arch` at `exit_layer` must hold for `config`'s
    model (the optional "draft_vocab" aside), in the module's parameter order. Raises
    PredictorFileError for an arch that does not exist or does not run on this model's family."""
    h = config.hidden_size
    with torch.device("meta"):
        if arch in ("affine", "mlp"):
            up = tensors.get("mlp.up.weight")
            mlp_size = up.shape[0] if arch == "mlp" and up is not None and up.dim() >= 1 and up.shape[0] > 0 else 512
            modules = {"": ExitMap(h, arch=arch, mlp_size=mlp_size)}
        elif arch == DRAFTER_ARCH:
            modules = {"": _swiglu(tensors, h)}
        elif arch == NEXT_LAYER_ARCH:
            reason = unsupported_reason(config)
            if reason is not None:
                raise PredictorFileError(f"a next-layer predictor does not run on {config.model_type} models ({reason})")
            _, rest = split_tensors(tensors)
            modules = {"draft_layer.": fused_layer(config, exit_layer + 1), "": _swiglu(rest, h)}
        else:
            raise PredictorFileError(f"predictor arch {arch!r} is not one of affine, mlp, {DRAFTER_ARCH}, "
                                     f"{NEXT_LAYER_ARCH}")
    return {prefix + n: tuple(t.shape) for prefix, m in modules.items() for n, t in m.state_dict().items()}


def check_exit_tensors(pred: PredictorFile, *, config: ModelConfig, where: str = "predictor") -> None:
    """Refuse an early-exit predictor whose tensors are not exactly those its metadata arch builds for
    `config`'s model at the file's exit layer: a missing tensor, one of another shape, or one the arch
    does not have. Raises PredictorFileError (a ValueError) naming the first bad tensor."""
    arch = pred.meta.get("arch", "affine")
    tensors = {n: t for n, t in pred.tensors.items() if n != "draft_vocab"}
    expected = expected_exit_tensors(tensors, arch=arch, config=config, exit_layer=pred.exit_layer)
    for name, shape in expected.items():
        if name not in tensors:
            raise PredictorFileError(f"{where} has no tensor {name!r}, which arch {arch!r} needs")
        if tuple(tensors[name].shape) != shape:
            raise PredictorFileError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                                     f"{shape} (arch {arch!r})")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise PredictorFileError(f"{where} has tensor {extra[0]!r}, which arch {arch!r} does not have")
