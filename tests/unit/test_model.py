"""Unit tests for pipeline.model.stage_model on the tiny random model, with Hugging Face transformers as the oracle.

What breaks when these fail: the decoder math (against transformers' Llama / Qwen2 / Mistral), RoPE
scaling, splitting the model into stages, the KV cache path (incremental decode and chunked prefill),
packing several sequences into one micro-batch, loading weights, and the tiny model folder helper.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pipeline.model.config import ModelConfig, RopeScaling, tiny_config
from pipeline.model.partition import LayerRange, balanced_split, split_from_sizes
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel, build_stage_model
from pipeline.model.tokenizer import Tokenizer
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names, stage_tensor_names
from tests.tiny_model import TINY_EOS_ID, random_state_dict, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Weights std 0.2 (not the 0.05 default) so logits are spread out and greedy output varies: with
# near-uniform logits a wrong RoPE or mask can hide under the tolerance and greedy decoding repeats
# one token.
STD = 0.2
TOL = {"rtol": 1e-5, "atol": 1e-5}
MAX_MODEL_LEN = 64
PROMPT = [5, 17, 200, 33, 9, 81, 140]

LLAMA3_SCALING = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64)
LINEAR_SCALING = RopeScaling(rope_type="linear", factor=4.0)

CONFIGS = {
    "llama-tied": tiny_config(),
    "llama-untied": tiny_config(tie_word_embeddings=False),
    "qwen2-qkv-bias": tiny_config(model_type="qwen2", attention_bias=True, tie_word_embeddings=False),
    "mistral": tiny_config(model_type="mistral"),
    "llama3-rope-scaling": tiny_config(rope_scaling=LLAMA3_SCALING),
    "linear-rope-scaling": tiny_config(rope_scaling=LINEAR_SCALING),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def _hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    """transformers' model for `cfg` (from `cfg.to_hf_dict()`) holding the same weights."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    model = getattr(transformers, HF_CLASSES[cfg.model_type])(hf_cfg).eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    if cfg.tie_word_embeddings:
        assert result.missing_keys == ["lm_head.weight"]
        assert model.lm_head.weight is model.model.embed_tokens.weight, "transformers did not tie the head"
    else:
        assert not result.missing_keys, result.missing_keys
    return model


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _stage_models(cfg: ModelConfig, state: dict[str, torch.Tensor], ranges: list[LayerRange]) -> list[StageModel]:
    last = len(ranges) - 1
    return [build_stage_model(cfg, r, is_first=i == 0, is_last=i == last, tensors=state)
            for i, r in enumerate(ranges)]


class Chain:
    """Stage models run one after the other, each with its own KV cache (an in-process pipeline)."""

    def __init__(self, stages: list[StageModel], *, max_num_seqs: int = 4) -> None:
        self.stages = stages
        self.kvs = [s.new_kv_cache(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN) for s in stages]

    def __call__(self, ids: list[int], spans: list[Span], *, all_rows: bool = False) -> torch.Tensor:
        """Logits [num_items, vocab] of each span's last row, or of every row when `all_rows`."""
        x: torch.Tensor = torch.tensor(ids, dtype=torch.int64)
        rows = torch.arange(len(ids)) if all_rows else None
        for stage, kv in zip(self.stages, self.kvs, strict=True):
            x = stage(x, spans, kv, logit_rows=rows if stage.is_last else None)
        return x


def _full_chain(cfg: ModelConfig, state: dict[str, torch.Tensor], **kwargs) -> Chain:
    return Chain(_stage_models(cfg, state, [LayerRange(0, cfg.num_hidden_layers)]), **kwargs)



@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = tiny_config()
    return cfg, random_state_dict(cfg, seed=1, std=STD)


# -- (1) the full model against transformers -----------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("length", [1, 2, 7, 40])
def test_full_stage_model_logits_match_transformers(name, length):
    cfg = CONFIGS[name]
    state = random_state_dict(cfg, seed=3, std=STD)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ours = _full_chain(cfg, state)(ids, [Span(0, 0, length)], all_rows=True)
    ref = _hf_logits(_hf_model(cfg, state), ids)
    assert ours.shape == (length, cfg.vocab_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("name", ["llama3-rope-scaling", "linear-rope-scaling"])
def test_rope_scaling_changes_the_logits(name):
    """Guard for the scaling comparison above: the scaled and unscaled models must really differ."""
    cfg = CONFIGS[name]
    state = random_state_dict(cfg, seed=3, std=STD)
    ids = list(range(10, 50))
    scaled = _full_chain(cfg, state)(ids, [Span(0, 0, len(ids))], all_rows=True)
    plain = _full_chain(tiny_config(), state)(ids, [Span(0, 0, len(ids))], all_rows=True)
    assert (scaled - plain).abs().max() > 1e-2


def test_qwen2_qkv_bias_is_used():
    cfg = CONFIGS["qwen2-qkv-bias"]
    state = random_state_dict(cfg, seed=3, std=STD)
    no_bias = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in state.items()}
    ids = PROMPT
    with_bias = _full_chain(cfg, state)(ids, [Span(0, 0, len(ids))])
    without = _full_chain(cfg, no_bias)(ids, [Span(0, 0, len(ids))])
    assert (with_bias - without).abs().max() > 1e-2


def test_untied_head_reads_lm_head_not_the_embedding():
    cfg = CONFIGS["llama-untied"]
    state = random_state_dict(cfg, seed=3, std=STD)
    assert "lm_head.weight" in state
    tied_like = dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"]})
    a = _full_chain(cfg, state)(PROMPT, [Span(0, 0, len(PROMPT))])
    b = _full_chain(cfg, tied_like)(PROMPT, [Span(0, 0, len(PROMPT))])
    assert (a - b).abs().max() > 1e-2


# -- (2) stage splits equal the full model ------------------------------------------------------

SPLITS = sorted({tuple(len(r) for r in balanced_split(4, s)) for s in range(1, 5)}
                | {(1, 3), (3, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)})


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_chained_stages_equal_the_full_model_for_prefill_and_decode(tiny, sizes):
    cfg, state = tiny
    full = _full_chain(cfg, state)
    split = Chain(_stage_models(cfg, state, split_from_sizes(sizes, cfg.num_hidden_layers)))
    assert len(split.stages) == len(sizes)
    assert split.stages[0].embed_tokens is not None and split.stages[-1].lm_head is not None
    assert all(s.embed_tokens is None for s in split.stages[1:])
    assert all(s.lm_head is None and s.norm is None for s in split.stages[:-1])

    want = full(PROMPT, [Span(1, 0, len(PROMPT))], all_rows=True)
    got = split(PROMPT, [Span(1, 0, len(PROMPT))], all_rows=True)
    torch.testing.assert_close(got, want, **TOL)
    pos, token = len(PROMPT), int(want[-1].argmax())
    for _ in range(5):
        want = full([token], [Span(1, pos, 1)])
        got = split([token], [Span(1, pos, 1)])
        torch.testing.assert_close(got, want, **TOL)
        pos, token = pos + 1, int(want[-1].argmax())
    for stage, kv in zip(split.stages, split.kvs, strict=True):
        assert kv.lengths[1] == pos, f"stage {stage.layer_range} KV length"
        assert kv.k.shape[0] == len(stage.layer_range)


def test_middle_stage_returns_hidden_states_not_logits(tiny):
    cfg, state = tiny
    first, middle, last = _stage_models(cfg, state, split_from_sizes([1, 2, 1], 4))
    kvs = [m.new_kv_cache(max_num_seqs=1, max_model_len=MAX_MODEL_LEN) for m in (first, middle, last)]
    spans = [Span(0, 0, 3)]
    h1 = first(torch.tensor([1, 2, 3]), spans, kvs[0])
    h2 = middle(h1, spans, kvs[1])
    assert h1.shape == h2.shape == (3, cfg.hidden_size)
    assert last(h2, spans, kvs[2]).shape == (1, cfg.vocab_size)


# -- (3) incremental decode and chunked prefill with the KV cache --------------------------------

def test_incremental_decode_equals_a_full_sequence_forward(tiny):
    cfg, state = tiny
    chain = _full_chain(cfg, state)
    ids = list(PROMPT)
    logits = chain(ids, [Span(0, 0, len(ids))])
    for _ in range(8):
        fresh = _full_chain(cfg, state)(ids, [Span(0, 0, len(ids))])
        torch.testing.assert_close(logits, fresh, **TOL)
        ids.append(int(logits[-1].argmax()))
        logits = chain([ids[-1]], [Span(0, len(ids) - 1, 1)])


def test_chunked_prefill_equals_a_single_prefill(tiny):
    cfg, state = tiny
    ids = list(range(30, 50))
    whole = _full_chain(cfg, state)(ids, [Span(0, 0, 20)], all_rows=True)
    chain = _full_chain(cfg, state)
    parts = [chain(ids[a:b], [Span(0, a, b - a)], all_rows=True) for a, b in [(0, 5), (5, 6), (6, 20)]]
    torch.testing.assert_close(torch.cat(parts), whole, **TOL)


# -- (4) packed micro-batches -------------------------------------------------------------------

def test_packed_micro_batch_equals_items_run_one_by_one(tiny):
    cfg, state = tiny
    histories = {2: list(range(60, 65)), 0: [], 1: [7, 8]}  # slot -> tokens already in its KV cache
    new_rows = {2: [1, 2, 3], 0: [100, 101, 102, 103, 104, 105], 1: [42]}  # lengths 3, 6, 1

    def fill(chain: Chain) -> None:
        for slot, ids in histories.items():
            if ids:
                chain(ids, [Span(slot, 0, len(ids))])

    alone = _full_chain(cfg, state, max_num_seqs=3)
    fill(alone)
    want = {slot: alone(ids, [Span(slot, len(histories[slot]), len(ids))], all_rows=True)
            for slot, ids in new_rows.items()}

    packed = _full_chain(cfg, state, max_num_seqs=3)
    fill(packed)
    spans = [Span(slot, len(histories[slot]), len(ids)) for slot, ids in new_rows.items()]
    ids = [t for row in new_rows.values() for t in row]
    got_all = packed(ids, spans, all_rows=True)
    torch.testing.assert_close(got_all, torch.cat(list(want.values())), **TOL)
    # Default logit rows are each item's last row, in item order.
    last_rows = torch.stack([w[-1] for w in want.values()])
    # One more decode step per slot, packed again, must still agree (the KV caches are equal).
    step = {slot: int(w[-1].argmax()) for slot, w in want.items()}
    ends = {slot: len(histories[slot]) + len(new_rows[slot]) for slot in new_rows}
    packed_step = packed(list(step.values()), [Span(slot, ends[slot], 1) for slot in step])
    alone_step = torch.cat([alone([tok], [Span(slot, ends[slot], 1)]) for slot, tok in step.items()])
    torch.testing.assert_close(packed_step, alone_step, **TOL)
    assert packed.kvs[0].lengths == [ends[slot] + 1 for slot in range(3)] == [7, 4, 9]
    fresh = _full_chain(cfg, state, max_num_seqs=3)
    fill(fresh)
    torch.testing.assert_close(fresh(ids, spans), last_rows, **TOL)


# -- (5) greedy generation through a 2-stage split equals transformers' generate ------------------

def test_greedy_generation_through_two_stages_equals_transformers_generate(tiny):
    cfg, state = tiny
    chain = Chain(_stage_models(cfg, state, balanced_split(cfg.num_hidden_layers, 2)))
    ids = list(PROMPT)
    logits = chain(ids, [Span(0, 0, len(ids))])
    generated = []
    for _ in range(20):
        generated.append(int(logits[-1].argmax()))
        logits = chain([generated[-1]], [Span(0, len(ids) + len(generated) - 1, 1)])
    hf = _hf_model(cfg, state)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert out.shape == (1, len(PROMPT) + 20)
    assert out[0, len(PROMPT):].tolist() == generated
    assert len(set(generated)) > 5, "degenerate oracle: the random model repeats one token"


# -- (6) building a stage from checkpoint tensors -------------------------------------------------

def test_build_stage_model_names_a_missing_tensor(tiny):
    cfg, state = tiny
    broken = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        build_stage_model(cfg, LayerRange(2, 4), is_first=False, is_last=True, tensors=broken)
    # A stage that does not hold layer 2 does not need it.
    build_stage_model(cfg, LayerRange(0, 2), is_first=True, is_last=False, tensors=broken)


def test_build_stage_model_names_a_missing_untied_head():
    cfg = tiny_config(tie_word_embeddings=False)
    state = random_state_dict(cfg)
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"no tensor 'lm_head\.weight'"):
        build_stage_model(cfg, LayerRange(3, 4), is_first=False, is_last=True, tensors=state)


def test_build_stage_model_names_a_wrongly_shaped_tensor(tiny):
    cfg, state = tiny
    bad = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(64, 64\), "
                                         r"expected \(32, 64\)"):
        build_stage_model(cfg, LayerRange(0, 1), is_first=True, is_last=False, tensors=bad)


def test_build_stage_model_casts_to_the_requested_dtype(tiny):
    cfg, state = tiny
    model = build_stage_model(cfg, LayerRange(0, 4), is_first=True, is_last=True, tensors=state,
                              dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq.device.type == "cpu"
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=16)
    assert kv.k.dtype == torch.bfloat16
    logits = model(torch.tensor(PROMPT), [Span(0, 0, len(PROMPT))], kv)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_stage_model_rejects_a_layer_range_past_the_model():
    with pytest.raises(ValueError, match=r"layer range \[2, 5\) exceeds the model's 4 layers"):
        StageModel(tiny_config(), LayerRange(2, 5), is_first=False, is_last=True)


def test_stage_forward_rejects_a_span_past_its_kv_slot(tiny):
    cfg, state = tiny
    model = _full_chain(cfg, state).stages[0]
    kv = model.new_kv_cache(max_num_seqs=2, max_model_len=8)
    with pytest.raises(ValueError, match="gap"):
        model(torch.tensor([1]), [Span(0, 3, 1)], kv)
    with pytest.raises(ValueError, match="max_model_len 8"):
        model(torch.arange(9), [Span(1, 0, 9)], kv)


def test_random_state_dict_has_exactly_the_checkpoint_names():
    for cfg in CONFIGS.values():
        assert set(random_state_dict(cfg)) == set(all_tensor_names(cfg)), cfg.model_type


# -- tests/tiny_model.py ------------------------------------------------------------------------

@pytest.mark.parametrize("num_shards", [1, 2])
def test_tiny_model_folder_loads_with_the_runtime_readers(tmp_path, num_shards):
    path = write_tiny_model(tmp_path / "tiny", seed=5, num_shards=num_shards)
    reader = CheckpointReader(path)
    cfg = tiny_config()
    assert reader.config == cfg
    expected = random_state_dict(cfg, seed=5)
    assert reader.tensor_names == frozenset(expected)
    got = reader.read(all_tensor_names(cfg), dtype=torch.float32)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    index = path / "model.safetensors.index.json"
    assert index.is_file() == (num_shards > 1)
    if num_shards > 1:
        files = set(json.loads(index.read_text())["weight_map"].values())
        assert len(files) == num_shards and all((path / f).is_file() for f in files)
    # A stage built from what the reader gives runs.
    names = stage_tensor_names(cfg, LayerRange(2, 4), is_first=False, is_last=True)
    build_stage_model(cfg, LayerRange(2, 4), is_first=False, is_last=True,
                      tensors=reader.read(names, dtype=torch.float32))


def test_tiny_model_tokenizer_is_256_bytes_with_eos_2(tmp_path):
    path = write_tiny_model(tmp_path / "tiny")
    tok = Tokenizer(path)
    cfg = ModelConfig.from_model_dir(path)
    assert tok.vocab_size == 256 == cfg.vocab_size
    assert tok.eos_token_ids == (TINY_EOS_ID,) and tok.bos_token_id is None and not tok.add_bos_token
    text = "Once upon a time, wörld 日本\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")), "token id must equal the byte value"
    assert all(0 <= i < cfg.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([72, 105, TINY_EOS_ID]) == "Hi", "EOS is special: skipped by default"
    assert tok.decode([72, 105, TINY_EOS_ID], skip_special_tokens=False) == "Hi\x02"
    config_eos = json.loads((path / "tokenizer_config.json").read_text())["eos_token"]
    assert tok.token_id(config_eos) == TINY_EOS_ID


def test_tiny_model_config_overrides_reach_config_json_and_weights(tmp_path):
    path = write_tiny_model(tmp_path / "tiny", num_hidden_layers=2, tie_word_embeddings=False)
    reader = CheckpointReader(path)
    assert reader.config.num_hidden_layers == 2 and not reader.config.tie_word_embeddings
    assert "lm_head.weight" in reader.tensor_names
    assert not any(n.startswith("model.layers.2.") for n in reader.tensor_names)
