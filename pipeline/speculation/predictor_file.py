"""Trained predictor files: safetensors tensors plus JSON metadata, validated against a model.

Owns the file format "speedpipe-predictor/1", the model identity a predictor is tied to, and the
checks that refuse to load a predictor into a model (or exit layer) it was not trained for.
Must not: train anything, build torch modules, or know about processes.

Format: one safetensors file. Its header's `__metadata__` holds a single key "speedpipe" whose
value is a JSON object:

    {"format": "speedpipe-predictor/1",
     "kind": "early-exit" | "firp",
     "model": {"name", "hash", "hidden_size", "num_layers", "vocab_size"},
     "exit_layer": int, "k": int (firp only), "arch": "affine" | "mlp" | "swiglu" | "next-layer",
     "corpus": str, "train_tokens": int,
     "eval": {"top1_agreement" | "accepted_per_pass": float, "eval_tokens": int, ...}}

Tensor names: early-exit "proj.weight" [H, H], "proj.bias" [H] (arch "mlp" adds "mlp.up.weight"
[M, H], "mlp.up.bias" [M], "mlp.down.weight" [H, M], "mlp.down.bias" [H]; arch "swiglu" adds
"blocks.{i}.norm.weight" [H], "blocks.{i}.gate.weight" / "blocks.{i}.up.weight" [M, H],
"blocks.{i}.down.weight" [H, M], see pipeline/speculation/drafting/drafter.py; arch "next-layer" adds the draft
layer's "draft_layer.<DecoderLayer parameter>" tensors, q/k/v and gate/up fused, see
pipeline/speculation/drafting/layer_drafter.py; optional
"draft_vocab" [V'] int64, the draft vocabulary of pipeline/speculation/predictors.py [Note: draft vocabulary],
with "draft_vocab_size": V' in the metadata); firp
"maps.{i}.weight" [H, H], "maps.{i}.bias" [H] for i = 1 .. k.
The same bytes travel to a stage worker inside LoadStageRequest, so `load_predictor_bytes` is the
one parser on both sides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.model.config import ModelConfig
from pipeline.weights.file_memo import file_sha256
from pipeline.weights.gguf_import import SOURCE_FILE, read_source

FORMAT = "speedpipe-predictor/1"
METADATA_KEY = "speedpipe"
KINDS = ("early-exit", "firp")
ARCHS = ("affine", "mlp", "swiglu", "next-layer")


class PredictorFileError(ValueError):
    """A predictor file that cannot be read or does not fit the running model (one-line message)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """What a predictor is tied to: a model's name, content hash and the shapes it depends on.

    hash: for a model converted from GGUF, the GGUF file's sha256 (as recorded in the converted
    folder's speedpipe_source.json, also the suffix of the cache folder's name); for a plain
    Hugging Face folder, sha256 over config.json and the sha256 of each safetensors file (reads
    the weights once per process: about 1 s per GB).
    """

    name: str
    hash: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_name(model_dir: str | Path) -> str:
    """The model's name in a ModelIdentity (cheap): a converted GGUF's cache folder name without its
    hash suffix (`smollm2-135m`), else the folder name."""
    model_dir = Path(model_dir)
    if (model_dir / SOURCE_FILE).is_file() and "-" in model_dir.name:
        return model_dir.name.rsplit("-", 1)[0]
    return model_dir.name


def model_identity(model_dir: str | Path, config: ModelConfig | None = None) -> ModelIdentity:
    """Identity of the model in `model_dir` (see ModelIdentity.hash for what is read)."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_model_dir(model_dir)
    source = read_source(model_dir)  # ValueError, one line, when malformed
    name = model_name(model_dir)
    if source is not None:
        digest = source.sha256
    else:
        h = hashlib.sha256((model_dir / "config.json").read_bytes())
        for path in sorted(model_dir.glob("*.safetensors")):
            h.update(file_sha256(path).encode())
        digest = h.hexdigest()
    return ModelIdentity(name=name, hash=digest, hidden_size=config.hidden_size,
                         num_layers=config.num_hidden_layers, vocab_size=config.vocab_size)


@dataclasses.dataclass(frozen=True)
class PredictorFile:
    """A loaded predictor: its tensors (float32, CPU; "draft_vocab" int64) and its metadata dict (see
    module docstring)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def exit_layer(self) -> int:
        return int(self.meta["exit_layer"])

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """[V'] int64 token ids an early-exit head may draft, or None (the whole vocabulary)."""
        return self.tensors.get("draft_vocab")


def _check_meta(meta: dict[str, Any]) -> None:
    """Raise PredictorFileError naming the first missing or invalid metadata field."""
    if meta.get("format") != FORMAT:
        raise PredictorFileError(f"predictor format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("kind") not in KINDS:
        raise PredictorFileError(f"predictor kind {meta.get('kind')!r} is not one of {', '.join(KINDS)}")
    model = meta.get("model")
    if not isinstance(model, dict) or not all(f in model for f in ("name", "hash", "hidden_size", "num_layers",
                                                                    "vocab_size")):
        raise PredictorFileError("predictor metadata field 'model' must hold name, hash, hidden_size, num_layers, "
                                 "vocab_size")
    if not isinstance(meta.get("exit_layer"), int):
        raise PredictorFileError("predictor metadata has no integer 'exit_layer'")
    if meta["kind"] == "firp" and not (isinstance(meta.get("k"), int) and meta["k"] >= 1):
        raise PredictorFileError("firp predictor metadata needs an integer 'k' >= 1")
    if meta["kind"] == "early-exit" and meta.get("arch", "affine") not in ARCHS:
        raise PredictorFileError(f"predictor arch {meta.get('arch')!r} is not one of {', '.join(ARCHS)}")


def predictor_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                    dtype: torch.dtype = torch.float16) -> bytes:
    """Serialise `tensors` (stored as `dtype`) and `meta` (format added) to safetensors bytes.

    Raises PredictorFileError for metadata missing a required field.
    """
    meta = {"format": FORMAT, **meta}
    _check_meta(meta)
    data = {name: t.detach().to("cpu", dtype if t.is_floating_point() else torch.int64).contiguous()
            for name, t in tensors.items()}
    return st_save(data, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})


def save_predictor(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                   dtype: torch.dtype = torch.float16) -> Path:
    """Write a predictor file at `path` (parent folders created); returns the path. See predictor_bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(predictor_bytes(tensors, meta, dtype=dtype))
    tmp.replace(path)
    return path


def _meta_from_header(raw: dict[str, str] | None, where: str) -> dict[str, Any]:
    if not raw or METADATA_KEY not in raw:
        raise PredictorFileError(f"{where} is not a speedpipe predictor (no {METADATA_KEY!r} metadata)")
    try:
        meta = json.loads(raw[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise PredictorFileError(f"{where}: predictor metadata is not valid JSON ({exc.msg})") from None
    if not isinstance(meta, dict):
        raise PredictorFileError(f"{where}: predictor metadata is not a JSON object")
    _check_meta(meta)
    return meta


def read_predictor_meta(path: str | Path) -> dict[str, Any]:
    """Only the metadata of the predictor file at `path` (reads the header). Raises PredictorFileError
    or FileNotFoundError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictor file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata()
    except Exception as exc:  # noqa: BLE001 - safetensors raises several error types for bad files
        raise PredictorFileError(f"predictor file {path} is not a safetensors file ({exc})") from None
    return _meta_from_header(raw, f"predictor file {path}")


def load_predictor_bytes(data: bytes, *, expect: ModelIdentity | None = None, exit_layer: int | None = None,
                         kind: str | None = None, where: str = "predictor") -> PredictorFile:
    """Parse predictor bytes (as written by `predictor_bytes`) and validate them. See `load_predictor`."""
    try:
        raw_meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__")
        tensors = st_load(data)
    except Exception as exc:  # noqa: BLE001
        raise PredictorFileError(f"{where} is not a safetensors file ({exc})") from None
    meta = _meta_from_header(raw_meta, where)
    pred = PredictorFile({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}, meta)
    check_predictor(pred, expect=expect, exit_layer=exit_layer, kind=kind, where=where)
    return pred


def load_predictor(path: str | Path, *, expect: ModelIdentity | None = None, exit_layer: int | None = None,
                   kind: str | None = None) -> PredictorFile:
    """Load and validate the predictor file at `path`.

    expect: the running model's identity; exit_layer: the running exit layer (--exit-layer);
    kind: the kind the caller needs. Each that is given must match the file.
    Raises FileNotFoundError, or PredictorFileError (a ValueError) with a one-line message naming
    the mismatching field (model hash, hidden size, number of layers, vocab size, exit layer, kind)
    or a tensor of the wrong shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictor file {path} does not exist")
    return load_predictor_bytes(path.read_bytes(), expect=expect, exit_layer=exit_layer, kind=kind,
                                where=f"predictor file {path}")


def check_predictor(pred: PredictorFile, *, expect: ModelIdentity | None = None, exit_layer: int | None = None,
                    kind: str | None = None, where: str = "predictor") -> None:
    """Validate a loaded predictor against the running model; see `load_predictor` for the errors."""
    meta, model = pred.meta, pred.meta["model"]
    if kind is not None and meta["kind"] != kind:
        raise PredictorFileError(f"{where} is {_a(meta['kind'])} {meta['kind']!r} predictor, but {_a(kind)} "
                                 f"{kind!r} one is needed")
    if expect is not None:
        if model["hash"] != expect.hash:
            raise PredictorFileError(f"{where} was trained for model {model['name']!r} (hash {model['hash'][:12]}), "
                                     f"not the running model {expect.name!r} (hash {expect.hash[:12]})")
        for field in ("hidden_size", "num_layers", "vocab_size"):
            if model[field] != getattr(expect, field):
                raise PredictorFileError(f"{where} has model {field.replace('_', ' ')} {model[field]}, but the "
                                         f"running model's is {getattr(expect, field)}")
    num_layers = model["num_layers"]
    top = num_layers - 1 if meta["kind"] == "early-exit" else num_layers  # FIRP maps may follow the last layer
    if isinstance(num_layers, int) and not 0 <= meta["exit_layer"] < top:
        which = "layers before the last" if meta["kind"] == "early-exit" else "layers"
        raise PredictorFileError(f"{where} claims exit layer {meta['exit_layer']}, outside its model's {which} "
                                 f"(0 to {top - 1} of {num_layers}): the file is damaged or was written for "
                                 f"another model")
    if exit_layer is not None and meta["exit_layer"] != exit_layer:
        raise PredictorFileError(f"{where} was trained at exit layer {meta['exit_layer']}, but this pipeline's exit "
                                 f"layer is {exit_layer} (exit_layer; default: the last layer of stage 0): pass "
                                 f"exit_layer {meta['exit_layer']}, or train a head for layer {exit_layer} "
                                 f"(train-predictor with exit_layer {exit_layer})")
    _check_shapes(pred, where)


def _a(word: str) -> str:
    """The indefinite article for `word` ("an 'early-exit'", "a 'firp'")."""
    return "an" if word[:1].lower() in ("a", "e", "i", "o", "u") else "a"


def _check_shapes(pred: PredictorFile, where: str) -> None:
    h = pred.meta["model"]["hidden_size"]
    if pred.kind == "early-exit":
        expected = {"proj.weight": (h, h), "proj.bias": (h,)}
    else:
        expected = {}
        for i in range(1, pred.meta["k"] + 1):
            expected |= {f"maps.{i}.weight": (h, h), f"maps.{i}.bias": (h,)}
    vocab = pred.tensors.get("draft_vocab")
    if vocab is not None:
        v = pred.meta["model"]["vocab_size"]
        if (vocab.dim() != 1 or vocab.is_floating_point() or vocab.numel() == 0 or int(vocab.min()) < 0
                or int(vocab.max()) >= v or vocab.unique().numel() != vocab.numel()):
            raise PredictorFileError(f"{where}: tensor 'draft_vocab' must hold distinct token ids in [0, {v})")
    for name, shape in expected.items():
        if name not in pred.tensors:
            raise PredictorFileError(f"{where} has no tensor {name!r}")
        if tuple(pred.tensors[name].shape) != shape:
            raise PredictorFileError(f"{where}: tensor {name!r} has shape {tuple(pred.tensors[name].shape)}, "
                                     f"expected {shape}")


SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "predictors"


def shipped_predictor_name(identity: ModelIdentity, *, kind: str, exit_layer: int, k: int | None = None) -> str:
    """File name of a predictor shipped with the project: `<model>-<hash12>-<kind>-L<layer>[-k<k>].safetensors`."""
    suffix = f"-k{k}" if k is not None else ""
    return f"{identity.name}-{identity.hash[:12]}-{kind}-L{exit_layer}{suffix}.safetensors"


def shipped_predictors(name: str, *, kind: str, hash12: str | None = None,
                       folder: Path = SHIPPED_DIR) -> dict[int, Path]:
    """{exit layer: file} of the predictors of `kind` shipped for model `name` (names as
    `shipped_predictor_name` writes them, with or without `-k<k>`): those of checkpoint hash `hash12`,
    or of any hash (hex digits) when None, the first file by name for a layer. The one parser of
    shipped names; files that do not parse are not predictors of this model and kind."""
    digest = re.escape(hash12) if hash12 is not None else "[0-9a-f]+"
    pattern = re.compile(rf"{re.escape(name)}-{digest}-{re.escape(kind)}-L(\d+)(?:-k\d+)?\.safetensors")
    found: dict[int, Path] = {}
    for path in sorted(folder.glob(f"{name}-*.safetensors")):
        if (match := pattern.fullmatch(path.name)) is not None:
            found.setdefault(int(match.group(1)), path)
    return found


def ships_predictors_for(name: str, *, folder: Path = SHIPPED_DIR) -> bool:
    """Whether any predictor ships for a model of this name (lets callers skip hashing a model)."""
    return any(folder.glob(f"{name}-*.safetensors"))


def shipped_predictor(identity: ModelIdentity, *, kind: str, exit_layer: int, k: int | None = None,
                      folder: Path = SHIPPED_DIR) -> Path | None:
    """The shipped predictor for this model, kind and exit layer (package data under
    pipeline/assets/predictors/), or None when the project ships none."""
    path = folder / shipped_predictor_name(identity, kind=kind, exit_layer=exit_layer, k=k)
    return path if path.is_file() else None
