"""Logprobs and penalties: the OpenAI / vLLM logit processors around sampling.

Owns OpenAI's logit bias (`apply_logit_bias`), the repetition / presence / frequency penalties
(`apply_penalties`), both in order (`processed_logits`), the log-probabilities
reported to clients (`TokenLogprob`, `token_logprob`), and prompt logprobs (echo's, vLLM's `prompt_logprobs`):
their reduction on the last stage (`reduce_prompt_rows`, with vLLM's rank, `prompt_rank`) and their records on the
coordinator (`prompt_token_logprobs`). See [Note: logprobs and penalties].
Must not: choose tokens (pipeline/speculation/sampling.py), do I/O, or know about stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from pipeline.speculation.sampling import MAX_LOGPROBS, SamplingParams, stable_top

# [Note: logprobs and penalties]
# Where: on the coordinator side, where the scheduler turns a result row into a token. A request that
# asks for logprobs, a logit bias or a penalty sets `needs_logits_at`, so its items carry `Item.want_logits`
# and the last stage returns float32 logits for each of their result rows (greedy requests without
# any pay nothing: the last stage returns only argmax ids for them). One place decides both the token
# and its logprob, so a draft's verify uses exactly what plain decoding uses at that position.
# Penalties (vLLM's definitions, vllm/model_executor/layers/utils.py `apply_penalties`; OpenAI API
# reference for presence/frequency): with c(t) = how often t occurs in the tokens *generated so far*
# (for a verify row: committed output plus the drafts accepted before that row in the same result),
#     logits[t] -= frequency_penalty * c(t) + presence_penalty * [c(t) > 0],
# and, first, for every t in the prompt or the output, repetition_penalty r (CTRL, Keskar et al.
# 2019, arXiv 1909.05858 §4.1): logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r.
# Logit bias (OpenAI's `logit_bias`) comes before the penalties, as in vLLM (v1's sampler applies its
# LogitBiasLogitsProcessor, a non-argmax-invariant processor, before `apply_penalties`; v0 applied
# the request's logits processors before the sampler): logits[t] += bias[t]. So a repetition
# penalty scales the biased logit. Greedy then takes the argmax of the biased, penalised logits
# (`processed_logits`); sampling applies temperature / min-p / top-k / top-p to them.
# Logprobs are those of the raw model distribution, log_softmax(logits) before bias, penalties and
# temperature (vLLM's default `raw_logprobs` mode), so they are comparable across requests; the
# reported token is the one committed (biased / penalised / sampled), whatever its raw rank.


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One position's reported log-probabilities: the chosen token's, and the `top` alternatives
    as (token id, logprob) pairs, most likely first (natural log, raw model distribution). `rank`:
    the token's rank in that distribution, vLLM's (`prompt_rank`), where recorded (prompt tokens), else None;
    the alternatives' ranks are their places, 1 .. len(top)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """logits: [vocab_size] raw final logits of a position; token_id: the token reported there;
    num_top: alternatives to list (0..MAX_LOGPROBS). Ties keep the lower token id first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.sort(logp, descending=True, stable=True)
        top = tuple(zip(ids[:num_top].tolist(), values[:num_top].tolist(), strict=True))
    return TokenLogprob(token_id, float(logp[token_id]), top)


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab_size] with `params.logit_bias` added ([Note: logprobs and penalties]); a new
    float32 tensor, or `logits` itself when no bias is set. Token ids must be < vocab_size
    (`SamplingParams.check_vocab`, which every front end runs)."""
    if not params.logit_bias:
        return logits
    ids, bias = _logit_bias_tensors(params.logit_bias, logits.device)
    return logits.float().index_add(0, ids, bias)


@functools.lru_cache(maxsize=256)
def _logit_bias_tensors(logit_bias: tuple[tuple[int, float], ...],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`SamplingParams.logit_bias` as (token ids, float32 biases) on `device`, built once per request's
    bias rather than per row (`apply_logit_bias` only reads them: index_add is out of place)."""
    ids, bias = zip(*logit_bias, strict=True)
    return torch.tensor(ids, device=device), torch.tensor(bias, dtype=torch.float32, device=device)


def processed_logits(logits: torch.Tensor, params: SamplingParams, *, prompt_ids: Sequence[int],
                     output_ids: Sequence[int]) -> torch.Tensor:
    """The logits a position's token is chosen from: `apply_logit_bias`, then `apply_penalties`
    (vLLM's order, [Note: logprobs and penalties]). logits: [vocab_size]; returns [vocab_size]."""
    return apply_penalties(apply_logit_bias(logits, params), params, prompt_ids=prompt_ids, output_ids=output_ids)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, *, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """The penalised logits of one position ([Note: logprobs and penalties]); a new tensor.

    logits: [vocab_size] float; prompt_ids: the sequence's prompt; output_ids: every token generated
    before this position. Returns [vocab_size] float32 (`logits` itself when no penalty is set).
    """
    if not params.has_penalties:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt_ids, *output_ids], dtype=torch.int64)] = True
        r = params.repetition_penalty
        top = torch.finfo(out.dtype).max  # a tiny r (1e-40) must not make a logit inf: no row could be sampled
        out = torch.where(seen, torch.where(out > 0, (out / r).clamp(max=top), out * r), out)
    if output_ids and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab)[:vocab].float()
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return out


def prompt_rank(logp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """vLLM's rank of a token: how many vocabulary entries have a logprob >= its own (itself included), so 1 for
    the most likely token and 1 + (entries strictly more likely) when no other entry ties with it (vLLM v1,
    vllm/v1/sample/ops/logprobs.py `batched_count_greater_than`, `(x >= values).sum(-1)`; v0's `_get_ranks`
    counted only the strictly larger ones, plus one: the two differ on exact ties alone).
    logp: [P, vocab]; chosen: [P], the token's logprob in each row. Returns [P] int64."""
    return (logp >= chosen[:, None]).sum(-1)


def reduce_prompt_rows(logits: torch.Tensor, next_ids: torch.Tensor, k: int = MAX_LOGPROBS, chunk_rows: int = 256
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last stage's half of prompt logprobs (OpenAI `echo`, vLLM's `prompt_logprobs`): per prompt row,
    the log-probability and rank of the prompt token that follows it and the k most likely tokens. A RESULT
    then carries 2k + 2 numbers per prompt row instead of a vocab-size row of logits (196 KiB for the default
    model), so a long prompt fits the data plane's message limit (as vLLM computes logprobs in its workers).

    logits: [P, vocab] raw final logits of prompt rows 0 .. P-1; next_ids: [P] int64, the prompt
    token after each row. Returns (chosen [P] float32, top_ids [P, k'] int64, top_logprobs [P, k']
    float32, rank [P] int64 (`prompt_rank`)), k' = min(k, vocab), most likely first, ties by lower token id
    (as `token_logprob`). Works on `chunk_rows` rows at a time, so it needs little memory beyond `logits`.
    """
    k = min(k, logits.shape[-1])
    chosen, top_ids, top_lp, ranks = [], [], [], []
    for lo in range(0, logits.shape[0], chunk_rows):
        logp = torch.log_softmax(logits[lo:lo + chunk_rows].float(), dim=-1)
        chosen.append(logp.gather(1, next_ids[lo:lo + chunk_rows, None].to(logp.device)).squeeze(1))
        ranks.append(prompt_rank(logp, chosen[-1]))
        values, ids = stable_top(logp, k)
        tied = ((logp >= values[:, -1:]).sum(-1) > k).nonzero().flatten()  # a tie across the k-th place
        if len(tied):
            values[tied], ids[tied] = (t[:, :k] for t in torch.sort(logp[tied], dim=-1, descending=True, stable=True))
        top_ids.append(ids)
        top_lp.append(values)
    if not chosen:
        return torch.zeros(0), torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k), torch.zeros(0, dtype=torch.int64)
    return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_lp), torch.cat(ranks)


def prompt_token_logprobs(prompt_ids: Sequence[int], reduced: Sequence[torch.Tensor] | None,
                          k: int) -> tuple[TokenLogprob | None, ...]:
    """Logprob and rank of each prompt token given the ones before it (None for the first), with `k`
    alternatives (echo's / vLLM's prompt logprobs), from `reduce_prompt_rows` of prompt rows 0 .. n-2:
    reduced = (chosen [n-1], top_ids [n-1, >= k], top_logprobs [n-1, >= k], rank [n-1]); None for n = 1."""
    if reduced is None:
        return (None,)
    chosen, ids, values = reduced[0].tolist(), reduced[1][:, :k].tolist(), reduced[2][:, :k].tolist()
    ranks = reduced[3].tolist()
    return (None, *(TokenLogprob(t, chosen[j], tuple(zip(ids[j], values[j], strict=True)), ranks[j])
                    for j, t in enumerate(prompt_ids[1:])))
