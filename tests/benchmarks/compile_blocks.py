"""Does `torch.compile` pay on the decode pass when it compiles whole blocks of a layer?

torch_compile_probe.py compiled two small pieces (the RMSNorm, the MLP) and found the call overhead
larger than the fusion gain. This compiles the largest pieces a stage forward can give inductor
without the KV-cache write (a mutation of a slice of the cache, which inductor turned into a copy of
the whole cache: 1.25 s a pass when tried): per layer, one graph for norm + qkv + RoPE and one for
o_proj + residual + norm + MLP + residual, the weights passed as arguments so that all layers share
two graphs; the attention between them stays eager. It times, side by side in one process, one
thread, the default model as one stage, `context` cached positions, one row:

    model     StageModel's layers as the runtime runs them
    blocks    the same maths as two plain functions a layer (checked bit for bit against `model`)
    compiled  those functions through inductor, with its Python wrapper and with its C++ wrapper

Ratios only; a quiet machine gives the meaningful numbers.

    python tests/benchmarks/compile_blocks.py [--context 200] [--repeats 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.model.attention import AttentionPlan, span_attention  # noqa: E402
from pipeline.model.family_blocks import rms_normalize  # noqa: E402
from pipeline.model.rope import rotate  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.row_cost import load_mode  # noqa: E402


def block_functions(config):
    """(pre, post): a layer's maths before and after attention as functions of tensors only."""
    h, kvh, d, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps

    def norm(x, w):
        return w * rms_normalize(x, eps)

    def pre(x, ln_w, qkv_t, cos, sin):
        qkv = norm(x, ln_w) @ qkv_t
        qk = rotate(qkv[:, :(h + kvh) * d].reshape(x.shape[0], h + kvh, d), cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * d:].reshape(x.shape[0], kvh, d)

    def post(x, attn, o_w, ln2_w, gate_up_t, down_w):
        x = x + attn.reshape(x.shape[0], h * d) @ o_w.t()
        gate_up = norm(x, ln2_w) @ gate_up_t
        inter = gate_up.shape[-1] // 2
        return x + (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ down_w.t()

    return pre, post


def layer_weights(layer) -> tuple:
    """The tensors `pre` and `post` take, from a `fast`-layout float32 DecoderLayer."""
    attn, mlp = layer.self_attn, layer.mlp
    return (layer.input_layernorm.weight, attn.qkv_proj.weight_t, attn.o_proj.weight,
            layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight_t, mlp.down_proj.weight)


def median_ms(fn, x, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "tests/benchmarks/results/compile_blocks.json"))
    args = ap.parse_args(argv)
    import torch._inductor.config as inductor_config

    torch.set_num_threads(1)
    model = load_mode(resolve_model(DEFAULT_MODEL, progress=False), "fp32-fast")
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=2048)
    with torch.inference_mode():
        model.forward_rows(torch.arange(args.context) % model.config.vocab_size, [Span(0, 0, args.context)], kv)
    plan = AttentionPlan.build([Span(0, args.context, 1)], None, torch.device("cpu"), scratch_base=kv.max_model_len)
    cos, sin = model.rope_tables(torch.tensor([args.context]), torch.float32)[model.layer_range.start]
    layers = list(model.layers.values())
    weights = [layer_weights(layer) for layer in layers]

    def model_pass(x):
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, plan, kv, i)
        return model._logits(x)

    def blocks_pass(pre, post):
        def run(x):
            for i, (ln_w, qkv_t, o_w, ln2_w, gate_up_t, down_w) in enumerate(weights):
                q, k, v = pre(x, ln_w, qkv_t, cos, sin)
                x = post(x, span_attention(q, k, v, plan, kv, i), o_w, ln2_w, gate_up_t, down_w)
            return model._logits(x)
        return run

    pre, post = block_functions(model.config)
    x = model.embed_tokens(torch.tensor([100]))
    report = {"mode": "fp32-fast", "context": args.context, "threads": 1, "passes": {}}
    with torch.inference_mode():
        reference = model_pass(x)
        passes = {"model": model_pass, "blocks": blocks_pass(pre, post)}
        report["blocks_bitwise_equal_to_model"] = torch.equal(passes["blocks"](x), reference)
        for wrapper in ("python", "cpp"):
            torch._dynamo.reset()
            inductor_config.cpp_wrapper = wrapper == "cpp"
            t = time.perf_counter()
            run = blocks_pass(torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False))
            out = run(x)
            passes[f"compiled_{wrapper}_wrapper"] = run
            report[f"compiled_{wrapper}_wrapper_compile_s"] = round(time.perf_counter() - t, 1)
            report[f"compiled_{wrapper}_wrapper_max_logit_diff"] = (out - reference).abs().max().item()
            for name in ("model", "blocks", f"compiled_{wrapper}_wrapper"):  # interleaved with the eager ones
                report["passes"].setdefault(name, []).append(round(median_ms(passes[name], x, args.repeats), 2))
    base = statistics.median(report["passes"]["model"])
    for name, values in report["passes"].items():
        print(f"{name}: {statistics.median(values):.2f} ms a one-row pass ({base / statistics.median(values):.3f}x model)")
    print(f"blocks bitwise equal to model: {report['blocks_bitwise_equal_to_model']}; compiled max |logit diff|: "
          f"{report['compiled_python_wrapper_max_logit_diff']:.2e} / {report['compiled_cpp_wrapper_max_logit_diff']:.2e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["blocks_bitwise_equal_to_model"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
