"""FIRP (and SPEED + FIRP) end to end on the tiny random model: real stage processes, gloo on loopback.

What breaks when these fail: FIRP chains change greedy output (pseudo rows leaking into a KV
cache, a chain committed past a rejected draft, a truncation that leaves a rejected draft's keys
behind, the wrong anchor's drafts used for the next pass), drafts past the token budget, pseudo
rows lost between stages, or SPEED run-ahead and FIRP chains disagreeing on what is committed.
The FIRP maps are untrained (identity plus noise, tests/tiny_model.py `write_firp_file`), so
drafts are sometimes right and often wrong: both accepted and rejected chains really happen.
The oracle is the single-process reference of tests/distributed/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.items import ItemKind
from pipeline.speculation.sampling import SamplingParams
from tests.chi_square import CHI2_CRITICAL, chi_square, top_k_counts
from tests.distributed.conftest import full_model, reference_generate, session_options
from tests.distributed.test_speculation_tiny import NORM_SCALE, NUM_SAMPLES, SAMPLING_PROMPT
from tests.tiny_model import write_firp_file, write_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

PROMPTS = ("Once upon a time", "def f(x):\n    return", "1, 2, 3, 5, 8,", "The quick brown fox")
BUDGETS = (24, 10, 17, 6)

# name -> (session overrides, FIRP layer). The FIRP layer's stage makes the pseudo rows.
SHAPES = {
    "1-stage-firp": (dict(num_stages=1, speculate="firp"), 1),
    "2-stage-firp-mid-stage-0": (dict(num_stages=2, layer_split="2,2", speculate="firp"), 0),
    "2-stage-speed+firp": (dict(num_stages=2, layer_split="2,2", speculate="speed+firp", predictor="logit-lens"), 1),
    "3-stage-firp-in-stage-1": (dict(num_stages=3, layer_split="1,1,2", speculate="firp"), 1),
    "3-stage-speed+firp-min-prob": (dict(num_stages=3, layer_split="1,2,1", speculate="speed+firp", predictor="logit-lens",
                                        firp_min_prob=0.01), 2),
    # chain lengths chosen per item from a row-cost table and the measured acceptance (they vary)
    "2-stage-firp-row-costs": (dict(num_stages=2, layer_split="2,2", speculate="firp", row_cost_file=True), 1),
}
# a fake float32 table: a second row costs 5 %, 16 rows 2.4x ([Note: row-cost-driven chains])
ROW_COSTS = {"tables": [{"mode": "fp32", "num_rows": [1, 2, 4, 8, 16, 32], "pass_s": [1.0, 1.05, 1.2, 1.6, 2.4, 4.0]}]}


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[str, list[int]]:
    model, tokenizer = full_model(tiny_model_dir)
    return {p: reference_generate(model, tokenizer.encode(p), SamplingParams(max_new_tokens=max(BUDGETS),
                                                                             ignore_eos=True)) for p in PROMPTS}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def firp_session(request, tiny_model_dir: Path, tmp_path_factory):
    overrides, layer = SHAPES[request.param]
    path = write_firp_file(tiny_model_dir, tmp_path_factory.mktemp("firp") / "firp.safetensors", layer=layer, k=3,
                           seed=len(request.param))
    if overrides.get("row_cost_file"):
        table = path.parent / "row_cost.json"
        table.write_text(json.dumps(ROW_COSTS))
        overrides = {**overrides, "row_cost_file": str(table)}
    options = session_options(tiny_model_dir, firp_file=str(path), **overrides)
    with PipelineSession(options, resolve(options)) as session:
        yield request.param, session


CONCURRENT_SHAPES = ("2-stage-speed+firp", "3-stage-firp-in-stage-1")  # 4 prompts at once: enough on two shapes


@pytest.mark.parametrize("num_prompts", [1, 4], ids=["1-prompt", "4-prompts"])
def test_greedy_with_firp_chains_equals_plain_decoding(firp_session, references, num_prompts):
    name, session = firp_session
    if num_prompts > 1 and name not in CONCURRENT_SHAPES:
        pytest.skip("concurrent prompts are checked on CONCURRENT_SHAPES")
    prompts = PROMPTS[:num_prompts]
    budgets = BUDGETS[:num_prompts] if num_prompts > 1 else (max(BUDGETS),)
    params = [SamplingParams(max_new_tokens=b, ignore_eos=True) for b in budgets]
    report = run_launch(session, list(prompts), params)
    for prompt, budget, out in zip(prompts, budgets, report["outputs"], strict=True):
        assert out["token_ids"] == references[prompt][:budget], f"{name}: FIRP changed greedy output of {prompt!r}"
        assert out["finish_reason"] == "length"
    stats = report["stats"]
    assert stats["firp_verified"] > 0, f"{name}: no FIRP draft was verified: {stats}"
    if num_prompts == 1:
        assert stats["firp_accepted"] < stats["firp_verified"], f"{name}: no FIRP draft was rejected: {stats}"
        assert stats["tokens_per_pass"] >= 1.0
        kinds = {k for s in session.coordinator.timeline.slices for k in s.kinds}
        assert ItemKind.FIRP in kinds, f"{name}: no FIRP item in the timeline ({kinds})"


@pytest.fixture(scope="module")
def repetitive_model_dir(tmp_path_factory) -> Path:
    """The unsharpened tiny model (it mostly repeats tokens, so identity FIRP maps at the last layer
    often draft the sampled token) with its final norm scaled so temperature-1 sampling concentrates
    on a few tokens (see [Note: sharp tiny model] in test_speculation_tiny.py)."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-repetitive") / "model")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * NORM_SCALE
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_sampling_with_firp_chains_keeps_the_token_distribution(repetitive_model_dir: Path, tmp_path_factory):
    """Temperature 1, 4 tokens, FIRP chains of 2: every token is distributed as plain sampling
    (chain verify applies the speculative accept rule row by row with a one-hot q), with chains
    both accepted and rejected. Plain side: the single-process sampler (what `--speculate none`
    produces)."""
    sharp_model_dir = repetitive_model_dir
    model, tokenizer = full_model(sharp_model_dir)
    ids = tokenizer.encode(SAMPLING_PROMPT)
    plain = [reference_generate(model, ids, SamplingParams(max_new_tokens=4, temperature=1.0, seed=i,
                                                           ignore_eos=True)) for i in range(NUM_SAMPLES)]
    path = write_firp_file(sharp_model_dir, tmp_path_factory.mktemp("firp-sharp") / "f.safetensors", layer=3, k=2,
                           noise=0.0)
    options = session_options(sharp_model_dir, num_stages=1, speculate="firp", firp_file=str(path))
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=10**6 + i, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    with PipelineSession(options, resolve(options)) as session:
        report = run_launch(session, [SAMPLING_PROMPT] * NUM_SAMPLES, params)
    stats = report["stats"]
    assert 0 < stats["firp_accepted"] < stats["firp_verified"], f"chains must be both accepted and rejected: {stats}"
    spec = [o["token_ids"] for o in report["outputs"]]
    for position in range(4):
        table, top = top_k_counts([o[position] for o in plain], [o[position] for o in spec])
        stat = chi_square(table)
        assert stat < CHI2_CRITICAL[5], (f"token {position + 1} is distributed differently with FIRP: chi2 {stat:.1f} "
                                         f">= {CHI2_CRITICAL[5]}; counts {table.tolist()} of tokens {top} + other")


SLIDING_WINDOW = 8
SLIDING_PROMPT = "Once upon a time, a "  # 20 bytes = 20 tokens of the byte tokenizer: a prefill past the window
SLIDING_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def small_window_model(tmp_path_factory) -> tuple[Path, list[int]]:
    """The tiny Mistral of tests/family_models.py (every layer sliding) with a window of 8, far below prompt +
    output, and transformers' greedy output for SLIDING_PROMPT."""
    import torch
    import transformers

    from tests.family_models import write_family_model

    folder = write_family_model(tmp_path_factory.mktemp("mistral") / "model", "mistral", seed=3,
                                sliding_window=SLIDING_WINDOW)
    ids = list(SLIDING_PROMPT.encode())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor([ids]), do_sample=False, max_new_tokens=SLIDING_NEW_TOKENS,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(want)) > 3, "degenerate oracle: the random model repeats one token"
    return folder, want


@pytest.mark.parametrize("speculate", ["none", "firp", "speed+firp"])
def test_firp_on_two_stages_through_a_binding_window_gives_transformers_greedy_output(small_window_model, speculate):
    """A sliding-window model (tiny Mistral, every layer sliding) with window 8 < 20 prompt + 24 new tokens (the
    window binds on almost every row; max_model_len 512): 2 real stages with FIRP chains from layer 1 through
    sliding layers 2 and 3 ([Note: windowed pseudo rows] in pipeline/model/attention.py), with and without SPEED
    run-ahead, give transformers' greedy output, as `--speculate none` does."""
    folder, want = small_window_model
    extra = {} if speculate == "none" else dict(firp_file=str(write_firp_file(folder, folder.parent / "firp.safetensors",
                                                                              layer=1, k=3)))
    if speculate == "speed+firp":
        extra["predictor"] = "logit-lens"
    options = session_options(folder, num_stages=2, layer_split="2,2", speculate=speculate, **extra)
    with PipelineSession(options, resolve(options)) as session:
        assert session.coordinator.tokenizer.encode(SLIDING_PROMPT) == list(SLIDING_PROMPT.encode())
        report = run_launch(session, [SLIDING_PROMPT], [SamplingParams(max_new_tokens=SLIDING_NEW_TOKENS,
                                                                       ignore_eos=True)])
    assert report["outputs"][0]["token_ids"] == want, f"{speculate} through a binding window changed greedy output"
    stats = report["stats"]
    if speculate != "none":
        assert 0 < stats["firp_verified"] and stats["firp_accepted"] < stats["firp_verified"], stats
