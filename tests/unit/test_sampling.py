"""Tests of `pipeline.speculation.sampling`: parameter validation, greedy / temperature / top-p sampling, and the
speculative accept rule `verify_draft`, whose output must be distributed exactly as the target p
(checked with a chi-square goodness-of-fit test over fixed-seed draws).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.speculation.sampling import Sampler, SamplingParamError, SamplingParams, verify_draft
from pipeline.speculation.verify import verify_result

# Hand-built target p and draft q on a vocab of 8: q is above p on some tokens and below on others,
# so both branches of the rule (certain accept, probabilistic accept + residual resample) are used.
P_TARGET = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
Q_DRAFT = torch.tensor([0.05, 0.25, 0.10, 0.20, 0.05, 0.15, 0.10, 0.10])
NUM_DRAWS = 20_000
# Chi-square critical value for df = 8 - 1 = 7, alpha = 0.001 (upper tail): chi2.ppf(0.999, 7) = 24.322.
# test_chi_square_critical_value_matches_its_alpha recomputes the tail with torch.special.gammaincc.
CHI2_DF = 7
CHI2_ALPHA = 0.001
CHI2_CRITICAL = 24.322


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic sum (observed - expected)^2 / expected, for counts: [vocab] against p: [vocab]."""
    expected = p.double() * counts.sum().double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _chi_square_tail(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def _assert_distributed_as(tokens: list[int], p: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=p.numel())
    stat = _chi_square(counts, p)
    assert stat < CHI2_CRITICAL, (
        f"token counts {counts.tolist()} do not fit p {p.tolist()}: chi2 = {stat:.1f} >= {CHI2_CRITICAL} "
        f"(df {CHI2_DF}, alpha {CHI2_ALPHA}, p-value {_chi_square_tail(stat, CHI2_DF):.2e})"
    )


# ---------------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be > 0, got 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be finite, got nan"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
        ({"top_k": -2}, "top_k must be an integer >= -1 (0 or -1: off), got -2"),
        ({"top_k": 2.0}, "top_k must be an integer >= -1 (0 or -1: off), got 2.0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": float("nan")}, "min_p must be in [0, 1], got nan"),
        ({"stop": ("ok", "")}, "stop must hold non-empty strings, got ''"),
        ({"stop": "\n"}, "stop must be a tuple of strings, got str '\\n'"),
    ],
)
def test_sampling_params_rejects_invalid_value_naming_parameter_value_and_limit(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_sampling_params_defaults_are_valid_greedy_and_keyword_only():
    params = SamplingParams()
    assert params.is_greedy
    assert (params.max_new_tokens, params.top_p, params.seed, params.stop) == (64, 1.0, None, ())
    assert not SamplingParams(temperature=0.7).is_greedy
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------


def test_greedy_sample_is_argmax_with_ties_to_lowest_index():
    sampler = Sampler(SamplingParams())
    logits = torch.tensor([0.1, 2.0, -1.0, 2.0, 0.5])
    assert sampler.sample(logits, 0) == 1
    assert sampler.probs(logits).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    for _ in range(5):
        logits = torch.randn(100)
        assert sampler.sample(logits, 0) == int(torch.argmax(logits))


def test_seeded_sampling_is_reproducible_and_different_seeds_differ():
    logits = torch.zeros(1000)  # uniform: two independent runs of 50 draws essentially never agree

    def run(seed: int | None) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(logits, i) for i in range(50)]

    assert run(1234) == run(1234)
    assert run(1234) != run(1235)
    assert run(None) != run(None)


def test_unseeded_sampler_reports_the_seed_that_reproduces_it():
    logits = torch.zeros(1000)
    first = Sampler(SamplingParams(temperature=1.0))
    tokens = [first.sample(logits, i) for i in range(20)]
    again = Sampler(SamplingParams(temperature=1.0, seed=first.seed))
    assert [again.sample(logits, i) for i in range(20)] == tokens


def test_top_p_keeps_smallest_set_reaching_top_p():
    # probabilities after softmax (temperature 1): 0.4, 0.3, 0.2, 0.1, in a shuffled vocab order.
    probs = torch.tensor([0.2, 0.4, 0.1, 0.3])
    logits = probs.log()

    def kept(top_p: float) -> list[int]:
        p = Sampler(SamplingParams(temperature=1.0, top_p=top_p)).probs(logits)
        assert abs(float(p.sum()) - 1.0) < 1e-6
        return torch.nonzero(p).flatten().tolist()

    assert kept(0.3) == [1]  # the top token alone reaches 0.3
    assert kept(0.4) == [1]  # exactly reaching top_p is enough
    assert kept(0.5) == [1, 3]  # 0.4 < 0.5 <= 0.7
    assert kept(0.7) == [1, 3]
    assert kept(0.75) == [0, 1, 3]
    assert kept(0.95) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(1e-6) == [1]  # the top token is always kept
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.75)).probs(logits)
    torch.testing.assert_close(p, torch.tensor([0.2, 0.4, 0.0, 0.3]) / 0.9)


def test_top_p_sampling_never_draws_outside_the_nucleus():
    logits = torch.tensor([0.2, 0.4, 0.1, 0.3]).log()
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {sampler.sample(logits, i) for i in range(300)} == {1, 3}


def test_temperature_scales_logits_and_small_temperature_approaches_greedy():
    logits = torch.tensor([1.0, 3.0, 2.9, -2.0])
    hot = Sampler(SamplingParams(temperature=2.0)).probs(logits)
    torch.testing.assert_close(hot, torch.softmax(logits / 2.0, dim=-1))
    gaps = []
    for temperature in (1.0, 0.1, 0.01, 1e-4):
        p = Sampler(SamplingParams(temperature=temperature)).probs(logits)
        gaps.append(float((p - torch.tensor([0.0, 1.0, 0.0, 0.0])).abs().sum()))
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-6, gaps
    tiny = Sampler(SamplingParams(temperature=1e-40, seed=0))  # logits / 1e-40 would overflow to inf
    assert [tiny.sample(logits, i) for i in range(20)] == [1] * 20


def test_sample_draws_from_probs():
    logits = P_TARGET.log() * 2.0
    sampler = Sampler(SamplingParams(temperature=2.0, seed=7))
    p = sampler.probs(logits)
    torch.testing.assert_close(p, P_TARGET)
    _assert_distributed_as([sampler.sample(logits, i) for i in range(NUM_DRAWS)], p)


def test_a_draw_depends_on_the_seed_and_position_only():
    """[Note: position-keyed draws]: the token at a position does not depend on the draws before it."""
    logits = torch.zeros(1000)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    forward = [sampler.sample(logits, i) for i in range(30)]
    other = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [other.sample(logits, i) for i in reversed(range(30))] == forward[::-1]
    assert len(set(forward)) > 20  # positions are not one draw repeated
    with pytest.raises(ValueError, match="position must be >= 0"):
        sampler.sample(logits, -1)


def test_sampled_verify_of_a_deterministic_draft_commits_what_plain_sampling_commits():
    """With q None the verified token is the plain sample at that position, whatever the draft, so
    seeded output with speculation is token-identical to seeded output without it."""
    logits = P_TARGET.log()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    for position in range(200):
        plain = sampler.sample(logits, position)
        for draft in range(8):
            assert sampler.verify(logits, draft, position) == (draft == plain, plain)


def test_verify_result_commits_the_plain_samples_whatever_the_drafts():
    """A sampled sequence's result rows commit the tokens plain decoding samples at their positions
    (the committed output before them sets the positions), as far as the drafts were right."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    plain = [sampler.sample(logits[i], 5 + i) for i in range(4)]
    shifted = [sampler.sample(logits[i], 6 + i) for i in range(4)]
    assert plain != shifted  # the position matters

    def verify(drafts):
        return verify_result(argmax=logits.argmax(-1).tolist(), drafts=drafts, logits=logits, sampler=sampler,
                             eos_token_ids=(), ignore_eos=False, budget_left=10, output_ids=[1] * 5)

    assert verify(plain[:3]) == plain
    assert verify([(plain[0] + 1) % 50, *plain[1:3]]) == plain[:1]
    assert verify([plain[0], (plain[1] + 1) % 50, plain[2]]) == plain[:2]


@pytest.mark.parametrize("draft_token", [0, 7], ids=["likely-draft", "unlikely-draft"])
def test_position_keyed_verify_accepts_with_p_x_and_outputs_exactly_p(draft_token):
    """The standard rule's statistics for a one-hot q: acceptance p(x), output distributed as p."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=100 + draft_token))
    results = [sampler.verify(P_TARGET.log(), draft_token, i) for i in range(NUM_DRAWS)]
    _assert_distributed_as([token for _, token in results], P_TARGET)
    p_x = float(P_TARGET[draft_token])
    num_accepted = sum(accepted for accepted, _ in results)
    assert abs(num_accepted / NUM_DRAWS - p_x) < 5 * (p_x * (1 - p_x) / NUM_DRAWS) ** 0.5


# ---------------------------------------------------------------------------------------------------
# Speculative acceptance
# ---------------------------------------------------------------------------------------------------


def test_chi_square_critical_value_matches_its_alpha():
    assert abs(_chi_square_tail(CHI2_CRITICAL, CHI2_DF) - CHI2_ALPHA) < 1e-5


@pytest.mark.parametrize("draft_token", [0, 7], ids=["likely-draft", "unlikely-draft"])
@pytest.mark.parametrize("one_hot_as_tensor", [False, True], ids=["q=None", "q=one-hot"])
def test_verify_draft_with_deterministic_draft_outputs_exactly_p(draft_token, one_hot_as_tensor):
    q = torch.nn.functional.one_hot(torch.tensor(draft_token), 8).float() if one_hot_as_tensor else None
    generator = torch.Generator().manual_seed(100 + draft_token)
    tokens, num_accepted = [], 0
    for _ in range(NUM_DRAWS):
        accepted, token = verify_draft(P_TARGET, draft_token, q, generator)
        assert not accepted or token == draft_token
        num_accepted += accepted
        tokens.append(token)
    _assert_distributed_as(tokens, P_TARGET)
    # Acceptance rate is p(x); 5 standard deviations of a binomial proportion.
    p_x = float(P_TARGET[draft_token])
    assert abs(num_accepted / NUM_DRAWS - p_x) < 5 * (p_x * (1 - p_x) / NUM_DRAWS) ** 0.5


def test_verify_draft_with_random_draft_distribution_outputs_exactly_p():
    generator = torch.Generator().manual_seed(2024)
    drafts = torch.multinomial(Q_DRAFT, NUM_DRAWS, replacement=True, generator=generator).tolist()
    tokens, num_accepted = [], 0
    for draft_token in drafts:
        accepted, token = verify_draft(P_TARGET, draft_token, Q_DRAFT, generator)
        assert not accepted or token == draft_token
        num_accepted += accepted
        tokens.append(token)
    _assert_distributed_as(tokens, P_TARGET)
    # Acceptance rate is sum_x min(p(x), q(x)) (Leviathan et al. 2023, §3.1 beta).
    beta = float(torch.minimum(P_TARGET, Q_DRAFT).sum())
    assert abs(num_accepted / NUM_DRAWS - beta) < 5 * (beta * (1 - beta) / NUM_DRAWS) ** 0.5


def test_verify_draft_degenerate_residual_samples_from_p():
    # p == q: max(0, p - q) is all zero. With p(x) = q(x) = 0 the draft is rejected, and the
    # replacement must come from p.
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    generator = torch.Generator().manual_seed(0)
    results = [verify_draft(p, 0, p.clone(), generator) for _ in range(200)]
    assert all(not accepted for accepted, _ in results)
    assert {token for _, token in results} == {1, 2}


def test_verify_draft_rejects_bad_shapes_and_tokens():
    with pytest.raises(ValueError, match=r"draft_token must be in \[0, 8\), got 8"):
        verify_draft(P_TARGET, 8, None, None)
    with pytest.raises(ValueError, match="p must be"):
        verify_draft(P_TARGET, 0, Q_DRAFT[:4], None)


def _distribution(size: int) -> st.SearchStrategy[torch.Tensor]:
    """Non-negative weights with at least one positive entry, normalised to sum 1, as float32."""
    weights = st.lists(st.floats(0.0, 1.0) | st.just(0.0), min_size=size, max_size=size)
    return (
        weights.filter(lambda w: sum(w) > 1e-6)
        .map(lambda w: torch.tensor(w, dtype=torch.float32))
        .map(lambda t: t / t.sum())
    )


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    size=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    deterministic=st.booleans(),
)
def test_verify_draft_never_returns_a_token_with_zero_target_probability(data, size, seed, deterministic):
    p = data.draw(_distribution(size), label="p")
    q = None if deterministic else data.draw(_distribution(size), label="q")
    draft_token = data.draw(st.integers(0, size - 1), label="draft_token")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(5):
        accepted, token = verify_draft(p, draft_token, q, generator)
        assert float(p[token]) > 0, (accepted, token)


def test_a_residual_of_only_subnormal_weights_never_resamples_a_token_of_probability_zero():
    """Found by the property test above: p - q left one weight of 1.4e-45 (float32's smallest
    subnormal), and torch.multinomial drew token 0, of weight 0, about half the time."""
    p = torch.tensor([0.0, 0.0, 1.4013e-45, 0.0, 0.0, 1.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    assert {verify_draft(p, 0, q, generator) for _ in range(50)} == {(False, 2)}


# ---------------------------------------------------------------------------------------------------
# Sampler.verify
# ---------------------------------------------------------------------------------------------------


def test_greedy_verify_accepts_only_the_argmax_and_always_returns_it():
    sampler = Sampler(SamplingParams())
    logits = torch.tensor([0.0, 5.0, 4.9, 1.0])
    assert sampler.verify(logits, 1, 0) == (True, 1)
    assert sampler.verify(logits, 2, 0) == (False, 1)
    assert sampler.verify(logits, 2, 0, q=torch.tensor([0.0, 0.0, 1.0, 0.0])) == (False, 1)


def test_sampled_verify_is_seeded_and_respects_top_p():
    logits = torch.tensor([0.2, 0.4, 0.1, 0.3]).log()
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=3)

    def run() -> list[tuple[bool, int]]:
        sampler = Sampler(params)
        return [sampler.verify(logits, draft, i) for i, draft in enumerate((0, 1, 2, 3) * 50)]

    results = run()
    assert results == run()
    # Drafts outside the nucleus (0, 2) have p = 0 and are never accepted; the output stays in {1, 3}.
    assert all(
        not accepted
        for (accepted, _), draft in zip(results, (0, 1, 2, 3) * 50, strict=True)
        if draft in (0, 2)
    )
    assert {token for _, token in results} == {1, 3}
    assert any(accepted for accepted, _ in results)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_non_finite_row_counts_only_where_plain_decoding_reads_it(sampled):
    """[Note: non-finite logits]: the first row verify needs that is non-finite ends the result with
    NON_FINITE_TOKEN after the tokens accepted before it; one after a rejected draft is never read
    (and a NaN row never reaches the sampler, which would raise)."""
    from pipeline.speculation.verify import NON_FINITE_TOKEN as NF

    logits = torch.full((4, 8), -30.0)
    for i, hot in enumerate([5, 6, 7, 1]):  # row i all but certainly gives `hot`, sampled or greedy
        logits[i, hot] = 30.0
    logits[2] = float("nan")
    params = SamplingParams(max_new_tokens=9, temperature=0.7 if sampled else 0.0, seed=3)
    kwargs = dict(argmax=[5, 6, NF, 1], logits=logits if sampled else None,
                  sampler=Sampler(params) if sampled else None, eos_token_ids=(), ignore_eos=False, budget_left=9)
    assert verify_result(drafts=[5, 6, 7], **kwargs) == [5, 6, NF]  # drafts 5, 6 accepted: row 2 is read
    assert verify_result(drafts=[5, 4, 7], **kwargs) == [5, 6]  # draft 4 rejected at row 1
    assert verify_result(drafts=[2, 6, 7], **kwargs) == [5]


@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"max_new_tokens": 1.5}, {"temperature": -1.0}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_k": -2}, {"min_p": 1.5}, {"seed": -1}, {"seed": "1"}, {"stop": ["x"]}, {"stop": ("",)},
    {"logprobs": 21}, {"prompt_logprobs": -1}, {"presence_penalty": 3.0}, {"frequency_penalty": -3.0},
    {"repetition_penalty": 0.0},
])
def test_every_invalid_setting_names_its_field_as_an_attribute(bad):
    """Front ends map the error to their field names (gRPC's BadRequest) from `param`, not by parsing
    the message; the message still starts with the field's name."""
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**bad)
    [field] = bad
    assert info.value.param == field and str(info.value).startswith(f"{field} must "), info.value
