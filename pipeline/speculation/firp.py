"""FIRP maps: predict future hidden states at an intermediate layer (stage side of FIRP).

Source: "FIRP: Faster LLM Inference via Future Intermediate Representation Prediction"
(arXiv 2410.20488) §3: at layer L, k linear maps turn the hidden state h_t of the last known
position into pseudo hidden states for positions t+1 .. t+k; they then run through layers L+1 ..
N attending to the real context (pipeline/model/stage_model.py; [Note: pseudo rows] in pipeline/model/row_layout.py) and the LM head turns
pseudo row i into a draft of the token at position t+i+1.

Owns the `FirpMaps` module (maps.{i}.weight [H, H], maps.{i}.bias [H], i = 1..k; identity at
init) and building it from a predictor file (pipeline/speculation/predictor_file.py). Must not: do I/O, or
decide which drafts are committed (pipeline/speculation/ledger.py does).

[Note: FIRP policy]
With `firp_k` = k > 0 (FIRP, arXiv 2410.20488; ARCHITECTURE.md §6) every item asks for pseudo
chains of up to k rows on each of its result rows (`Item.firp_k`, `Item.firp_anchors`); the last
stage returns one draft per pseudo row. When a result leaves the sequence with nothing in flight,
the next real item is [last committed token, the k drafts of the chain anchored at the row that
produced it] (kind FIRP), verified as a chain ([Note: chain verify] in pipeline/speculation/ledger.py). Chains
are cut so that no draft lies past the token budget, and before the first draft whose probability
(softmax of its pseudo row) is below `firp_min_prob`: unlikely drafts cost rows and, with SPEED, a
short confident chain leaves the run-ahead draft behind it a chance. With SPEED on as well, run-ahead drafts follow
FIRP items as they follow any item; FIRP drafts of a result are used only if the chain ends there.
(The scheduler in pipeline/engine/scheduler.py applies this policy.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.speculation.predictor_file import PredictorFile, PredictorFileError


class FirpMaps(nn.Module):
    """k affine maps: pseudo_i = h @ W_i^T + b_i for i = 1..k.

    weight: [k, H, H] (W_i = weight[i-1]); bias: [k, H]. Identity maps and zero bias at init.
    """

    def __init__(self, hidden_size: int, k: int) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"firp_k must be >= 1, got {k}")
        self.k, self.hidden_size = k, hidden_size
        self.weight = nn.Parameter(torch.eye(hidden_size).repeat(k, 1, 1))
        self.bias = nn.Parameter(torch.zeros(k, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, H] layer-L states -> [num_rows, k, H] pseudo states of t+1 .. t+k."""
        w = self.weight.to(hidden.dtype)
        return torch.einsum("kij,nj->nki", w, hidden) + self.bias.to(hidden.dtype)

    @torch.inference_mode()
    def chains(self, anchor_hidden: torch.Tensor, chain_lens: Sequence[int]) -> torch.Tensor:
        """Pseudo rows for anchors with `chain_lens[a]` (<= k) rows each, concatenated in anchor order.

        anchor_hidden: [num_anchors, H] -> [sum(chain_lens), H].
        """
        full = self(anchor_hidden)
        return torch.cat([full[a, :n] for a, n in enumerate(chain_lens)])

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors in predictor-file names: maps.{i}.weight, maps.{i}.bias for i = 1..k."""
        out = {}
        for i in range(self.k):
            out[f"maps.{i + 1}.weight"] = self.weight[i].detach()
            out[f"maps.{i + 1}.bias"] = self.bias[i].detach()
        return out

    @classmethod
    def from_predictor(cls, pred: PredictorFile, *, k: int | None = None, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> FirpMaps:
        """The first `k` maps (default: all) of a firp predictor file.

        Raises PredictorFileError if the file is not a firp file or has fewer than k maps.
        """
        if pred.kind != "firp":
            raise PredictorFileError(f"speculate firp needs a 'firp' predictor file, got a {pred.kind!r} one")
        have = int(pred.meta["k"])
        k = have if k is None else k
        if not 1 <= k <= have:
            raise PredictorFileError(f"firp_k {k} needs {k} maps, but the firp file holds {have}")
        maps = cls(int(pred.meta["model"]["hidden_size"]), k)
        with torch.no_grad():
            for i in range(k):
                maps.weight[i].copy_(pred.tensors[f"maps.{i + 1}.weight"])
                maps.bias[i].copy_(pred.tensors[f"maps.{i + 1}.bias"])
        return maps.to(device=device, dtype=dtype).eval().requires_grad_(False)
