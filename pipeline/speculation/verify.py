"""Verify: which tokens one result of the last stage commits. One pure function, read top to bottom.

Owns the verify rule of speculative decoding for one result (SPEED, arXiv 2310.12072 §3; FIRP
chains, arXiv 2410.20488 §3.3): each result row is checked against the draft that followed it.
Must not: touch the ledger, the scheduler or any I/O (pipeline/engine/scheduler.py applies the verdict,
pipeline/speculation/ledger.py keeps the chain). See [Note: verify] and [Note: chain verify] in pipeline/speculation/ledger.py.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pipeline.speculation.grammar import GrammarError, GrammarState
from pipeline.speculation.logprobs import processed_logits
from pipeline.speculation.masks.token_masks import apply_token_masks, ends_sequence, has_token_masks
from pipeline.speculation.sampling import Sampler, SamplingParams

# The last stage's token for a logits row holding NaN or inf ([Note: non-finite logits] in
# pipeline/engine/records.py).
NON_FINITE_TOKEN = -1


def verify_result(*, argmax: Sequence[int], drafts: Sequence[int], logits: torch.Tensor | None,
                  sampler: Sampler | None, eos_token_ids: Collection[int], ignore_eos: bool,
                  budget_left: int, prompt_ids: Sequence[int] = (),
                  output_ids: Sequence[int] = (), grammar: GrammarState | None = None) -> list[int]:
    """The tokens one result commits, in row order: the longest accepted prefix plus one real token.

    argmax: [num_result_rows] the last stage's argmax of each result row (row i is the model's
        next token after the item's i-th result position).
    drafts: the draft that followed each row (`SequenceLedger.drafts_to_verify()`: the item's own
        FIRP drafts, then the run-ahead draft after it); shorter than argmax when the last rows
        had none.
    logits: [num_result_rows, vocab_size] float32 when the sequence needs them
        (`SamplingParams.needs_logits_at` the first row's position: sampling, logit bias, penalties, logprobs,
        a grammar, or a token mask acting there), None otherwise.
    sampler: the sequence's sampler (its params and seed); used only with logits. Row i chooses the
        token at position len(output_ids) + i (the key of its random draw).
    prompt_ids / output_ids: the sequence's prompt and committed output before this result; row i
        is biased (`logit_bias`) and, with penalties, penalised with output_ids + the tokens this result committed before it,
        exactly the history plain decoding has at that position ([Note: logprobs and penalties] in
        pipeline/speculation/logprobs.py).
    eos_token_ids / ignore_eos: the tokenizer's EOS ids and the request's ignore_eos; with the request's
        `stop_token_ids` they end the sequence (`ends_sequence`); budget_left: tokens it may still commit (>= 1).
    Row i is also masked by the request's token masks (min_tokens, allowed_token_ids, bad_words: [Note: token
        masks] in pipeline/speculation/masks/token_masks.py) at that same history, before the grammar.
    grammar: the sequence's structured output state (`SamplingParams.grammar`; logits then given):
        row i is masked to the tokens it allows after output_ids + the tokens committed before it, after
        the bias and the penalties ([Note: grammar masks] in pipeline/speculation/grammar.py); it has
        consumed every committed token on return.
    Returns 1..num_result_rows tokens; every token but the last equals its draft. The last is
    NON_FINITE_TOKEN where a row it reads is not finite (rows after a rejected draft are never read).
    Raises GrammarError (its `tokens`: those committed before the failing row) when the grammar (or the
    token masks) allow no token (its `fields` name the request's fields: [Note: no token left]) or its
    matcher fails.
    """
    assert grammar is None or logits is not None, "a constrained sequence must ship its logits rows"
    out: list[int] = []
    stop_ids = sampler.params.stop_token_ids if sampler is not None else ()
    for i, top in enumerate(argmax):
        if top == NON_FINITE_TOKEN:
            out.append(NON_FINITE_TOKEN)
            break
        draft = drafts[i] if i < len(drafts) else None
        try:
            token = _row_token(top, draft, None if logits is None else logits[i], sampler, prompt_ids=prompt_ids,
                               history=[*output_ids, *out], grammar=grammar, eos_token_ids=eos_token_ids)
        except GrammarError as err:
            raise GrammarError(str(err), out, fields=err.fields) from None
        out.append(token)
        if ends_sequence(token, eos_token_ids=eos_token_ids, ignore_eos=ignore_eos, stop_token_ids=stop_ids):
            break  # never commit past EOS or a stop token id (§5.5)
        if len(out) >= budget_left:
            break  # nor past the token budget
        if draft is None or token != draft:
            break  # a rejected draft (or none): the rows after it saw a wrong context
    if grammar is not None and out[-1] != NON_FINITE_TOKEN:
        try:
            grammar.sync([*output_ids, *out])  # consume the last token too
        except GrammarError as err:
            raise GrammarError(str(err), out[:-1]) from None
    return out


# [Note: no token left]
# The token masks (allowed_token_ids, bad_words, min_tokens) and a grammar may together leave no token at a
# later position although they left some at the first (`check_leaves_a_token` refuses only what fails there):
# allowed_token_ids {a, b} with bad_words "b" and "aa" dead-end at output token 1. The request fails there with
# GrammarError naming the fields (`fields`), at the same position with and without speculation (each row is
# masked with the history plain decoding has, so a dead end is found at the same token), after committing the
# tokens before it; its slot is freed as for any finished sequence. The front ends answer it as bad input:
# vLLM's servers answer a ValueError raised while a request runs with a 400 (non-streamed:
# vllm/entrypoints/openai/serving_chat.py `create_chat_completion`, `except ValueError as e: return
# self.create_error_response(str(e))`) and, once streaming, an in-stream error event
# (`create_streaming_error_response`) before `data: [DONE]`; gRPC: INVALID_ARGUMENT (launcher/serving/).


def masking_fields(params: SamplingParams, *, history: Sequence[int], grammar_field: str | None) -> tuple[str, ...]:
    """The request's fields whose masks act at output position len(history): allowed_token_ids, bad_words,
    min_tokens (before min_tokens tokens), and `grammar_field` (the field that asked for the grammar,
    `GrammarSpec.field`; None: no grammar); the names of a dead end ([Note: no token left])."""
    named = [("allowed_token_ids", params.allowed_token_ids is not None), ("bad_words", bool(params.bad_word_ids)),
             ("min_tokens", len(history) < params.min_tokens), (grammar_field or "", grammar_field is not None)]
    return tuple(name for name, acts in named if acts)


def _row_token(top: int, draft: int | None, logits: torch.Tensor | None, sampler: Sampler | None, *,
               prompt_ids: Sequence[int], history: Sequence[int], grammar: GrammarState | None,
               eos_token_ids: Collection[int]) -> int:
    """The token one result row chooses: top is the row's raw argmax, draft the token that followed it
    (None: none), logits its [vocab_size] row (None: greedy on the raw argmax), history the output before
    it (its position is len(history)). Raises GrammarError from the grammar's mask, or when the token masks
    allow no token."""
    row = None
    if logits is not None:
        row = processed_logits(logits, sampler.params, prompt_ids=prompt_ids, output_ids=history)
        row = apply_token_masks(row, sampler.params, history=history, eos_token_ids=eos_token_ids)
        if grammar is not None:  # after the bias, the penalties and the token masks ([Note: grammar masks])
            row = grammar.masked(row, history)
        if has_token_masks(sampler.params) and not bool(torch.isfinite(row).any()):  # (only masks give -inf)
            fields = masking_fields(sampler.params, history=history,
                                    grammar_field=None if grammar is None else grammar.spec.field)
            raise GrammarError(f"{', '.join(fields)} {'leaves' if len(fields) == 1 else 'leave'} no token to generate "
                               f"at output token {len(history)} "
                               f"(every token is masked there)", (), fields=fields)
    if row is not None and sampler.params.is_greedy:
        # Greedy on the biased, penalised, masked logits (the raw argmax when none is set); a draft is
        # accepted iff it equals this token, as in the plain greedy case below.
        return int(torch.argmax(row)) if sampler.params.changes_logits_at(len(history)) else top
    if logits is None:
        # Greedy: the real token is the argmax; the draft is accepted iff it equals it. So
        # greedy output with speculation is token-identical to greedy output without it
        # (ARCHITECTURE.md §5.3), whatever the predictor proposes.
        return top
    if draft is None:
        # No draft followed this row: sample the real next token from p = softmax(logits / T).
        return sampler.sample(row, len(history))
    # Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192 §2.3; SPEED §3): our
    # predictors are deterministic (q one-hot at the draft x), so the draft is accepted
    # with probability p(x), else y ~ p without x is committed; the token is distributed
    # exactly as p (a draft the grammar forbids has p = 0). The draw is keyed by the token's position,
    # so it is the token plain decoding samples there ([Note: position-keyed draws] in
    # pipeline/speculation/sampling.py).
    return sampler.verify(row, draft, len(history))[1]
