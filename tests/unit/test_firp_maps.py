"""Unit tests for FIRP maps (pipeline/speculation/firp.py), their training and eval (pipeline/training/firp.py),
and how a launch picks the FIRP file and chain length (launcher/coordinator/run_plan.py).

What breaks when these fail: maps that do not round-trip through a predictor file, a fit that
does not recover a known linear dynamics, an eval whose replay of the chain policy is wrong, or a
default --firp-k / shipped-file choice that ignores the file's own eval.
"""

from __future__ import annotations

import pytest
import torch

from launcher.coordinator.run_plan import default_firp_k, shipped_firp_file
from pipeline.model.config import tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.firp import FirpMaps
from pipeline.speculation.predictor_file import (
    ModelIdentity,
    PredictorFile,
    PredictorFileError,
    shipped_predictor_name,
)
from pipeline.training.firp import SKIP_FIRST, chain_drafts, firp_acceptance, fit_firp_maps
from tests.tiny_model import random_state_dict


def _pred(maps: FirpMaps, k: int) -> PredictorFile:
    meta = {"kind": "firp", "k": k, "exit_layer": 1, "model": {"hidden_size": maps.hidden_size}}
    return PredictorFile({n: t.clone() for n, t in maps.to_tensors().items()}, meta)


def test_maps_round_trip_through_predictor_tensors_and_a_prefix_of_maps_is_a_shorter_chain():
    maps = FirpMaps(8, 3)
    with torch.no_grad():
        maps.weight.normal_()
        maps.bias.normal_()
    h = torch.randn(5, 8)
    again = FirpMaps.from_predictor(_pred(maps, 3))
    torch.testing.assert_close(again(h), maps(h))
    two = FirpMaps.from_predictor(_pred(maps, 3), k=2)
    torch.testing.assert_close(two(h), maps(h)[:, :2])
    chains = maps.chains(h[:2], [3, 1])
    torch.testing.assert_close(chains, torch.cat([maps(h[:1])[0], maps(h[1:2])[0, :1]]))
    with pytest.raises(PredictorFileError, match="firp_k 4"):
        FirpMaps.from_predictor(_pred(maps, 3), k=4)


def test_untrained_maps_are_the_identity():
    h = torch.randn(4, 6)
    torch.testing.assert_close(FirpMaps(6, 2)(h), h[:, None].expand(4, 2, 6))


def test_fit_recovers_a_linear_dynamics():
    gen = torch.Generator().manual_seed(0)
    dim, steps = 6, 40
    a = torch.linalg.qr(torch.randn(dim, dim, generator=gen))[0] * 0.9  # stable rotation-like map
    b = torch.randn(dim, generator=gen)
    h = torch.zeros(30, steps, dim)
    h[:, 0] = torch.randn(30, dim, generator=gen) * 3
    for t in range(1, steps):
        h[:, t] = h[:, t - 1] @ a.T + b
    maps, report = fit_firp_maps(h, k=2)
    x = h[:, SKIP_FIRST:-2].reshape(-1, dim)
    want1, want2 = x @ a.T + b, (x @ a.T + b) @ a.T + b
    got = maps(x)
    torch.testing.assert_close(got[:, 0], want1, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[:, 1], want2, atol=1e-2, rtol=1e-2)
    assert all(m < 1e-3 for m in report["val_mse"]), report


def test_eval_replays_the_chain_policy_with_the_real_pseudo_row_forward():
    cfg = tiny_config()
    model = build_stage_model(cfg, LayerRange(0, cfg.num_hidden_layers), is_first=True, is_last=True,
                              tensors=random_state_dict(cfg, seed=2, std=0.3))
    maps = FirpMaps(cfg.hidden_size, 3)
    result = firp_acceptance(model, maps, 1, [[5, 6, 7, 8], [40, 41]], num_new_tokens=12)
    for k in (1, 2, 3):
        assert 0.0 <= result.accepted_per_pass[k] <= k
        assert result.tokens_per_pass[k] == pytest.approx(1 + result.accepted_per_pass[k])
        assert result.num_passes[k] >= 12 / (k + 1) - 2
    assert result.accepted_per_pass[1] <= result.accepted_per_pass[3] + 1e-9
    drafts = chain_drafts(model, maps, 1, [5, 6, 7, 8, 9], 3)
    assert drafts.shape == (2, 3) and drafts.dtype == torch.int64


def test_default_chain_length_is_the_shortest_within_002_of_the_best():
    meta = {"k": 4, "eval": {"accepted_per_pass": {"1": 0.30, "2": 0.40, "3": 0.41, "4": 0.41}}}
    assert default_firp_k(meta) == 2
    assert default_firp_k({"k": 3, "eval": {}}) == 3
    assert default_firp_k({"k": 2, "eval": {"accepted_per_pass": {"1": 0.1, "2": 0.5}}}) == 2


def test_shipped_firp_file_prefers_the_exit_layer_then_the_nearest(tmp_path):
    ident = ModelIdentity(name="m", hash="ab" * 32, hidden_size=4, num_layers=30, vocab_size=9)
    assert shipped_firp_file(ident, 16, tmp_path) is None
    for layer in (10, 16, 20):
        (tmp_path / shipped_predictor_name(ident, kind="firp", exit_layer=layer, k=4)).write_bytes(b"")
    assert shipped_firp_file(ident, 16, tmp_path).name.endswith("-L16-k4.safetensors")
    assert shipped_firp_file(ident, 19, tmp_path).name.endswith("-L20-k4.safetensors")
    assert shipped_firp_file(ident, 12, tmp_path).name.endswith("-L10-k4.safetensors")
