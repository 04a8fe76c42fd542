"""Checkpoint names of the decoder's tensors: the one place that spells them.

Owns the Hugging Face names of the embedding, the final norm and the LM head, which tensor the head
reads (`head_tensor_name`: the embedding itself when the config ties them), the family renames
(`family_tensor_name`: Mixtral's `block_sparse_moe.experts.{e}.w1`) and the map from a StageModel
parameter to its checkpoint tensor (`checkpoint_name`), and the language model's names inside a
multimodal checkpoint (`text_model_name`). Must not: read files or build modules
(pipeline/weights/checkpoint.py chooses and reads a stage's tensors; pipeline/model/stage_model.py
builds the modules).
"""

from __future__ import annotations

from pipeline.model.config import ModelConfig

EMBED_TOKENS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# A multimodal checkpoint's language-model prefixes -> this decoder's: the layout of the Hub's Gemma 3
# checkpoints (transformers 4.50-4.51, and 5.x's save_pretrained writes it again) and of 4.52-4.57.
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."), ("lm_head.", "lm_head."))

# Mixtral's checkpoint names for what this decoder calls mlp.gate_proj / up_proj / down_proj.
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def head_tensor_name(config: ModelConfig) -> str:
    """The LM head's checkpoint name: the embedding itself when `tie_word_embeddings`."""
    return EMBED_TOKENS if config.tie_word_embeddings else LM_HEAD


def family_tensor_name(name: str, config: ModelConfig) -> str:
    """The checkpoint's name for a tensor this decoder calls `name` (HF names, "model." prefix):
    identity except Mixtral's `block_sparse_moe` prefix and w1/w3/w2 expert projections."""
    if config.model_type != "mixtral" or ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in _MIXTRAL_EXPERT.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


def checkpoint_name(param_name: str, config: ModelConfig) -> str:
    """Checkpoint tensor name for a StageModel parameter (`lm_head.weight` reads the tied embedding
    when the config ties them; family renames as `family_tensor_name`)."""
    if param_name == LM_HEAD:
        return head_tensor_name(config)
    return family_tensor_name("model." + param_name, config)


def text_model_name(stored: str) -> str | None:
    """This decoder's name for tensor `stored` of a multimodal checkpoint ([Note: text-only multimodal]
    in pipeline/model/family_config.py): `language_model.model.layers.0...` and
    `model.language_model.layers.0...` -> `model.layers.0...`, `language_model.lm_head.weight` ->
    `lm_head.weight`; None for the vision tower's and the projector's tensors (never read)."""
    for theirs, ours in _TEXT_MODEL_PREFIXES:
        if stored.startswith(theirs):
            return ours + stored[len(theirs):]
    return None
