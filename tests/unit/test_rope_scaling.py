"""Long-context RoPE variants (YaRN, LongRoPE, partial rotary), with Hugging Face transformers as the oracle.

What breaks when these fail: YaRN's per-dimension interpolation or its mscale on cos/sin
(transformers' `_compute_yarn_parameters`), LongRoPE's short/long factor sets, its attention factor
and the position at which the long set starts ([Note: LongRoPE switch] in pipeline/model/rope.py),
rotating only the first `rotary_dim` dims of a phi3 head, reading these settings from config.json
as transformers does (absent keys, phi3's top-level original context), or the one-line refusal
of dynamic NTK and unknown types.

Tolerance: the frequencies are the same float32 bits as transformers' (checked with torch.equal
below), so logits differ only by the order of float32 sums in attention and matmuls over four
layers: ~1e-6 here, checked at 1e-4 as tests/unit/test_families.py does; a wrong frequency, factor
set or attention factor moves them by more than 1e-3 (the guard test).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.rope import config_inv_freq, rope_cos_sin, rotate, rotation_tables
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.family_models import ROPE_CONFIGS, family_config, hf_config, write_family_model
from tests.in_process_pipeline import InProcessPipeline
from tests.unit.test_families import TOL, Chain, _hf, _stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250, 12, 64]  # 12 positions: inside the original 16
NUM_NEW_TOKENS = 28  # decoding reaches position 39, well past the original context
LONG_PROMPT = [(7 * i + 3) % 256 for i in range(40)]
ORIGINAL = 16



@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    return {f: write_family_model(tmp_path_factory.mktemp(f), f, seed=3) for f in ROPE_CONFIGS}


# -- frequencies and rotation against transformers' own functions -----------------------------------

@pytest.mark.parametrize("family", list(ROPE_CONFIGS))
def test_inv_freq_and_attention_factor_are_transformers_bits(family):
    hf = hf_config(family)
    ours = family_config(family)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    assert torch.equal(config_inv_freq(ours, local=False), inv_freq)
    assert ours.rope_scaling.attention_factor == attention_factor != 1.0
    assert ours.rope_scaling.original_max_position_embeddings == ORIGINAL
    if ours.rope_scaling.rope_type == "longrope":  # the long set, as transformers builds it past the original context
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=ORIGINAL + 1)
        assert torch.equal(config_inv_freq(ours, local=False, long=True), long)
        assert not torch.equal(long, inv_freq)


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16, beta_fast=4, beta_slow=2, truncate=False),
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=None, attention_factor=0.9),
])
def test_yarn_variants_match_transformers(rope):
    hf = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=128,
                                  rope_theta=50000.0, rope_scaling=dict(rope))
    ours = ModelConfig.from_hf_dict(hf.to_dict())
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(config_inv_freq(ours, local=False), inv_freq)
    assert ours.rope_scaling.attention_factor == attention_factor



@pytest.mark.parametrize("rotary_dim", [8, 12])
def test_partial_rotation_is_phi3s_apply_rotary_pos_emb_bitwise(rotary_dim):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(rotary_dim)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(5) * 11, config_inv_freq(
        family_config("phi3-longrope"), local=False)[:rotary_dim // 2], torch.float32, attention_factor=1.2)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    tables = rotation_tables(cos, sin)
    assert torch.equal(rotate(q, *tables), want_q[0].transpose(0, 1))
    assert torch.equal(rotate(k, *tables), want_k[0].transpose(0, 1))
    assert torch.equal(rotate(q, *tables)[..., rotary_dim:], q[..., rotary_dim:])


def test_longrope_picks_the_factor_set_by_each_rows_position_not_by_the_pass():
    config = family_config("phi3-longrope")
    short, long = (config_inv_freq(config, local=False, long=b) for b in (False, True))
    both = rope_cos_sin(torch.tensor([3, 15, 16, 30]), short, torch.float32, long_inv_freq=long, long_from=ORIGINAL)
    alone = [rope_cos_sin(torch.tensor([p]), long if p >= ORIGINAL else short, torch.float32) for p in (3, 15, 16, 30)]
    for i, (cos, sin) in enumerate(alone):
        assert torch.equal(both[0][i], cos[0]) and torch.equal(both[1][i], sin[0])


# -- config.json: what is read, what is refused ------------------------------------------------------

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4}


@pytest.mark.parametrize("bad, match", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not supported: .*batching"),
    (dict(rope_scaling={"type": "ntk-by-parts", "factor": 2.0}), "'ntk-by-parts' is not supported .*yarn, longrope"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported for llama"),
    (dict(model_type="phi3", partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(model_type="phi3", partial_rotary_factor=0.0), r"must be in \(0, 1\] and give head_dim 16 an even .*got 0.0"),
    (dict(model_type="phi3", partial_rotary_factor=0.1875), r"an even rotary_dim >= 2, got 0.1875"),  # 3 dims
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}), "'rope_scaling.beta_fast' must be"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7,
                        "original_max_position_embeddings": 16}), "short_factor and long_factor .* 8 and 7"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                        "original_max_position_embeddings": 16}), "have 4 entries, expected rotary_dim // 2 = 8"),
])
def test_unsupported_rope_settings_are_one_line_errors_naming_them(bad, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_hf_dict(_BASE | bad)
    assert "\n" not in str(err.value)


def test_phi3_reads_its_top_level_original_context_and_su_as_longrope():
    rope = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 99}
    config = ModelConfig.from_hf_dict(_BASE | {"model_type": "phi3", "max_position_embeddings": 4096 * 32,
                                               "rope_scaling": rope})
    assert config.rope_scaling.rope_type == "longrope"
    assert config.rope_scaling.original_max_position_embeddings == 4096  # Phi3Config's default wins over the dict
    assert config.rope_scaling.factor == 32.0
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again.rope_scaling == config.rope_scaling


# Real checkpoints' original contexts: with the tiny models' 16 positions both YaRN correction dims clamp
# to 0, so beta_fast / beta_slow (and their defaults) would not change a single bit there.
@pytest.mark.parametrize("rope", [
    dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),  # Qwen2.5's long-context recipe
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, beta_fast=None, beta_slow=None),
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707,
         beta_fast=32, beta_slow=1),  # DeepSeek-style
])
def test_yarn_read_from_a_raw_config_json_at_a_real_original_context_is_transformers_bits(rope):
    raw = _BASE | dict(model_type="qwen2", hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                       rope_theta=1000000.0, rope_scaling=rope)
    hf = transformers.Qwen2Config(**copy.deepcopy(raw))
    ours = ModelConfig.from_hf_dict(copy.deepcopy(raw))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(config_inv_freq(ours, local=False), inv_freq)
    assert ours.rope_scaling.attention_factor == attention_factor
    assert not torch.equal(inv_freq[:32], inv_freq[:32] / rope["factor"]), "no dimension is kept: a vacuous case"


@pytest.mark.parametrize("legacy_type", ["su", "yarn", "longrope"])
def test_phi3_legacy_rope_types_read_as_transformers_phi3config_reads_them(legacy_type):
    """Phi3Config turns "su" and "yarn" (Phi-3's early configs) into "longrope"; so does speedpipe."""
    raw = _BASE | dict(model_type="phi3", max_position_embeddings=4096 * 32, rope_scaling=dict(
        type=legacy_type, short_factor=[1.0 + i / 16 for i in range(8)], long_factor=[1.0 + i for i in range(8)]))
    hf = transformers.Phi3Config(**copy.deepcopy(raw))
    ours = ModelConfig.from_hf_dict(copy.deepcopy(raw))
    assert hf.rope_parameters["rope_type"] == ours.rope_scaling.rope_type == "longrope"
    for long in (False, True):
        want, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097 if long else None)
        assert torch.equal(config_inv_freq(ours, local=False, long=long), want)
        assert ours.rope_scaling.attention_factor == attention_factor


def test_the_next_layer_drafter_refuses_what_its_training_forward_does_not_apply():
    from pipeline.speculation.drafting.layer_drafter import unsupported_reason

    assert "YaRN or LongRoPE" in unsupported_reason(family_config("qwen2-yarn"))
    assert "YaRN or LongRoPE" in unsupported_reason(family_config("llama-longrope"))
    # One factor set and no attention factor (a GGUF's rope_freqs): only the frequencies, which it applies.
    one_set = dataclasses.replace(family_config("llama-longrope").rope_scaling, attention_factor=1.0,
                                  long_factor=family_config("llama-longrope").rope_scaling.short_factor)
    assert unsupported_reason(dataclasses.replace(family_config("llama-longrope"), rope_scaling=one_set)) is None
    assert unsupported_reason(family_config("llama3")) is None
    # Two factor sets switch by position, which the training forward does not, even with no attention factor.
    two_sets = dataclasses.replace(family_config("llama-longrope").rope_scaling, attention_factor=1.0)
    assert "YaRN or LongRoPE" in unsupported_reason(dataclasses.replace(family_config("llama-longrope"),
                                                                        rope_scaling=two_sets))


# -- the decoder against transformers, past the original context --------------------------------------

def _greedy_with_logits(chain: Chain, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits [n, vocab], one decode row per pass."""
    logits, out, steps = chain(prompt, 0), [], []
    for _ in range(n):
        steps.append(logits[-1])
        out.append(int(logits[-1].argmax()))
        logits = chain([out[-1]], len(prompt) + len(out) - 1)
    return out, torch.stack(steps)


def _hf_generate(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy `generate`: tokens and each step's logits [n, vocab]."""
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)
    return ref.sequences[0, len(prompt):].tolist(), torch.cat(ref.logits).float()


def _hf_stepwise(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' model run as `generate` runs it, a prompt pass then one row per pass on its
    DynamicCache, without phi3's `prepare_inputs_for_generation`, which drops the cache and re-encodes
    the whole sequence with the long factors at the first step past the original context
    ([Note: LongRoPE switch] in pipeline/model/rope.py)."""
    cache, ids, out, steps = transformers.DynamicCache(config=hf.config), prompt, [], []
    with torch.no_grad():
        for _ in range(n):
            start = len(prompt) + len(out) - len(ids)
            logits = hf(torch.tensor([ids]), cache=cache, use_cache=True,
                        position_ids=torch.arange(start, start + len(ids))[None]).logits[0, -1].float()
            steps.append(logits)
            out.append(int(logits.argmax()))
            ids = [out[-1]]
    return out, torch.stack(steps)


@pytest.mark.parametrize("family", list(ROPE_CONFIGS))
def test_greedy_past_the_original_context_equals_transformers_on_one_and_two_stages(folders, family):
    """Token-identical to transformers' `generate` (phi3: to its model stepped as `generate` steps other
    families, see `_hf_stepwise`), step logits within TOL, on one and two stages."""
    hf = _hf(folders[family])
    ref_tokens, ref_logits = (_hf_stepwise if family == "phi3-longrope" else _hf_generate)(hf, PROMPT, NUM_NEW_TOKENS)
    outs = {s: _greedy_with_logits(Chain(_stages(folders[family], s)), PROMPT, NUM_NEW_TOKENS) for s in (1, 2)}
    assert outs[1][0] == outs[2][0] == ref_tokens, (outs[1][0], outs[2][0], ref_tokens)
    for _, logits in outs.values():
        torch.testing.assert_close(logits, ref_logits, **TOL)
    assert len(set(ref_tokens)) > 3, "degenerate oracle: the random model repeats one token"


def test_phi3_generate_agrees_until_it_re_encodes_past_the_original_context(folders):
    """The documented difference: phi3's `generate` equals the stepwise run (and so speedpipe) while the
    sequence fits in the original context, and re-encodes everything with the long factors after."""
    hf = _hf(folders["phi3-longrope"])
    (gen, gen_logits), (step, step_logits) = (f(hf, PROMPT, 8) for f in (_hf_generate, _hf_stepwise))
    fits = ORIGINAL - len(PROMPT) + 1  # steps whose last row is at a position < ORIGINAL
    assert gen[:fits] == step[:fits]
    torch.testing.assert_close(gen_logits[:fits], step_logits[:fits], **TOL)
    assert (gen_logits[fits] - step_logits[fits]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama-yarn", "qwen2-yarn", "qwen3-yarn"])
def test_yarn_prompt_longer_than_the_original_context_matches_transformers_logits(folders, family):
    logits = Chain(_stages(folders[family], 2))(LONG_PROMPT, 0, all_rows=True)
    with torch.no_grad():
        ref = _hf(folders[family])(torch.tensor([LONG_PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, ref, **TOL)


def test_longrope_logits_do_not_depend_on_how_the_prompt_is_split_into_passes(folders):
    stages = _stages(folders["phi3-longrope"], 2)
    whole = Chain(stages)(LONG_PROMPT, 0, all_rows=True)
    chain = Chain(stages)
    parts = [chain(LONG_PROMPT[a:b], a, all_rows=True) for a, b in ((0, 10), (10, 17), (17, 40))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, off", [
    ("qwen2-yarn", dict(rope_scaling=None)),
    ("llama-yarn", dict(rope_scaling=None)),
    ("phi3-longrope", dict(partial_rotary_factor=1.0, rope_scaling=None)),
    ("phi3-longrope", "short factors past the original context"),
    ("phi3-longrope", "attention factor 1"),
])
def test_the_scaling_really_changes_the_logits_past_the_original_context(folders, family, off):
    """Guard for the comparisons above: each setting moves the logits by more than their tolerance."""
    reader = CheckpointReader(folders[family])
    cfg = reader.config
    if off == "short factors past the original context":
        off = dict(rope_scaling=dataclasses.replace(cfg.rope_scaling, long_factor=cfg.rope_scaling.short_factor))
    elif off == "attention factor 1":
        off = dict(rope_scaling=dataclasses.replace(cfg.rope_scaling, attention_factor=1.0))
    tensors = reader.read(all_tensor_names(cfg), dtype=torch.float32)
    full = LayerRange(0, cfg.num_hidden_layers)
    a, b = (Chain([build_stage_model(c, full, is_first=True, is_last=True, tensors=tensors)])(
        LONG_PROMPT, 0, all_rows=True)[ORIGINAL:] for c in (cfg, dataclasses.replace(cfg, **off)))
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["phi3-longrope", "qwen2-yarn"])
def test_speculation_with_squashed_drafts_gives_plain_greedy_past_the_original_context(folders, family):
    prompts, budgets = [PROMPT, PROMPT[:5]], (NUM_NEW_TOKENS, 20)
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
    reference = [Chain(_stages(folders[family], 1)).greedy(p, b) for p, b in zip(prompts, budgets, strict=True)]
    table = ReferenceTable(zip(prompts, reference, strict=True))
    pipe = InProcessPipeline(_stages(folders[family], 2), max_model_len=64,
                             predictor=AlwaysWrongPredictor(table, vocab_size=256))
    assert pipe.generate(prompts, params) == reference
    assert pipe.engine.spec.squashed_items > 0, "no draft was squashed: speculation was not exercised"
