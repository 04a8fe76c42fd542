"""Rotary position embeddings (RoPE): frequencies, cos/sin tables and the rotation.

Owns the RoPE maths of every family: the base frequencies with linear or Llama-3 scaling, Gemma 3's
separate base for sliding-window layers, and the half-split rotation of q and k.
Must not: hold model weights or know about stages.
"""

from __future__ import annotations

import math

import torch

from pipeline.model.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2] (float32), with linear or Llama-3 scaling.

    Source: RoFormer (arXiv 2104.09864) §3.4; Llama 3.1 scaling as in Meta's reference code.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, head_dim] for integer `positions` [num_tokens] (computed in float32)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables `rotate` takes, built once per forward from cos/sin [num_tokens, head_dim]: cos as
    [num_tokens, 1, head_dim], and sin with its first half negated, [num_tokens, 1, head_dim]."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [num_tokens, num_heads, head_dim] by the `rotation_tables` of its rows (half-split layout).

    The same numbers as x * cos + cat(-x2, x1) * sin (RoFormer, arXiv 2104.09864 §3.4.2), bit for bit:
    negating sin instead of x is exact, and one `roll` replaces two slices, a negation and a cat
    (three fewer ops per layer on the decode path)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


def config_inv_freq(config: ModelConfig, *, local: bool) -> torch.Tensor:
    """Global RoPE frequencies, or those of sliding layers with their own unscaled base (Gemma 3)."""
    if local and config.rope_local_theta is not None:
        return rope_inv_freq(config.head_dim, config.rope_local_theta, None)
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
