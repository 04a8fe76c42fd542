"""Speculation under load in the discrete-event simulator: `SimConfig.speculative_disable_by_batch_size`.

What breaks when these fail: the simulator speculates at any load while `launch` pauses from
stages + 1 running sequences (`--speculative-disable-by-batch-size`), so its projection of several
streams is not the runtime's; its `spec_disabled_steps` does not count the paused micro-batches as
`launch --json` does; or the limit pauses a single stream that the runtime lets speculate. See
[Note: speculation under load] in pipeline/engine/row_budget.py.
"""

from __future__ import annotations

import pytest

from pipeline.engine.row_budget import default_disable_by_batch_size
from pipeline.engine.simulator import Bernoulli, CostModel, SimConfig, Simulator

pytestmark = pytest.mark.timeout(60)


def _runs(num_stages: int, concurrency: int, limit: int | None, *, firp_k: int = 0):
    """(plain decode, speculating with `limit`) simulated runs of one configuration."""
    cost = CostModel.uniform(num_stages=num_stages, stage_s=1e-3, per_token_s=2e-4)
    cfg = dict(num_stages=num_stages, concurrency=concurrency, prompt_len=4, max_new_tokens=40)
    plain = Simulator(SimConfig(**cfg), cost).run()
    spec = Simulator(SimConfig(**cfg, speculate=True, firp_k=firp_k, firp_alpha=0.5,
                               speculative_disable_by_batch_size=limit),
                     cost, acceptance=Bernoulli(0.9, seed=0)).run()
    return plain, spec


def _batches(result) -> int:
    """Micro-batches the run sent (each ran once on stage 0)."""
    return sum(s.stage == 0 for s in result.timeline.slices)


@pytest.mark.parametrize(("num_stages", "concurrency", "limit", "firp_k"), [
    (4, 2, 2, 0),  # SPEED into the free slots of a pipeline that two streams do not fill
    (2, 3, default_disable_by_batch_size(2), 2),  # launch's auto default (3) with FIRP chains
])
def test_a_paused_multi_stream_run_projects_plain_decode_and_counts_its_steps(num_stages, concurrency, limit,
                                                                            firp_k):
    plain, spec = _runs(num_stages, concurrency, limit, firp_k=firp_k)
    unpaused = _runs(num_stages, concurrency, None, firp_k=firp_k)[1]
    assert unpaused.drafted > 0 and unpaused.tokens_per_s != plain.tokens_per_s, "the case must speculate unpaused"
    assert unpaused.spec_disabled_steps == 0
    first_done_ns = min(spec.e2e_s) * 1e9  # until then every stream runs: count >= limit, every step paused
    assert [c for c in spec.commits if c[0] < first_done_ns] == [c for c in plain.commits if c[0] < first_done_ns]
    assert spec.tokens_per_s == plain.tokens_per_s and spec.drafted == 0
    assert spec.spec_disabled_steps == _batches(spec) == _batches(plain) > 0  # every micro-batch sent


def test_a_single_stream_is_not_paused_by_the_default_limit():
    limit = default_disable_by_batch_size(4)
    assert limit == 5
    plain, spec = _runs(4, 1, limit)
    never = _runs(4, 1, None)[1]
    assert spec.spec_disabled_steps == 0 and spec.drafted > 0
    assert spec.commits == never.commits and spec.tokens_per_s == never.tokens_per_s > plain.tokens_per_s


def test_a_limit_of_one_pauses_even_a_single_stream():
    plain, spec = _runs(4, 1, 1)
    assert spec.commits == plain.commits and spec.spec_disabled_steps == 40 and spec.drafted == 0


@pytest.mark.parametrize("value", [0, -3])
def test_a_limit_below_one_is_refused_with_launchs_words(value):
    with pytest.raises(ValueError, match=rf"^speculative_disable_by_batch_size must be >= 1 .*got {value}$"):
        SimConfig(num_stages=2, speculate=True, speculative_disable_by_batch_size=value)
