"""Logprobs and penalties in the scheduler, plain and under speculation (fake in-process pipeline).

What breaks when these fail: a draft's verify uses another distribution than plain decoding at the
same position (penalty counts that miss the drafts accepted earlier in the same result, or logprobs
of the wrong row), so logprobs or penalised tokens change with `--speculate`; the penalty formulas
drift from vLLM's / OpenAI's definitions; bad penalty / logprob values are accepted.
The pipeline is tests/unit/test_speculation_scheduler.py's FakePipeline (S lock-step stages, the real
engine, scheduler and StageExecutor.admit), whose last stage returns `fake_logits(prefix)`.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.wire import forward_tensors
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.logprobs import (
    apply_penalties,
    prompt_token_logprobs,
    reduce_prompt_rows,
    token_logprob,
)
from pipeline.speculation.sampling import Sampler, SamplingParams
from pipeline.speculation.verify import verify_result
from tests.unit.test_speculation_scheduler import (
    MAX_MODEL_LEN,
    SAMPLING_VOCAB,
    FakePipeline,
    MostlyArgmaxPredictor,
    _submits,
    fake_argmax,
    fake_logits,
)

PROMPTS = [[1, 2, 3], [4, 4], [5]]


def _reference_penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The penalties written out per token (vLLM's apply_penalties / OpenAI's formula), as the oracle."""
    x = logits.clone().tolist()
    for t in set(prompt) | set(out):
        r = params.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
    return torch.tensor(x)


def _reference(prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], list[list[int]]]:
    """Plain greedy decoding of the fake model with penalties: tokens, their raw logprobs, top ids."""
    out, logps, tops = [], [], []
    for _ in range(params.max_new_tokens):
        logits = fake_logits(prompt + out)
        token = int(torch.argmax(_reference_penalised(logits, params, prompt, out)))
        logp = torch.log_softmax(logits, dim=-1)
        logps.append(float(logp[token]))
        tops.append(torch.sort(logp, descending=True, stable=True).indices[:params.logprobs].tolist())
        out.append(token)
    return out, logps, tops


def _run(params: SamplingParams, *, num_stages: int, speculate: bool, seed: int = 0):
    """(tokens per seq, commits' logprobs per seq, speculation counters) through the fake pipeline."""
    logprobs: dict[int, list] = {i: [] for i in range(len(PROMPTS))}

    def sink(commit) -> bool:
        assert commit.logprobs is not None and len(commit.logprobs) == len(commit.token_ids)
        logprobs[commit.seq_id].extend(commit.logprobs)
        return False

    config = SchedulerConfig(num_stages=num_stages, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, speculate=speculate)
    engine = Engine(config, MostlyArgmaxPredictor(seed) if speculate else None, commit_sink=sink)
    fake = FakePipeline(engine, _submits(PROMPTS, params), next_fn=fake_argmax, logits_fn=fake_logits)
    outputs = fake.run()
    return [outputs[i] for i in range(len(PROMPTS))], [logprobs[i] for i in range(len(PROMPTS))], engine.spec


PENALTIES = [dict(), dict(presence_penalty=0.7), dict(frequency_penalty=0.4), dict(repetition_penalty=1.6),
             dict(presence_penalty=-0.3, frequency_penalty=0.5, repetition_penalty=0.8)]


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(p) or "none")
@pytest.mark.parametrize("num_stages", [1, 4])
def test_greedy_logprobs_and_penalties_match_plain_decoding_with_and_without_speculation(num_stages, penalties):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3, **penalties)
    plain, plain_lp, _ = _run(params, num_stages=num_stages, speculate=False)
    spec, spec_lp, counters = _run(params, num_stages=num_stages, speculate=True)
    for i, prompt in enumerate(PROMPTS):
        tokens, logps, tops = _reference(prompt, params)
        assert plain[i] == tokens and spec[i] == tokens, f"seq {i}: penalised greedy tokens differ"
        for name, got in (("plain", plain_lp[i]), ("speculative", spec_lp[i])):
            assert [e.token_id for e in got] == tokens
            assert [e.logprob for e in got] == pytest.approx(logps, abs=1e-6), f"{name} logprobs of seq {i}"
            assert [[t for t, _ in e.top] for e in got] == tops, f"{name} top logprobs of seq {i}"
    if num_stages > 1:
        assert counters.verified_drafts > 0 and counters.accepted_tokens > 0, "speculation never verified a draft"


def test_penalties_change_greedy_output_of_a_repetitive_model():
    base = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)
    penalised = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0, frequency_penalty=2.0)
    assert _run(base, num_stages=1, speculate=False)[0] != _run(penalised, num_stages=1, speculate=False)[0]


def test_apply_penalties_matches_the_per_token_formula():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    got = apply_penalties(logits, params, prompt_ids=[0, 4], output_ids=[3, 3, 1])
    assert got.tolist() == pytest.approx(_reference_penalised(logits, params, [0, 4], [3, 3, 1]).tolist())
    assert apply_penalties(logits, SamplingParams(), prompt_ids=[0], output_ids=[1]) is logits



def test_a_tiny_repetition_penalty_keeps_the_logits_finite_and_the_engine_running():
    """r = 1e-40 is inside (0, 2] (HTTP accepts it), but a positive logit / r is past float32's range:
    once +inf, so the sampler raised ValueError out of the engine's step."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0, repetition_penalty=1e-40, seed=1, ignore_eos=True,
                            logprobs=0)
    got = apply_penalties(torch.tensor([2.0, -1.0, 0.5]), params, prompt_ids=[0, 1], output_ids=[])
    assert torch.isfinite(got).all() and int(torch.argmax(got)) == 0
    tokens = _run(params, num_stages=1, speculate=False)[0]
    assert [len(t) for t in tokens] == [4] * len(PROMPTS)

def test_token_logprob_is_log_softmax_with_sorted_alternatives():
    logits = torch.randn(SAMPLING_VOCAB, generator=torch.Generator().manual_seed(0))
    entry = token_logprob(logits, 2, 3)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert entry.logprob == pytest.approx(float(ref[2]), abs=1e-6)
    assert [t for t, _ in entry.top] == torch.argsort(ref, descending=True)[:3].tolist()


@pytest.mark.parametrize(("field", "value"), [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                              ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
                                              ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 99)])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_chain_verify_penalises_each_row_with_the_drafts_accepted_before_it():
    # Two result rows of one FIRP chain: row 0 verifies draft 3 (its argmax), row 1's raw argmax is 3
    # again, but plain decoding would have 3 in the history there, so the penalty makes it 4.
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0, 4.0, 0.0]])
    params = SamplingParams(frequency_penalty=2.0, max_new_tokens=8)
    tokens = verify_result(argmax=[3, 3], drafts=[3, 3], logits=logits, sampler=Sampler(params), eos_token_ids=(),
                           ignore_eos=True, budget_left=8, prompt_ids=[1], output_ids=[0])
    assert tokens == [3, 4]


def test_only_requests_that_need_them_ask_the_last_stage_for_logits():
    assert not SamplingParams().needs_logits_at(0)  # greedy without logprobs or penalties: argmax ids only
    for kw in (dict(temperature=0.7), dict(logprobs=0), dict(presence_penalty=0.1), dict(repetition_penalty=1.1)):
        assert SamplingParams(**kw).needs_logits_at(0), kw
    with pytest.raises(ValueError, match="want_prompt_logits"):
        Item(seq_id=0, slot=0, start=3, num_tokens=1, kind=ItemKind.DECODE, want_logits=True, want_prompt_logits=True)
    prefill = Item(seq_id=0, slot=0, start=0, num_tokens=5, kind=ItemKind.PREFILL, want_logits=True,
                   want_prompt_logits=True)
    assert (prefill.num_logit_rows, prefill.num_result_rows) == (5, 1)


# ---------------------------------------------------------------------------------------------------
# Prompt logprobs (the last stage's reduction)
# ---------------------------------------------------------------------------------------------------


def test_reduced_prompt_rows_give_what_token_logprob_gives_on_the_full_rows():
    """reduce_prompt_rows (last stage) + prompt_token_logprobs (coordinator) == token_logprob on
    the full logits, including tied logits (lower id first) and chunks smaller than the rows."""
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(4))
    logits[2, [3, 9, 17]] = 5.0  # a three-way tie at the top
    prompt = [1, 4, 9, 0, 17, 3, 29, 8]
    reduced = reduce_prompt_rows(logits, torch.tensor(prompt[1:]), chunk_rows=3)
    got = prompt_token_logprobs(prompt, reduced, k=5)
    assert got[0] is None and len(got) == len(prompt)
    for j, entry in enumerate(got[1:]):
        want = token_logprob(logits[j], prompt[j + 1], 5)
        assert entry.token_id == want.token_id and entry.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [t for t, _ in entry.top] == [t for t, _ in want.top]
        assert [v for _, v in entry.top] == pytest.approx([v for _, v in want.top], abs=1e-6)
    assert [t for t, _ in got[3].top[:3]] == [3, 9, 17]
    chosen, ids, values, ranks = reduce_prompt_rows(logits[:2, :4], torch.tensor([0, 1]))  # k above the vocab
    assert ids.shape == values.shape == (2, 4) and chosen.shape == ranks.shape == (2,)


def test_prompt_ranks_are_vllms_count_of_entries_at_least_as_likely():
    """Each prompt token's rank (vLLM's prompt_logprobs `rank`): 1 for the most likely token, and the number of
    vocabulary entries whose logprob is >= its own otherwise (vLLM v1's `batched_count_greater_than`), counted
    here one entry at a time in Python, with ties at, above and below the token and chunks smaller than the rows."""
    logits = torch.round(torch.randn(9, 50, generator=torch.Generator().manual_seed(7)) * 2) / 2  # many ties
    prompt = [0, 3, 49, 7, 7, 21, 0, 11, 30, 2]
    logits[0, 3] = logits[0].max() + 1  # the next token is the most likely: rank 1
    logits[1, [49, 5]] = logits[1].max() + 1  # tied for the top with a lower id: both count, rank 2
    reduced = reduce_prompt_rows(logits, torch.tensor(prompt[1:]), chunk_rows=4)
    got = prompt_token_logprobs(prompt, reduced, k=3)
    for j, entry in enumerate(got[1:]):
        values = torch.log_softmax(logits[j], dim=-1).tolist()
        mine = values[prompt[j + 1]]
        assert entry.rank == sum(1 for v in values if v >= mine), j
    assert (got[1].rank, got[2].rank) == (1, 2)
    assert all(e.rank > 3 for e in got[1:] if e.token_id not in [t for t, _ in e.top]), "rank beyond the top k"


def test_prompt_alternatives_tied_across_the_kth_place_follow_the_stable_order():
    """bf16 or quantised logits tie often: the top-k must be the full stable sort's (lower id first),
    also where the tie group straddles the k-th place, as token_logprob reports generated tokens."""
    logits = torch.round(torch.randn(40, 3000, generator=torch.Generator().manual_seed(1)) * 4) / 4
    next_ids = torch.arange(40)
    _, ids, values, _ = reduce_prompt_rows(logits, next_ids, k=20)
    for j in range(40):
        want = token_logprob(logits[j], j, 20)
        assert ids[j].tolist() == [t for t, _ in want.top], j
        assert values[j].tolist() == pytest.approx([v for _, v in want.top], abs=1e-6)


def test_a_one_token_prompt_echoes_with_its_one_none_entry():
    """A one-token prompt has no prompt row (nothing before its token): its echo logprobs are
    (None,), not missing (the reduction made them disappear once)."""
    for prompt in ([5], [5, 6, 7]):
        engine = Engine(SchedulerConfig(num_stages=1, max_num_seqs=4, max_model_len=MAX_MODEL_LEN))
        submit = Submit(seq_id=0, prompt_ids=tuple(prompt), params=SamplingParams(max_new_tokens=2, prompt_logprobs=2))
        [batch] = engine.step([submit]).sends
        tensors, logits = forward_tensors(batch), torch.randn(len(prompt), 64)
        reduced = tuple(reduce_prompt_rows(logits[:-1], tensors["prompt_next"])) if len(prompt) > 1 else None
        result = Result(items=(batch[0].without_tokens(),), token_ids=torch.tensor([9]), logits=logits[-1:],
                        prompt_logprobs=reduced)
        [commit] = engine.step([result]).commits
        assert len(commit.prompt_logprobs) == len(prompt) and commit.prompt_logprobs[0] is None
