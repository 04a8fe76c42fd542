"""Draft predictors: guess the next token of a sequence before the last stage has computed it.

Owns the exit head (the stage-side part: final norm + LM head on an exit-layer hidden state, the
"logit lens") and the coordinator-side predictors that turn a sequence's context plus the exit
head's guess into a draft: `logit-lens`, `early-exit` (trained map, see ExitMap), `ngram` (prompt
lookup) and `hybrid`.
Sources: SPEED (arXiv 2310.12072) §3 for early-exit drafting; prompt-lookup decoding
(Saxena 2023) / LLMA (arXiv 2304.04487) for n-gram matching. Pure: no I/O.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.family_blocks import RMSNorm, rms_normalize, soft_cap

PREDICTORS = ("logit-lens", "early-exit", "ngram", "hybrid")
PREDICTOR_FILE_SUFFIX = ".safetensors"  # a --predictor value ending so names a trained early-exit file


@dataclasses.dataclass(frozen=True)
class ExitGuess:
    """The exit head's top token for one position and its probability (confidence in [0, 1]);
    `alternatives`: its next most likely (token, probability) pairs, best first, when the exit
    stage was asked for its top-k (token trees, pipeline/speculation/tree.py); else empty."""

    token: int
    prob: float
    alternatives: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Draft:
    """A proposed next token, its confidence in [0, 1], and which predictor made it."""

    token: int
    confidence: float
    source: str


class ExitMap(nn.Module):
    """Trained map on the exit hidden state, applied before the frozen final norm + LM head.

    arch "affine": y = W x + b, W: [H, H] (initialised at the identity, so an untrained map is the
    logit lens). arch "mlp": the affine map plus a residual one-hidden-layer SiLU MLP on the RMS-normalised
    input, y = W x + b + down(silu(up(x / rms(x)))), up: [M, H], down: [H, M] (down initialised at
    zero). forward(x: [num_rows, H]) -> [num_rows, H] in x's dtype.
    Parameter names are the predictor file's tensor names (pipeline/speculation/predictor_file.py).
    Source: self-distilled early-exit heads, SPEED (arXiv 2310.12072) §3; LayerSkip (arXiv 2404.16710).
    """

    def __init__(self, hidden_size: int, *, arch: str = "affine", mlp_size: int = 512, eps: float = 1e-5) -> None:
        super().__init__()
        if arch not in ("affine", "mlp"):
            raise ValueError(f"exit map arch must be affine or mlp, got {arch!r}")
        self.arch, self.eps = arch, eps
        self.proj = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(hidden_size))
            self.proj.bias.zero_()
        self.mlp: nn.ModuleDict | None = None
        if arch == "mlp":
            self.mlp = nn.ModuleDict({"up": nn.Linear(hidden_size, mlp_size), "down": nn.Linear(mlp_size, hidden_size)})
            with torch.no_grad():
                self.mlp["down"].weight.zero_()
                self.mlp["down"].bias.zero_()

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, arch: str, eps: float = 1e-5) -> ExitMap:
        """Build an "affine" or "mlp" map from predictor-file tensors ("proj.weight" [H, H], ...; a
        "draft_vocab" is the ExitHead's, not the map's, and is skipped). Every arch of a file, the
        drafters' included: `exit_map_from_tensors` in pipeline/speculation/drafting/exit_tensors.py.
        Raises ValueError on another arch or a missing or mis-shaped tensor."""
        tensors = {n: t for n, t in tensors.items() if n != "draft_vocab"}
        needed = ["proj.weight"] + (["mlp.up.weight"] if arch == "mlp" else [])
        if any(n not in tensors for n in needed):
            raise ValueError(f"exit map tensors do not fit arch {arch!r}: it needs {', '.join(needed)}, the file has "
                             f"{', '.join(sorted(tensors)) or 'none'}")
        hidden_size = tensors["proj.weight"].shape[0]
        mlp_size = tensors["mlp.up.weight"].shape[0] if arch == "mlp" else 512
        exit_map = cls(hidden_size, arch=arch, mlp_size=mlp_size, eps=eps)
        try:
            exit_map.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"exit map tensors do not fit arch {arch!r}: {str(exc).splitlines()[0]}") from None
        return exit_map.eval().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x.to(self.proj.weight.dtype))
        if self.mlp is not None:
            normed = rms_normalize(x.float(), self.eps).to(y.dtype)
            y = y + self.mlp["down"](F.silu(self.mlp["up"](normed)))
        return y.to(x.dtype)


class ExitHead(nn.Module):
    """Early exit at the exit layer: [trained map ->] final norm + LM head on an intermediate
    hidden state. Without a map this is the "logit lens".

    forward(hidden: [num_rows, hidden_size]) -> (tokens [num_rows] int64, probs [num_rows] float32).
    The norm and head weights are copies of the model's final norm and LM head (held by the exit
    stage); `exit_map` is a trained ExitMap or DrafterMap (pipeline/speculation/predictor_file.py holds its file format).
    `softcap`: the model's final logit soft-cap (Gemma 2/3's `final_logit_softcapping`, as the last stage
    applies it) or None, so that a guess's probability is the model's head's, not a sharper one.
    With a draft vocabulary (`restrict_vocab`), see [Note: draft vocabulary].
    """

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, *, exit_map: nn.Module | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.exit_map = exit_map
        self.softcap = softcap
        self.vocab_ids: torch.Tensor | None = None  # [V'] int64: row i of lm_head is token vocab_ids[i]

    def restrict_vocab(self, vocab_ids: torch.Tensor) -> None:
        """Keep only the LM-head rows of `vocab_ids` ([V'] int64 token ids, unique, in range).

        [Note: draft vocabulary]
        The exit head's full LM head (49152 x 576 on the default model) costs about five decoder
        layers per decode item on the exit stage in float32 (about 12-15 under `auto`, where it is
        dense bfloat16 over int4 layers: [Note: partition cost] in pipeline/model/partition.py),
        but a draft is only worth making for tokens the model emits often. A trained head stores
        the tokens that were the base model's argmax in its training data (capped by frequency;
        95% of held-out argmax tokens on the default model)
        and the head scores only those: about 4% of the matmul. A draft outside the draft
        vocabulary is never made, so the cost is a few missed drafts, never a wrong output (the
        verify step is unchanged). The probability is the softmax over the draft vocabulary, so
        it overstates confidence a little; the draft gate learns acceptance per confidence bucket.
        Raises ValueError for an empty, out-of-range or duplicated id list.
        """
        ids = vocab_ids.to(torch.int64).flatten()
        vocab_size = self.lm_head.weight.shape[0]
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"draft vocabulary must be {vocab_size}-vocab token ids without repeats, "
                             f"got {ids.numel()} ids")
        weight = self.lm_head.weight.detach()[ids.to(self.lm_head.weight.device)].contiguous()
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight = nn.Parameter(weight, requires_grad=False)
        self.lm_head, self.vocab_ids = head, ids.to(weight.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab'] of hidden [rows, hidden_size]."""
        if self.exit_map is not None:
            hidden = self.exit_map(hidden)
        return soft_cap(self.lm_head(self.norm(hidden)).float(), self.softcap)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top token and its probability per row: ([rows] int64, [rows] float32); with top_k > 1
        the top_k best, best first: ([rows, top_k], [rows, top_k]) (token trees)."""
        # Row by row, in the shape of a lone row: a guess never depends on which other rows want one
        # ([Note: batch invariance] in pipeline/weights/quant.py).
        logits = torch.cat([self._logits(row) for row in hidden.split(1)]) if hidden.shape[0] > 1 \
            else self._logits(hidden)
        probs = torch.softmax(logits, dim=-1)
        probs, tokens = probs.max(dim=-1) if top_k == 1 else probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        if self.vocab_ids is not None:
            tokens = self.vocab_ids[tokens]
        return tokens, probs


def exit_guesses(tokens: torch.Tensor | None, probs: torch.Tensor | None, num_items: int) -> list[ExitGuess | None]:
    """The exit stage's tensors as one guess per item: tokens/probs [num_items] (top token) or
    [num_items, k] (top-k, best first); token -1 (or no tensors): no guess for that item."""
    if tokens is None:
        return [None] * num_items
    tokens, probs = tokens.reshape(num_items, -1).tolist(), probs.reshape(num_items, -1).tolist()
    return [None if t[0] < 0 else ExitGuess(t[0], p[0], tuple(zip(t[1:], p[1:], strict=True)))
            for t, p in zip(tokens, probs, strict=True)]


class Predictor(Protocol):
    """Coordinator-side draft proposal for one sequence."""

    name: str
    needs_exit_head: bool

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        """context: prompt + committed + in-flight draft tokens, up to the chain's end; guess: the
        exit head's output for the chain's end (None without an exit head). None = no draft."""
        ...


class LogitLensPredictor:
    """Draft = the exit head's argmax (no training; weak at early layers of small models)."""

    name = "logit-lens"
    needs_exit_head = True

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        return None if guess is None else Draft(guess.token, guess.prob, self.name)

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        """Token-tree candidates, most likely first: the exit head's top-k ([Note: token trees] in
        pipeline/speculation/tree.py); the caller drops the one it proposed."""
        if guess is None:
            return []
        return [Draft(guess.token, guess.prob, self.name),
                *(Draft(t, p, self.name) for t, p in guess.alternatives)]


class EarlyExitPredictor(LogitLensPredictor):
    """Draft = the argmax of a trained early-exit head (ExitMap before the frozen norm + head); the
    stage computes it, so the coordinator side is the logit lens's."""

    name = "early-exit"


_WORD = 8  # bytes per token id in NGramPredictor's search buffer (array typecode 'q')


class NGramPredictor:
    """Prompt lookup: find the longest suffix of the context (max_ngram .. min_ngram tokens) that
    occurred earlier in the context and propose the token that followed its latest occurrence.

    Confidence = matched length / max_ngram. No training; strong on repetitive text.
    """

    name = "ngram"
    needs_exit_head = False

    def __init__(self, *, max_ngram: int = 4, min_ngram: int = 1, window: int = 1024) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        """For size = max_ngram .. min_ngram: the latest start s <= n - size - 1 with
        ctx[s:s + size] == ctx[n - size:] proposes ctx[s + size] (ctx: the last `window` tokens).
        The search runs in C (`bytes.rfind` over the tokens as 8-byte words; a hit that is not
        word-aligned is skipped): ~20 us where a Python scan of a 600-token context without a
        match took ~0.45 ms, on the critical path of every draft."""
        ctx = context[-self.window:]
        n = len(ctx)
        buf = array.array("q", ctx).tobytes()
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            needle = buf[(n - size) * _WORD:]
            end = (n - 1) * _WORD  # an occurrence must end before the last token
            while (at := buf.rfind(needle, 0, end)) >= 0:
                if at % _WORD == 0:
                    return Draft(int(ctx[at // _WORD + size]), size / self.max_ngram, self.name)
                end = at + len(needle) - 1  # a hit across word boundaries: look further left
        return None


class HybridPredictor:
    """Per position, whichever of n-gram lookup and the exit head (trained early-exit head when the
    stage has one, else the logit lens) is more confident."""

    name = "hybrid"
    needs_exit_head = True

    def __init__(self, ngram: NGramPredictor | None = None) -> None:
        self.ngram = ngram or NGramPredictor()
        self.lens = LogitLensPredictor()

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        a = self.ngram.propose(context, guess)
        b = self.lens.propose(context, guess)
        if a is None or b is None:
            return a or b
        return a if a.confidence >= b.confidence else b

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        """Token-tree candidates, most likely first: the n-gram proposal and the exit head's top-k
        ([Note: token trees] in pipeline/speculation/tree.py)."""
        a = self.ngram.propose(context, guess)
        return sorted([*([a] if a else []), *self.lens.alternatives(context, guess)], key=lambda d: -d.confidence)


def is_predictor_file(name: str) -> bool:
    """Whether a --predictor value names a trained predictor file rather than a built-in predictor."""
    return name.endswith(PREDICTOR_FILE_SUFFIX)


def make_predictor(name: str) -> Predictor:
    """Predictor by CLI name; a trained file path (see is_predictor_file) is an early-exit predictor.
    Raises ValueError for an unknown name."""
    if name == "logit-lens":
        return LogitLensPredictor()
    if name == "early-exit" or is_predictor_file(name):
        return EarlyExitPredictor()
    if name == "ngram":
        return NGramPredictor()
    if name == "hybrid":
        return HybridPredictor()
    raise ValueError(f"predictor {name!r} is not one of {', '.join(PREDICTORS)} nor a trained predictor file "
                     f"(*{PREDICTOR_FILE_SUFFIX})")
