"""Adaptive drafting: send a draft only when it is expected to pay for itself.

Owns the running acceptance estimate of every (predictor source, confidence bucket) and the
break-even acceptance below which a draft costs more than it saves. Pure: no I/O, no clock.

[Note: adaptive drafting]
A draft that is accepted saves the S − e stage-steps the real token would have waited for
(ARCHITECTURE.md §5: speed-up S / (α·e + (1−α)·S)); a rejected one costs r stage-steps: the real
token may wait behind the stale item, and the stale pass shares the machine with the real one.
Drafting a token with acceptance probability a pays when a·(S − e) > (1 − a)·r, i.e.
a > r / (S − e + r). r was about one stage-step in the first pipeline (untrained predictors at
α ≈ 0.15–0.35 ran 0.77–0.89× plain decode at --stages 2). Since in-band squashes, stale items that
no longer count as in flight and withdrawal, it is far smaller: on 2026-12-05 (Intel, --stages 2,
tests/benchmarks/results/speculation_intel_gate_*.json) sending every draft (α 0.31–0.85) beat the
1/S gate on all three held-out sets in float32, bfloat16 and `auto` (e.g. float32 code 1.37× against
1.28×). REJECTION_COST = 0.1 keeps the gate for predictors that are almost never right (break-even
0.09 at S = 2) and sends nearly every other draft.
That holds while every stage computes on its own device or cores, so a stale pass runs where the
pipeline would have idled. When the stages share fewer cores than there are stages (P stages can
compute at once, P < S: --stages 3 or 4 on this 2-CPU machine), a stale pass takes a core from a
real one, and a right draft can only fill the P − 1 idle cores: r ≈ 1 stage-step
(SHARED_REJECTION_COST) and the gain is P − e. Measured 2026-12-05 (float32, held-out chat /
speeches / code, tests/benchmarks/results/speculation_intel_gate_sweep_s{3,4}.json and, after
the change, ..._shared_s{3,4}.json): at --stages 4 the per-core price (break-even 0.03) ran
0.60 / 1.22 / 0.58× plain decode, the old 1/S (0.25) 0.79 / 1.42 / 0.95×, and this rule (0.5 at
P = 2) 0.99 / 1.41 / 1.03×; at --stages 3, 0.72 / 1.25 / 0.70× against 1.01 / 1.41 / 1.00×.
With P = 1 no draft can gain (break-even 1). The launcher counts P (launcher/backends/placement.py
`parallel_stages`).
Predictors report a confidence; how well it predicts acceptance differs per predictor and model,
so the gate learns it: drafts are grouped by (source, confidence bucket), each bucket keeps an
acceptance estimate (successes + prior · w) / (trials + w), and a draft is sent only when its
bucket's estimate reaches `min_acceptance`. The prior of a bucket is the predictor's own claim, the
bucket's mid-point confidence, but never below an optimistic floor of 0.6 (OPTIMISTIC_PRIOR), worth
w = 2 verdicts: a trained head that says 0.95 and is right 70 % of the time keeps its bucket open
through an early miss, and one that is always wrong closes it after 2 misses at break-even 0.5
(after 12–20 misses, prior 0.6–0.95, at the default 0.09, where a miss costs a tenth as much). (A
flat prior of 0.6 closed every bucket on its first miss at break-even 0.5, and a closed bucket is
only probed every 16th draft: that is what held a self-distilled drafter at α 0.08 over 12 of 92
drafts in a launch whose ungated α was 0.30, the same as its offline held-out acceptance.) The
floor keeps new low buckets tried: an n-gram match's confidence is its length over the longest
n-gram, not a probability, and short matches are often right (tests/distributed/test_serving_tiny.py
sends no draft at all without it). A refused bucket still gets every
`explore_every`-th draft, so its estimate can recover when the text changes (deterministic: no random numbers, so
runs are reproducible). Gating only decides whether to draft; committed tokens never change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipeline.speculation.items import Item
from pipeline.speculation.ledger import InFlight
from pipeline.speculation.predictors import Draft

OPTIMISTIC_PRIOR = 0.6  # the lowest prior acceptance of a new bucket (see the note)
REJECTION_COST = 0.1  # stage-steps a rejected draft costs, every stage on its own cores (see the note)
SHARED_REJECTION_COST = 1.0  # the same when the stages share fewer cores than there are stages (see the note)


@dataclasses.dataclass
class BucketStats:
    """Verified drafts of one (source, confidence bucket) and how many were accepted."""

    verified: int = 0
    accepted: int = 0
    refused_since_probe: int = 0


class DraftGate:
    """Decides per draft whether to send it; learns from verdicts. See [Note: adaptive drafting].

    min_acceptance: break-even acceptance in [0, 1] (0 = send every draft).
    num_buckets: confidence buckets over [0, 1]; prior_acceptance, prior_weight: the Beta-style
    prior each bucket starts from (prior_acceptance None, the default: the bucket's mid-point
    confidence or OPTIMISTIC_PRIOR, whichever is higher; a number: that value for every bucket).
    Raises ValueError for out-of-range arguments.
    """

    def __init__(self, *, min_acceptance: float, num_buckets: int = 10, prior_acceptance: float | None = None,
                 prior_weight: float = 2.0, explore_every: int = 16) -> None:
        if not 0.0 <= min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {min_acceptance}")
        if num_buckets < 1 or explore_every < 1 or prior_weight < 0 or not (
                prior_acceptance is None or 0 <= prior_acceptance <= 1):
            raise ValueError("draft gate: num_buckets, explore_every >= 1, prior_weight >= 0, prior in [0, 1]")
        self.min_acceptance = min_acceptance
        self.num_buckets = num_buckets
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.explore_every = explore_every
        self.buckets: dict[tuple[str, int], BucketStats] = {}
        self.num_refused = 0

    @staticmethod
    def break_even(num_stages: int, *, parallel_stages: int | None = None, draft_lag: float = 1.0,
                   rejection_cost: float | None = None) -> float:
        """Acceptance at which a draft neither gains nor loses: r / (G + r), in stage-steps.

        parallel_stages: how many stages can compute at the same time (None or >= num_stages: all,
        one device or core set each). With all of them the gain of a right draft is G = S − e and a
        rejected one costs REJECTION_COST; with P < S stages at once, G = P − e and
        SHARED_REJECTION_COST ([Note: adaptive drafting]). rejection_cost overrides r. Returns a
        value in [0, 1]; 1 when no draft can gain (G <= 0: one stage at a time)."""
        stages = num_stages if parallel_stages is None else max(1, min(num_stages, parallel_stages))
        shared = stages < num_stages
        if rejection_cost is None:
            rejection_cost = SHARED_REJECTION_COST if shared else REJECTION_COST
        gain = stages - draft_lag
        return rejection_cost / (gain + rejection_cost) if gain > 0 else 1.0

    def key(self, draft: Draft) -> tuple[str, int]:
        """The bucket of a draft: its source and its confidence bucket."""
        return draft.source, self.bucket(draft.confidence, self.num_buckets)

    @staticmethod
    def bucket(confidence: float, num_buckets: int) -> int:
        """The confidence bucket of a confidence (clipped to [0, 1]) among `num_buckets`."""
        conf = min(max(confidence, 0.0), 1.0)
        return min(int(conf * num_buckets), num_buckets - 1)

    def would_allow(self, key: tuple[str, int]) -> bool:
        """Whether `allow` would send a draft of bucket `key` now (counts nothing): the rule the
        exit stage applies to a draft it makes itself (pipeline/engine/local_draft.py)."""
        if self.min_acceptance <= 0.0 or self.estimate(key) >= self.min_acceptance:
            return True
        return self.buckets.get(key, BucketStats()).refused_since_probe + 1 >= self.explore_every

    def estimate(self, key: tuple[str, int]) -> float:
        """Current acceptance estimate of a bucket (the prior when it has no verdicts yet)."""
        b = self.buckets.get(key, BucketStats())
        if self.prior_acceptance is None:
            prior = max(OPTIMISTIC_PRIOR, (key[1] + 0.5) / self.num_buckets)
        else:
            prior = self.prior_acceptance
        return (b.accepted + prior * self.prior_weight) / (b.verified + self.prior_weight)

    def allow(self, draft: Draft) -> bool:
        """Whether to send `draft` (counts refusals; every explore_every-th refusal is sent)."""
        if self.min_acceptance <= 0.0:
            return True
        key = self.key(draft)
        if self.estimate(key) >= self.min_acceptance:
            return True
        stats = self.buckets.setdefault(key, BucketStats())
        stats.refused_since_probe += 1
        if stats.refused_since_probe >= self.explore_every:
            stats.refused_since_probe = 0
            return True
        self.num_refused += 1
        return False

    def record(self, key: tuple[str, int], *, accepted: bool) -> None:
        """A draft of bucket `key` was verified."""
        stats = self.buckets.setdefault(key, BucketStats())
        stats.verified += 1
        stats.accepted += int(accepted)

    def record_run_ahead(self, chain: Sequence[InFlight], item: Item, tokens: Sequence[int]) -> None:
        """Record whether the run-ahead draft that followed `item` (chain[1] of the sequence's
        in-flight chain, before the ledger applies the result) was right. The real token at
        position item.end is tokens[num_result_rows - 1] when the chain got that far; a draft
        behind a broken chain was never verified."""
        if len(chain) < 2 or chain[1].position != item.end or chain[1].gate_key is None:
            return
        i = item.num_result_rows - 1
        if i < len(tokens):
            self.record(chain[1].gate_key, accepted=tokens[i] == chain[1].token)
