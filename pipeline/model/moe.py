"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE), by configuration.

Owns `SparseMoE`: a linear router over `num_experts` SwiGLU experts, top-k selection, the
family's renormalisation, and the weighted sum of the chosen experts' outputs. Each stage holds
the experts of its own layers only (a layer's experts are parameters of that layer's module).
Must not: read files, or move tokens between processes (no expert parallelism here).

Routing (Mixtral, arXiv 2401.04088 §2.1; Qwen3 MoE as in transformers' Qwen3MoeTopKRouter):
    p = softmax(router(x)) in float32;  (w, e) = top_k(p)
    w = w / sum(w)            (Mixtral always; Qwen3-MoE when norm_topk_prob)
    y = sum_j w_j * expert_{e_j}(x)
Checkpoint names: `mlp.gate.weight` and `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE;
Mixtral's `block_sparse_moe.*` / `w1,w3,w2` are mapped in pipeline/weights/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class SparseMoE(nn.Module):
    """Router + experts of one layer. x: [num_tokens, hidden] -> [num_tokens, hidden].

    make_expert() builds one expert (a gated MLP with `moe_intermediate_size`).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalise: bool,
                 make_expert: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.top_k, self.renormalise = top_k, renormalise

    def fuse(self) -> None:
        """Fuse each expert's gate/up projections (see MLP.fuse)."""
        for expert in self.experts:
            expert.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert weights [num_tokens, top_k] (x's dtype) and indices [num_tokens, top_k]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # only the experts some token picked
            token, slot = torch.where(chosen == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out
