"""Every supported family on a tiny random model, with Hugging Face transformers as the oracle.

What breaks when these fail: a family feature of the decoder (Llama-3 RoPE scaling, Mistral's
sliding window, Qwen2 q/k/v bias, Qwen3 q/k norm, Gemma's (1 + w) norms, GeGLU, embedding scale and
head_dim apart from hidden / heads, Gemma 2/3's sandwich norms, query scale, local/global layers (Gemma 3
with their own RoPE bases), Gemma 2's attention soft-cap on both attention paths, logit soft-capping,
phi3's fused checkpoint tensors, Mixtral / Qwen3-MoE routing and dense layers), reading a family's
config.json, the checkpoint names a stage reads, or splitting a family's model into stages.

The models come from transformers' own config classes (tests/family_models.py); transformers loads
the same safetensors folder with `from_pretrained` (so our checkpoint names are the Hub's: it
converts Mixtral's and Qwen3-MoE's per-expert tensors itself).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pipeline.model.attention import SMALL_ITEM_ROWS
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange, balanced_split
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel, build_stage_model
from pipeline.speculation.predictors import LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names, stage_tensor_names
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.family_models import FAMILY_CONFIGS, family_config, write_family_model
from tests.in_process_pipeline import InProcessPipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = list(FAMILY_CONFIGS)
TOL = {"rtol": 1e-4, "atol": 1e-4}
MAX_MODEL_LEN = 96
PROMPT = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250, 12, 64]  # longer than every sliding window
NUM_NEW_TOKENS = 16



@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    return {f: write_family_model(tmp_path_factory.mktemp(f), f, seed=3) for f in FAMILIES}


def _hf(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, attn_implementation="eager")
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    assert not missing and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _stages(folder, num_stages: int) -> list[StageModel]:
    reader = CheckpointReader(folder)
    cfg = reader.config
    ranges = balanced_split(cfg.num_hidden_layers, num_stages)
    out = []
    for i, r in enumerate(ranges):
        first, last = i == 0, i == num_stages - 1
        tensors = reader.read(stage_tensor_names(cfg, r, is_first=first, is_last=last), dtype=torch.float32)
        out.append(build_stage_model(cfg, r, is_first=first, is_last=last, tensors=tensors))
    return out


class Chain:
    """Stage models run one after the other, each with its own KV cache (an in-process pipeline)."""

    def __init__(self, stages: list[StageModel]) -> None:
        self.stages = stages
        self.kvs = [s.new_kv_cache(max_num_seqs=1, max_model_len=MAX_MODEL_LEN) for s in stages]

    def __call__(self, ids: list[int], start: int, *, all_rows: bool = False) -> torch.Tensor:
        x = torch.tensor(ids, dtype=torch.int64)
        spans = [Span(0, start, len(ids))]
        for stage, kv in zip(self.stages, self.kvs, strict=True):
            rows = torch.arange(len(ids)) if all_rows and stage.is_last else None
            x = stage(x, spans, kv, logit_rows=rows)
        return x

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        logits = self(prompt, 0)
        out = []
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            logits = self([out[-1]], len(prompt) + len(out) - 1)
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_last_stage_logits_match_transformers(folders, family):
    ours = Chain(_stages(folders[family], 2))(PROMPT, 0, all_rows=True)
    with torch.no_grad():
        ref = _hf(folders[family])(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape == (len(PROMPT), 256)
    torch.testing.assert_close(ours, ref, **TOL)
    assert ref.std() > 0.1, "degenerate oracle: near-constant logits"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_identical_across_one_to_three_stages_and_equals_transformers_generate(folders, family):
    outs = {s: Chain(_stages(folders[family], s)).greedy(PROMPT, NUM_NEW_TOKENS) for s in (1, 2, 3)}
    assert outs[1] == outs[2] == outs[3], outs
    with torch.no_grad():
        ref = _hf(folders[family]).generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                            eos_token_id=None, pad_token_id=0)
    assert ref[0, len(PROMPT):].tolist() == outs[1]
    assert len(set(outs[1])) > 3, "degenerate oracle: the random model repeats one token"


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_tensor_names_are_exactly_the_parameters_each_stage_builds(family):
    cfg = family_config(family)
    for ranges in (balanced_split(4, 1), balanced_split(4, 3)):
        for i, r in enumerate(ranges):
            first, last = i == 0, i == len(ranges) - 1
            with torch.device("meta"):
                model = StageModel(cfg, r, is_first=first, is_last=last)
            from pipeline.model.tensor_names import checkpoint_name
            wanted = {checkpoint_name(n, cfg) for n, _ in model.named_parameters()}
            assert set(stage_tensor_names(cfg, r, is_first=first, is_last=last)) == wanted


def test_each_stage_reads_only_its_own_layers_tensors(folders):
    for family in ("mixtral", "gemma3_text", "phi3"):
        reader = CheckpointReader(folders[family])
        cfg = reader.config
        r = LayerRange(1, 3)
        tensors = reader.read(stage_tensor_names(cfg, r, is_first=False, is_last=False), dtype=torch.float32)
        build_stage_model(cfg, r, is_first=False, is_last=False, tensors=tensors)
        assert reader.read_names == set(tensors)
        assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in reader.read_names)
        assert reader.read_names < set(all_tensor_names(cfg))


def test_family_features_are_read_from_transformers_configs():
    gemma = family_config("gemma3_text")
    assert (gemma.norm_weight_offset, gemma.sandwich_norms, gemma.qk_norm, gemma.hidden_act) == \
        (1.0, True, True, "gelu_pytorch_tanh")
    assert gemma.embedding_scale == 8.0 and gemma.rope_local_theta == 10000.0 and gemma.rope_theta == 1e6
    assert gemma.layer_types[:2] == ("sliding_attention", "full_attention") and gemma.sliding_window == 6
    assert gemma.final_logit_softcapping == 5.0 and gemma.rope_scaling.rope_type == "linear"
    moe = family_config("qwen3_moe")
    assert [moe.is_moe_layer(i) for i in range(4)] == [True, False, True, True] and not moe.norm_topk_prob
    assert family_config("mixtral").norm_topk_prob and family_config("mistral").is_sliding(3)
    assert family_config("llama3").rope_scaling.rope_type == "llama3"


FEATURES_OFF = {
    "gemma3_text": ("gemma3_text", dict(final_logit_softcapping=None, rope_local_theta=None)),
    "mistral": ("mistral", dict(sliding_window=None, layer_types=())),
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=True)),
    "gemma2-attention-cap": ("gemma2", dict(attn_logit_softcapping=None)),
    "gemma2-final-cap": ("gemma2", dict(final_logit_softcapping=None)),
    "gemma2-window": ("gemma2", dict(sliding_window=None, layer_types=())),
    "gemma-embedding-scale": ("gemma", dict(embedding_scale=1.0)),
}


@pytest.mark.parametrize("case", list(FEATURES_OFF))
def test_a_family_feature_switched_off_changes_the_logits(folders, case):
    """Guard for the comparisons above: the family features really change the numbers."""
    import dataclasses

    family, off = FEATURES_OFF[case]
    reader = CheckpointReader(folders[family])
    cfg = reader.config
    tensors = reader.read(all_tensor_names(cfg), dtype=torch.float32)
    full = LayerRange(0, cfg.num_hidden_layers)
    a, b = (Chain([build_stage_model(c, full, is_first=True, is_last=True, tensors=tensors)])(PROMPT, 0)
            for c in (cfg, dataclasses.replace(cfg, **off)))
    assert (a - b).abs().max() > 1e-3


LONG_PROMPT = [(7 * i + 3) % 250 + 3 for i in range(SMALL_ITEM_ROWS + 8)]  # a prefill on the SDPA path


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_a_prefill_longer_than_a_batched_item_equals_transformers(folders, family):
    """A prompt of more than SMALL_ITEM_ROWS tokens is attended by the prefill path (SDPA, or its
    soft-capped form for Gemma 2), the decode rows after it by the batched path: both as transformers."""
    ours = Chain(_stages(folders[family], 2))(LONG_PROMPT, 0, all_rows=True)
    hf = _hf(folders[family])
    with torch.no_grad():
        ref = hf(torch.tensor([LONG_PROMPT])).logits[0].float()
        want = hf.generate(torch.tensor([LONG_PROMPT]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                           eos_token_id=None, pad_token_id=0)[0, len(LONG_PROMPT):].tolist()
    torch.testing.assert_close(ours, ref, **TOL)
    assert {s: Chain(_stages(folders[family], s)).greedy(LONG_PROMPT, NUM_NEW_TOKENS) for s in (1, 3)} == \
        {1: want, 3: want}


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_logit_lens_after_the_last_layer_gives_transformers_next_token_probabilities(tmp_path, family):
    """The exit head the worker builds is the model's own head: on the last layer's output it gives
    transformers' next-token token and probability, the final logit soft-cap included (Gemma 2/3; a
    cap of 0.5 here, as the tiny models' logits stay under 1). Before: the exit head skipped the cap,
    so its guesses' confidences (the draft gate's buckets, hybrid's choice) were not the model's."""
    import json

    from pipeline.engine.stage_assembly import StageLoadSpec, build_exit_head

    folder = write_family_model(tmp_path / family, family, seed=3)
    d = json.loads((folder / "config.json").read_text()) | {"final_logit_softcapping": 0.5}
    (folder / "config.json").write_text(json.dumps(d))
    reader = CheckpointReader(folder)
    n = reader.config.num_hidden_layers
    spec = StageLoadSpec(model_dir=str(folder), stage_index=0, num_stages=1, layer_range=LayerRange(0, n),
                         exit_layer=n - 1)
    head = build_exit_head(reader.config, reader, spec)
    hf = _hf(folder)
    seen = {}
    hook = hf.model.norm.register_forward_hook(lambda m, i, o: seen.update(h=i[0][0].clone()))
    with torch.no_grad():
        want = torch.softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1).max(dim=-1)
        hf.config.final_logit_softcapping = None
        uncapped = torch.softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1).max(dim=-1).values
    hook.remove()
    assert (uncapped - want.values).abs().max() > 1e-3, "the cap does not bite: the comparison proves nothing"
    tokens, probs = head(seen["h"])
    assert tokens.tolist() == want.indices.tolist()
    torch.testing.assert_close(probs, want.values, **TOL)


def test_gemma_configs_read_as_transformers_reads_them():
    """Keys absent from config.json take transformers' defaults: Gemma2Config's layer_types rule
    (sliding, full, ...), window and soft-caps; GemmaConfig's legacy `hidden_act: gelu` is tanh-GELU."""
    for n in (3, 5, 6):
        d = transformers.Gemma2Config(num_hidden_layers=n).to_dict()
        want = tuple(d.pop("layer_types"))
        for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            want_value = d.pop(key)
            assert getattr(ModelConfig.from_hf_dict(d), key) == want_value, key
        assert ModelConfig.from_hf_dict(d).layer_types == want
    legacy = transformers.GemmaConfig(hidden_act="gelu")
    d = legacy.to_dict() | {"hidden_act": "gelu"}
    assert ModelConfig.from_hf_dict(d).hidden_act == legacy.hidden_act == "gelu_pytorch_tanh"


def test_gemma_embedding_scale_is_cast_to_the_activation_dtype_as_transformers():
    """Gemma 7B's sqrt(3072) = 55.43 becomes 55.5 in bfloat16 before it multiplies (transformers'
    GemmaTextScaledWordEmbedding); a float32 scale would give other bfloat16 embeddings."""
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from pipeline.model.family_blocks import make_embedding

    d = transformers.GemmaConfig(vocab_size=16, hidden_size=3072, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=8, num_hidden_layers=1).to_dict()
    ours = make_embedding(ModelConfig.from_hf_dict(d)).to(torch.bfloat16)
    ref = GemmaTextScaledWordEmbedding(16, 3072, 0, embed_scale=3072 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16, 3072, generator=torch.Generator().manual_seed(0)))
        ref.weight.copy_(ours.weight)
        ids = torch.arange(16)
        assert torch.equal(ours(ids), ref(ids))
        assert not torch.equal(ours(ids), (ours.weight.float() * 3072 ** 0.5).to(torch.bfloat16))


@pytest.mark.parametrize("bad, match", [
    (dict(model_type="falcon"), "model_type 'falcon' is not supported .*llama.*gemma3_text"),
    (dict(model_type="llama", attn_logit_softcapping=50.0), "llama config attn_logit_softcapping=50.0"),
    (dict(model_type="gemma", attn_logit_softcapping=50.0), "gemma config attn_logit_softcapping=50.0"),
    # transformers' Gemma 3 attention takes no cap (its Gemma 2 does)
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "gemma3_text config attn_logit_softcapping"),
    (dict(model_type="gemma2", attn_logit_softcapping=0.0), "attn_logit_softcapping must be > 0, got 0.0"),
    (dict(model_type="gemma2", attn_logit_softcapping="50"), "field 'attn_logit_softcapping' must be a number"),
    (dict(model_type="llama", hidden_act="gelu"), "activation 'gelu' is not supported"),
    (dict(model_type="llama", partial_rotary_factor=0.75), "partial_rotary_factor 0.75 is not supported for llama"),
    (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "'dynamic' is not supported: .*"),
    (dict(model_type="llama", rope_scaling={"rope_type": "ntk", "factor": 4.0}), "'ntk' is not supported .*yarn"),
])
def test_unsupported_config_is_a_one_line_error_naming_it(bad, match):
    d = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4} | bad
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_hf_dict(d)
    assert "\n" not in str(err.value)


# -- speculation (SPEED) on every family, in process ------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_speculate_speed_greedy_equals_plain_on_every_family(folders, family):
    """The real Scheduler and StageExecutors over 2 and 3 stages of each family's model: SPEED with
    an always-wrong predictor (every draft squashed on every stage) and the real logit lens gives the
    tokens of plain greedy decoding (tests/in_process_pipeline.py)."""
    prompts = [PROMPT, PROMPT[:5], [7, 7, 7]]
    budgets = (NUM_NEW_TOKENS, 6, 11)  # sequences finish one by one, leaving idle stages for drafts
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
    reference = [Chain(_stages(folders[family], 1)).greedy(p, b) for p, b in zip(prompts, budgets, strict=True)]
    table = ReferenceTable(zip(prompts, reference, strict=True))
    for num_stages in (2, 3):
        stages = _stages(folders[family], num_stages)
        plain = InProcessPipeline(stages, max_model_len=MAX_MODEL_LEN).generate(prompts, params)
        assert plain == reference, f"{num_stages} stages without speculation"
        for predictor in (AlwaysWrongPredictor(table, vocab_size=256), LogitLensPredictor()):
            pipe = InProcessPipeline(_stages(folders[family], num_stages), max_model_len=MAX_MODEL_LEN,
                                     predictor=predictor)
            assert pipe.generate(prompts, params) == reference, f"{type(predictor).__name__}, {num_stages} stages"
            spec = pipe.engine.spec
            assert spec.drafted_tokens > 0, "no draft was sent: speculation was not exercised"
            if isinstance(predictor, AlwaysWrongPredictor):
                assert spec.squashed_items > 0 and spec.accepted_tokens == 0


def test_build_stage_model_consume_frees_the_tensors_it_used(folders):
    reader = CheckpointReader(folders["phi3"])
    cfg = reader.config
    tensors = reader.read(all_tensor_names(cfg), dtype=torch.float32)
    tensors["unrelated"] = torch.zeros(1)
    build_stage_model(cfg, LayerRange(0, 2), is_first=True, is_last=False, tensors=tensors, consume=True)
    assert set(tensors) == {"unrelated"} | set(stage_tensor_names(cfg, LayerRange(2, 4), is_first=False, is_last=True))


def test_cli_exits_2_with_one_line_naming_an_unsupported_architecture(tmp_path, capsys):
    from launcher.cli.main import main

    (tmp_path / "config.json").write_text('{"model_type": "falcon", "vocab_size": 10, "hidden_size": 8, '
                                          '"intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2}')
    assert main(["launch", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model_type 'falcon' is not supported (supported: llama," in err
