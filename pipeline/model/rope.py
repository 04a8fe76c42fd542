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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [num_tokens, num_heads, head_dim] by cos/sin: [num_tokens, head_dim] (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def config_inv_freq(config: ModelConfig, *, local: bool) -> torch.Tensor:
    """Global RoPE frequencies, or those of sliding layers with their own unscaled base (Gemma 3)."""
    if local and config.rope_local_theta is not None:
        return rope_inv_freq(config.head_dim, config.rope_local_theta, None)
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
