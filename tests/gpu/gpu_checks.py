"""GPU checks of issue 13 (run by tests/gpu/run.sh on a one-GPU machine; nothing here runs on CPU).

Owns: the stage model on CUDA against transformers on CUDA (last-row logits of every prompt, max
abs difference against a per-dtype tolerance, and greedy agreement over `--new-tokens` tokens),
decode tokens/s of a plain speedpipe decode loop against transformers `generate` on the same GPU,
and what `--quantization` does on CUDA (auto: dense fallback; int4/int8: refused, the kernels here
are torch's CPU ones). Writes one JSON report. Must not: assert timings.
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

from pipeline.model.partition import LayerRange  # noqa: E402
from pipeline.model.row_layout import Span  # noqa: E402
from pipeline.model.tokenizer import Tokenizer  # noqa: E402
from pipeline.weights.quant_load import effective_mode, load_stage_model  # noqa: E402
from pipeline.weights.registry import DEFAULT_MODEL, resolve_model  # noqa: E402

PROMPTS = ("Once upon a time, in a small village at the edge of the forest,", "def quicksort(arr):\n    ",
           "3, 1, 4, 1, 5, 9, 2, 6, 5, 3,")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25}


def sp_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor, float]:
    """Greedy tokens, the prefill's last-row logits, and seconds for the prefill and the 1-row decode
    loop that make `n` tokens (what `hf_greedy` times of `generate`)."""
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(ids) + n + 1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits = model(torch.tensor(ids, device="cuda"), [Span(0, 0, len(ids))], kv)
    tokens = [int(logits[0].argmax())]
    first = logits[0].float().cpu()
    while len(tokens) < n:
        logits = model(torch.tensor(tokens[-1:], device="cuda"), [Span(0, len(ids) + len(tokens) - 1, 1)], kv)
        tokens.append(int(logits[0].argmax()))
    torch.cuda.synchronize()
    return tokens, first, time.perf_counter() - start


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], torch.Tensor, float]:
    x = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        first = hf(x).logits[0, -1].float().cpu()
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=2,
                    min_new_tokens=2, pad_token_id=2)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=2)
        torch.cuda.synchronize()
    return out[0, len(ids):].tolist(), first, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a registered name, a model folder or a .gguf file "
                   f"(default {DEFAULT_MODEL})")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: error: torch sees no CUDA device", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(args.model, progress=False)
    tok = Tokenizer(model_dir)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        sp = load_stage_model(str(model_dir), LayerRange(0, 30), is_first=True, is_last=True, dtype=dtype,
                              device="cuda")
        rows = []
        sp_greedy(sp, tok.encode(PROMPTS[0]), 4)  # warm-up (CUDA context, cuBLAS handles), as hf_greedy has
        for text in PROMPTS:
            ids = tok.encode(text)
            sp_tokens, sp_first, sp_s = sp_greedy(sp, ids, args.new_tokens)
            hf_tokens, hf_first, hf_s = hf_greedy(hf, ids, args.new_tokens)
            same = next((i for i, (a, b) in enumerate(zip(sp_tokens, hf_tokens, strict=True)) if a != b), len(sp_tokens))
            rows.append({"max_abs_logit_diff": (sp_first - hf_first).abs().max().item(), "matching_prefix": same,
                         "sp_tokens_per_s": args.new_tokens / sp_s,
                         "hf_generate_tokens_per_s": args.new_tokens / hf_s})
        name = str(dtype).removeprefix("torch.")
        report["dtypes"][name] = {"tolerance": TOLERANCE[dtype], "prompts": rows,
                                  "logits_within_tolerance": all(r["max_abs_logit_diff"] <= TOLERANCE[dtype]
                                                                 for r in rows)}
        print(name, json.dumps(report["dtypes"][name], indent=1))
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # kept if a later step fails
        del hf, sp
        torch.cuda.empty_cache()
    report["quantization_on_cuda"] = {"auto": effective_mode("auto", str(model_dir), "cuda")}
    for mode in ("int4", "int8"):
        try:
            load_stage_model(str(model_dir), LayerRange(0, 1), is_first=True, is_last=False, quantization=mode,
                             device="cuda")
            report["quantization_on_cuda"][mode] = "loaded"
        except Exception as err:  # noqa: BLE001 -- recorded, whatever it is: this is what the check is for
            report["quantization_on_cuda"][mode] = f"refused: {type(err).__name__}: {err}"
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["quantization_on_cuda"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
