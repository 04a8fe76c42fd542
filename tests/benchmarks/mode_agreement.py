"""Greedy agreement of each numeric mode with Hugging Face transformers (float32, dequantised weights).

Owns the held-out agreement numbers of issue 13: for every `--quantization` mode (and `none-fast`,
float32 with `--dense-layout fast`), over held-out
prompts (State of the Union openings, never used to train or tune anything here), the share of
prompts whose first `--max-new-tokens` greedy tokens equal transformers' greedy tokens, the mean
length of the matching prefix, and, teacher-forced over transformers' tokens (one early difference
then does not decide the rest: the prefix is noisy over few prompts), the share of positions whose
argmax agrees with transformers' logits and the mean KL from them. Reference: `AutoModelForCausalLM.generate(do_sample=False)` on the
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


def load_mode_model(model_dir: Path, mode: str):
    """The whole model as one speedpipe stage in numeric `mode` (a --quantization value or none-fast)."""
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    quantization, dense_layout = mode_flags(mode)
    return load_stage_model(str(model_dir), LayerRange(0, n), is_first=True, is_last=True, quantization=quantization,
                            dense_layout=dense_layout)


def hf_sequence_logits(model_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len, vocab] at every position of each sequence (one forward each)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([ids])).logits[0].float() for ids in sequences]


def teacher_forced(model, sequences: list[list[int]], prompt_lens: list[int],
                   reference: list[torch.Tensor]) -> tuple[float, float]:
    """Over the generated part of each sequence (the reference's greedy tokens fed in, so one early
    difference does not decide the rest, as it does for the matching prefix): the share of positions
    whose argmax equals the reference logits' and the mean KL(reference || model), in nats."""
    agree = kl = count = 0.0
    with torch.inference_mode():
        for ids, start, ref in zip(sequences, prompt_lens, reference, strict=True):
            kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(ids) + 1)
            got = model(torch.tensor(ids), [Span(0, 0, len(ids))], kv, logit_rows=torch.arange(len(ids))).float()
            got, want = got[start - 1:-1], ref[start - 1:-1]
            agree += float((got.argmax(-1) == want.argmax(-1)).sum())
            kl += float(torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
            count += len(want)
    return agree / count, kl / count


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
    sequences = [p + r for p, r in zip(prompts, reference, strict=True)]
    reference_logits = hf_sequence_logits(model_dir, sequences)
    num_tokens = len(prompts) * args.max_new_tokens
    report = {"model": DEFAULT_MODEL, "reference": "transformers generate, float32, greedy, EOS masked",
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "hf_cpu_ms_per_token": round(hf_cpu_s / num_tokens * 1e3, 2), "modes": {}}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        model = load_mode_model(model_dir, mode)
        got, cpu_s = greedy_tokens(model, prompts, args.max_new_tokens, eos)
        top1, kl = teacher_forced(model, sequences, [len(p) for p in prompts], reference_logits)
        del model
        prefixes = [prefix_len(a, b) for a, b in zip(got, reference, strict=True)]
        report["modes"][mode] = {
            "all_tokens_match_share": sum(pl == args.max_new_tokens for pl in prefixes) / len(prompts),
            "mean_matching_prefix": sum(prefixes) / len(prompts), "prefixes": prefixes,
            "teacher_forced_top1": round(top1, 4), "teacher_forced_mean_kl": round(kl, 5),
            "cpu_ms_per_token": round(cpu_s / num_tokens * 1e3, 2), "speed_vs_hf_cpu": round(hf_cpu_s / cpu_s, 3)}
        r = report["modes"][mode]
        print(f"{mode:>9}: {r['all_tokens_match_share']:.0%} of {len(prompts)} prompts match all "
              f"{args.max_new_tokens} tokens; mean matching prefix {r['mean_matching_prefix']:.1f}  {prefixes}; "
              f"teacher-forced top-1 {top1:.3f}, KL {kl:.4f}; "
              f"CPU {r['cpu_ms_per_token']:.1f} ms/token = {r['speed_vs_hf_cpu']:.2f}x HF "
              f"({report['hf_cpu_ms_per_token']:.1f} ms/token)")
    report["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
