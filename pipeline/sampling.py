"""Sampling: turning one position's final logits into a token, and the speculative accept rule.

Owns the per-request sampling settings (`SamplingParams`), the per-sequence `Sampler` (greedy or
temperature + nucleus sampling with its own seeded `torch.Generator`), and `verify_draft`, the
distribution-exact accept/resample rule for a drafted token (ARCHITECTURE.md §5.4).
Must not: do I/O, know about stages, processes or torch.distributed, or decide when to stop a
sequence (EOS, budget and stop strings are the scheduler's job; this module only carries the settings).
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Seeds accepted by torch.Generator.manual_seed without wrapping, as [0, _SEED_LIMIT).
_SEED_LIMIT = 2**64


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it ends.

    max_new_tokens: the token budget, counted in generated tokens (prompt excluded).
    temperature: logits are divided by it before softmax; 0 means greedy (argmax).
    top_p: nucleus sampling; keep the smallest set of most likely tokens whose probability sums to
        at least `top_p` (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration", §3.1).
        1.0 keeps every token. Ignored when greedy.
    seed: seeds the sequence's generator; None draws a fresh random seed, so runs differ.
    stop: strings that end generation when they appear in the output (applied by the scheduler).
    ignore_eos: keep generating past EOS until `max_new_tokens` (benchmarks).

    Raises ValueError (naming the parameter, the value and the limit) for invalid settings.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.stop, tuple):
            raise ValueError(
                f"stop must be a tuple of strings, got {type(self.stop).__name__} {self.stop!r}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature == 0)."""
        return self.temperature == 0.0


class Sampler:
    """Chooses the next token of one sequence from its final logits, and verifies drafts.

    Owns the sequence's `torch.Generator` (on `device`, which must be where the logits live), seeded
    from `params.seed`, or from a fresh non-deterministic seed when it is None; `seed` reports the seed
    used so a run can be reproduced. One Sampler per sequence: draws are reproducible per sequence
    regardless of how sequences are batched or interleaved.
    """

    def __init__(self, params: SamplingParams, *, device: torch.device | str = "cpu") -> None:
        self.params = params
        self._generator = torch.Generator(device=device)
        if params.seed is None:
            self.seed = self._generator.seed()  # non-deterministic (std::random_device / time)
        else:
            self.seed = params.seed
            self._generator.manual_seed(params.seed)

    @property
    def generator(self) -> torch.Generator:
        """The sequence's generator (for callers that draw on its behalf, e.g. a sampled draft)."""
        return self._generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The exact distribution `sample` draws from.

        logits: [vocab_size] float. Returns p: [vocab_size] float32 summing to 1: one-hot at the
        argmax when greedy; otherwise softmax(logits / temperature), restricted to the top-p nucleus
        and renormalised. Within the nucleus, ties at the boundary keep the lower token index.
        """
        assert logits.dim() == 1, f"logits must be [vocab_size], got shape {tuple(logits.shape)}"
        logits = logits.float()
        if self.params.is_greedy:
            p = torch.zeros_like(logits)
            p[torch.argmax(logits)] = 1.0
            return p
        # Subtract the max before dividing so a tiny temperature gives -inf, never +inf / NaN.
        scaled = (logits - logits.max()) / self.params.temperature
        p = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1.0:
            p = _top_p_filter(p, self.params.top_p)
        return p

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id from logits: [vocab_size]. Greedy: argmax (ties -> lowest index)."""
        if self.params.is_greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self._generator))

    def verify(
        self, logits: torch.Tensor, draft_token: int, q: torch.Tensor | None = None
    ) -> tuple[bool, int]:
        """Decide a drafted token against the target model's logits at the same position.

        logits: [vocab_size], the final logits of the token before the draft. q: [vocab_size], the
        predictor's distribution the draft was drawn from, or None for a deterministic predictor.
        Returns (accepted, token): token is the draft when accepted, else the corrected token to commit.
        Greedy: accepted iff the draft equals the argmax, and the token is always the argmax (so greedy
        output with speculation is token-identical to greedy output without it, ARCHITECTURE.md §5.3).
        Sampling: `verify_draft` with p = `probs(logits)` and this sequence's generator.
        """
        if self.params.is_greedy:
            token = int(torch.argmax(logits))
            return token == draft_token, token
        return verify_draft(self.probs(logits), draft_token, q, self._generator)


def _top_p_filter(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending p) whose mass is >= top_p; renormalise.

    p: [vocab_size] probabilities. Returns [vocab_size]. The top token is always kept.
    """
    sorted_p, order = torch.sort(p, descending=True, stable=True)  # stable: ties keep lower index first
    # A token is kept iff the mass strictly before it is < top_p: this is the smallest prefix whose
    # cumulative mass reaches top_p, and the first token (mass before it = 0 < top_p) is always kept.
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    filtered = torch.where(keep, p, torch.zeros_like(p))
    return filtered / filtered.sum()


def verify_draft(
    p: torch.Tensor, draft_token: int, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[bool, int]:
    """Speculative sampling: accept a draft x ~ q, or resample, so the result is distributed as p.

    p: [vocab_size] the target distribution (e.g. `Sampler.probs`), non-negative, sums to 1.
    draft_token: x, the drafted token id. q: [vocab_size] the draft distribution x was drawn from,
    or None for a deterministic predictor (q = one-hot at x). generator: on p's device, or None for
    torch's default generator. Returns (accepted, token).

    Source: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
    (arXiv 2211.17192), §2.3 and Appendix A.1; Chen et al. 2023 (arXiv 2302.01318), Algorithm 2.
    """
    vocab_size = p.shape[-1]
    if p.dim() != 1 or (q is not None and q.shape != p.shape):
        raise ValueError(
            f"p must be [vocab_size] and q None or the same shape, got p {tuple(p.shape)}, "
            f"q {None if q is None else tuple(q.shape)}"
        )
    if not 0 <= draft_token < vocab_size:
        raise ValueError(f"draft_token must be in [0, {vocab_size}), got {draft_token}")
    # Accept x with probability min(1, p(x) / q(x)):
    #   u ~ U[0, 1);  accept  <=>  u < p(x) / q(x)  <=>  u * q(x) < p(x)   (no division, so q(x) = 0
    #   with p(x) > 0 accepts, and p(x) = 0 never accepts). One-hot q: q(x) = 1, accept w.p. p(x).
    # P(accept and emit x) = q(x) * min(1, p(x)/q(x)) = min(p(x), q(x)).
    p_x = float(p[draft_token])
    q_x = 1.0 if q is None else float(q[draft_token])
    u = float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))
    if u * q_x < p_x:
        return True, draft_token
    # Rejected (total probability 1 - sum_y min(p(y), q(y))): resample y ~ normalise(max(0, p - q)).
    # Then P(emit y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y): the output is distributed as p.
    # One-hot q: max(0, p - q) is p with p(x) zeroed (p(x) - 1 <= 0), so y ~ p restricted to y != x.
    if q is None:
        residual = p.clone()
        residual[draft_token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    if not bool(residual.sum() > 0):
        # Degenerate: p <= q everywhere (p == q up to rounding), so rejection had probability ~0.
        # Any draw from p keeps the output distributed as p.
        residual = p
    # torch.multinomial normalises its weights, which is the normalise() above.
    return False, int(torch.multinomial(residual, 1, generator=generator))
