"""GGUF RoPE factor tensors: Llama 3.x's `rope_freqs` and Phi-3's `rope_factors_*` read as the RoPE scaling.

What breaks when these fail: a Llama 3.1 / 3.2 GGUF (llama.cpp's converter stores the llama3 RoPE
scaling as a `rope_freqs` tensor of per-frequency divisors, [Note: GGUF RoPE factor tensors] in
pipeline/weights/gguf_metadata/families.py) refused, loaded unscaled, scaled the wrong way (multiplied instead
of divided), or its factors missing on a stage; a Phi-3 LongRoPE GGUF with its factor sets swapped, its
original context or attention factor lost; a malformed tensor accepted instead of refused with one
line naming it and the file (exit 2 from the CLI).
The oracle is the same f16-rounded tiny model loaded from its Hugging Face folder with
`rope_scaling: {rope_type: llama3, ...}` / `longrope` (paths checked against transformers in
tests/unit/test_families.py and tests/unit/test_rope_scaling.py); the GGUF's `rope_freqs` is computed
here with llama.cpp's formula.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.model.config import ModelConfig
from pipeline.weights.gguf_import import convert_gguf, open_gguf
from pipeline.weights.gguf_metadata.families import config_from_gguf
from tests.unit.test_families import PROMPT, Chain, _hf, _stages
from tests.unit.test_gguf_families import _f16_rounded_family_model, write_hf_family_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 48 positions: past the model's original context (32); its frequencies of wavelength > 32 / low_freq_factor
# are divided by `factor` (8), those between 32 / high_freq_factor and that are interpolated.
LONG_PROMPT = [(7 * i + 3) % 256 for i in range(48)]
TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_NEW_TOKENS = 12


def llama_cpp_rope_freqs(d: dict) -> np.ndarray:
    """[head_dim // 2] float32 divisors as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)
    computes them from a transformers config dict `d` with a llama3 rope scaling, except that the original
    context is the rope dict's here: the converter reads a top-level `original_max_position_embeddings`,
    else 8192, which equals the rope dict's 8192 for every Llama 3.x config but not the tiny model's 32."""
    rope = d.get("rope_scaling") or d["rope_parameters"]
    base = rope.get("rope_theta", d.get("rope_theta"))
    dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama3_model(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The f16-rounded llama3 family model (tests/family_models.py) with band limits moved so that its
    8 frequencies (theta 500000, head_dim 16: wavelengths 6.3, 32.6, 169, ...) fall in all three
    llama3 bands (kept below 32 / 2, interpolated up to 32 / 0.25, divided by 8 above)."""
    d, tensors = _f16_rounded_family_model(path, "llama3")
    d["rope_parameters"] |= {"low_freq_factor": 0.25, "high_freq_factor": 2.0}
    (path / "config.json").write_text(json.dumps(d))
    return d, tensors


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> dict[str, Path]:
    """The llama3 family model as an HF folder ('hf'), and converted from GGUFs with its `rope_freqs`
    ('gguf') and without ('unscaled')."""
    root = tmp_path_factory.mktemp("llama3")
    d, tensors = _llama3_model(root / "hf")
    freqs = llama_cpp_rope_freqs(d)
    assert 1.0 in freqs and 8.0 in freqs and ((freqs > 1) & (freqs < 8)).any()  # all three bands
    out = {"hf": root / "hf"}
    for name, extra in (("gguf", {"rope_freqs.weight": freqs}), ("unscaled", {})):
        write_hf_family_gguf(root / f"{name}.gguf", d, tensors, "llama3", arch="llama", extra=extra)
        out[name] = convert_gguf(root / f"{name}.gguf", root / name, progress=False)
    return out


def test_rope_freqs_gguf_logits_equal_the_hf_folder_with_llama3_rope_scaling(llama3):
    config = ModelConfig.from_model_dir(llama3["gguf"])
    want = Chain(_stages(llama3["hf"], 1))(LONG_PROMPT, 0, all_rows=True)
    with torch.no_grad():  # the oracle's own oracle: transformers on the folder (moved band limits) ...
        torch.testing.assert_close(want, _hf(llama3["hf"])(torch.tensor([LONG_PROMPT])).logits[0].float(),
                                   rtol=1e-4, atol=1e-4)
        # ... and on the converted folder, whose one-set longrope it reads as this runtime does
        torch.testing.assert_close(want, _hf(llama3["gguf"])(torch.tensor([LONG_PROMPT])).logits[0].float(),
                                   rtol=1e-4, atol=1e-4)
    for num_stages in (1, 2):
        got = Chain(_stages(llama3["gguf"], num_stages))(LONG_PROMPT, 0, all_rows=True)
        torch.testing.assert_close(got, want, **TOL)
    assert want.std() > 0.1, "degenerate oracle: near-constant logits"
    # The scaling matters here: the same weights without rope_freqs differ past the first positions.
    unscaled = Chain(_stages(llama3["unscaled"], 1))(LONG_PROMPT, 0, all_rows=True)
    assert (unscaled - want)[32:].abs().max() > 1e-2
    assert config.rope_scaling is not None and config.rope_scaling.attention_factor == 1.0


def test_rope_freqs_gguf_greedy_is_identical_on_one_to_three_stages_and_equals_the_hf_folder(llama3):
    want = Chain(_stages(llama3["hf"], 1)).greedy(LONG_PROMPT, NUM_NEW_TOKENS)
    outs = {s: Chain(_stages(llama3["gguf"], s)).greedy(LONG_PROMPT, NUM_NEW_TOKENS) for s in (1, 2, 3)}
    assert outs[1] == outs[2] == outs[3] == want, (outs, want)
    assert len(set(want)) > 3, "degenerate oracle: the random model repeats one token"


def test_rope_freqs_gguf_loads_per_stage_with_quantization_auto(llama3):
    """`--quantization auto` reads linears from the GGUF itself: the factor tensor is no weight to map."""
    from tests.unit.test_gguf_quantised_families import _stages as quant_stages

    one = Chain(quant_stages(llama3["gguf"], 1, "auto")).greedy(PROMPT, 6)
    assert Chain(quant_stages(llama3["gguf"], 2, "auto")).greedy(PROMPT, 6) == one


@pytest.mark.parametrize("bad, problem", [
    (np.ones(7, dtype=np.float32), r"must be F32 \[8\] \(one factor per rotary frequency\), got F32 \[7\]"),
    (np.ones(8, dtype=np.float16), r"must be F32 \[8\] \(one factor per rotary frequency\), got F16 \[8\]"),
    (np.array([1, 1, 1, 1, 2, 4, 8, 0], dtype=np.float32), r"must hold finite factors > 0"),
], ids=["length", "dtype", "zero"])
def test_malformed_rope_freqs_is_a_one_line_error_naming_tensor_and_file_and_exit_2(tmp_path, capsys, bad, problem):
    from launcher.cli.main import main

    d, tensors = _llama3_model(tmp_path / "hf")
    path = tmp_path / "bad.gguf"
    write_hf_family_gguf(path, d, tensors, "llama3", arch="llama", extra={"rope_freqs.weight": bad})
    with pytest.raises(ValueError, match=rf"GGUF file .*bad\.gguf: GGUF tensor 'rope_freqs\.weight' {problem}") as err:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    assert main(["launch", "--model", str(path), "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
    err_text = capsys.readouterr().err.strip()
    assert "\n" not in err_text and "'rope_freqs.weight'" in err_text and "bad.gguf" in err_text, err_text


def test_rope_freqs_with_a_metadata_scaling_too_is_refused(tmp_path):
    """llama.cpp's converter writes no such file; dividing the frequencies twice is not guessed at."""
    d, tensors = _llama3_model(tmp_path / "hf")
    freqs = llama_cpp_rope_freqs(d)
    d["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": d["rope_parameters"]["rope_theta"]}
    write_hf_family_gguf(tmp_path / "m.gguf", d, tensors, "llama3", arch="llama", extra={"rope_freqs.weight": freqs})
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF tensor 'rope_freqs\.weight' together with rope scaling "
                                         r"type 'linear' is not supported"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)


# -- Phi-3 LongRoPE: rope_factors_short / rope_factors_long ---------------------------------------------

@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory) -> dict[str, Path]:
    """The phi3-longrope model (original context 16 of 64, partial rotary 0.75: 6 factors per set) as an
    HF folder ('hf') and converted from the GGUF llama.cpp's converter writes for it ('gguf')."""
    root = tmp_path_factory.mktemp("phi3_longrope")
    d, tensors = _f16_rounded_family_model(root / "hf", "phi3-longrope")
    write_hf_family_gguf(root / "m.gguf", d, tensors, "phi3", arch="phi3")
    return {"hf": root / "hf", "gguf": convert_gguf(root / "m.gguf", root / "gguf", progress=False)}


def test_longrope_gguf_reads_the_hf_folder_s_scaling_and_its_logits_and_greedy_equal_it(phi3_longrope):
    ours, want = (ModelConfig.from_model_dir(phi3_longrope[k]) for k in ("gguf", "hf"))
    assert ours.partial_rotary_factor == want.partial_rotary_factor == 0.75
    got, ref = ours.rope_scaling.to_hf_dict(), want.rope_scaling.to_hf_dict()
    for key in ("short_factor", "long_factor"):  # the GGUF's float32 values: the frequencies' own precision
        assert np.array_equal(np.float32(got.pop(key)), np.float32(ref.pop(key))), key
    assert got.pop("attention_factor") == pytest.approx(ref.pop("attention_factor"), rel=1e-7) != 1.0
    assert got == ref  # rope_type, factor (64 / 16), original_max_position_embeddings
    prompt = LONG_PROMPT[:40]  # rows past the original context (16) take the long factors
    ref = Chain(_stages(phi3_longrope["hf"], 1))(prompt, 0, all_rows=True)
    for num_stages in (1, 2):
        torch.testing.assert_close(Chain(_stages(phi3_longrope["gguf"], num_stages))(prompt, 0, all_rows=True),
                                   ref, **TOL)
    greedy = Chain(_stages(phi3_longrope["hf"], 1)).greedy(PROMPT, NUM_NEW_TOKENS)  # decodes across 16
    assert Chain(_stages(phi3_longrope["gguf"], 1)).greedy(PROMPT, NUM_NEW_TOKENS) == greedy
    assert Chain(_stages(phi3_longrope["gguf"], 2)).greedy(PROMPT, NUM_NEW_TOKENS) == greedy


@pytest.mark.parametrize("attn_factor", [1.0625, False], ids=["gguf-key", "no-key"])
def test_longrope_attention_factor_is_the_gguf_s_else_transformers_default(tmp_path, attn_factor):
    """rope.scaling.attn_factor is what llama.cpp scales cos/sin by; a file without it (older converters)
    gets transformers' default for the folder's factor (max_position_embeddings / original: 64 / 16)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d, tensors = _f16_rounded_family_model(tmp_path / "hf", "phi3-longrope")
    write_hf_family_gguf(tmp_path / "m.gguf", d, tensors, "phi3", arch="phi3", attn_factor=attn_factor)
    got = config_from_gguf(open_gguf(tmp_path / "m.gguf")).rope_scaling.attention_factor
    default = ROPE_INIT_FUNCTIONS["longrope"](AutoConfig.from_pretrained(tmp_path / "hf"), "cpu")[1]
    assert default > 1.1 and got == pytest.approx(attn_factor or default, rel=1e-7)


def test_longrope_gguf_with_the_scaling_type_key_newer_converters_write_reads_the_same(tmp_path):
    """llama.cpp's TextModel.set_gguf_parameters writes rope.scaling.type = longrope for a LongRoPE config
    (the factors still come as tensors); without the tensors that key is refused naming them."""
    from pipeline.weights.gguf_metadata.families import hf_config_dict

    d, tensors = _f16_rounded_family_model(tmp_path / "hf", "phi3-longrope")
    for name, scaling_type in (("old", None), ("new", gguf.RopeScalingType.LONGROPE)):
        write_hf_family_gguf(tmp_path / f"{name}.gguf", d, tensors, "phi3", arch="phi3", scaling_type=scaling_type)
    want = hf_config_dict(open_gguf(tmp_path / "old.gguf"))
    assert want["rope_scaling"]["rope_type"] == "longrope"
    assert hf_config_dict(open_gguf(tmp_path / "new.gguf")) == want
    d, tensors = _f16_rounded_family_model(tmp_path / "plain", "phi3")
    write_hf_family_gguf(tmp_path / "lone.gguf", d, tensors, "phi3", scaling_type=gguf.RopeScalingType.LONGROPE)
    with pytest.raises(ValueError, match=r"lone\.gguf: GGUF rope scaling type 'longrope' comes without its factor "
                                         r"tensors 'rope_factors_long\.weight' and 'rope_factors_short\.weight'"):
        convert_gguf(tmp_path / "lone.gguf", tmp_path / "out", progress=False)


def test_malformed_longrope_factors_are_a_one_line_error_naming_the_tensor_and_file(tmp_path):
    d, tensors = _f16_rounded_family_model(tmp_path / "hf", "phi3-longrope")
    write_hf_family_gguf(tmp_path / "bad.gguf", d, tensors, "phi3", arch="phi3",
                         extra={"rope_factors_long.weight": np.ones(5, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"bad\.gguf: GGUF tensor 'rope_factors_long\.weight' must be F32 \[6\]"
                                         r" \(one factor per rotary frequency\), got F32 \[5\]") as err:
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
