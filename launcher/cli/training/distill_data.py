"""Self-distilled training data for `speedpipe train-predictor --data self-distill`.

Owns which prompts are used (chat-templated instructions of pipeline/assets/prompts/, excerpts of
the corpus's training documents; held out: the instruction files' held-out lines and the corpus's
held-out documents), generating the base model's greedy and sampled continuations of them with a
progress bar, caching those sequences on disk, and the prefill that turns them into exit-layer
states and targets. The maths lives in pipeline/training/self_distill.py ([Note: self-distilled data]).
Must not: train anything or write predictor files (launcher/cli/training/train_predictor.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

from launcher.serving.openai_protocol import render_chat
from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.predictor_file import model_identity
from pipeline.training.data import load_corpus, load_full_model, split_documents
from pipeline.training.self_distill import (
    GenerationConfig,
    SequenceStates,
    excerpts,
    generate,
    load_generation,
    load_instructions,
    save_generation,
    split_texts,
)
from pipeline.weights.checkpoint import CheckpointReader, read_norm_and_head
from pipeline.weights.registry import default_cache_dir

log = logging.getLogger("speedpipe.train")

CACHE_VERSION = "2"
EVAL_SETS = ("chat", "speeches", "code")  # held-out sets, in report order


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSpec:
    """What to generate: `new_tokens` per continuation; per training prompt one greedy and
    `sampled` sampled continuations at `temperature`; `excerpts_per_doc` plain-text prompts of
    `excerpt_words` words per training document of `corpus`, at most `max_text_prompts` of them;
    held out: every held-out instruction and `eval_docs` held-out documents spread over the corpus
    (greedy only). `max_prompts` / `max_eval_prompts` (None = no cap): a reduced run takes at most that
    many training prompts (evenly spread over chat, code and text) / held-out prompts per set."""

    model_dir: Path
    corpus: str = "sotu"
    new_tokens: int = 128
    sampled: int = 1
    temperature: float = 0.8
    excerpts_per_doc: int = 1
    excerpt_words: int = 48
    max_text_prompts: int = 96
    eval_docs: int = 16
    batch_size: int = 32
    max_prompts: int | None = None
    max_eval_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError(f"--new-tokens must be >= 2, got {self.new_tokens}")
        if self.sampled < 0:
            raise ValueError(f"--sampled must be >= 0, got {self.sampled}")
        if self.max_text_prompts < 0 or self.eval_docs < 1:
            raise ValueError(f"--text-prompts must be >= 0 and eval documents >= 1, got {self.max_text_prompts}, "
                             f"{self.eval_docs}")
        if (self.max_prompts is not None and self.max_prompts < 1) or (
                self.max_eval_prompts is not None and self.max_eval_prompts < 1):
            raise ValueError(f"--prompts and --eval-prompts must be >= 1 (or 0 = all), got {self.max_prompts}, "
                             f"{self.max_eval_prompts}")


@dataclasses.dataclass(frozen=True)
class DistillData:
    """Training states (every fed generated token of every training continuation) and one
    held-out set per EVAL_SETS name, plus the frozen head: norm_weight [H], lm_head_weight [V, H]
    float32."""

    train: SequenceStates
    evals: dict[str, SequenceStates]
    norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    rms_norm_eps: float


def chat_prompt(tokenizer: Tokenizer, instruction: str) -> str:
    """One user turn rendered with the model's chat template (a plain `User:/Assistant:` frame for a
    model without one, such as the tiny test model)."""
    if not tokenizer.chat_template:
        return f"User: {instruction}\nAssistant:"
    text = render_chat([{"role": "user", "content": instruction}], tokenizer=tokenizer)
    bos = tokenizer.decode([tokenizer.bos_token_id], skip_special_tokens=False) if tokenizer.bos_token_id is not None else ""
    if tokenizer.add_bos_token and bos and text.startswith(bos):  # `encode` adds it back: one BOS, as serving
        text = text[len(bos):]  # sends (openai_protocol.parse_chat) and apply_chat_template makes
    return text


def prompt_texts(spec: DistillSpec, tokenizer: Tokenizer) -> tuple[list[str], dict[str, list[str]]]:
    """(training prompts, {held-out set name: prompts}), as text ready to tokenise."""
    chat_train, chat_eval = split_texts(load_instructions("chat"))
    code_train, code_eval = split_texts(load_instructions("code"))
    docs_train, docs_eval = split_documents(load_corpus(spec.corpus))
    text_train = excerpts([d.text for d in docs_train], per_text=spec.excerpts_per_doc, words=spec.excerpt_words,
                          max_total=spec.max_text_prompts)
    text_eval = excerpts([d.text for d in docs_eval], per_text=1, words=spec.excerpt_words, max_total=spec.eval_docs)
    train = [chat_prompt(tokenizer, t) for t in chat_train + code_train] + text_train
    evals = {"chat": [chat_prompt(tokenizer, t) for t in chat_eval], "speeches": text_eval,
             "code": [chat_prompt(tokenizer, t) for t in code_eval]}
    return _spread(train, spec.max_prompts), {k: _spread(v, spec.max_eval_prompts) for k, v in evals.items()}


def _spread(texts: list[str], limit: int | None) -> list[str]:
    """At most `limit` of `texts`, evenly spaced through the list (all of them when None)."""
    if limit is None or len(texts) <= limit:
        return texts
    return [texts[i * len(texts) // limit] for i in range(limit)]


def _generation(model, tokenizer: Tokenizer, texts: list[str], gen: GenerationConfig, *, layer: int, path: Path,
                desc: str, progress: bool) -> SequenceStates:
    """The states of the model's continuations of `texts` at `layer`, from the cache file `path`
    or generated (and cached)."""
    if path.is_file():
        log.info("read cached continuations from %s", path)
        return load_generation(path)[1].states
    from tqdm import tqdm

    prompts = [tokenizer.encode(t) for t in texts]
    with tqdm(total=len(prompts) * gen.num_new_tokens, desc=desc, unit="tok", disable=not progress,
              file=sys.stderr) as bar:
        out = generate(model(), prompts, gen, layer=layer, stop_ids=tokenizer.eos_token_ids, on_tokens=bar.update)
    save_generation(path, prompts, out, meta={"desc": desc, "layer": str(layer)})
    return out.states


def _cache_path(cache: Path, identity, *, layer: int, texts: list[str], name: str, gen: GenerationConfig) -> Path:
    """The cache file of one generation: named by model, layer and set, keyed by everything that
    changes its contents (cache format version, weights, layer, prompts, generation settings)."""
    key = json.dumps([CACHE_VERSION, identity.hash, layer, texts, dataclasses.asdict(gen)])
    return cache / f"{identity.name}-L{layer}-{name.replace(' ', '-')}-" \
                   f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def _greedy(spec: DistillSpec) -> GenerationConfig:
    return GenerationConfig(num_new_tokens=spec.new_tokens, batch_size=spec.batch_size)


def distill_sequences(spec: DistillSpec, *, layer: int, seed: int = 0,
                      cache_dir: Path | None = None) -> dict[str, list[tuple[list[int], list[int], list[int]]]]:
    """The continuations that `prepare_distill_data(spec, layer=layer, seed=seed)` cached, as token
    sequences: {"train": [(prompt ids, continuation ids, targets), ...] (greedy, then each sampled
    round), held-out set name: [...] (greedy)}; targets[j] is the model's greedy next token after
    continuation[j] (what a draft there must match; a sampled continuation went elsewhere), one
    per fed token, len(continuation) - 1 of them. For drafters that attend over whole sequences
    (pipeline/speculation/drafting/layer_drafter.py). Raises FileNotFoundError when they are not cached yet."""
    config = ModelConfig.from_model_dir(spec.model_dir)
    identity = model_identity(spec.model_dir, config)
    train_texts, eval_texts = prompt_texts(spec, Tokenizer(spec.model_dir))
    cache = default_cache_dir(cache_dir) / "self-distill"
    greedy = _greedy(spec)
    parts = [("train", train_texts, "train greedy", greedy)]
    parts += [("train", train_texts, f"train sampled {i + 1}",
               dataclasses.replace(greedy, temperature=spec.temperature, seed=seed + i)) for i in range(spec.sampled)]
    parts += [(k, texts, f"held-out {k}", greedy) for k, texts in eval_texts.items() if texts]
    out: dict[str, list[tuple[list[int], list[int], list[int]]]] = {}
    for key, texts, name, gen in parts:
        path = _cache_path(cache, identity, layer=layer, texts=texts, name=name, gen=gen)
        if not path.is_file():
            raise FileNotFoundError(f"no cached continuations at {path}: run prepare_distill_data first")
        prompts, generation = load_generation(path)
        targets = generation.states.targets.split([max(len(c) - 1, 0) for c in generation.continuations])
        out.setdefault(key, []).extend(
            (p, c, t.tolist()) for p, c, t in zip(prompts, generation.continuations, targets, strict=True))
    return out


def prepare_distill_data(spec: DistillSpec, *, layer: int, seed: int = 0, cache_dir: Path | None = None,
                         progress: bool = True) -> DistillData:
    """Generate (or read from `<cache>/self-distill/`) the continuations with their states at
    `layer`. Raises ValueError / FileNotFoundError for a bad corpus, model or layer."""
    config = ModelConfig.from_model_dir(spec.model_dir)
    if not 0 <= layer < config.num_hidden_layers - 1:
        raise ValueError(f"--exit-layer {layer} must be in [0, {config.num_hidden_layers - 1}) "
                         f"(a layer before the model's last)")
    identity = model_identity(spec.model_dir, config)
    tokenizer = Tokenizer(spec.model_dir)
    train_texts, eval_texts = prompt_texts(spec, tokenizer)
    cache = default_cache_dir(cache_dir) / "self-distill"
    loaded = []

    def model():
        if not loaded:
            loaded.append(load_full_model(spec.model_dir))
        return loaded[0]

    def run(texts: list[str], name: str, gen: GenerationConfig) -> SequenceStates:
        path = _cache_path(cache, identity, layer=layer, texts=texts, name=name, gen=gen)
        return _generation(model, tokenizer, texts, gen, layer=layer, path=path, desc=name, progress=progress)

    greedy = _greedy(spec)
    parts = [run(train_texts, "train greedy", greedy)]
    for i in range(spec.sampled):
        sampled = dataclasses.replace(greedy, temperature=spec.temperature, seed=seed + i)
        parts.append(run(train_texts, f"train sampled {i + 1}", sampled))
    train = SequenceStates(**{f.name: torch.cat([getattr(p, f.name) for p in parts])
                              for f in dataclasses.fields(SequenceStates)})
    evals = {name: run(texts, f"held-out {name}", greedy) for name, texts in eval_texts.items() if texts}
    norm, head = read_norm_and_head(CheckpointReader(spec.model_dir), config, dtype=torch.float32)
    return DistillData(train=train, evals=evals, norm_weight=norm, lm_head_weight=head,
                       rms_norm_eps=config.rms_norm_eps)
