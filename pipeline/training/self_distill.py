"""Self-distillation data: the frozen base model's own continuations of diverse prompts.

Owns the prompt sources (the instruction files shipped under pipeline/assets/prompts/, excerpts of
corpus documents), their deterministic train/held-out split, batched KV-cached generation of greedy
and sampled continuations that also keeps, at every fed generated token, the exit layer's output
and the base model's own argmax (the self-distillation target), and the on-disk cache of both.
Must not: train anything (pipeline/speculation/drafting/drafter.py, pipeline/training/early_exit.py), render chat
templates (the caller passes prompts already rendered and tokenised), or parse command lines.

[Note: self-distilled data]
A drafter is accepted when it predicts what *this model* says next, on what the model is asked
(Kangaroo arXiv 2404.18911 §3, EAGLE arXiv 2401.15077 §4: train on the target model's own outputs).
Teacher-forced human text is off-distribution twice: its inputs are not the model's own tokens, and
chat answers look nothing like speeches. So the training rows are the positions of the model's own
continuations (greedy, and sampled at a temperature for variety), of chat-templated instructions
and plain-text excerpts; the target at every position is the model's greedy next token (what the
verifier will compare a draft with), even where a sampled continuation went elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "prompts"
INSTRUCTION_SETS = ("chat", "code")  # pipeline/assets/prompts/{name}_instructions.txt
TEACHER_TOPK = 8  # the base model's top tokens kept per row (SequenceStates.teacher_ids)


def load_instructions(name: str, *, folder: Path = PROMPTS_DIR) -> list[str]:
    """The instruction texts of set `name` (one per line; `#` comments and blank lines skipped).
    Raises ValueError for an unknown set."""
    path = folder / f"{name}_instructions.txt"
    if name not in INSTRUCTION_SETS or not path.is_file():
        raise ValueError(f"instruction set {name!r} is not one of {', '.join(INSTRUCTION_SETS)}")
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def held_out(text: str, *, eval_fraction: float) -> bool:
    """Deterministic split: `text` is held out when the sha256 of it falls in the first
    `eval_fraction` of the hash range (adding texts never moves existing ones)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32 < eval_fraction


def split_texts(texts: Sequence[str], *, eval_fraction: float = 0.2) -> tuple[list[str], list[str]]:
    """(train, held-out) by `held_out`; at least one text on each side when there are two or more."""
    held = [t for t in texts if held_out(t, eval_fraction=eval_fraction)]
    if len(texts) >= 2:
        held = held[:len(texts) - 1] or list(texts[:1])
    return [t for t in texts if t not in held], held


def excerpts(texts: Sequence[str], *, per_text: int, words: int, max_total: int | None = None) -> list[str]:
    """Plain-text prompts: `per_text` excerpts of `words` words from each text, starting at the
    paragraph boundaries nearest the midpoints of `per_text` equal parts of it (one excerpt: from
    the middle paragraph on, past the formulaic opening). With `max_total`, texts are taken evenly
    spaced through the list (every k-th) so that at most that many excerpts come out."""
    if max_total is not None:
        per = max(1, per_text)
        texts = list(texts)[::max(1, -(-len(texts) * per // max(1, max_total)))]
    out = []
    for text in texts:
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        starts = sorted({int((i + 0.5) * len(paragraphs) / per_text) for i in range(per_text)})
        for i in starts:
            piece = " ".join(" ".join(paragraphs[i:]).split()[:words])
            if piece:
                out.append(piece)
    return out if max_total is None else out[:max_total]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How continuations are generated: `num_new_tokens` per prompt, `temperature` (0 = greedy;
    > 0 samples from the `top_k` most likely tokens), `seed`, `batch_size` sequences at once."""

    num_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 50
    seed: int = 0
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.num_new_tokens < 1:
            raise ValueError(f"new tokens per prompt must be >= 1, got {self.num_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 1 or self.batch_size < 1:
            raise ValueError(f"top_k and batch_size must be >= 1, got {self.top_k}, {self.batch_size}")


def _next_tokens(logits: torch.Tensor, config: GenerationConfig, gen: torch.Generator) -> torch.Tensor:
    """[rows, vocab] float logits -> [rows] int64: argmax, or a top-k sample at the temperature."""
    if config.temperature == 0:
        return logits.argmax(-1)
    top, ids = logits.float().topk(min(config.top_k, logits.shape[-1]), dim=-1)
    pick = torch.multinomial(torch.softmax(top / config.temperature, dim=-1), 1, generator=gen)
    return ids.gather(-1, pick).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class SequenceStates:
    """Per-row data of the decode steps that fed a generated token: each sequence's rows in order,
    sequence after sequence.

    token_ids: [num_rows] int64 the generated token fed at that step (its position is one a SPEED
        draft is made from: the first token after prefill is never speculative).
    hidden: [num_rows, hidden_size] output of the exit layer at that row.
    targets: [num_rows] int64 the base model's greedy next token after it (the step's argmax).
    teacher_ids, teacher_probs: [num_rows, TEACHER_TOPK] the base model's most likely next tokens
        (int64) and their probabilities (float16, softmax over the whole vocabulary), for
        distribution-matching losses.
    """

    token_ids: torch.Tensor
    hidden: torch.Tensor
    targets: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_probs: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.targets.numel())


@dataclasses.dataclass(frozen=True)
class Generation:
    """Continuations (without their prompts) and the states of every fed generated token."""

    continuations: list[list[int]]
    states: SequenceStates


@torch.inference_mode()
def generate(model: StageModel, prompts: Sequence[Sequence[int]], config: GenerationConfig, *, layer: int,
             stop_ids: Sequence[int] = (), hidden_dtype: torch.dtype = torch.float16,
             on_tokens: Callable[[int], None] | None = None) -> Generation:
    """The base model's continuation of each prompt (KV-cached decode of `config.batch_size`
    sequences at once on the whole model); a continuation ends after a token of `stop_ids` or
    `config.num_new_tokens` tokens. Every decode step also yields, per sequence, the output of
    absolute layer `layer` at the fed token and the step's argmax (see SequenceStates): the
    training rows, with no second pass over the sequences. on_tokens(n) after each step.
    Raises ValueError for an empty prompt, a layer outside the model, or a partial model."""
    if not (model.is_first and model.is_last and len(model.layer_range) == model.config.num_hidden_layers):
        raise ValueError("generate needs the whole model (embedding to LM head)")
    if not 0 <= layer < model.config.num_hidden_layers:
        raise ValueError(f"layer {layer} is outside the model's layers [0, {model.config.num_hidden_layers})")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    gen = torch.Generator().manual_seed(config.seed)
    stop = set(stop_ids)
    conts: list[list[int]] = []
    fed, hidden, targets, t_ids, t_probs = [], [], [], [], []
    for lo in range(0, len(prompts), config.batch_size):
        batch = [list(p) for p in prompts[lo:lo + config.batch_size]]
        kv = model.new_kv_cache(max_num_seqs=len(batch), max_model_len=max(map(len, batch)) + config.num_new_tokens)
        logits = model(torch.tensor([t for p in batch for t in p]), [Span(i, 0, len(p)) for i, p in enumerate(batch)], kv)
        out: list[list[int]] = [[] for _ in batch]
        live = list(range(len(batch)))
        steps_h, steps_t, steps_k, seq_of_row = [], [], [], []
        while live:
            for i, tok in zip(live, _next_tokens(logits, config, gen).tolist(), strict=True):
                out[i].append(tok)
            if on_tokens is not None:
                on_tokens(len(live))
            live = [i for i in live if out[i][-1] not in stop and len(out[i]) < config.num_new_tokens]
            if not live:
                break
            x = torch.tensor([out[i][-1] for i in live])
            step = model.forward_rows(x, [Span(i, len(batch[i]) + len(out[i]) - 1, 1) for i in live], kv,
                                      exit_layer=layer)
            logits = step.out
            steps_h.append(step.exit_hidden.to(hidden_dtype))
            steps_t.append(logits.argmax(-1))
            steps_k.append(torch.softmax(logits.float(), dim=-1).topk(TEACHER_TOPK, dim=-1))
            seq_of_row.extend(live)
        if seq_of_row:  # rows step-major -> sequence-major (stable: each sequence's rows stay in order)
            order = torch.argsort(torch.tensor(seq_of_row), stable=True)
            hidden.append(torch.cat(steps_h)[order])
            targets.append(torch.cat(steps_t)[order])
            t_probs.append(torch.cat([k.values for k in steps_k])[order].to(torch.float16))
            t_ids.append(torch.cat([k.indices for k in steps_k])[order])
            fed.append(torch.tensor([t for c in out for t in c[:-1]], dtype=torch.int64))
        conts.extend(out)
    if not fed:  # every continuation ended after its first token
        h, k = model.config.hidden_size, TEACHER_TOPK
        fed, hidden, targets = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, h, dtype=hidden_dtype)], \
            [torch.empty(0, dtype=torch.int64)]
        t_ids, t_probs = [torch.empty(0, k, dtype=torch.int64)], [torch.empty(0, k, dtype=torch.float16)]
    states = SequenceStates(token_ids=torch.cat(fed), hidden=torch.cat(hidden), targets=torch.cat(targets),
                            teacher_ids=torch.cat(t_ids), teacher_probs=torch.cat(t_probs))
    return Generation(conts, states)


def save_generation(path: str | Path, prompts: Sequence[Sequence[int]], generation: Generation, *,
                    meta: dict[str, str]) -> None:
    """Cache a Generation and its prompts as safetensors (hidden states as stored)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    st = generation.states
    save_file({"prompts": torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
               "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
               "continuations": torch.tensor([t for c in generation.continuations for t in c], dtype=torch.int64),
               "continuation_lens": torch.tensor([len(c) for c in generation.continuations], dtype=torch.int64),
               "token_ids": st.token_ids, "hidden": st.hidden.contiguous(), "targets": st.targets,
               "teacher_ids": st.teacher_ids.contiguous(), "teacher_probs": st.teacher_probs.contiguous()},
              str(tmp), metadata=meta)
    tmp.replace(path)


def _split(flat: list[int], lengths: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in lengths:
        out.append(flat[at:at + n])
        at += n
    return out


def load_generation(path: str | Path) -> tuple[list[list[int]], Generation]:
    """Read a cache written by `save_generation`: (prompts, generation). Raises ValueError naming
    the file when it cannot be read (truncated or damaged: delete it and it is generated again)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except SafetensorError as exc:
        raise ValueError(f"cache file {path} cannot be read ({str(exc).splitlines()[0]}): it is truncated or "
                         f"damaged; delete it and run again") from None
    missing = [name for name in ("prompts", "prompt_lens", "continuations", "continuation_lens") if name not in t]
    if missing:
        raise ValueError(f"cache file {path} has no tensor {missing[0]!r}: delete it and run again")
    prompts = _split(t["prompts"].tolist(), t["prompt_lens"].tolist())
    conts = _split(t["continuations"].tolist(), t["continuation_lens"].tolist())
    states = SequenceStates(**{f.name: t[f.name] for f in dataclasses.fields(SequenceStates)})
    return prompts, Generation(conts, states)


@torch.inference_mode()
def sequence_states(model: StageModel, layer: int, prompt: Sequence[int], continuation: Sequence[int],
                    targets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute layer `layer`'s output at every position of prompt + continuation[:-1] (one
    teacher-forced prefill of the whole `model`; the continuation is the model's own, so these are
    the states its decode saw) -> (hidden [T, H] float32, targets [T] int64: `targets`, the greedy
    next token after each fed continuation token (SequenceStates.targets' rows of this sequence),
    at those positions and -100 at prompt positions). For drafters that attend over the whole
    sequence (pipeline/speculation/drafting/layer_drafter.py). Raises ValueError for an empty prompt, a
    continuation shorter than 2 tokens, or len(targets) != len(continuation) - 1."""
    (hidden,), rows = sequence_layer_states(model, (layer,), prompt, continuation, targets)
    return hidden, rows


def sequence_layer_states(model: StageModel, layers: Sequence[int], prompt: Sequence[int],
                          continuation: Sequence[int], targets: Sequence[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`sequence_states` for several absolute `layers` from the same prefill: ([T, H] float32 per
    layer, in `layers`' order), targets [T]. Raises as `sequence_states` does."""
    if not prompt or len(continuation) < 2 or len(targets) != len(continuation) - 1:
        raise ValueError("sequence_states needs a prompt, >= 2 continuation tokens and one target per fed token")
    seen = {}
    hooks = [model.layers[str(i)].register_forward_hook(lambda m, inp, out, i=i: seen.__setitem__(i, out))
             for i in layers]
    try:
        tokens = list(prompt) + list(continuation[:-1])
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(tokens) + 1)
        model(torch.tensor(tokens), [Span(0, 0, len(tokens))], kv)
    finally:
        for hook in hooks:
            hook.remove()
    rows = torch.full((len(tokens),), -100, dtype=torch.int64)
    rows[len(prompt):] = torch.tensor(list(targets), dtype=torch.int64)
    return [seen[i].float().clone() for i in layers], rows
