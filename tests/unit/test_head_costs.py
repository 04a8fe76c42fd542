"""run_plan.head_costs on tiny random models ([Note: partition cost] in pipeline/model/partition.py):
the head priced by its bytes over an average decoder layer's linear bytes, a mixture-of-experts
layer's experts counted at num_experts_per_tok / num_experts (a decode row runs that many)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import head_costs
from pipeline.model.config import ModelConfig
from pipeline.model.partition import HEAD_EFFICIENCY
from tests.family_models import write_family_model


def _checkpoint_bytes(folder: Path) -> dict[str, int]:
    """float32 bytes of every 2-D tensor of the folder's checkpoint (a linear's weight, or the embedding)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: 4 * shape[0] * shape[1] for name in f.keys() if len(shape := f.get_slice(name).get_shape()) == 2}


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_head_cost_is_the_head_bytes_over_a_layer_s_active_linear_bytes(tmp_path: Path, family: str):
    """float32: a dense linear streams 4 bytes a weight, so the price is HEAD_EFFICIENCY x the head's
    weights over a layer's, the mixtral experts' at 2 of 4 (a price counting all experts, or the head in
    the layers, fails); the exit head (dense float32 too) costs the same."""
    folder = write_family_model(tmp_path / family, family, tie_word_embeddings=False)
    config = ModelConfig.from_model_dir(folder)
    sizes = _checkpoint_bytes(folder)
    share = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    assert (share < 1) == (family == "mixtral")
    layers = sum(b * (share if ".experts." in name else 1.0) for name, b in sizes.items()
                 if name.startswith("model.layers.")) / config.num_hidden_layers
    want = HEAD_EFFICIENCY * sizes["lm_head.weight"] / layers
    options = PipelineOptions(num_stages=2, model=str(folder), progress=False)
    got = head_costs(options, config, folder)
    assert got.head == pytest.approx(want, rel=1e-9)
    assert got.exit_head == pytest.approx(want, rel=1e-9)
