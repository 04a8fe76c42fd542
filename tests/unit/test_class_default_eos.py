"""The tokenizer class's default eos_token where a folder names none ([Note: class default EOS] in
pipeline/model/tokenizer.py).

transformers' AutoTokenizer builds the folder's tokenizer class, whose __init__ gives `eos_token` a default
(Qwen2Tokenizer and GPT2Tokenizer: "<|endoftext|>", LlamaTokenizer: "</s>", GemmaTokenizer: "<eos>") that holds
when neither tokenizer_config.json nor special_tokens_map.json names one: that is Hugging Face's `eos_token_id`
and vLLM's primary EOS. What breaks when these fail: such a folder (a Qwen2Tokenizer without an eos_token) had no
primary EOS, so its EOS id ended requests as a stop token id (finish "stop", a stop_reason) where vLLM says EOS.
Reference: the installed transformers (its classes' __init__ defaults, its AutoTokenizer on each folder).
"""

from __future__ import annotations

import inspect
import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import coordinator_config
from pipeline.model import tokenizer as tokenizer_module
from pipeline.model.config import SUPPORTED_MODEL_TYPES
from pipeline.model.family_config import MULTIMODAL_TEXT_MODELS
from pipeline.model.tokenizer import Tokenizer
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer, write_tiny_model

transformers = pytest.importorskip("transformers")
auto = pytest.importorskip("transformers.models.auto.tokenization_auto")
pytestmark = pytest.mark.timeout(300)

DEFAULTS = ("<|endoftext|>", "</s>", "<eos>")  # every class default in the table, so each is in the vocabulary
MODEL_TYPES = (*SUPPORTED_MODEL_TYPES, *MULTIMODAL_TEXT_MODELS)
CLASSES = sorted({*tokenizer_module._CLASS_DEFAULT_EOS, *tokenizer_module._REGISTERED_TOKENIZER.values(),
                  "PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2TokenizerFast", "GPT2TokenizerFast"})


def _transformers_default(class_name: str) -> str | None:
    """The eos_token default of the __init__ of the class transformers resolves `class_name` to."""
    cls = auto.tokenizer_class_from_name(class_name)
    assert cls is not None, f"transformers has no tokenizer class {class_name}"
    param = inspect.signature(cls.__init__).parameters.get("eos_token")
    return None if param is None else param.default


@pytest.mark.parametrize("class_name", CLASSES)
def test_the_class_table_is_the_installed_transformers_defaults(class_name):
    assert tokenizer_module._CLASS_DEFAULT_EOS.get(class_name.removesuffix("Fast")) == _transformers_default(class_name)


def test_the_model_type_tables_are_the_installed_transformers_mapping():
    """The class each speedpipe model type registers, and the types whose hub class AutoTokenizer ignores."""
    assert {m: auto.TOKENIZER_MAPPING_NAMES.get(m) for m in MODEL_TYPES} == \
        {m: tokenizer_module._REGISTERED_TOKENIZER.get(m) for m in MODEL_TYPES}
    assert set(MODEL_TYPES) & set(auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) == \
        set(tokenizer_module._HUB_CLASS_IGNORED)


def _word_level() -> tokenizers.Tokenizer:
    """A tokenizer.json that is not byte-level (word-level, whitespace split)."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "0", "hello", *DEFAULTS])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _folder(path, *, tok: tokenizers.Tokenizer, model_type: str, class_name: str | None, **config):
    path.mkdir(parents=True)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in DEFAULTS])
    tok.save(str(path / "tokenizer.json"))
    names = {"tokenizer_class": class_name} if class_name else {}
    (path / "tokenizer_config.json").write_text(json.dumps({**names, **config}))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


@pytest.mark.parametrize("byte_level", [True, False], ids=["byte-level", "word-level"])
@pytest.mark.parametrize("class_name", [None, "Qwen2Tokenizer", "GPT2TokenizerFast", "LlamaTokenizerFast",
                                        "GemmaTokenizer", "PreTrainedTokenizerFast"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_primary_eos_is_autotokenizer_s_for_each_model_type_and_class(tmp_path, model_type, class_name,
                                                                          byte_level):
    tok = byte_tokenizer() if byte_level else _word_level()
    folder = _folder(tmp_path / "m", tok=tok, model_type=model_type, class_name=class_name)
    assert Tokenizer(folder).eos_token_id == transformers.AutoTokenizer.from_pretrained(folder).eos_token_id


@pytest.mark.parametrize("where", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_null_eos_token_in_a_file_is_none_not_the_class_default(tmp_path, where):
    folder = _folder(tmp_path / "m", tok=byte_tokenizer(), model_type="qwen3", class_name="Qwen2Tokenizer")
    if where == "special_tokens_map.json":
        (folder / where).write_text(json.dumps({"eos_token": None}))
    else:
        (folder / where).write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": None}))
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token_id is None
    assert Tokenizer(folder).eos_token_id is None


def test_a_qwen2_tokenizer_without_eos_token_has_endoftext_as_its_primary_eos(tmp_path):
    """The tiny model folder naming Qwen2Tokenizer and no eos_token: its primary EOS is "<|endoftext|>"'s id, as
    AutoTokenizer's, and the scheduler gets it first with primary_eos (it was none: every EOS a stop token id)."""
    path = write_tiny_model(tmp_path / "m", eos_token=False, vocab_size=264)
    tok = byte_tokenizer()
    tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert Tokenizer(path).eos_token_id == hf.eos_token_id
    options = PipelineOptions(num_stages=2, model=str(path), progress=False, max_model_len=64)
    scheduler = coordinator_config(options, resolve(options), master_addr="127.0.0.1", master_port=1).scheduler
    assert scheduler.primary_eos and scheduler.eos_token_ids == (hf.eos_token_id, TINY_EOS_ID)
