"""FIRP pseudo rows on sliding-window layers ([Note: windowed pseudo rows] in pipeline/model/attention.py;
[Note: a window that never binds] in pipeline/model/family_blocks.py).

What breaks when these fail: the window rule off by one (transformers' `sliding_window_overlay`:
kv_idx > q_idx - window), a pseudo row masked at the wrong position (its anchor's, 0, one off) or its
chain's own pseudo keys left outside the window, on the batched path or on a prefill's (a large item's),
the run plan refusing FIRP on a model whose later layers slide, or FIRP chains through binding windows
changing greedy output. Oracles: transformers' mask functions for the masks, the same chain run as real
rows on a cloned cache truncated after its anchor for the stage outputs ([Note: pseudo rows] in
pipeline/model/row_layout.py), and transformers' Mistral (every layer sliding) for greedy output.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from transformers.masking_utils import sliding_window_causal_mask_function

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from pipeline.model import attention
from pipeline.model.attention import AttentionPlan, span_attention
from pipeline.model.family_blocks import window_binds
from pipeline.model.kv_cache import KVCache
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import PseudoLayout, Span
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.predictors import LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.quant_load import load_stage_model
from tests.family_models import family_config, family_state_dict, write_family_model
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_firp_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 24
PROMPT = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250, 12, 64]  # + 12 new tokens = WINDOW positions
LONG_PROMPT = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250, 12, 64, 7, 99, 150, 42, 18, 230, 61, 120]  # 20: a large item
NEW_TOKENS = 24
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """The tiny Mistral of tests/family_models.py (every layer sliding) with a window of WINDOW."""
    return write_family_model(tmp_path_factory.mktemp("mistral") / "model", "mistral", seed=3, sliding_window=WINDOW)


def _hf(folder, **overrides):
    config = transformers.AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_the_window_binds_exactly_where_transformers_sliding_attention_parts_from_full_attention(mistral_dir):
    """transformers' sliding model equals its full-attention twin on WINDOW positions and differs at
    WINDOW + 1 (the last row loses key 0): so a KV slot of max_model_len = WINDOW never sees the window,
    one of WINDOW + 1 does, and `window_binds` says so."""
    sliding, full = _hf(mistral_dir), _hf(mistral_dir, sliding_window=None)
    ids = torch.tensor([[*PROMPT, *PROMPT, *PROMPT][:WINDOW + 1]])
    with torch.no_grad():
        a, b = sliding(ids).logits[0], full(ids).logits[0]
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW], rtol=0, atol=0)
    assert (a[WINDOW] - b[WINDOW]).abs().max() > 1e-3, "transformers' window hid nothing at WINDOW + 1 positions"
    assert not window_binds(WINDOW, WINDOW) and window_binds(WINDOW, WINDOW + 1) and not window_binds(None, 8)


def _reference_mask(span: Span, window: int) -> torch.Tensor:
    """[n + p, end + p] bool (True = may attend) from transformers' sliding causal mask function: real row r
    is the token at start + r over the cached keys; row i of chain a is the chain's token at p_a + 1 + i run as
    a real token after its anchor p_a: cached keys 0..p_a and its chain's rows up to itself."""
    allowed = sliding_window_causal_mask_function(window)
    n, k, end = span.num_tokens, span.chain_len, span.start + span.num_tokens
    query_pos, key_pos = list(range(span.start, end)), list(range(end))  # a query sees a key only at these
    pairs = [[False] * (end + span.num_pseudo) for _ in range(n + span.num_pseudo)]
    for r in range(n):
        pairs[r][:end] = [True] * end
    for a in range(span.num_anchors):
        anchor = end - span.num_anchors + a
        for i in range(k):
            query_pos.append(anchor + 1 + i)
            row = pairs[n + a * k + i]
            row[:anchor + 1] = [True] * (anchor + 1)
            row[end + a * k:end + a * k + i + 1] = [True] * (i + 1)
        key_pos.extend(anchor + 1 + i for i in range(k))
    q, kv = torch.tensor(query_pos)[:, None], torch.tensor(key_pos)[None, :]
    return torch.tensor(pairs) & allowed(0, 0, q, kv)


# start 10, 3 rows, 2 chains of 3 (positions 12..14 and 13..15); a window of 1 or 2 hides the chain's own first
# pseudo keys, 3..13 cut the cached keys at every boundary, 16 hides nothing
SMALL = Span(0, 10, 3, num_anchors=2, chain_len=3)
LARGE = Span(1, 0, len(LONG_PROMPT), num_anchors=1, chain_len=3)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 8, 12, 13, 14, 16])
def test_pseudo_row_masks_keep_exactly_transformers_sliding_window_on_both_paths(window):
    """Batched item (with a plain item beside it, so rows and keys are padded) and large item: every query row's
    visible keys, real and pseudo, equal transformers' sliding causal mask at the rows' positions."""
    spans = [SMALL, Span(2, 4, 1), LARGE]
    plan = AttentionPlan.build(spans, PseudoLayout.build(spans, "cpu"), torch.device("cpu"))
    assert plan.small == [0, 1] and plan.large == [2]
    want = _reference_mask(SMALL, window)
    n, p, end = SMALL.num_tokens, SMALL.num_pseudo, SMALL.start + SMALL.num_tokens
    seen = ~plan.masked_out_for(window)[0, :n + p]  # [n + p, max_len + max_p]
    assert torch.equal(seen[:, :end], want[:, :end]) and not seen[:, end:plan.max_len].any()
    assert torch.equal(seen[:, plan.max_len:plan.max_len + p], want[:, end:])
    plain = ~plan.masked_out_for(window)[1, :1, :plan.max_len]  # the plain 1-row item at position 4
    assert torch.equal(plain[0, :5], _reference_mask(Span(2, 4, 1), window)[0]) and not plain[0, 5:].any()
    assert torch.equal(plan.pseudo_mask_for(2, window), _reference_mask(LARGE, window))


def test_two_prefills_with_pseudo_rows_keep_their_own_windowed_masks_on_every_layer():
    """Two large items with pseudo rows in one plan (different spans, chains and shapes), each asked for its
    windowed mask under two windows on every layer, interleaved as the layers ask: each (item, window) gets its
    own mask (`pseudo_mask_for` caches per plan; a cache keyed by the window alone or by the item alone hands
    one item's or one window's mask to the other)."""
    other = Span(3, 0, 18, num_anchors=2, chain_len=2)
    spans = [LARGE, other]
    plan = AttentionPlan.build(spans, PseudoLayout.build(spans, "cpu"), torch.device("cpu"))
    assert plan.large == [0, 1]
    for _layer in range(2):
        for window in (3, 8):
            for i, span in enumerate(spans):
                assert torch.equal(plan.pseudo_mask_for(i, window), _reference_mask(span, window)), (i, window)


@pytest.mark.parametrize("window", [None, 64], ids=["no-window", "window-never-binds"])
def test_a_firp_pass_without_a_binding_window_never_looks_up_a_pseudo_rows_position(monkeypatch, window):
    """The plan of a FIRP pass is built on every stage of every FIRP step: where no layer's window binds (families
    without sliding layers, Gemma's global layers, window >= max_model_len) it runs the ops it ran before pseudo rows
    had a window, so neither the build nor the attention (batched and large item) looks up a pseudo row's position;
    a binding window then does, and masks as transformers does."""
    spans = [SMALL, Span(2, 4, 1), LARGE]
    layout = PseudoLayout.build(spans, "cpu")
    kv = KVCache(num_layers=1, max_num_seqs=3, max_model_len=64, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(_num_rows(spans), heads, 8, generator=gen) for heads in (4, 2, 2))

    def no_lookup(span):
        raise AssertionError(f"pseudo positions of {span} looked up without a binding window")

    with monkeypatch.context() as m:
        m.setattr(Span, "pseudo_positions", no_lookup)
        plan = AttentionPlan.build(spans, layout, torch.device("cpu"))
        span_attention(q, k, v, plan, kv, 0, window=window)
    assert torch.equal(~plan.masked_out_for(3)[0, :SMALL.num_tokens + SMALL.num_pseudo, plan.max_len:],
                       _reference_mask(SMALL, 3)[:, SMALL.start + SMALL.num_tokens:])


def _num_rows(spans) -> int:
    """Real and pseudo rows of a micro-batch."""
    return sum(s.num_tokens + s.num_pseudo for s in spans)


def _windowed_models(window: int, firp_layer: int = 1):
    """Tiny Mistral (every layer sliding, window `window`) split after `firp_layer`: (config, first, rest)."""
    cfg = dataclasses.replace(family_config("mistral"), sliding_window=window)
    state = family_state_dict(cfg, seed=5)
    n = cfg.num_hidden_layers
    first = build_stage_model(cfg, LayerRange(0, firp_layer + 1), is_first=True, is_last=False, tensors=state)
    rest = build_stage_model(cfg, LayerRange(firp_layer + 1, n), is_first=False, is_last=True, tensors=state)
    return cfg, first, rest


@pytest.mark.parametrize("window", [2, 4, 7])
@pytest.mark.parametrize("item", [[11, 12, 13, 14], LONG_PROMPT], ids=["batched-item", "large-item"])
def test_windowed_pseudo_rows_equal_their_chain_run_as_real_rows_after_the_anchor(window, item):
    """A 4-row item after a 9-token context, and a 20-row prefill (SDPA path), each with 2 chains of 3 pseudo rows
    through sliding layers whose window binds: every chain's logits equal its pseudo hidden states run as real
    rows after the anchor on a cloned, truncated cache (real rows are windowed as transformers: test_families.py)."""
    cfg, first, rest = _windowed_models(window)
    gen = torch.Generator().manual_seed(7)
    maps = 0.3 * torch.randn(3, cfg.hidden_size, cfg.hidden_size, generator=gen)

    def make_pseudo(anchor_hidden):  # [A, H] -> [A * 3, H], chains in anchor order
        return torch.einsum("kij,aj->aki", maps, anchor_hidden).reshape(-1, cfg.hidden_size)

    kv_a, kv_b = (m.new_kv_cache(max_num_seqs=2, max_model_len=64) for m in (first, rest))
    start = 0 if item is LONG_PROMPT else 9
    if start:
        ctx = torch.tensor(PROMPT[:start])
        rest(first(ctx, [Span(1, 0, start)], kv_a), [Span(1, 0, start)], kv_b)
    before = copy.deepcopy(kv_b)
    span = Span(1, start, len(item), num_anchors=2, chain_len=3)
    mid = first.forward_rows(torch.tensor(item), [span], kv_a, firp_layer=1, make_pseudo=make_pseudo)
    out = rest.forward_rows(mid.out, [span], kv_b, pseudo=mid.pseudo)
    for a in range(2):
        anchor = len(item) - 2 + a
        kv = copy.deepcopy(before)
        rest(mid.out[:anchor + 1], [Span(1, start, anchor + 1)], kv)
        chain = mid.pseudo[a * 3:(a + 1) * 3]
        want = rest(chain, [Span(1, start + anchor + 1, 3)], kv, logit_rows=torch.arange(3))
        torch.testing.assert_close(out.pseudo[a * 3:(a + 1) * 3], want, **TOL)


def test_a_windowed_firp_pass_builds_each_window_mask_once_for_all_its_sliding_layers(monkeypatch):
    """One stage of 3 sliding layers (window 4) runs a micro-batch with a 4-row batched item and a 20-row prefill
    (a large item), both with 2 chains of 3 pseudo rows: the batched items' windowed mask (`masked_out_for`) and the
    prefill's (`pseudo_mask_for`) are each built once for the pass, not once per layer (the plan is shared by every
    layer; a per-layer rebuild of the pseudo mask called `inside_window` 1 + 3 times)."""
    cfg, first, rest = _windowed_models(4, firp_layer=0)
    assert rest.layer_range == LayerRange(1, cfg.num_hidden_layers) and cfg.num_hidden_layers - 1 == 3
    kv_a, kv_b = (m.new_kv_cache(max_num_seqs=2, max_model_len=64) for m in (first, rest))
    ctx = [Span(0, 0, 9)]
    rest(first(torch.tensor(PROMPT[:9]), ctx, kv_a), ctx, kv_b)
    spans = [Span(0, 9, 4, num_anchors=2, chain_len=3), Span(1, 0, len(LONG_PROMPT), num_anchors=2, chain_len=3)]
    maps = 0.3 * torch.randn(3, cfg.hidden_size, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    mid = first.forward_rows(torch.tensor([11, 12, 13, 14, *LONG_PROMPT]), spans, kv_a, firp_layer=0,
                             make_pseudo=lambda h: torch.einsum("kij,aj->aki", maps, h).reshape(-1, cfg.hidden_size))
    calls = []
    real_inside_window = attention.inside_window

    def counted(query_pos, key_pos, window):
        calls.append(window)
        return real_inside_window(query_pos, key_pos, window)

    monkeypatch.setattr(attention, "inside_window", counted)
    rest.forward_rows(mid.out, spans, kv_b, pseudo=mid.pseudo)
    assert calls == [4, 4], f"inside_window called for windows {calls}: a windowed mask rebuilt per layer"


def _options(model_dir, firp_file, max_model_len: int) -> PipelineOptions:
    return PipelineOptions(num_stages=2, model=str(model_dir), layer_split="2,2", progress=False,
                           max_model_len=max_model_len, speculate="firp", firp_file=str(firp_file))


@pytest.mark.parametrize("max_model_len", [WINDOW, WINDOW + 1, 512])
def test_firp_on_a_sliding_model_is_planned_whatever_the_window(mistral_dir, tmp_path, monkeypatch, max_model_len):
    """A window that never binds (== max_model_len), binds at the last position (one short) or binds widely:
    the plan keeps the FIRP layer (it refused the last two while pseudo rows had no windowed mask)."""
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 4)
    firp = write_firp_file(mistral_dir, tmp_path / "firp.safetensors", layer=1, k=2)
    assert resolve(_options(mistral_dir, firp, max_model_len)).firp.layer == 1


def _stages(folder):
    return [load_stage_model(str(folder), r, is_first=i == 0, is_last=i == 1)
            for i, r in enumerate((LayerRange(0, 2), LayerRange(2, 4)))]


@pytest.fixture(scope="module")
def small_window_dir(tmp_path_factory):
    """The tiny Mistral with a window of 8, well below prompt + output (20 + 24 positions)."""
    return write_family_model(tmp_path_factory.mktemp("mistral8") / "model", "mistral", seed=3, sliding_window=8)


@pytest.mark.parametrize("speculate", ["none", "firp", "speed+firp"])
def test_firp_chains_through_binding_windows_give_transformers_greedy_output(small_window_dir, speculate):
    """Two stages, FIRP chains of 3 from layer 1 through the sliding layers 2 and 3 (window 8 < a 20-token prompt
    + 24 new tokens, max_model_len 64), with and without SPEED run-ahead, and no speculation: transformers'
    greedy output. The prompt is a large item with pseudo rows (SDPA path); the rest are batched."""
    firp_k = 0 if speculate == "none" else 3
    predictor = LogitLensPredictor() if speculate == "speed+firp" else None
    pipe = InProcessPipeline(_stages(small_window_dir), max_model_len=64, firp_k=firp_k, exit_layer=1,
                             predictor=predictor)
    got = pipe.generate([LONG_PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    with torch.no_grad():
        ref = _hf(small_window_dir).generate(torch.tensor([LONG_PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                             eos_token_id=None, pad_token_id=0)[0, len(LONG_PROMPT):].tolist()
    assert got == ref
    assert len(set(ref)) > 3, "degenerate oracle: the random model repeats one token"
    spec = pipe.engine.spec
    if firp_k:
        assert 0 < spec.firp_verified and spec.firp_accepted < spec.firp_verified, "chains not both kinds"


# family -> config changes: Gemma 2 / 3 slide on some layers (window 6, their own local RoPE for Gemma 3,
# soft-caps), Phi-3 on every layer once given a window
SLIDING_FAMILIES = {"gemma2": {}, "gemma3_text": {}, "phi3": {"sliding_window": 8}, "mixtral": {"sliding_window": 8}}


@pytest.mark.parametrize("family", list(SLIDING_FAMILIES))
def test_firp_through_other_families_sliding_layers_gives_transformers_greedy_output(family, tmp_path):
    """FIRP chains of 3 from layer 1 through layers 2 and 3 of each family with a window below prompt + output:
    transformers' greedy output (the family's own mask, RoPE and caps)."""
    folder = write_family_model(tmp_path / family, family, seed=3, **SLIDING_FAMILIES[family])
    pipe = InProcessPipeline(_stages(folder), max_model_len=64, firp_k=3, exit_layer=1)
    got = pipe.generate([LONG_PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    with torch.no_grad():
        ref = _hf(folder).generate(torch.tensor([LONG_PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=None, pad_token_id=0)[0, len(LONG_PROMPT):].tolist()
    assert got == ref
    assert len(set(ref)) > 3, "degenerate oracle: the random model repeats one token"
    assert pipe.engine.spec.firp_verified > 0
