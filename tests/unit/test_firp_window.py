"""FIRP on sliding-window models whose window never binds ([Note: a window that never binds] in
pipeline/model/family_blocks.py).

What breaks when these fail: the off-by-one of the rule (a window of max_model_len - 1 hides key 0 from
the query at max_model_len - 1, as transformers masks it), the run plan refusing FIRP where the window
covers every position of a KV slot or allowing it where it does not (its message must name the
max_model_len that would allow it), or the attention running a never-binding window differently from full
attention (FIRP chains through it must give transformers' greedy output). The oracle is transformers'
Mistral (every layer sliding) on the same folder.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from launcher.cli.errors import flag_message
from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from pipeline.model.family_blocks import window_binds
from pipeline.model.partition import LayerRange
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.quant_load import load_stage_model
from tests.family_models import write_family_model
from tests.in_process_pipeline import InProcessPipeline
from tests.tiny_model import write_firp_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 24
PROMPT = [5, 17, 200, 33, 9, 81, 140, 77, 3, 250, 12, 64]  # + 12 new tokens = WINDOW positions


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


def _options(model_dir, firp_file, max_model_len: int) -> PipelineOptions:
    return PipelineOptions(num_stages=2, model=str(model_dir), layer_split="2,2", progress=False,
                           max_model_len=max_model_len, speculate="firp", firp_file=str(firp_file))


@pytest.mark.parametrize(("max_model_len", "allowed"), [(WINDOW - 8, True), (WINDOW, True), (WINDOW + 1, False)],
                         ids=["window-above", "window-equal", "window-one-short"])
def test_firp_on_a_sliding_model_is_planned_only_where_the_window_covers_max_model_len(
        mistral_dir, tmp_path, monkeypatch, max_model_len, allowed):
    """window == max_model_len: planned; window == max_model_len - 1: refused before any stage starts, naming
    the first sliding layer after the FIRP layer and the max_model_len that would allow it (a flag on the CLI)."""
    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 4)
    firp = write_firp_file(mistral_dir, tmp_path / "firp.safetensors", layer=1, k=2)
    options = _options(mistral_dir, firp, max_model_len)
    if allowed:
        assert resolve(options).firp.layer == 1
        return
    with pytest.raises(ValueError) as info:
        resolve(options)
    want = (f"speculate firp is not supported on this model: FIRP pseudo rows run layers 2..3 after the FIRP layer, "
            f"and 2 of them (first: 2) use sliding-window attention (window {WINDOW} < max_model_len {WINDOW + 1}; "
            f"max_model_len {WINDOW} or less would allow it); use --speculate speed")
    assert str(info.value) == want
    assert f"--max-model-len {WINDOW} or less would allow it" in flag_message(str(info.value))


def _stages(folder):
    return [load_stage_model(str(folder), r, is_first=i == 0, is_last=i == 1)
            for i, r in enumerate((LayerRange(0, 2), LayerRange(2, 4)))]


def test_firp_chains_through_never_binding_windows_give_transformers_greedy_output(mistral_dir):
    """Two stages, FIRP chains of 2 from layer 1 through the sliding layers 2 and 3, prompt + budget filling a
    KV slot of max_model_len = WINDOW: transformers' greedy output. With max_model_len = WINDOW + 1 the
    window binds and a pseudo row on a sliding layer stays an error at the stage (the plan refuses that run)."""
    budget = WINDOW - len(PROMPT)
    params = SamplingParams(max_new_tokens=budget, ignore_eos=True)
    pipe = InProcessPipeline(_stages(mistral_dir), max_model_len=WINDOW, firp_k=2, exit_layer=1)
    got = pipe.generate([PROMPT], params)[0]
    with torch.no_grad():
        ref = _hf(mistral_dir).generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=budget,
                                        eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == ref
    assert len(set(ref)) > 3, "degenerate oracle: the random model repeats one token"
    assert pipe.engine.spec.firp_verified > 0, "no FIRP chain ran through the sliding layers"
    binding = InProcessPipeline(_stages(mistral_dir), max_model_len=WINDOW + 1, firp_k=2, exit_layer=1)
    with pytest.raises(ValueError, match=rf"sliding-window layer whose window \({WINDOW}\) is below max_model_len"):
        binding.generate([PROMPT], SamplingParams(max_new_tokens=budget + 1, ignore_eos=True))
