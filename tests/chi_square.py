"""Chi-square homogeneity tests of two token samples, for the sampling-exactness tests.

Upper-tail critical values at alpha = 0.001 (chi2.ppf(0.999, df)), rechecked in the tests with
torch.special.gammaincc since scipy is not installed:
  df = 5: two samples over TOP_K tokens + "other", (2 - 1) * (TOP_K + 1 - 1);
  df = 1: a 2 x 2 table (a token emitted or not, in two samples).
"""

from __future__ import annotations

import collections

import torch

TOP_K = 5
CHI2_ALPHA = 0.001
CHI2_CRITICAL = {5: 20.515, 1: 10.828}


def chi_square(table: torch.Tensor) -> float:
    """Pearson chi-square of a contingency table (rows: samples), columns with no counts dropped."""
    table = table.double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    keep = expected.min(0).values > 0
    return float(((table - expected) ** 2 / expected)[:, keep].sum())


def top_k_counts(a: list[int], b: list[int]) -> tuple[torch.Tensor, list[int]]:
    """2 x (TOP_K + 1) counts of two samples over the TOP_K most common tokens of both plus "other"."""
    top = [t for t, _ in collections.Counter(a + b).most_common(TOP_K)]

    def counts(xs):
        c = collections.Counter(x if x in top else -1 for x in xs)
        return [c[t] for t in [*top, -1]]

    return torch.tensor([counts(a), counts(b)]), top


def upper_tail(stat: float, df: int) -> float:
    """P(chi2(df) >= stat)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
