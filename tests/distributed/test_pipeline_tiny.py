"""End-to-end pipeline on the tiny random model: real stage processes, gloo on loopback.

Every pipeline shape (1, 2, 3, 4 stages, an uneven --layer-split on a 2-shard checkpoint) must
reproduce the single-process reference token for token: greedy and seeded sampling, one request
at a time and many at once (more than the KV slots), with the right finish reasons; and each stage
must read only its own tensors and report sane stats. One session per shape (module scope).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from tests.conftest import wait_for
from tests.distributed.conftest import full_model, reference_generate, session_options
from tests.tiny_model import byte_alphabet

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

RESULT_TIMEOUT_S = 60.0
MAX_NUM_SEQS = 3  # fewer KV slots than CONCURRENT_PROMPTS, so slots are reused
PROMPTS = ("Once upon a time", "def f(x):\n    return", "x", "1, 2, 3, 5, 8,", "¿Qué tal? Très bien.")
CONCURRENT_PROMPTS = (*PROMPTS, "The quick brown fox", "zzz", "Hello, world!")
NUM_NEW_TOKENS = 24


@dataclasses.dataclass(frozen=True)
class Shape:
    """One pipeline layout under test."""

    num_stages: int
    layer_split: str | None = None
    sharded: bool = False


SHAPES = {
    "1-stage": Shape(1),
    "2-stage": Shape(2),
    "3-stage": Shape(3),
    "4-stage": Shape(4),
    "split-1,3-2-shards": Shape(2, layer_split="1,3", sharded=True),
}


@dataclasses.dataclass
class Pipeline:
    shape: Shape
    model_dir: Path
    options: PipelineOptions
    session: PipelineSession

    def generate(self, prompt: str | list[int], params: SamplingParams):
        return self.session.coordinator.submit(prompt, params).result(RESULT_TIMEOUT_S)

    def generate_concurrently(self, prompts, params: list[SamplingParams]):
        handles = [self.session.coordinator.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return [h.result(RESULT_TIMEOUT_S) for h in handles]


# [Note: EOS remap]
# The tiny model practically never picks its own EOS (id 2), so the folders used here are copies
# whose config.json / generation_config.json and tokenizer_config.json's eos_token name another EOS: the
# token the model greedily emits at index EOS_INDEX for EOS_PROMPT (chosen so it does not occur earlier).
# It must be the tokenizer's eos_token too: that is the primary EOS (finish "eos"); an id only the
# generation config lists is a secondary one, a stop token id ([Note: token masks] in
# pipeline/speculation/masks/token_masks.py). Every other test sets ignore_eos, so only the EOS test sees the difference.
EOS_PROMPT = PROMPTS[0]


@pytest.fixture(scope="module")
def eos_remap(tiny_model_dir: Path) -> tuple[int, int]:
    """(EOS id for the copies, index of its first appearance in EOS_PROMPT's greedy output)."""
    model, tokenizer = full_model(tiny_model_dir)
    tokens = reference_generate(model, tokenizer.encode(EOS_PROMPT), greedy(16))
    k = next(i for i in range(2, 16) if tokens[i] not in tokens[:i])
    return tokens[k], k


def _copy_with_eos(src: Path, dst: Path, eos: int) -> Path:
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((dst / name).read_text())
        config["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(config))
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**tok_config, "eos_token": byte_alphabet()[eos]}))
    return dst


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_model_dir: Path, tiny_sharded_dir: Path, eos_remap) -> dict[bool, Path]:
    """{sharded?: folder}: the tiny model, single-file and 2-shard, with the EOS of [Note: EOS remap]."""
    root = tmp_path_factory.mktemp("tiny-eos")
    return {False: _copy_with_eos(tiny_model_dir, root / "single", eos_remap[0]),
            True: _copy_with_eos(tiny_sharded_dir, root / "sharded", eos_remap[0])}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def pipeline(request, model_dirs: dict[bool, Path]):
    """A started pipeline of one shape; one session per shape, shared by the module's tests."""
    shape = SHAPES[request.param]
    options = session_options(model_dirs[shape.sharded], shape.num_stages, layer_split=shape.layer_split,
                              max_num_seqs=MAX_NUM_SEQS)
    with PipelineSession(options, resolve(options)) as session:
        yield Pipeline(shape, model_dirs[shape.sharded], options, session)


@pytest.fixture(scope="module")
def reference(model_dirs: dict[bool, Path]):
    """The single-process model and tokenizer (the shards hold the same weights)."""
    return full_model(model_dirs[False])


def greedy(max_new_tokens: int = NUM_NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


_REFERENCE_CACHE: dict[tuple[str, SamplingParams], list[int]] = {}


def reference_tokens(reference, prompt: str, params: SamplingParams) -> list[int]:
    """Single-process output for `prompt` (cached: every pipeline shape compares with the same)."""
    key = (prompt, params)
    if key not in _REFERENCE_CACHE:
        model, tokenizer = reference
        _REFERENCE_CACHE[key] = reference_generate(model, tokenizer.encode(prompt), params,
                                                   eos_token_ids=tokenizer.eos_token_ids)
    return list(_REFERENCE_CACHE[key])


# -- token identity -----------------------------------------------------------------------------------

def test_greedy_tokens_match_single_process_reference(pipeline: Pipeline, reference):
    for prompt in PROMPTS:
        out = pipeline.generate(prompt, greedy())
        assert out.token_ids == reference_tokens(reference, prompt, greedy()), (pipeline.shape, prompt)
        assert out.finish_reason == "length"
        assert out.text == reference[1].decode(out.token_ids)


def test_concurrent_prompts_beyond_max_num_seqs_match_one_at_a_time(pipeline: Pipeline, reference):
    # Different budgets, so requests finish at different times and freed slots are refilled mid-run.
    params = [greedy(8 + 3 * i) for i in range(len(CONCURRENT_PROMPTS))]
    assert len(CONCURRENT_PROMPTS) > MAX_NUM_SEQS
    one_at_a_time = [pipeline.generate(p, sp).token_ids for p, sp in zip(CONCURRENT_PROMPTS, params, strict=True)]
    concurrent = [r.token_ids for r in pipeline.generate_concurrently(CONCURRENT_PROMPTS, params)]
    assert concurrent == one_at_a_time
    expected = [reference_tokens(reference, p, sp) for p, sp in zip(CONCURRENT_PROMPTS, params, strict=True)]
    assert one_at_a_time == expected


def test_kv_slots_are_all_released_after_requests_finish(pipeline: Pipeline):
    pipeline.generate_concurrently(CONCURRENT_PROMPTS, [greedy(4)] * len(CONCURRENT_PROMPTS))
    def slots_in_use() -> list[int]:
        return [st.kv_slots_in_use for st in pipeline.session.coordinator.stage_stats()]

    # RELEASE travels in-band after the last result
    wait_for(lambda: not any(slots_in_use()), timeout_s=10.0)
    assert slots_in_use() == [0] * pipeline.shape.num_stages


def test_seeded_sampling_matches_reference_sampler_on_every_stage_count(pipeline: Pipeline, reference):
    """Same seed -> same tokens as the single-process Sampler, hence identical across stage counts."""
    params = [SamplingParams(max_new_tokens=NUM_NEW_TOKENS, temperature=0.8, top_p=0.9, seed=1234 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    outs = pipeline.generate_concurrently(PROMPTS, params)
    for prompt, sp, out in zip(PROMPTS, params, outs, strict=True):
        assert out.token_ids == reference_tokens(reference, prompt, sp), (pipeline.shape, prompt)
    greedy_outs = [reference_tokens(reference, p, greedy()) for p in PROMPTS]
    assert [o.token_ids for o in outs] != greedy_outs, "temperature 0.8 should not reproduce greedy output"


# -- finish reasons -----------------------------------------------------------------------------------

def test_max_new_tokens_finishes_with_length(pipeline: Pipeline):
    for n in (1, 2, 7):
        out = pipeline.generate("Once upon a time", greedy(n))
        assert (len(out.token_ids), out.finish_reason) == (n, "length")


def test_stop_string_finishes_with_stop_and_cuts_the_text(pipeline: Pipeline):
    full = pipeline.generate(PROMPTS[0], greedy(32))
    # The first printable ASCII character that first appears at least 3 characters in.
    found = next(((i, c) for i, c in enumerate(full.text) if i >= 3 and c.isascii() and c.isalnum()
                  and full.text.index(c) == i), None)
    if found is None:
        pytest.fail(f"no usable stop character in the tiny model's output {full.text!r}")
    i, stop = found
    out = pipeline.generate(PROMPTS[0], greedy(32, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:i]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 32


def test_eos_finishes_with_eos_unless_ignore_eos(pipeline: Pipeline, eos_remap):
    eos, k = eos_remap
    assert pipeline.session.model.tokenizer.eos_token_ids == (eos,)
    full = pipeline.generate(EOS_PROMPT, greedy(16))  # ignore_eos: EOS committed, generation goes on
    assert full.finish_reason == "length" and len(full.token_ids) == 16 and full.token_ids[k] == eos
    out = pipeline.generate(EOS_PROMPT, SamplingParams(max_new_tokens=16))
    assert out.finish_reason == "eos"
    assert out.token_ids == full.token_ids[:k + 1]


# -- stages: weights and stats ------------------------------------------------------------------------

def _stage_names(config: ModelConfig, pipeline: Pipeline, i: int) -> list[str]:
    ranges = pipeline.session.model.ranges
    return stage_tensor_names(config, ranges[i], is_first=i == 0, is_last=i == len(ranges) - 1)


def test_layer_ranges_follow_the_requested_split(pipeline: Pipeline):
    ranges = [(r.start, r.stop) for r in pipeline.session.model.ranges]
    assert len(ranges) == pipeline.shape.num_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == 4
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    if pipeline.shape.layer_split:
        assert [b - a for a, b in ranges] == [int(s) for s in pipeline.shape.layer_split.split(",")]


def test_each_stage_reads_only_its_own_tensors(pipeline: Pipeline):
    config = ModelConfig.from_model_dir(pipeline.model_dir)
    loads = pipeline.session.load_responses
    assert len(loads) == pipeline.shape.num_stages
    for i, load in enumerate(loads):
        assert sorted(load.tensor_names) == sorted(_stage_names(config, pipeline, i)), f"stage {i}"


def test_weights_bytes_equal_checkpoint_bytes_of_the_stage_tensors(pipeline: Pipeline, request):
    config = ModelConfig.from_model_dir(pipeline.model_dir)
    reader = CheckpointReader(pipeline.model_dir)
    stats = pipeline.session.coordinator.stage_stats()
    for i, (load, st) in enumerate(zip(pipeline.session.load_responses, stats, strict=True)):
        expected = reader.nbytes(_stage_names(config, pipeline, i), dtype=torch.float32)
        assert (load.weights_bytes, st.weights_bytes) == (expected, expected), f"stage {i}"


def test_busy_fraction_is_in_the_unit_interval_and_nonzero_after_work(pipeline: Pipeline):
    coordinator = pipeline.session.coordinator
    coordinator.reset_stats()
    pipeline.generate_concurrently(PROMPTS, [greedy(16)] * len(PROMPTS))
    for i, st in enumerate(coordinator.stage_stats()):
        assert st.wall_ns > 0 and 0 < st.busy_ns <= st.wall_ns, f"stage {i}: busy {st.busy_ns} wall {st.wall_ns}"
        assert st.items_processed > 0 and st.tokens_processed >= st.items_processed
        assert st.rss_bytes > st.weights_bytes > 0 and st.kv_cache_bytes > 0


# -- pure (no processes) ------------------------------------------------------------------------------

def test_single_stage_resolves_without_speculation(tiny_model_dir: Path):
    model = resolve(PipelineOptions(num_stages=1, model=str(tiny_model_dir), progress=False))
    assert [(r.start, r.stop) for r in model.ranges] == [(0, 4)]


def test_reference_tokenizer_round_trips_the_prompts(tiny_model_dir: Path):
    tokenizer = Tokenizer(tiny_model_dir)
    for prompt in CONCURRENT_PROMPTS:
        assert tokenizer.decode(tokenizer.encode(prompt)) == prompt
