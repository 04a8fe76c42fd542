"""tests/benchmarks/fp32_breakdown.py counts the GEMVs of a pass as the model runs them.

What breaks when these fail: the benchmark's "GEMVs alone" sum (README "Where the float32 pass
goes") leaves out or double counts a weight, or times a layout the mode does not use.
"""

from __future__ import annotations

import pytest

from tests.benchmarks import fp32_breakdown
from tests.benchmarks.row_cost import load_mode
from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fp32-breakdown") / "tiny", seed=3)


@pytest.mark.parametrize("mode", ["fp32", "fp32-fast"])
def test_every_linear_of_the_pass_is_counted_once_in_its_layout(tiny_dir, mode):
    model = load_mode(tiny_dir, mode)
    c = model.config
    counts = fp32_breakdown.gemv_counts(model)
    assert sum(counts.values()) == 4 * c.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    head = [key for key in counts if key[:2] == (c.hidden_size, c.vocab_size)]
    assert len(head) == 1 and counts[head[0]] >= 1
    for (k, n, transposed) in counts:  # `fast` stores exactly the wide weights transposed ([Note: dense layout])
        assert transposed == (mode == "fp32-fast" and n > k), (k, n, transposed)


def test_a_gemv_is_timed_over_copies_out_of_cache(monkeypatch):
    """The weights cycled through must exceed OUT_OF_CACHE_BYTES together (one cached copy would
    time a cache hit, not a stream from memory)."""
    monkeypatch.setattr(fp32_breakdown, "OUT_OF_CACHE_BYTES", 1e6)
    made = []
    real_randn = fp32_breakdown.torch.randn
    monkeypatch.setattr(fp32_breakdown.torch, "randn", lambda *shape: made.append(shape) or real_randn(*shape))
    for k, n, transposed in ((64, 256, True), (256, 64, False)):
        made.clear()
        assert fp32_breakdown.gemv_us(k, n, transposed=transposed) > 0
        weights = [s for s in made if s != (1, k)]
        assert len(weights) >= 2 and sum(a * b * 4 for a, b in weights) >= 1e6, weights
