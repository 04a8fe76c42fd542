"""config.json as real Hugging Face repos write it: what transformers loads, `ModelConfig` accepts.

Each case is the shape of a published config (sizes shrunk where they do not matter), with its
nulls, ints where floats are meant (`"rope_theta": 1000000`) and floats written as `1e-06`;
transformers' own config class (the oracle, test-only) loads each, so none may be refused here.
"""

from __future__ import annotations

import json

import pytest

from pipeline.model.config import ModelConfig

_LLAMA31 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
            "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
           "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 32768,
           "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
_QWEN3 = {**_QWEN25, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 1024,
          "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
          "max_window_layers": 28, "rope_theta": 1000000, "sliding_window": None, "attention_bias": False}
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
            "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
            "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000}
_PHI3 = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 32000,
         "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
         "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
         "original_max_position_embeddings": 4096, "pad_token_id": 32000, "rms_norm_eps": 1e-05, "rope_scaling": None,
         "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False, "vocab_size": 32064}
_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
           "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
           "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
           "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
           "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}
_LLAMA2 = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
           "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 32000}
_PHI3_128K = {**_PHI3, "max_position_embeddings": 131072, "sliding_window": 262144, "rope_scaling": {
    "type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(48)],  # Phi-3-mini-128k: head_dim 96
    "long_factor": [1.0 + 0.9 * i for i in range(48)]}}
_PHI4_MINI = {**_PHI3, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
              "max_position_embeddings": 131072, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
              "sliding_window": 262144, "vocab_size": 200064, "rope_theta": 10000.0, "rope_scaling": {
                  "type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0 + i for i in range(48)]}}

CASES = {
    "llama3.1": _LLAMA31,
    # before: refused, "field 'rope_scaling.original_max_position_embeddings' must be an integer, got 8192.0"
    "llama3.1 original context 8192.0": {**_LLAMA31, "rope_scaling": {**_LLAMA31["rope_scaling"],
                                                                      "original_max_position_embeddings": 8192.0}},
    "llama3.1 integer factors": {**_LLAMA31, "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 8,
                                                              "low_freq_factor": 1, "high_freq_factor": 4}},
    "llama2 null kv heads, int theta": {**_LLAMA2, "num_key_value_heads": None, "rope_theta": 10000, "head_dim": None},
    "tinyllama legacy linear type": {**_LLAMA2, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "qwen2.5": _QWEN25,
    "qwen3": _QWEN3,
    # before: refused, "rope_scaling type 'yarn' is not supported" (Qwen2.5's long-context recipe)
    "qwen2.5 yarn": {**_QWEN25, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                                                 "type": "yarn"}},
    "qwen3 yarn": {**_QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768}},
    "llama yarn deepseek mscale": {**_LLAMA2, "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                                                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                               "original_max_position_embeddings": 4096}},
    # before: refused, "rope_scaling type 'longrope' ..." and "partial_rotary_factor 0.75 is not supported"
    "phi3 mini 128k longrope": _PHI3_128K,
    "phi4 mini longrope, partial rotary": _PHI4_MINI,
    "mixtral": _MIXTRAL,
    "phi3 null rope_scaling": _PHI3,
    "gemma3 text": _GEMMA3,
    "transformers 5 rope_parameters, int theta": {**_LLAMA2, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 10000}},
}


@pytest.mark.parametrize("name", CASES)
def test_a_config_transformers_loads_is_accepted(tmp_path, name):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(CASES[name]))
    AutoConfig.from_pretrained(tmp_path)  # the oracle: a shape transformers refuses is no case for this test
    config = ModelConfig.from_model_dir(tmp_path)
    assert (config.model_type, config.num_hidden_layers) == (CASES[name]["model_type"],
                                                             CASES[name]["num_hidden_layers"])


def test_long_context_rope_settings_are_read_as_transformers_resolves_them():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("qwen2.5 yarn", "llama yarn deepseek mscale", "phi3 mini 128k longrope", "phi4 mini longrope, partial rotary"):
        hf, ours = AutoConfig.for_model(**CASES[name]), ModelConfig.from_hf_dict(CASES[name])
        _, attention_factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
        assert ours.rope_scaling.attention_factor == attention_factor, name
        assert (ours.rope_scaling.original_max_position_embeddings
                == hf.rope_parameters["original_max_position_embeddings"]), name
    assert ModelConfig.from_hf_dict(_PHI4_MINI).rotary_dim == 96


def test_an_integral_float_original_context_reads_as_the_integer():
    config = ModelConfig.from_hf_dict(CASES["llama3.1 original context 8192.0"])
    assert config.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="'rope_scaling.original_max_position_embeddings' must be an integer"):
        ModelConfig.from_hf_dict({**_LLAMA31, "rope_scaling": {**_LLAMA31["rope_scaling"],
                                                               "original_max_position_embeddings": 8192.5}})
