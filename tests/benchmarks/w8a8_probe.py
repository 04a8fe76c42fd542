"""Would int8 activations make extra rows cheap? A probe of W8A8 (int8 weights and activations).

The fastest mode (`auto`: int4 weights, bfloat16 activations) pays for every extra row: the int4
kernel's cost grows with the rows (issue 13's 8-rows / 1-row target is missed at 2.2-2.4x).
oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, AMX int8 / AVX-512 VNNI, what inductor's
x86 int8 path calls) costs nearly the same for 1 and 16 rows. This probe swaps every int8 linear
of an `--quantization int8` model for `ProbeW8A8Linear` (each input row quantised to int8 with its
own symmetric scale, SmoothQuant arXiv 2211.10438 §3's per-token W8A8 without its smoothing) and
measures, side by side in one process, one thread:
  1. bitwise batch invariance of the linear (a row's output must not depend on the other rows);
  2. whole-model pass cost by rows against `auto` (tests/benchmarks/row_cost.py's shapes);
  3. greedy agreement over the first `--max-new-tokens` tokens of held-out sotu prompts with
     float32 `none` (token-identical to transformers, tests/integration), against `auto`.
Not a product mode: the README gives the numbers and why it is not one. Ratios only.

    python tests/benchmarks/w8a8_probe.py [--repeats 5] [--num-prompts 8] [--max-new-tokens 64]
        [--out tests/benchmarks/results/w8a8_probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.model.config import ModelConfig  # noqa: E402
from pipeline.model.tokenizer import Tokenizer  # noqa: E402
from pipeline.weights.quant import ACTIVATION_DTYPE, Int8Linear, int8_rows_from_float  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.core_speed import sotu_prompts  # noqa: E402
from tests.benchmarks.mode_agreement import greedy_tokens, prefix_len  # noqa: E402
from tests.benchmarks.row_cost import load_mode, measure  # noqa: E402


class ProbeW8A8Linear(nn.Module):
    """y = (round(x · 127 / max|x_row|) @ q.T) · w_scale · max|x_row| / 127 (+ bias), int32 accumulation
    in oneDNN. x: [rows, in] bfloat16 → [rows, out] bfloat16. Built from an Int8Linear's q and scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
        self.w_scale = scale.float().contiguous()
        self.w_zero = torch.zeros(q.shape[0], dtype=torch.int64)
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.linalg.vector_norm(x, float("inf"), -1, True, dtype=torch.float32).clamp_(min=1e-30)
        xq = torch.mul(x, 127.0 / s).round_().to(torch.int8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.packed, self.w_scale, self.w_zero, None,
                                               1.0, 0, torch.float32, "none", [], "")
        y = y.mul_(s.mul_(1.0 / 127))
        return (y if self.bias is None else y.add_(self.bias)).to(ACTIVATION_DTYPE)


def to_w8a8(model: nn.Module) -> nn.Module:
    """Swap every Int8Linear of `model` (an int8-mode StageModel) for a ProbeW8A8Linear, in place."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Int8Linear):
            parent, _, attr = name.rpartition(".")
            bias = None if mod.bias is None else mod.bias.float()
            setattr(model.get_submodule(parent) if parent else model, attr,
                    ProbeW8A8Linear(mod.q, mod.scale.float(), bias))
    return model


def batch_invariant(rows: int = 16) -> bool:
    """Whether every row of a [rows, 576] x [3072, 576] W8A8 product equals the same row computed alone
    or in any prefix, bitwise."""
    w = int8_rows_from_float(0.05 * torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)))
    lin = ProbeW8A8Linear(w.q, w.scale, None)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1)).to(ACTIVATION_DTYPE)
    full = lin(x)
    return all(torch.equal(lin(x[:m]), full[:m]) for m in range(1, rows)) and \
        all(torch.equal(lin(x[i:i + 1])[0], full[i]) for i in range(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "tests/benchmarks/results/w8a8_probe.json"))
    args = p.parse_args(argv)
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        print("w8a8_probe: error: this torch has no oneDNN int8 linear (an x86 build is needed)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir = Path(resolve_model(DEFAULT_MODEL, progress=False))
    report = {"batch_invariant": batch_invariant(), "row_cost": {}, "agreement_with_float32": {}}
    print(f"W8A8 linear batch-invariant (bitwise, 1-16 rows): {report['batch_invariant']}")
    models = {"auto": load_mode(model_dir, "auto"), "w8a8": to_w8a8(load_mode(model_dir, "int8"))}
    for mode, model in models.items():
        rows = measure(model, context=200, repeats=args.repeats, firp_layer=16)
        report["row_cost"][mode] = rows
        shown = {(r["real_rows"], r["firp_k"]): r for r in rows}
        print(f"{mode:>5}: one row {shown[(1, 0)]['median_ms']:.1f} ms; rows 2/4/8/16 "
              + " / ".join(f"{shown[(n, 0)]['ratio_to_one_row']:.2f}x" for n in (2, 4, 8, 16))
              + f"; FIRP k=3 verify {shown[(4, 3)]['ratio_to_one_row']:.2f}x")
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(t) for t in sotu_prompts(num_prompts=args.num_prompts, num_words=40)]
    eos = ModelConfig.from_model_dir(model_dir).eos_token_ids
    reference, _ = greedy_tokens(load_mode(model_dir, "fp32"), prompts, args.max_new_tokens, eos)
    for mode, model in models.items():
        got, _ = greedy_tokens(model, prompts, args.max_new_tokens, eos)
        prefixes = [prefix_len(a, b) for a, b in zip(got, reference, strict=True)]
        report["agreement_with_float32"][mode] = {"mean_matching_prefix": sum(prefixes) / len(prefixes),
                                                  "prefixes": prefixes}
        print(f"{mode:>5}: greedy agreement with float32, mean matching prefix "
              f"{sum(prefixes) / len(prefixes):.1f} of {args.max_new_tokens} tokens {prefixes}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
