"""SPEED speculation end to end on the tiny random model: real stage processes, gloo on loopback.

What breaks when these fail: speculation changes greedy output (a squash that leaves stale keys
in some stage's KV cache, a token lost or repeated, a slot reused while squashed drafts of its
previous sequence are still in flight), the exit layer in a later stage, the launch report's
speculation counters or its split of busy time into useful and wasted work, or sampling with
drafts that is no longer distributed like plain sampling (ARCHITECTURE.md §5.3 and §5.4).

Drafts come from the adversarial predictors of tests/adversarial_predictors.py, switched on one
session per pipeline shape: always wrong (every draft squashed) and sometimes right (accepts and
squashes), each either drafting as soon as an item is sent or only after the chain's end passed
the exit layer ("@exit"), plus the real logit-lens predictor; the sampling test drafts (mostly)
uniformly random tokens. The oracle is
the single-process reference of tests/distributed/conftest.py, which test_pipeline_tiny.py checks
is what `--speculate none` produces on every shape.

[Note: sharp tiny model]
The tiny model samples almost uniformly over its 256 tokens at temperature 1, where a chi-square
test has no power. These tests use a copy whose final norm weight is scaled by NORM_SCALE: logits
are scaled, so greedy output (and the logit-lens argmax) is unchanged, while temperature-1
sampling concentrates on a few tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launcher.cli.launch import run_launch
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.predictors import LogitLensPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import (
    AlwaysWrongPredictor,
    RandomPredictor,
    ReferenceTable,
    SometimesRightPredictor,
    SwitchablePredictor,
)
from tests.chi_square import CHI2_ALPHA, CHI2_CRITICAL, chi_square, top_k_counts, upper_tail
from tests.distributed.conftest import full_model, reference_generate, session_options

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

VOCAB = 256
NORM_SCALE = 16.0
PROMPTS = ("Once upon a time", "def f(x):\n    return", "1, 2, 3, 5, 8,", "The quick brown fox")
NUM_NEW_TOKENS = 24
BUDGETS = (24, 10, 17, 6)  # concurrent requests finish one by one, leaving idle places for drafts

# name -> session overrides. Explicit splits: the default split depends on the predictor's cost.
SHAPES = {
    # One KV slot: concurrent requests run one after the other, every one of them speculating
    # (a slot is reused while the previous sequence's squashed drafts may still be in flight).
    "2-stage-1-slot": dict(num_stages=2, layer_split="2,2", max_num_seqs=1),
    # The exit layer (feeding the predictor) is the last layer of stage 1, not of stage 0.
    "3-stage-exit-in-stage-1": dict(num_stages=3, layer_split="1,1,2", exit_layer=1),
    "4-stage": dict(num_stages=4, layer_split="1,1,1,1"),
}
EXIT_DRIVEN = ("always-wrong@exit", "sometimes-right@exit", "logit-lens")
SEND_DRIVEN = ("always-wrong", "sometimes-right")  # (the uniformly random predictor: see the sampling test)


def greedy(max_new_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, tiny_model_dir: Path) -> Path:
    """The sharpened tiny model with its final norm scaled: see [Note: sharp tiny model]."""
    path = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("tiny-sharp") / "model")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * NORM_SCALE
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@dataclasses.dataclass
class References:
    model: object
    tokenizer: object
    prompt_ids: dict[str, list[int]]
    greedy: dict[str, list[int]]  # prompt -> NUM_NEW_TOKENS greedy tokens
    table: ReferenceTable


@pytest.fixture(scope="module")
def refs(sharp_model_dir: Path) -> References:
    model, tokenizer = full_model(sharp_model_dir)
    ids = {p: tokenizer.encode(p) for p in PROMPTS}
    out = {p: reference_generate(model, ids[p], greedy()) for p in PROMPTS}
    return References(model, tokenizer, ids, out, ReferenceTable((ids[p], out[p]) for p in PROMPTS))


def make_predictor(kind: str, refs: References, *, seed: int = 0):
    at_exit = kind.endswith("@exit")
    base = kind.removesuffix("@exit")
    if base == "always-wrong":
        return AlwaysWrongPredictor(refs.table, vocab_size=VOCAB, needs_exit_head=at_exit)
    if base == "sometimes-right":
        return SometimesRightPredictor(refs.table, seed=seed, vocab_size=VOCAB, needs_exit_head=at_exit)
    assert base == "logit-lens"
    return LogitLensPredictor()


@dataclasses.dataclass
class SpecPipeline:
    name: str
    num_stages: int
    session: PipelineSession
    switch: SwitchablePredictor

    def launch(self, predictor, prompts, params) -> dict:
        """run_launch with `predictor` drafting (the session is idle between calls)."""
        self.switch.use(predictor)
        return run_launch(self.session, list(prompts), list(params))


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def pipeline(request, sharp_model_dir: Path):
    """A speculating pipeline (exit head loaded for logit-lens); one session per shape."""
    shape = SHAPES[request.param]
    options = session_options(sharp_model_dir, speculate="speed", predictor="logit-lens", **shape)
    switch = SwitchablePredictor(LogitLensPredictor())
    with PipelineSession(options, resolve(options), predictor=switch) as session:
        yield SpecPipeline(request.param, shape["num_stages"], session, switch)


def _check_counters(kind: str, stats: dict, *, single: bool) -> None:
    """What each predictor must do to the speculation counters of one run_launch."""
    assert stats["drafted_tokens"] >= stats["verified_drafts"] > 0, f"{kind}: no draft was verified: {stats}"
    if kind.startswith("always-wrong"):
        assert stats["accepted_tokens"] == 0 and stats["acceptance_rate"] == 0.0, stats
        assert stats["squashed_items"] >= stats["verified_drafts"], stats
    if kind.startswith("sometimes-right") and single:
        assert stats["accepted_tokens"] > 0 and stats["squashed_items"] > 0, stats


def _greedy_equals_reference(pipeline: SpecPipeline, refs: References, kind: str, num_prompts: int) -> None:
    predictor = make_predictor(kind, refs, seed=pipeline.num_stages)
    if num_prompts == 1:
        prompts, params = PROMPTS[:1], [greedy()]
    else:
        prompts, params = PROMPTS, [greedy(b) for b in BUDGETS]
    report = pipeline.launch(predictor, prompts, params)
    for prompt, sp, out in zip(prompts, params, report["outputs"], strict=True):
        expected = refs.greedy[prompt][:sp.max_new_tokens]
        assert out["token_ids"] == expected, f"{pipeline.name}, {kind}: speculation changed greedy output of {prompt!r}"
        assert out["finish_reason"] == "length"
    _check_counters(kind, report["stats"], single=num_prompts == 1)


# -- greedy equality -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_prompts", [1, 4], ids=["1-prompt", "4-prompts"])
@pytest.mark.parametrize("kind", EXIT_DRIVEN)
def test_greedy_with_exit_driven_drafts_equals_plain_decoding(pipeline: SpecPipeline, refs: References, kind: str,
                                                              num_prompts: int):
    _greedy_equals_reference(pipeline, refs, kind, num_prompts)


def test_exit_stage_is_where_the_shape_puts_the_exit_layer(pipeline: SpecPipeline):
    expected = 1 if pipeline.name == "3-stage-exit-in-stage-1" else 0
    assert pipeline.session.model.exit_stage == expected


# -- launch report --------------------------------------------------------------------------------------
def test_launch_report_counts_speculation_and_splits_busy_time_into_useful_and_wasted(pipeline: SpecPipeline,
                                                                                      refs: References):
    report = pipeline.launch(make_predictor("always-wrong@exit", refs), PROMPTS[:1], [greedy()])
    stats = report["stats"]
    for key in ("acceptance_rate", "drafted_tokens", "verified_drafts", "accepted_tokens", "squashed_items"):
        assert key in stats, f"launch report lacks {key}: {sorted(stats)}"
    assert stats["squashed_items"] > 0 and stats["accepted_tokens"] == 0
    assert len(stats["stages"]) == pipeline.num_stages
    for st in stats["stages"]:
        busy, useful, wasted = st["busy_fraction"], st["useful_fraction"], st["wasted_fraction"]
        assert 0.0 < busy <= 1.0 and useful >= 0.0, st
        assert abs(useful + wasted - busy) <= 0.05, f"useful + wasted != busy on stage {st['stage']}: {st}"
        assert wasted > 0.0, f"squashed drafts ran on stage {st['stage']} but no time was counted as wasted: {st}"


def test_launch_json_has_the_speculation_summary_of_the_human_output(pipeline: SpecPipeline, refs: References,
                                                                     capsys):
    """`launch --json` (run_launch's report) carries stats["speculation"]: the counters the summary
    line states, its text, and the notes printed before a run without --json."""
    if pipeline.name != "2-stage-1-slot":
        pytest.skip("one shape is enough")
    from launcher.cli.launch import print_report, speculation_notes

    report = pipeline.launch(make_predictor("sometimes-right@exit", refs, seed=11), PROMPTS[:1], [greedy()])
    stats = report["stats"]
    spec = stats["speculation"]
    assert spec["mode"] == "speed" and spec["acceptance_rate"] == stats["acceptance_rate"]
    assert (spec["drafts_sent"], spec["drafts_verified"], spec["drafts_committed"], spec["items_squashed"]) == (
        stats["drafted_tokens"], stats["verified_drafts"], stats["accepted_tokens"], stats["squashed_items"])
    assert spec["drafts_rejected"] == stats["verified_drafts"] - stats["accepted_tokens"] > 0
    assert spec["tokens_per_pass"] == stats["tokens_per_pass"]
    print_report(report, streamed=True)
    assert spec["summary"].startswith("acceptance ") and f"; {spec['summary']}" in capsys.readouterr().err
    assert spec["notes"] == speculation_notes(pipeline.session) and json.loads(json.dumps(spec)) == spec


def test_coordinator_forgets_finished_sequences(pipeline: SpecPipeline, refs: References):
    """A server must not keep every finished sequence (prompt, output, sampler, ledger) forever,
    also not those whose drafts were still queued when they ended."""
    if pipeline.name != "2-stage-1-slot":
        pytest.skip("one shape is enough")
    pipeline.launch(make_predictor("always-wrong", refs), PROMPTS, [greedy(6)] * len(PROMPTS))
    coordinator = pipeline.session.coordinator
    assert coordinator.sync(10.0), "the engine thread did not get to the end of its queue"
    assert not coordinator.engine.num_sequences, "finished sequences are kept forever"


def test_acceptance_rate_is_accepted_over_verified_drafts(pipeline: SpecPipeline, refs: References):
    report = pipeline.launch(make_predictor("sometimes-right@exit", refs, seed=11), PROMPTS[:1], [greedy()])
    stats = report["stats"]
    assert stats["verified_drafts"] > 0
    assert math.isclose(stats["acceptance_rate"], stats["accepted_tokens"] / stats["verified_drafts"], abs_tol=1e-4)
    assert 0.0 < stats["acceptance_rate"] < 1.0, stats


# -- exit-head skipping ---------------------------------------------------------------------------------
def test_exit_head_runs_on_few_rows_when_prompts_fill_the_pipeline(pipeline: SpecPipeline, refs: References):
    """[Note: exit-head skipping] in pipeline/engine/row_budget.py: with at least as many running prompts as
    stages the exit stage skips its head on most decode items; one prompt keeps it on every item
    but those at the budget's end (one position, re-sent at most once per squash). Greedy output is
    the reference's both ways."""
    if pipeline.name == "2-stage-1-slot":
        pytest.skip("one KV slot: the running sequences never fill the pipeline")
    one = pipeline.launch(LogitLensPredictor(), PROMPTS[:1], [greedy()])
    many = pipeline.launch(LogitLensPredictor(), PROMPTS, [greedy()] * len(PROMPTS))
    assert len(PROMPTS) >= pipeline.num_stages
    for report, prompts in ((one, PROMPTS[:1]), (many, PROMPTS)):
        for prompt, out in zip(prompts, report["outputs"], strict=True):
            assert out["token_ids"] == refs.greedy[prompt], f"{pipeline.name}: exit-head skipping changed {prompt!r}"
    s1, sn = one["stats"], many["stats"]
    assert s1["exit_rows"] > 0 and s1["exit_rows_skipped"] <= 1 + s1["squashed_items"], s1
    assert sn["exit_rows_skipped"] > sn["exit_rows"], sn


# -- sampling -------------------------------------------------------------------------------------------
NUM_SAMPLES = 300
SAMPLING_PROMPT = PROMPTS[0]


class RecordingPredictor(RandomPredictor):
    """RandomPredictor that records (context, draft) of every proposal, in order."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.proposals: list[tuple[tuple[int, ...], int]] = []

    def propose(self, context, guess):
        draft = super().propose(context, guess)
        self.proposals.append((tuple(context), draft.token))
        return draft


def test_chi_square_critical_values_match_alpha():
    for df, critical in CHI2_CRITICAL.items():
        assert math.isclose(upper_tail(critical, df), CHI2_ALPHA, rel_tol=0.01), df


def test_sampling_with_drafts_keeps_the_token_distribution(pipeline: SpecPipeline, refs: References):
    """Temperature 1, 3 tokens. The 2nd token is verified against a draft (accepted with
    probability p(draft), else resampled without it), the 3rd computed after an accepted draft or
    after a squash: all three are distributed as without speculation, and the 2nd does not depend on
    the draft, and with the same seed every token is the one plain sampling draws. Plain side: the
    single-process sampler, which is what `--speculate none` produces (test_pipeline_tiny.py). One KV slot, so sequences run one after the other and every one drafts."""
    if pipeline.name != "2-stage-1-slot":
        pytest.skip("one shape is enough (and it must leave idle places for drafts)")
    ids = refs.prompt_ids[SAMPLING_PROMPT]
    plain = [reference_generate(refs.model, ids, SamplingParams(max_new_tokens=3, temperature=1.0, seed=i,
                                                                ignore_eos=True)) for i in range(NUM_SAMPLES)]
    # 80 % of the drafts are the token the model most often samples second, the rest uniform.
    likely = collections.Counter(o[1] for o in plain).most_common(1)[0][0]
    predictor = RecordingPredictor(seed=3, vocab_size=VOCAB, candidates=[likely], p_candidate=0.8)
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=10**6 + i, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    report = pipeline.launch(predictor, [SAMPLING_PROMPT] * NUM_SAMPLES, params)
    spec = [o["token_ids"] for o in report["outputs"]]
    # Each draw is keyed by (seed, position): the same seeds give plain sampling's very tokens.
    assert spec == [reference_generate(refs.model, ids, p) for p in params]
    stats = report["stats"]
    rejected = stats["verified_drafts"] - stats["accepted_tokens"]
    assert stats["accepted_tokens"] >= NUM_SAMPLES // 20 and rejected >= NUM_SAMPLES // 4, stats
    for position in (0, 1, 2):
        table, top = top_k_counts([o[position] for o in plain], [o[position] for o in spec])
        stat = chi_square(table)
        assert stat < CHI2_CRITICAL[5], (f"token {position + 1} is distributed differently with drafts: chi2 {stat:.1f} "
                                         f">= {CHI2_CRITICAL[5]} (df 5, alpha {CHI2_ALPHA}); counts {table.tolist()} "
                                         f"of tokens {top} + other")
    # One draft per sequence, proposed while it ran (one slot): pair them in order. Where the draft
    # was `likely`, the 2nd token must still be `likely` with the plain probability (a resample
    # that forgets to exclude the rejected draft, or an accept that ignores p, inflates it).
    assert len(predictor.proposals) == NUM_SAMPLES
    assert all(ctx == (*ids, out[0]) for (ctx, _), out in zip(predictor.proposals, spec, strict=True))
    drafted = [out[1] for (_, d), out in zip(predictor.proposals, spec, strict=True) if d == likely]
    assert len(drafted) >= NUM_SAMPLES // 2
    table = torch.tensor([[sum(t == likely for t in drafted), sum(t != likely for t in drafted)],
                          [sum(o[1] == likely for o in plain), sum(o[1] != likely for o in plain)]])
    stat = chi_square(table)
    assert stat < CHI2_CRITICAL[1], (f"P(token 2 = draft {likely}) differs from plain sampling: {table.tolist()} "
                                     f"(drafted: yes/no; plain: yes/no), chi2 {stat:.1f} >= {CHI2_CRITICAL[1]}")


# -- greedy equality, drafting as soon as an item is sent ----------------------------------------------
@pytest.mark.parametrize("num_prompts", [1, 4], ids=["1-prompt", "4-prompts"])
@pytest.mark.parametrize("kind", SEND_DRIVEN)
def test_greedy_with_send_time_drafts_equals_plain_decoding(pipeline: SpecPipeline, refs: References, kind: str,
                                                            num_prompts: int):
    _greedy_equals_reference(pipeline, refs, kind, num_prompts)


def test_closing_a_speculating_session_ends_every_coordinator_receiver(sharp_model_dir: Path):
    """The exit stage passes SHUTDOWN to the coordinator too, so the receiver of its exit events
    ends with the data plane, before any stage is told to exit (a receiver left blocked in a gloo
    receive made the launcher abort at exit: "terminate called without an active exception")."""
    options = session_options(sharp_model_dir, speculate="speed", predictor="logit-lens", num_stages=3,
                              stage_timeout_s=10.0)
    alive_at_stage_shutdown: list[list[str]] = []

    class Stub:  # records which receivers still run when the first stage is told to shut down
        def __init__(self, stub):
            self.stub = stub

        def Shutdown(self, *args, **kwargs):  # noqa: N802 - the gRPC method's name
            alive_at_stage_shutdown.append([t.name for t in receivers if t.is_alive()])
            return self.stub.Shutdown(*args, **kwargs)

    with PipelineSession(options, resolve(options)) as session:
        run_launch(session, [PROMPTS[0]], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
        receivers = list(session.coordinator._receivers)
        session.coordinator.stubs = [Stub(stub) for stub in session.coordinator.stubs]
    assert [t.name for t in receivers] == ["receiver-1", "receiver-3"]  # exit stage 0, last stage 2
    assert alive_at_stage_shutdown and alive_at_stage_shutdown[0] == []


def test_an_idle_pipeline_with_an_exit_stage_before_the_last_stays_up(sharp_model_dir: Path):
    """The coordinator's receiver of exit events waits with the data-plane deadline, like every wait.
    KEEPALIVEs went round the ring only, so an idle `serve` with speculation on (exit stage 0) failed
    at every --stage-timeout-s ("timed out ... waiting to receive from stage 0"), spent its restarts
    and answered 503 for good. The exit stage now passes each KEEPALIVE to the coordinator too."""
    options = session_options(sharp_model_dir, speculate="speed", predictor="logit-lens", num_stages=3,
                              stage_timeout_s=2.0)
    with PipelineSession(options, resolve(options)) as session:
        time.sleep(3 * options.stage_timeout_s)  # idle: nothing but keepalives
        coord = session.coordinator
        assert coord.failure is None and coord.num_restarts == 0
        report = run_launch(session, [PROMPTS[0]], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
        assert "error" not in report["outputs"][0], report["outputs"][0]
        assert coord.failure is None and coord.num_restarts == 0
