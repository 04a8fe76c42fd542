"""Training and evaluating FIRP maps on hidden states of the frozen base model.

Source: FIRP (arXiv 2410.20488) §3.2: a linear map per future offset i = 1..k predicts the layer-L
hidden state of position t+i from that of position t, trained with a mean-squared error on the
hidden states. A linear map under an MSE loss has a closed-form optimum, so `fit_firp_maps`
solves it exactly (ridge least squares, the ridge picked on a validation slice of the training
windows) instead of running an optimiser from the identity.
`firp_acceptance` measures what matters in the pipeline: accepted drafts per pass, with the real
pseudo-row forward of pipeline/model/stage_model.py ([Note: pseudo rows] in pipeline/model/row_layout.py) on the base model's own greedy
continuations of held-out text, replaying the chain policy of the scheduler ([Note: FIRP policy]).
Owns: the maths only. Must not: read corpora or files, or parse command lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel
from pipeline.speculation.firp import FirpMaps

RIDGES = (1e-4, 1e-3, 1e-2, 1e-1)  # ridge strength, relative to the mean diagonal of X^T X


SKIP_FIRST = 4  # window positions never used as anchors: the first tokens are attention sinks whose huge
#                hidden states would dominate the squared error (decoding never anchors there)


def _pairs(hidden: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_t, h_{t+offset}) rows of every window for t >= SKIP_FIRST: hidden [W, T, H] -> two [N, H] float64."""
    h = hidden.shape[-1]
    return (hidden[:, SKIP_FIRST:-offset].reshape(-1, h).double(), hidden[:, SKIP_FIRST + offset:].reshape(-1, h).double())


def _ridge(x: torch.Tensor, y: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine least squares y ~ x @ A + b with ridge `ridge` * mean(diag(X^T X)). Returns (A [H, H], b [H])."""
    mx, my = x.mean(0), y.mean(0)
    xc = x - mx
    gram = xc.T @ xc
    lam = ridge * gram.diagonal().mean()
    a = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ (y - my))
    return a, my - mx @ a


def fit_firp_maps(hidden: torch.Tensor, *, k: int, val_fraction: float = 0.1,
                  on_map: Callable[[int, float], None] | None = None) -> tuple[FirpMaps, dict]:
    """Fit k FIRP maps on layer-L hidden states of token windows.

    hidden: [num_windows, window, H] (any float dtype), consecutive positions of each window.
    Map i (1-based) minimises sum ||h_{t+i} - (W_i h_t + b_i)||^2 over every pair inside a window,
    plus a ridge chosen from RIDGES by MSE on the last `val_fraction` of windows, then refitted on all.
    on_map(i, val_mse) is called after each map. Returns (maps [float32], {"val_mse": [...], "ridge": [...],
    "identity_val_mse": [...]}). Raises ValueError if windows are not longer than k.
    """
    num_windows, window, _ = hidden.shape
    if window <= k + SKIP_FIRST:
        raise ValueError(f"windows of {window} tokens are too short for firp_k {k} (need > {k + SKIP_FIRST})")
    num_val = max(1, int(num_windows * val_fraction)) if num_windows > 1 else 0
    train, val = hidden[:num_windows - num_val], hidden[num_windows - num_val:]
    maps = FirpMaps(hidden.shape[-1], k)
    report: dict[str, list] = {"val_mse": [], "ridge": [], "identity_val_mse": []}
    for i in range(1, k + 1):
        x, y = _pairs(train, i)
        best = (float("inf"), RIDGES[-1])
        if num_val:
            vx, vy = _pairs(val, i)
            for ridge in RIDGES:
                a, b = _ridge(x, y, ridge)
                mse = float(((vx @ a + b - vy) ** 2).mean())
                best = min(best, (mse, ridge))
            report["identity_val_mse"].append(round(float(((vx - vy) ** 2).mean()), 5))
        a, b = _ridge(*_pairs(hidden, i), best[1])
        with torch.no_grad():
            maps.weight[i - 1].copy_(a.T.float())
            maps.bias[i - 1].copy_(b.float())
        report["val_mse"].append(round(best[0], 5))
        report["ridge"].append(best[1])
        if on_map is not None:
            on_map(i, best[0])
    return maps.eval().requires_grad_(False), report


@dataclasses.dataclass(frozen=True)
class FirpEval:
    """Accepted FIRP drafts per pass for each chain length (replaying the scheduler's chain policy),
    and the mean accepted prefix length per anchor (every position, not only those a decode visits)."""

    accepted_per_pass: dict[int, float]
    tokens_per_pass: dict[int, float]
    accepted_per_anchor: dict[int, float]
    num_passes: dict[int, int]
    num_sequences: int
    num_new_tokens: int


@torch.inference_mode()
def greedy_continue(model: StageModel, prompt: Sequence[int], num_new_tokens: int) -> list[int]:
    """The base model's greedy continuation (KV-cached decode on the full model)."""
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(prompt) + num_new_tokens)
    logits = model(torch.tensor(list(prompt)), [Span(0, 0, len(prompt))], kv)[0]
    out = []
    for _ in range(num_new_tokens):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor(out[-1:]), [Span(0, len(prompt) + len(out) - 1, 1)], kv)[0]
    return out


@torch.inference_mode()
def chain_drafts(model: StageModel, maps: FirpMaps, layer: int, ids: Sequence[int], first_anchor: int) -> torch.Tensor:
    """FIRP drafts of every anchor from `first_anchor` to len(ids) - 1 in one pass of the full model.

    Returns [num_anchors, k] int64: row a, column j is the draft for position first_anchor + a + 2 + j.
    """
    n, k = len(ids), maps.k
    num_anchors = n - first_anchor
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=n)
    out = model.forward_rows(torch.tensor(list(ids)), [Span(0, 0, n, num_anchors=num_anchors, chain_len=k)], kv,
                             firp_layer=layer, make_pseudo=lambda h: maps.chains(h, [k] * len(h)))
    return out.pseudo.argmax(dim=-1).reshape(num_anchors, k)


def firp_acceptance(model: StageModel, maps: FirpMaps, layer: int, prompts: Sequence[Sequence[int]], *,
                    num_new_tokens: int = 64, ks: Sequence[int] | None = None,
                    on_sequence: Callable[[], None] | None = None) -> FirpEval:
    """Accepted drafts per pass of FIRP decoding on the base model's greedy continuation of each prompt.

    For each prompt: greedy-decode `num_new_tokens` tokens, compute every anchor's chain with the
    real pseudo-row forward, then replay the decode: a pass anchored at position a commits
    1 + acc(a) tokens (acc = the longest prefix of its drafts equal to the greedy tokens) and the next
    pass is anchored at a + 1 + acc(a). ks: chain lengths to report (<= maps.k; default 1..k).
    """
    ks = list(range(1, maps.k + 1)) if ks is None else list(ks)
    passes = {k: 0 for k in ks}
    accepted = {k: 0 for k in ks}
    anchor_acc = {k: [] for k in ks}
    for prompt in prompts:
        seq = list(prompt) + greedy_continue(model, prompt, num_new_tokens)
        first = len(prompt) - 1
        drafts = chain_drafts(model, maps, layer, seq[:-1], first)
        acc_full = []
        for a in range(first, len(seq) - 2):
            acc = 0
            for j in range(maps.k):
                pos = a + 2 + j
                if pos >= len(seq) or int(drafts[a - first, j]) != seq[pos]:
                    break
                acc += 1
            acc_full.append(acc)
        for k in ks:
            accs = [min(acc, k) for acc in acc_full]
            anchor_acc[k].extend(accs)
            a = 0
            while a < len(accs):
                passes[k] += 1
                accepted[k] += accs[a]
                a += 1 + accs[a]
        if on_sequence is not None:
            on_sequence()
    per_pass = {k: accepted[k] / passes[k] if passes[k] else 0.0 for k in ks}
    return FirpEval(accepted_per_pass=per_pass, tokens_per_pass={k: 1 + v for k, v in per_pass.items()},
                    accepted_per_anchor={k: sum(v) / len(v) if v else 0.0 for k, v in anchor_acc.items()},
                    num_passes=passes, num_sequences=len(prompts), num_new_tokens=num_new_tokens)
