"""`--quantization auto` on quantised GGUFs of every family the loader supports.

What breaks when these fail: a family's quantised tensors (phi3's fused attn_qkv / ffn_up, the
stacked Q4/Q8 experts and the router of mixtral and qwen3moe, qwen2's biases beside Q4 weights,
gemma, gemma2 and gemma3's tied Q4 embedding as the head, Gemma 2's soft-caps and sliding layers in
bfloat16) reaching the int4 / int8 kernels as the file's own blocks,
a split changing a number, SPEED changing a token, or the result drifting from the float32 model of
the same dequantised weights.

Each family's tiny GGUF stores every matrix whose rows are whole 32-weight blocks as Q8_0, Q4_0 or
Q4_1 (`gguf.quants.quantize`), other matrices F16 and norms F32, as llama.cpp's quantiser does.
Q4_K and Q6_K (no numpy `quantize` in gguf) are covered by hand-built blocks in
tests/unit/test_gguf_k_quants.py, and on a real Q4_K_M file in tests/integration. The float32
reference is the folder `convert_gguf` wrote (`gguf.quants.dequantize` of every tensor, checked here
too) loaded dense.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from pipeline.model.partition import LayerRange, balanced_split
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.checkpoint import CheckpointReader
from pipeline.weights.gguf_import import convert_gguf, open_gguf
from pipeline.weights.quant import Int4Linear, Int8Linear
from pipeline.weights.quant_load import fused_linears, linear_weight_bytes, load_stage_model
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.in_process_pipeline import InProcessPipeline
from tests.unit.test_families import PROMPT, Chain
from tests.unit.test_gguf_families import (
    _config,
    _f16_rounded_family_model,
    write_family_gguf,
    write_hf_family_gguf,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
QUANTS = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
# family -> GGUF architecture (mistral stands for llama: same architecture, Q/K rows permuted).
FAMILIES = {
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
}
NUM_NEW_TOKENS = 6
MAX_MODEL_LEN = 48

# Tolerance, per logits row: ||auto - float32|| / ||float32||. The quantised model runs bfloat16
# activations and KV (8 mantissa bits); a dense bfloat16 model of the same weights alone is off by up
# to 0.09 on these models (measured), Q4 blocks add nothing (the file's own q, scale and minimum; the
# kernel rounds scales to bfloat16) and Q8_0 little (re-scaled to one scale per row: error up to half
# a step of the row's largest block). In an MoE layer a router near-tie can switch one expert for a
# row (measured worst row 0.23, qwen3_moe Q4_0). A lost un-permute, a wrong expert slice or a router
# read from another tensor leaves the logits unrelated to the reference: relative error ~1.4.
MAX_ROW_ERROR = 0.35
MEAN_ROW_ERROR = 0.12



@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[tuple[str, Q], tuple]:
    """(family, quant) -> (the GGUF, its converted folder)."""
    out = {}
    for family, arch in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        if family == "gemma3_text":  # gemma3's GGUF keys (norm shift, window) come from the arch writer
            config = dataclasses.replace(
                _config(family), hidden_size=64, intermediate_size=96, head_dim=32, query_pre_attn_scalar=32
            )
        else:
            d, tensors = _f16_rounded_family_model(root / "hf", family)
        for quant in QUANTS:
            path = root / f"{quant.name}.gguf"
            if family == "gemma3_text":
                write_family_gguf(path, arch, config, quant=quant)
            else:
                write_hf_family_gguf(path, d, tensors, family, arch=arch, quant=quant)
            out[family, quant] = path, convert_gguf(path, root / quant.name, progress=False)
    return out


def _stages(folder, num_stages: int, quantization: str) -> list:
    n = CheckpointReader(folder).config.num_hidden_layers
    ranges = balanced_split(n, num_stages)
    return [
        load_stage_model(
            str(folder), r, is_first=i == 0, is_last=i == num_stages - 1, quantization=quantization
        )
        for i, r in enumerate(ranges)
    ]


def _expected_module(quant: Q, in_features: int) -> type:
    """The module `auto` runs for a linear with `in_features` inputs stored in `quant`: the file's
    own Q4 blocks -> Int4Linear, Q8_0 -> Int8Linear; a matrix whose rows are not whole blocks is F16
    in the file (qwen3_moe's experts of width 48), has no kernel as it is and is requantised to int8
    rows (quant_load._requantise). No projection stays a dense nn.Linear."""
    if in_features % 32:
        return Int8Linear
    return Int8Linear if quant == Q.Q8_0 else Int4Linear


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_runs_every_family_s_quantised_blocks_close_to_float32_and_identically_on_1_and_2_stages(
    ggufs, family, quant
):
    path, folder = ggufs[family, quant]
    full = _stages(folder, 1, "auto")[0]
    linears = {
        n: m for n, m in full.named_modules() if isinstance(m, (torch.nn.Linear, Int4Linear, Int8Linear))
    }
    assert "lm_head" in linears and len(linears) > 4 * full.config.num_hidden_layers
    for name, module in linears.items():
        assert type(module) is _expected_module(quant, module.in_features), (name, type(module).__name__)
    if full.config.num_experts:
        assert any(".experts." in n for n in linears) and any(n.endswith("mlp.gate") for n in linears)

    dense = _stages(folder, 1, "none")[0]
    got = Chain([full])(PROMPT, 0, all_rows=True).float()
    want = Chain([dense])(PROMPT, 0, all_rows=True)
    assert want.std() > 0.1, "degenerate model: near-constant logits"
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)  # [len(PROMPT)]
    assert err.max() < MAX_ROW_ERROR and err.mean() < MEAN_ROW_ERROR, err.tolist()

    one = Chain([full]).greedy(PROMPT, NUM_NEW_TOKENS)
    assert Chain(_stages(folder, 2, "auto")).greedy(PROMPT, NUM_NEW_TOKENS) == one


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_split_s_linear_bytes_are_what_each_mode_builds(ggufs, family, quant):
    """`linear_weight_bytes` (what the split costs the LM head by, before any stage loads: [Note:
    partition cost]) equals the bytes each built linear holds, per numeric mode: the GGUF's own block
    types in auto (Q8_0 -> int8 rows, Q4 -> int4, a width-48 expert or a router -> int8), int4 / int8
    requantised, dense float32 and bfloat16."""
    _, folder = ggufs[family, quant]
    config = CheckpointReader(folder).config
    full = LayerRange(0, config.num_hidden_layers)
    for mode, dtype in (("auto", torch.float32), ("int4", torch.float32), ("int8", torch.float32),
                        ("none", torch.float32), ("none", torch.bfloat16)):
        want = linear_weight_bytes(config, full, is_last=True, quantization=mode, dtype=dtype, model_dir=str(folder))
        model = load_stage_model(str(folder), full, is_first=True, is_last=True, quantization=mode, dtype=dtype)
        for module, names in fused_linears(config, full, is_last=True).items():
            got = model.get_submodule(module)
            held = sum(t.numel() * t.element_size() for n, t in [*got.named_parameters(), *got.named_buffers()]
                       if n != "bias")
            assert sum(want[n] for n in names) == held, (mode, dtype, module, type(got).__name__)


@pytest.mark.parametrize("family", ["phi3", "mixtral", "qwen3_moe"])
def test_speed_on_two_stages_of_a_q4_gguf_gives_plain_greedy_tokens(ggufs, family):
    """An always-wrong predictor: every draft is squashed on both stages of the int4 model (one
    sequence, so the idle stage runs drafts)."""
    _, folder = ggufs[family, Q.Q4_0]
    prompts, params = [PROMPT], SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    plain = InProcessPipeline(_stages(folder, 2, "auto"), max_model_len=MAX_MODEL_LEN).generate(
        prompts, params
    )
    predictor = AlwaysWrongPredictor(ReferenceTable(zip(prompts, plain, strict=True)), vocab_size=256)
    spec = InProcessPipeline(_stages(folder, 2, "auto"), max_model_len=MAX_MODEL_LEN, predictor=predictor)
    assert spec.generate(prompts, params) == plain
    assert spec.engine.spec.squashed_items > 0


@pytest.mark.parametrize("family", ["phi3", "mixtral", "qwen3_moe"])
def test_the_float32_reference_is_gguf_s_own_dequantisation(ggufs, family):
    """The reference folder holds exactly `gguf.quants.dequantize` of the file's fused and expert tensors."""
    path, folder = ggufs[family, Q.Q4_1]
    reader = CheckpointReader(folder)
    stacked = {t.name: t for t in open_gguf(path).tensors}
    t = stacked["blk.0.ffn_up_exps.weight" if family != "phi3" else "blk.0.attn_qkv.weight"]
    assert t.tensor_type == Q.Q4_1
    whole = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    if family == "phi3":
        names, parts = ["model.layers.0.self_attn.qkv_proj.weight"], [whole]
    else:
        expert = "block_sparse_moe.experts.1.w3" if family == "mixtral" else "mlp.experts.1.up_proj"
        names, parts = [f"model.layers.0.{expert}.weight"], [whole[1]]
    got = reader.read(names, dtype=torch.float32)
    for name, want in zip(names, parts, strict=True):
        torch.testing.assert_close(got[name], torch.from_numpy(np.ascontiguousarray(want)), rtol=0, atol=0)
