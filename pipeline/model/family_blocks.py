"""Small per-family building blocks of the decoder, chosen by ModelConfig ([Note: model families]).

Owns the RMS normalisation (`rms_normalize`, the one copy of its maths), the RMSNorm, the norm factory
(Llama's RMSNorm or Gemma's (1 + w) variant) and the plain-norm weight that stands for Gemma's
(`plain_norm_weight`), the embedding with a scale (Gemma multiplies by sqrt(hidden_size)), the gated feed-forward activations (SwiGLU's SiLU, GeGLU's
tanh-approximate GELU), final logit soft-capping, the sliding-window rule (`inside_window`) and causal mask, and whether a
window can hide anything at all in a KV slot (`window_binds`, [Note: a window that never binds]).
Must not: read files or know about stages, KV slots or processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.config import ModelConfig


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in x's dtype, no weight (RMSNorm, arXiv
    1910.07467 §3). x: [..., dim] -> same shape and dtype. The norms below call it in float32, as do
    the trainers and the exit maps on their float32 rows."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (arXiv 1910.07467), computed in float32 and cast back before the
    weight multiplies it, as transformers' LlamaRMSNorm does. x: [..., dim] -> same shape and dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, dim]
        dtype = x.dtype
        if dtype == torch.float32:  # the same maths without the two casts (no-ops here, but dispatched)
            return self.weight * rms_normalize(x, self.eps)
        return self.weight * rms_normalize(x.float(), self.eps).to(dtype)


class GemmaRMSNorm(nn.Module):
    """RMSNorm with weight offset `offset` (Gemma: 1.0): normalise in float32, times (offset + w),
    cast back. x: [..., dim] -> same shape and dtype. Unlike Llama's, the product is taken in float32
    before the cast (transformers' Gemma3RMSNorm; Gemma paper, arXiv 2403.08295 §2)."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x.float(), self.eps) * (self.offset + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The RMSNorm this family uses over `dim` features (plain, or Gemma's when norm_weight_offset)."""
    if config.norm_weight_offset:
        return GemmaRMSNorm(dim, config.rms_norm_eps, config.norm_weight_offset)
    return RMSNorm(dim, config.rms_norm_eps)


def plain_norm_weight(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The weight [dim] of a plain RMSNorm that stands for this family's norm of weight `weight` [dim]:
    `weight + norm_weight_offset` (Gemma's (1 + w); `weight`'s values for the other families), what
    the exit head's copy of the final norm holds. Gemma multiplies in float32 before its cast
    (GemmaRMSNorm), the plain norm after it: equal in float32, last-bit differences below it."""
    return weight + config.norm_weight_offset


class ScaledEmbedding(nn.Embedding):
    """Token embedding times a constant (`scale` cast to the weight's dtype, as transformers'
    Gemma3TextScaledWordEmbedding does). ids: [num_tokens] -> [num_tokens, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)


def make_embedding(config: ModelConfig) -> nn.Embedding:
    """The first stage's token embedding (scaled when `config.embedding_scale` != 1)."""
    if config.embedding_scale != 1.0:
        return ScaledEmbedding(config.vocab_size, config.hidden_size, config.embedding_scale)
    return nn.Embedding(config.vocab_size, config.hidden_size)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (transformers' `gelu_pytorch_tanh`)."""
    return F.gelu(x, approximate="tanh")


ACTIVATION_FNS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2, arXiv 2408.00118 §2), or `logits` when cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def inside_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window rule, its one copy: True where the key at absolute position `key_pos` lies in
    the window of the query at `query_pos`, i.e. key_pos > query_pos - window (Mistral's sliding window,
    arXiv 2310.06825 §2; transformers' `sliding_window_overlay`: kv_idx > q_idx - sliding_window).
    query_pos: [..., num_queries]; key_pos: [..., num_keys] (leading dims broadcast) ->
    [..., num_queries, num_keys] bool. Says nothing about causality (keys after the query)."""
    return key_pos[..., None, :] > query_pos[..., :, None] - window


def window_mask(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Causal mask [num_queries, num_keys] (True = attend) for queries at absolute `query_pos`
    over keys at positions 0..num_keys-1; with `window`, key j is visible to query i only when
    i - window < j <= i (`inside_window`)."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= inside_window(query_pos, key_pos, window)
    return mask


# [Note: a window that never binds]
# `window_mask` hides key j from query i when j <= i - window (transformers' `sliding_window_overlay`:
# kv_idx > q_idx - sliding_window, so a query sees `window` keys, itself included). A KV slot holds
# positions 0 .. max_model_len - 1; the widest gap is the query at max_model_len - 1 over key 0, hidden
# iff max_model_len - 1 >= window. So a layer whose window >= max_model_len masks exactly what full
# causal attention masks, for every row the slot can hold: `span_attention` runs it as full attention
# (the same boolean mask, so bit-identical; tests/unit/test_firp_window.py checks the boundary against
# transformers). A window that binds is applied to every query row by `inside_window`, FIRP pseudo rows
# included ([Note: windowed pseudo rows] in pipeline/model/attention.py). The engine never runs
# position max_model_len - 1 itself (a full budget's last token is never fed back), so a window of
# max_model_len - 1 would not bind on its real rows either; the rule stays with what the slot holds so
# that it holds for every caller of the model (training, calibration), not only for the engine. A
# pseudo row past the slot (a chain off a late anchor near the budget) has no real counterpart: its
# drafts lie past the token budget and are never used.


def window_binds(window: int | None, max_model_len: int) -> bool:
    """True when a sliding window of `window` positions can hide a key from some query of a KV slot of
    `max_model_len` positions (window < max_model_len); False for None (full attention)
    ([Note: a window that never binds])."""
    return window is not None and window < max_model_len
