"""Tests of the sampling filters of `pipeline.speculation.sampling.Sampler.probs` (min-p, top-k,
top-p in vLLM's order) and of the inverse-CDF draw: each filter against its definition, the fast
top-p path against a full stable sort (ties, boundaries, large nuclei), NaN logits refused, and
every setting the API accepts (down to 5e-324) drawing a token from finite logits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.speculation.sampling import Sampler, SamplingParams
from tests.unit.test_sampling import P_TARGET


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    logits = P_TARGET.log()  # temperature 1: probs are P_TARGET, top 0.30
    p = Sampler(SamplingParams(temperature=1.0, min_p=0.5)).probs(logits)  # keep p >= 0.15
    kept = P_TARGET[:3] / P_TARGET[:3].sum()
    torch.testing.assert_close(p, torch.cat([kept, torch.zeros(5)]))
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, min_p=0.0)).probs(logits) > 0, P_TARGET > 0)


@pytest.mark.parametrize("top_k", [0, -1, 8, 100])
def test_top_k_off_keeps_every_token(top_k):
    p = Sampler(SamplingParams(temperature=1.0, top_k=top_k)).probs(P_TARGET.log())
    torch.testing.assert_close(p, P_TARGET)


def test_top_k_keeps_the_k_most_likely_and_ties_at_the_kth():
    p = Sampler(SamplingParams(temperature=1.0, top_k=2)).probs(P_TARGET.log())
    torch.testing.assert_close(p, torch.tensor([0.6, 0.4, 0, 0, 0, 0, 0, 0]))
    tied = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).log()
    p = Sampler(SamplingParams(temperature=1.0, top_k=2)).probs(tied)
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))


def test_filters_apply_in_vllm_order_min_p_then_top_k_then_top_p():
    # min_p 0.3 keeps 0.30, 0.20, 0.15, 0.12, 0.10 (>= 0.09); top_k 4 drops 0.10; top_p 0.6 over
    # the renormalised 0.30/0.77, 0.20/0.77, ... keeps the first two (0.39 + 0.26 >= 0.6).
    params = SamplingParams(temperature=1.0, min_p=0.3, top_k=4, top_p=0.6)
    p = Sampler(params).probs(P_TARGET.log())
    torch.testing.assert_close(p, torch.tensor([0.6, 0.4, 0, 0, 0, 0, 0, 0]))


@pytest.mark.parametrize("vocab", [10, 64, 100, 2000, 49152])
def test_top_p_keeps_what_a_full_stable_sort_keeps(vocab):
    """The partial sort (top 64, then 1024) keeps exactly the prefix a full stable sort keeps,
    including ties at the boundary (lower index first) and nuclei larger than 1024 tokens."""
    from pipeline.speculation.sampling import _top_p_filter

    def full_sort(p, top_p):
        values, order = torch.sort(p, descending=True, stable=True)
        keep = torch.zeros(p.shape, dtype=torch.bool)
        keep[order[torch.cumsum(values, -1) - values < top_p]] = True
        return keep

    g = torch.Generator().manual_seed(vocab)
    for trial in range(24):
        p = torch.softmax(torch.randn(vocab, generator=g) * (0.5, 3.0, 10.0)[trial % 3], -1)
        if trial % 4 == 0:  # coarse probabilities: many ties
            p = torch.round(p * 40) + 1.0
            p = p / p.sum()
        top_p = (0.1, 0.5, 0.9, 0.99)[trial % 4]
        kept = _top_p_filter(p, top_p)
        assert torch.equal(kept > 0, full_sort(p, top_p)), (trial, top_p)
        torch.testing.assert_close(kept.sum(), torch.tensor(1.0))


def test_top_p_at_the_mass_of_the_first_64_tokens_keeps_what_a_full_sort_keeps():
    """The fast path must not decide on a float32 sum in another order than the cumulative mass:
    top_p set exactly at the mass of the 64 (and 65) most likely tokens."""
    from pipeline.speculation.sampling import _top_p_filter

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        p = torch.softmax(torch.randn(5000, generator=g) * (1 + trial % 7), -1)
        values, order = torch.sort(p, descending=True, stable=True)
        mass = torch.cumsum(values, 0)
        for top_p in (float(torch.topk(p, 64).values.sum()), float(mass[63]), float(mass[64] - values[64])):
            if not 0 < top_p < 1:
                continue
            keep = torch.zeros(p.shape, dtype=torch.bool)
            keep[order[mass - values < top_p]] = True
            assert torch.equal(_top_p_filter(p, top_p) > 0, keep), (trial, top_p)


def test_sampling_refuses_nan_logits_and_never_draws_past_the_last_positive_token():
    from pipeline.speculation.sampling import _inverse_cdf

    logits = torch.zeros(100)
    logits[7] = float("nan")
    for params in (SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=1)):
        with pytest.raises(ValueError, match="cannot sample"):
            Sampler(params).sample(logits, 0)
    p = torch.tensor([0.25, 0.5, 0.25, 0.0, 0.0])
    assert [_inverse_cdf(p, u) for u in (0.0, 0.2499, 0.25, 0.75, 1.0 - 2**-53)] == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_value_below_float32s_range_samples_the_top_token(field):
    """1e-320 is a positive double the API accepts, but 0 in float32: temperature made 0 / 0 = NaN, and
    top_p kept no token, so `sample` raised ValueError (out of the engine's step, failing the pipeline)."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    sampler = Sampler(SamplingParams(**{"temperature": 1.0, field: 1e-320}, seed=3))
    assert sampler.probs(logits).tolist() == [0.0, 1.0, 0.0, 0.0] and sampler.sample(logits, 0) == 1


@settings(max_examples=300, deadline=None, derandomize=True)
@given(temperature=st.one_of(st.floats(0, 2), st.sampled_from([5e-324, 1e-320, 1e-40])),
       top_p=st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-320, 1e-40])),
       min_p=st.floats(0, 1), top_k=st.integers(-1, 40), scale=st.sampled_from([1.0, 1e4, 1e30]),
       seed=st.integers(0, 2**63 - 1))
def test_every_setting_the_api_accepts_samples_a_token_of_finite_logits(temperature, top_p, min_p, top_k, scale, seed):
    """Any SamplingParams in the HTTP / gRPC ranges draws a token from any finite logits row."""
    logits = torch.randn(32, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed))
    p = sampler.probs(logits)
    assert bool(torch.isfinite(p).all()) and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
    assert p[sampler.sample(logits, 0)] > 0
