"""Sampling: turning one position's final logits into a token, and the speculative accept rule.

Owns the per-request sampling settings (`SamplingParams`), the per-sequence `Sampler` (greedy, or
temperature with min-p / top-k / top-p filters, each draw keyed by the sequence's seed and the
token's position: [Note: position-keyed draws]), `verify_draft`, the distribution-exact
accept/resample rule for a drafted token (ARCHITECTURE.md §5.4). Applying the logit bias and the
penalties, and the logprobs reported to clients: pipeline/speculation/logprobs.py; vLLM's token masks
(min_tokens, stop_token_ids, allowed_token_ids, bad_words): pipeline/speculation/masks/token_masks.py.
Must not: do I/O, know about stages, processes or torch.distributed, or decide when to stop a
sequence (EOS, budget and stop strings are the scheduler's job; this module only carries the settings).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from pipeline.speculation.echo import shown
from pipeline.speculation.grammar import GrammarSpec
from pipeline.speculation.masks import token_masks

SamplingParamError = token_masks.SamplingParamError  # the error of an invalid setting (defined below this module)

# Seeds accepted by torch.Generator.manual_seed without wrapping, as [0, _SEED_LIMIT).
_SEED_LIMIT = 2**64
MAX_LOGPROBS = 20  # most alternatives a request may ask for per position (vLLM's default max_logprobs)
# logit_bias: OpenAI's range of one bias, and the most entries one request may set: 300, the limit
# OpenAI's API enforces as far as known (its reference names none; vLLM sets none); it bounds the work.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,20}")  # a JSON object key that names a token id ("50256")

# [Note: position-keyed draws]
# Every random draw of a sequence uses a generator seeded from (seed, position of the token it
# chooses), `draw_key`, never a stream consumed draw by draw. So the token at position i is a
# function of the seed and the logits there alone: how many drafts were verified before it, how
# the requests were batched, whether a stage failed and the sequence was replayed, change nothing.
# A seeded request gives the same tokens with and without speculation (plain decoding samples
# position i with the same generator state) and alone or beside others (vLLM's per-request seeds
# promise the same). Verify of a deterministic draft x (every built-in predictor's: q one-hot at
# x) then draws the real token y ~ p at that position and accepts iff y = x: accepted with
# probability p(x), and a rejected draft commits y ~ p restricted to y != x, renormalised, which
# is the standard speculative rule for one-hot q (Leviathan et al. 2023, arXiv 2211.17192 §2.3),
# so acceptance and the output distribution are unchanged. A draft drawn from a distribution q
# (`verify(..., q=...)`) keeps the general accept/resample rule, with the position's generator.


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it ends.

    max_new_tokens: the token budget, counted in generated tokens (prompt excluded).
    temperature: logits are divided by it before softmax; 0 means greedy (argmax).
    top_p: nucleus sampling; keep the smallest set of most likely tokens whose probability sums to
        at least `top_p` (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration", §3.1).
        1.0 keeps every token. Ignored when greedy.
    top_k: keep the k most likely tokens (ties at the k-th probability kept, as vLLM); 0 or -1
        keeps every token (vLLM's "off"). Ignored when greedy.
    min_p: keep tokens whose probability is at least min_p times the most likely one's (Nguyen et
        al. 2024, "Min P Sampling", arXiv 2407.01082 §3); 0 keeps every token. Ignored when greedy.
        Filters apply in vLLM's order: temperature, min-p, top-k, top-p.
    seed: seeds the sequence's generator; None draws a fresh random seed, so runs differ.
    stop: strings that end generation when they appear in the output (applied by the scheduler).
    ignore_eos: keep generating past EOS until `max_new_tokens` (benchmarks).
    logprobs: None, or report each generated token's logprob plus this many (0..MAX_LOGPROBS) most
        likely alternatives per position ([Note: logprobs and penalties] in pipeline/speculation/logprobs.py).
    prompt_logprobs: None, or report the logprob of every prompt token after the first (given the
        tokens before it) plus this many alternatives (OpenAI completions `echo` + `logprobs`).
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's; repetition_penalty: in (0, 2], vLLM's
        extension, 1 = off.
    logit_bias: OpenAI's token id -> bias in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], added to that token's
        logit (at most MAX_LOGIT_BIAS_ENTRIES ids, each >= 0; `check_vocab` checks them against a
        vocabulary). Given as a mapping (keys: ints, or OpenAI's JSON strings of ints, "50256");
        kept as (token id, bias) pairs sorted by token id. Applied as vLLM does, first: bias, then penalties,
        then temperature and the filters, so greedy is the argmax of the biased (and penalised) logits.
        Reported logprobs stay the raw model's ([Note: logprobs and penalties] in pipeline/speculation/logprobs.py).
    grammar: None, or the structured output constraint (JSON object / schema, regex, choice, grammar, structural
        tag): tokens are chosen from the logits with every token it forbids masked ([Note: grammar masks] in
        pipeline/speculation/grammar.py); refused with ignore_eos (a complete document allows only EOS).
    min_tokens, stop_token_ids, allowed_token_ids, bad_words and bad_word_ids (the bad words' token sequences,
    which the coordinator fills): vLLM's token masks ([Note: token masks] in pipeline/speculation/masks/token_masks.py).
    Raises SamplingParamError, a ValueError (naming the parameter, the value and the limit), for
    invalid settings.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise SamplingParamError("max_new_tokens", f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise SamplingParamError("max_new_tokens", f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature):
            raise SamplingParamError("temperature", f"temperature must be finite, got {self.temperature}")
        if self.temperature < 0:
            raise SamplingParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamError("top_k",
                                     f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:  # also rejects NaN
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise SamplingParamError("seed", f"seed must be an integer or None, got {self.seed!r}")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise SamplingParamError("seed", f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.stop, tuple):
            raise SamplingParamError("stop", f"stop must be a tuple of strings, got {type(self.stop).__name__} {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamError("stop", f"stop must hold non-empty strings, got {s!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise SamplingParamError(
                    name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also rejects NaN
                raise SamplingParamError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamError("repetition_penalty",
                                     f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if self.grammar is not None and (not isinstance(self.grammar, GrammarSpec) or self.ignore_eos):
            what = (f"a {self.grammar.kind.replace('_', ' ')} structured output" if isinstance(self.grammar, GrammarSpec)
                    else f"a {type(self.grammar).__name__}, not a GrammarSpec")  # never its text: up to 262,144 chars
            raise SamplingParamError("response_format", f"response_format must be a GrammarSpec and cannot be combined "
                                                        f"with ignore_eos, got {what}")
        token_masks.check_token_masks(self)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamError (naming the field) when a logit_bias, stop, allowed or bad-word token id
        is not in [0, vocab_size)."""
        token_masks.check_token_mask_vocab(self, vocab_size)
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token_id} is outside the "
                                                       f"vocabulary [0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def changes_logits_at(self, position: int) -> bool:
        """True when a nonzero logit bias, a penalty, a grammar or a token mask acting at output token `position`
        (0 = the first generated; min_tokens acts only before min_tokens tokens) changes that row (greedy != raw argmax)."""
        return (any(bias != 0.0 for _, bias in self.logit_bias) or self.has_penalties or self.grammar is not None
                or token_masks.masks_act_at(self, position))

    def needs_logits_at(self, position: int) -> bool:
        """Whether the last stage must return the logits row that chooses output token `position` (0 = the first
        generated): sampling, logprobs, or `changes_logits_at(position)`. A greedy request whose only setting
        of these is min_tokens needs them before min_tokens tokens only; after them its token is the argmax."""
        return not self.is_greedy or self.logprobs is not None or self.changes_logits_at(position)


def _checked_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """`SamplingParams.logit_bias` (a mapping, or the pairs it keeps) as sorted (token id, bias) pairs;
    a key may be OpenAI's JSON form of an id, a string of an integer ("50256"). Raises SamplingParamError."""
    if not isinstance(value, (Mapping, tuple)):
        raise SamplingParamError("logit_bias", f"logit_bias must be an object of token id -> bias, got "
                                               f"{type(value).__name__}")
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingParamError("logit_bias", f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for key, bias in pairs:
        token_id = int(key) if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key) else key
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise SamplingParamError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {shown(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise SamplingParamError("logit_bias", f"logit_bias of token {token_id} must be a number in "
                                                   f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {shown(bias)}")
        if out.setdefault(token_id, float(bias)) != float(bias):
            raise SamplingParamError("logit_bias", f"logit_bias sets token {token_id} twice")
    return tuple(sorted(out.items()))


def draw_key(seed: int, position: int) -> int:
    """The 64-bit key of the draw that chooses the token at `position` (0 = the first generated
    token) of a sequence seeded with `seed`: SplitMix64 (Steele et al. 2014, "Fast splittable
    pseudorandom number generators", OOPSLA) of the two, in [0, 2**64). [Note: position-keyed draws]
    Raises ValueError for a negative position."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) % _SEED_LIMIT
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _SEED_LIMIT
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _SEED_LIMIT
    return z ^ (z >> 31)


class Sampler:
    """Chooses the next token of one sequence from its final logits, and verifies drafts.

    Owns the sequence's seed (`params.seed`, or a fresh non-deterministic one when it is None;
    `seed` reports it so a run can be reproduced). A draw is u = the top 53 bits of `draw_key(seed,
    position)` / 2**53, the same on every device ([Note: position-keyed draws]); only `verify` with
    a draft distribution q uses a `torch.Generator` (on `device`, seeded from that key; a CPU
    generator keeps its low 32 bits).
    """

    def __init__(self, params: SamplingParams, *, device: torch.device | str = "cpu") -> None:
        self.params = params
        self._generator = torch.Generator(device=device)
        self.seed = self._generator.seed() if params.seed is None else params.seed  # seed(): random_device / time

    def _at(self, position: int) -> torch.Generator:
        return self._generator.manual_seed(draw_key(self.seed, position))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The exact distribution `sample` draws from.

        logits: [vocab_size] float. Returns p: [vocab_size] float32 summing to 1: one-hot at the
        argmax when greedy; otherwise softmax(logits / temperature), restricted by min-p, top-k and
        the top-p nucleus (in that order, vLLM's) and renormalised. Within the nucleus, ties at the
        boundary keep the lower token index.
        """
        assert logits.dim() == 1, f"logits must be [vocab_size], got shape {tuple(logits.shape)}"
        logits = logits.float()
        if self.params.is_greedy:
            p = torch.zeros_like(logits)
            p[torch.argmax(logits)] = 1.0
            return p
        # Subtract the max before dividing so a tiny temperature gives -inf, never +inf / NaN (one
        # below float32's range, 1e-320, would round to 0 and make 0 / 0: it counts as `tiny`).
        scaled = (logits - logits.max()) / max(self.params.temperature, torch.finfo(logits.dtype).tiny)
        p = torch.softmax(scaled, dim=-1)
        if self.params.min_p > 0.0:
            p = _renormalised(torch.where(p >= self.params.min_p * p.max(), p, torch.zeros_like(p)))
        if 0 < self.params.top_k < p.shape[-1]:
            kth = torch.topk(p, self.params.top_k).values[-1]
            p = _renormalised(torch.where(p >= kth, p, torch.zeros_like(p)))
        if self.params.top_p < 1.0:
            p = _top_p_filter(p, self.params.top_p)
        return p

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """The token at `position` (0 = first generated) from logits: [vocab_size]. Greedy: argmax
        (ties -> lowest index). Raises ValueError for a negative position."""
        if self.params.is_greedy:
            return int(torch.argmax(logits))
        return _inverse_cdf(self.probs(logits), (draw_key(self.seed, position) >> 11) / 2**53)

    def verify(self, logits: torch.Tensor, draft_token: int, position: int,
               q: torch.Tensor | None = None) -> tuple[bool, int]:
        """Decide a drafted token for `position` against the target model's logits there.

        logits: [vocab_size], the final logits of the token before the draft. q: [vocab_size], the
        predictor's distribution the draft was drawn from, or None for a deterministic predictor.
        Returns (accepted, token): token is the draft when accepted, else the corrected token to commit.
        Greedy: accepted iff the draft equals the argmax, and the token is always the argmax (so greedy
        output with speculation is token-identical to greedy output without it, ARCHITECTURE.md §5.3).
        Sampling, q None: the token is `sample(logits, position)`, accepted iff it is the draft, so
        seeded output with speculation is token-identical to seeded output without it ([Note:
        position-keyed draws]). Sampling with q: `verify_draft` with p = `probs(logits)` and the
        position's generator.
        """
        if self.params.is_greedy:
            token = int(torch.argmax(logits))
            return token == draft_token, token
        if q is None:
            token = self.sample(logits, position)
            return token == draft_token, token
        return verify_draft(self.probs(logits), draft_token, q, self._at(position))


def _renormalised(p: torch.Tensor) -> torch.Tensor:  # p / its sum
    return p / p.sum()


def _top_p_filter(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending p, ties lower index first) whose mass is
    >= top_p; renormalise.

    p: [vocab_size] probabilities. Returns [vocab_size]. The top token is always kept. Sorts only
    the 64 (then 1024) most likely tokens when the kept prefix ends inside them and no token
    outside them ties the least of them (or that is 0), so the prefix is a full stable sort's;
    else sorts everything (~5 ms for a 49k vocabulary on one CPU thread, the first try ~0.5 ms).
    """
    values = ids = None
    for k in (64, 1024):
        if values is None and k < p.shape[-1]:
            top, top_ids = stable_top(p, k)
            if float(top[-1]) == 0.0 or int((p >= top[-1]).sum()) == k:
                values, ids = top, top_ids
                if float((torch.cumsum(values, -1) - values)[-1]) < top_p:  # the prefix may go on: look further
                    values = None
    if values is None:
        values, ids = torch.sort(p, descending=True, stable=True)
    # A token is kept iff the mass strictly before it is < top_p: this is the smallest prefix whose
    # cumulative mass reaches top_p, and the first token (mass before it = 0 < top_p) is always kept;
    # a top_p below float32's range (1e-320) would round to 0 and keep none, so it counts as `tiny`.
    keep = ids[torch.cumsum(values, dim=-1) - values < max(top_p, torch.finfo(values.dtype).tiny)]
    return _renormalised(torch.zeros_like(p).index_put_((keep,), p[keep]))


def stable_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest entries along the last dim of x: [..., n], most first, ties
    by lower id among the ones `torch.topk` picked (a full stable sort's order when no entry
    outside them ties the k-th, which callers check)."""
    values, ids = torch.topk(x, k, dim=-1)
    ids, order = torch.sort(ids, dim=-1)
    values, order = torch.sort(values.gather(-1, order), dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The token of p: [vocab_size] (non-negative) at u in [0, 1) by inverse transform sampling:
    the first whose cumulative mass (float64) exceeds u * total, never a zero-probability one
    (~0.1 ms for a 49k vocabulary; torch.multinomial takes ~1 ms on one CPU thread). Raises
    ValueError when p has no finite positive mass (NaN or infinite logits)."""
    cdf = torch.cumsum(p.double(), dim=-1)
    total = cdf[-1]
    if not bool(torch.isfinite(total) and total > 0):
        raise ValueError(f"cannot sample: the probabilities sum to {float(total)} (NaN or infinite logits?)")
    last = int(torch.searchsorted(cdf, total))  # the last token with p > 0
    return min(int(torch.searchsorted(cdf, u * total, right=True)), last)


def verify_draft(p: torch.Tensor, draft_token: int, q: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[bool, int]:
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
        raise ValueError(f"p must be [vocab_size] and q None or the same shape, got p {tuple(p.shape)}, "
                         f"q {None if q is None else tuple(q.shape)}")
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
    total = residual.sum()
    if not bool(total > 0):
        # Degenerate: p <= q everywhere (p == q up to rounding), so rejection had probability ~0.
        # Any draw from p keeps the output distributed as p.
        residual = p
    elif bool(total < torch.finfo(residual.dtype).tiny):
        # Only subnormal weights (p(y) = 1e-45 beside q = p elsewhere): torch.multinomial then
        # sometimes draws a token of weight 0, so normalise in float64, where they are normal numbers.
        residual = residual.double() / total.double()
    # torch.multinomial normalises its weights, which is the normalise() above.
    return False, int(torch.multinomial(residual, 1, generator=generator))
