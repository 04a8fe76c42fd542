"""Greedy agreement of each numeric mode with Hugging Face transformers (float32, dequantised weights).

Owns the held-out agreement numbers of issue 13: for every `--quantization` mode (and `none-fast`,
float32 with `--dense-layout fast`), over held-out
prompts (State of the Union openings, never used to train or tune anything here), the share of
prompts whose first `--max-new-tokens` greedy tokens equal transformers' greedy tokens, and the mean
length of the matching prefix. Reference: `AutoModelForCausalLM.generate(do_sample=False)` on the
converted float32 folder (the GGUF dequantised exactly once), EOS masked so every prompt yields
the same number of tokens. speedpipe runs in-process, one stage holding every layer, one 1-row
decode item per token (the stage split and speculation do not change the numbers within a mode:
tests/unit/test_numeric_modes.py). Also reports the CPU time per generated token (this thread's
`time.thread_time`, prefill included) of each mode against transformers: on a machine shared with
other jobs wall time mostly measures waiting for a core. Must not: tune the runtime or assert anything.

    python tests/benchmarks/mode_agreement.py [--modes none,none-fast,auto,int8,int4] [--num-prompts 16]
        [--max-new-tokens 64] [--out tests/benchmarks/results/mode_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.model.config import ModelConfig  # noqa: E402
from pipeline.model.partition import LayerRange  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.model.tokenizer import Tokenizer  # noqa: E402
from pipeline.weights.quant_load import load_stage_model  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.benchmarks.core_speed import FAST_LAYOUT_MODE, mode_flags, sotu_prompts  # noqa: E402


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """transformers greedy tokens of every prompt (float32, EOS masked), and the CPU seconds of this
    thread spent in `generate` (prefill included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, cpu_s = [], 0.0
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            start = time.thread_time()
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=model.config.eos_token_id)
            cpu_s += time.thread_time() - start
            out.append(gen[0, len(ids):].tolist())
    return out, cpu_s


def speedpipe_greedy(model_dir: Path, mode: str, prompts: list[list[int]], max_new_tokens: int,
                     eos_ids: tuple[int, ...]) -> tuple[list[list[int]], float]:
    """speedpipe greedy tokens in numeric `mode`, EOS masked like min_new_tokens does, and the CPU
    seconds of this thread spent generating (prefill included)."""
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    quantization, dense_layout = mode_flags(mode)
    model = load_stage_model(str(model_dir), LayerRange(0, n), is_first=True, is_last=True, quantization=quantization,
                             dense_layout=dense_layout)
    return greedy_tokens(model, prompts, max_new_tokens, eos_ids)


def greedy_tokens(model, prompts: list[list[int]], max_new_tokens: int,
                  eos_ids: tuple[int, ...]) -> tuple[list[list[int]], float]:
    """Greedy tokens of a whole-model StageModel, EOS masked, one 1-row item per token, and the CPU
    seconds of this thread spent generating (prefill included)."""
    out, cpu_s = [], 0.0
    for ids in prompts:
        start = time.thread_time()
        kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(ids) + max_new_tokens + 1)
        logits = model(torch.tensor(ids), [Span(0, 0, len(ids))], kv)
        tokens: list[int] = []
        while True:
            logits = logits.clone()
            logits[:, list(eos_ids)] = float("-inf")
            tokens.append(int(logits[0].argmax()))
            if len(tokens) == max_new_tokens:
                break
            logits = model(torch.tensor(tokens[-1:]), [Span(0, len(ids) + len(tokens) - 1, 1)], kv)
        cpu_s += time.thread_time() - start
        out.append(tokens)
    return out, cpu_s


def prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=f"none,{FAST_LAYOUT_MODE},auto,int8,int4")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "tests/benchmarks/results/mode_agreement.json"))
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        print("mode_agreement: error: need --num-prompts >= 1 and --max-new-tokens >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir = resolve_model(DEFAULT_MODEL, progress=False)
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(t) for t in sotu_prompts(num_prompts=args.num_prompts, num_words=40)]
    eos = ModelConfig.from_model_dir(model_dir).eos_token_ids
    started = time.perf_counter()
    reference, hf_cpu_s = hf_greedy(model_dir, prompts, args.max_new_tokens)
    num_tokens = len(prompts) * args.max_new_tokens
    report = {"model": DEFAULT_MODEL, "reference": "transformers generate, float32, greedy, EOS masked",
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "hf_cpu_ms_per_token": round(hf_cpu_s / num_tokens * 1e3, 2), "modes": {}}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        got, cpu_s = speedpipe_greedy(model_dir, mode, prompts, args.max_new_tokens, eos)
        prefixes = [prefix_len(a, b) for a, b in zip(got, reference, strict=True)]
        report["modes"][mode] = {
            "all_tokens_match_share": sum(pl == args.max_new_tokens for pl in prefixes) / len(prompts),
            "mean_matching_prefix": sum(prefixes) / len(prompts), "prefixes": prefixes,
            "cpu_ms_per_token": round(cpu_s / num_tokens * 1e3, 2), "speed_vs_hf_cpu": round(hf_cpu_s / cpu_s, 3)}
        r = report["modes"][mode]
        print(f"{mode:>9}: {r['all_tokens_match_share']:.0%} of {len(prompts)} prompts match all "
              f"{args.max_new_tokens} tokens; mean matching prefix {r['mean_matching_prefix']:.1f}  {prefixes}; "
              f"CPU {r['cpu_ms_per_token']:.1f} ms/token = {r['speed_vs_hf_cpu']:.2f}x HF "
              f"({report['hf_cpu_ms_per_token']:.1f} ms/token)")
    report["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
