"""Gemma 3 multimodal checkpoints (`Gemma3ForConditionalGeneration`) run text-only.

What breaks when these fail: reading `text_config` out of a multimodal config.json (with
transformers' Gemma3TextConfig defaults for what it omits, as the Hub's Gemma 3 configs do), mapping
the language model's tensor names of either layout (`language_model.model.*`: the Hub's checkpoints
and transformers 5's save_pretrained; `model.language_model.*`: transformers 4.52-4.57), leaving the
vision tower and projector unread, the one stderr note, the tokenizer's EOS / chat template of such
a folder. [Note: text-only multimodal] in pipeline/model/family_config.py.

The oracle is transformers' own Gemma3ForConditionalGeneration, built tiny (the gemma3_text family
model of tests/family_models.py plus a 1-layer SigLIP vision tower), saved with save_pretrained and
loaded back with from_pretrained, called with text only, in float32.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.serving.openai_protocol import render_chat
from pipeline.model.config import ModelConfig
from pipeline.model.family_config import MULTIMODAL_TEXT_MODELS
from pipeline.model.tensor_names import text_model_name
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights.checkpoint import INDEX_FILE, CheckpointReader
from tests.family_models import family_config, family_state_dict, hf_config
from tests.tiny_model import byte_tokenizer
from tests.unit.test_families import NUM_NEW_TOKENS, PROMPT, TOL, Chain, _stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT_SHARD, VISION_SHARD = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
# transformers 4.52-4.57 saved the language model under model.language_model.* (and the head as lm_head).
_LAYOUT_4_52 = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."))
# Gemma 3's chat template (google/gemma-3-4b-it's chat_template.json), image branch and all.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- set loop_messages = messages -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}")



def _tiny_multimodal() -> transformers.Gemma3ForConditionalGeneration:
    """The gemma3_text family's tiny model (its random weights, std 0.2) inside a conditional-generation
    model with a tiny SigLIP vision tower (transformers' own random init)."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=hf_config("gemma3_text"), vision_config=vision,
                                       mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254,
                                       image_token_index=255)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    text = family_state_dict(family_config("gemma3_text"), seed=3)
    model.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in text.items()}, strict=False)
    return model


def _reshard(folder, layout: str) -> None:
    """Split save_pretrained's single file into a language-model shard and a vision shard (tower and
    projector) with an index, in the Hub's layout or transformers 4.52's."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    if layout == "4.52":
        for old, new in _LAYOUT_4_52:
            tensors = {new + k.removeprefix(old) if k.startswith(old) else k: v for k, v in tensors.items()}
    shards = {name: TEXT_SHARD if "language_model" in name else VISION_SHARD for name in tensors}
    for shard in (TEXT_SHARD, VISION_SHARD):
        save_file({k: v for k, v in tensors.items() if shards[k] == shard}, str(folder / shard),
                  metadata={"format": "pt"})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": shards}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers' model loaded from the saved folder, {layout: speedpipe folder})."""
    saved = tmp_path_factory.mktemp("saved")
    _tiny_multimodal().save_pretrained(saved)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(saved, dtype=torch.float32,
                                                                        attn_implementation="eager").eval()
    folders = {}
    for layout in ("hub", "4.52"):
        folder = shutil.copytree(saved, tmp_path_factory.mktemp(layout) / "model")
        _reshard(folder, layout)
        byte_tokenizer().save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_CHAT_TEMPLATE}))
        folders[layout] = folder
    return model, folders


def test_the_checkpoint_is_what_transformers_saves(reference):
    _, folders = reference
    names = set(json.loads((folders["hub"] / INDEX_FILE).read_text())["weight_map"])
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("multi_modal_projector.")
                                                                    for n in names)
    config = json.loads((folders["hub"] / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["architectures"] == ["Gemma3ForConditionalGeneration"]


@pytest.mark.parametrize("layout", ["hub", "4.52"])
def test_logits_on_a_text_prompt_equal_transformers(reference, layout):
    """float32 on both sides, the same ops in another order: the family tests' 1e-4 (logits here
    are about +-2, and a wrong name, norm, scale or soft-cap moves them by more than 2e-3).
    text_config asks for final_logit_softcapping 5.0, which Gemma3ForConditionalGeneration ignores
    (its Gemma3ForCausalLM would apply it): speedpipe follows the class the checkpoint names."""
    model, folders = reference
    assert model.config.text_config.final_logit_softcapping == 5.0
    assert CheckpointReader(folders[layout]).config.final_logit_softcapping is None
    ours = Chain(_stages(folders[layout], 2))(PROMPT, 0, all_rows=True)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape == (len(PROMPT), 256)
    torch.testing.assert_close(ours, ref, **TOL)
    assert ref.std() > 0.1, "degenerate oracle: near-constant logits"


def test_greedy_tokens_equal_transformers_generate_on_one_and_two_stages(reference):
    model, folders = reference
    outs = {s: Chain(_stages(folders["hub"], s)).greedy(PROMPT, NUM_NEW_TOKENS) for s in (1, 2)}
    assert outs[1] == outs[2], outs
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                             eos_token_id=None, pad_token_id=0)
    assert ref[0, len(PROMPT):].tolist() == outs[1]
    assert len(set(outs[1])) > 3, "degenerate oracle: the random model repeats one token"


def test_vision_tensors_are_never_read_and_their_shard_may_be_broken(reference, tmp_path):
    """A loader that read (or opened) the vision tower's shard fails on the truncated one."""
    _, folders = reference
    folder = shutil.copytree(folders["hub"], tmp_path / "m")
    vision = set(safe_open(str(folder / VISION_SHARD), "pt").keys())
    (folder / VISION_SHARD).write_bytes((folder / VISION_SHARD).read_bytes()[:100])
    with pytest.raises(SafetensorError):
        safe_open(str(folder / VISION_SHARD), "pt")
    reader = CheckpointReader(folder)
    assert reader.skipped_names == vision and len(vision) > 10
    plan = resolve(PipelineOptions(model=str(folder), num_stages=2, progress=False, speculate="none"))
    assert plan.model_dir == folder
    stages = _stages(folder, 2)  # each reads its own tensors through a fresh reader
    assert Chain(stages).greedy(PROMPT, 2)
    assert reader.read(["model.layers.0.self_attn.q_proj.weight"], dtype=torch.float32)
    assert reader.read_names == {"model.layers.0.self_attn.q_proj.weight"}
    with pytest.raises(ValueError, match="not in checkpoint"):
        reader.read(["vision_tower.head.probe"], dtype=torch.float32)


def test_launch_says_once_on_stderr_that_the_vision_part_is_not_used(reference, caplog):
    _, folders = reference
    options = PipelineOptions(model=str(folders["4.52"]), num_stages=2, progress=False, speculate="none")
    with caplog.at_level(logging.WARNING):
        resolve(options)
        resolve(options)  # launch and --serve resolve the plan again (settle_auto)
    notes = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(notes) == 1 and "Gemma3ForConditionalGeneration" in notes[0] and "text only" in notes[0], notes


def test_tokenizer_of_a_multimodal_folder_reads_eos_from_text_config_and_renders_text_chats(reference, tmp_path):
    _, folders = reference
    folder = shutil.copytree(folders["hub"], tmp_path / "m")
    (folder / "generation_config.json").unlink()
    assert "eos_token_id" not in json.loads((folder / "config.json").read_text())  # only in its text_config
    tok = Tokenizer(folder)
    assert tok.eos_token_ids == (2,) and tok.chat_template == GEMMA3_CHAT_TEMPLATE
    text = render_chat([{"role": "user", "content": [{"type": "text", "text": " Hi "}]}], tokenizer=tok)
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"), text


# google/gemma-3-4b-it's config.json: text_config omits the heads, vocabulary, head_dim, eps, ...
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_a_hub_config_reads_as_transformers_reads_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    text = hf.text_config
    ours = ModelConfig.from_model_dir(tmp_path)
    assert ours.model_type == "gemma3_text" and ours.text_only_of == "Gemma3ForConditionalGeneration"
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window",
                 "final_logit_softcapping"):
        assert getattr(ours, name) == getattr(text, name), name
    assert ours.query_pre_attn_scalar == text.query_pre_attn_scalar and ours.hidden_act == text.hidden_activation
    assert list(ours.layer_types) == text.layer_types and ours.tie_word_embeddings == hf.tie_word_embeddings
    rope = text.rope_parameters
    assert (ours.rope_theta, ours.rope_local_theta) == (rope["full_attention"]["rope_theta"],
                                                        rope["sliding_attention"]["rope_theta"])
    assert ours.rope_scaling.rope_type == "linear" and ours.rope_scaling.factor == 8.0
    assert ours.eos_token_ids == (1, 106) and ours.bos_token_id == 2



@pytest.mark.parametrize("text_tie, top_tie", [(False, None), (True, False), (False, True)])
def test_the_head_is_tied_by_the_top_level_flag_alone_as_transformers_ties_it(text_tie, top_tie):
    """Gemma3ForConditionalGeneration ties its head by the top-level tie_word_embeddings (Gemma3Config's
    default True when absent) and ignores text_config's: a text_config saying false must not send the
    head to a `lm_head.weight` that save_pretrained never wrote."""
    text = hf_config("gemma3_text").to_dict() | {"tie_word_embeddings": text_tie}
    raw = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}}
    if top_tie is not None:
        raw["tie_word_embeddings"] = top_tie
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(**json.loads(json.dumps(raw))))
    tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == (top_tie is not False)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(raw))).tie_word_embeddings == tied


def test_the_text_config_defaults_are_transformers():
    _, defaults = MULTIMODAL_TEXT_MODELS["gemma3"]
    hf = transformers.Gemma3TextConfig()
    assert {k: getattr(hf, k) for k in defaults} == defaults


def test_a_text_config_alone_still_reads_as_before():
    assert ModelConfig.from_hf_dict(GEMMA3_4B["text_config"] | {"vocab_size": 64, "num_attention_heads": 8}) \
        .text_only_of is None


@pytest.mark.parametrize("text_config, match", [
    ([1, 2], "'text_config' must be an object, got \\[1, 2\\]"),
    ({"model_type": "llama"}, "text_config.model_type 'llama' is not supported \\(only 'gemma3_text'\\)"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_a_multimodal_config_this_decoder_cannot_run_is_one_line(text_config, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_hf_dict(GEMMA3_4B | {"text_config": text_config})
    assert "\n" not in str(err.value)


def test_another_multimodal_model_type_is_still_refused_naming_what_runs():
    with pytest.raises(ValueError, match="model_type 'llava' is not supported .*gemma3 multimodal: text only"):
        ModelConfig.from_hf_dict(GEMMA3_4B | {"model_type": "llava"})


@pytest.mark.parametrize("stored, ours", [
    ("language_model.model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),  # the Hub's layout
    ("model.language_model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),  # transformers 4.52
    ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.language_model.norm.weight", "model.norm.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),  # an untied head, either layout
    ("lm_head.weight", "lm_head.weight"),
    ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", None),
    ("model.vision_tower.vision_model.post_layernorm.weight", None),
    ("multi_modal_projector.mm_input_projection_weight", None),
    ("model.multi_modal_projector.mm_soft_emb_norm.weight", None),
])
def test_text_model_names_of_both_layouts(stored, ours):
    assert text_model_name(stored) == ours


def test_a_checkpoint_with_both_layouts_of_one_tensor_is_refused_naming_it(reference, tmp_path):
    _, folders = reference
    folder = shutil.copytree(folders["hub"], tmp_path / "m")
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.language_model.norm.weight"] = TEXT_SHARD
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.norm.weight' twice: as 'language_model.model.norm.weight' and "
                                         "'model.language_model.norm.weight'"):
        CheckpointReader(folder)
