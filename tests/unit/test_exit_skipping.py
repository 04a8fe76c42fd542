"""Exit-head skipping: the scheduler's `Item.want_exit` decision and the exit stage honouring it.

What breaks when these fail: the exit head runs on items whose guess can never become a sent draft
(the exit stage pays several layers of work per decode item for nothing, e.g. when the running
sequences already fill the pipeline), or, worse, it is skipped where a draft would have been sent
(a single speculating sequence stops filling the pipeline), or skipping changes greedy output, or
the `exit_rows` / `exit_rows_skipped` counters of `--json` are wrong.
See [Note: exit-head skipping] in pipeline/engine/row_budget.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import Abort, ExitPassed, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.simulator import Bernoulli, CostModel, SimConfig, Simulator
from pipeline.engine.stage_executor import StageExecutor
from pipeline.model.config import tiny_config
from pipeline.model.partition import balanced_split
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.predictors import ExitGuess, ExitHead, LogitLensPredictor, NGramPredictor
from pipeline.speculation.sampling import SamplingParams
from tests.tiny_model import random_state_dict
from tests.unit.test_speculation_scheduler import PROMPTS, _generate, greedy_reference


def _sched(num_stages: int = 2, *, predictor=None, speculate: bool = True, max_inflight: int = 0) -> Engine:
    if speculate and predictor is None:
        predictor = LogitLensPredictor()
    return Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=8, max_model_len=128, speculate=speculate,
                                  max_inflight=max_inflight), predictor)


def _send_one(engine: Engine, events=()) -> tuple[Item, ...]:
    sends = engine.step(events).sends
    assert sends, "the engine sent nothing"
    return sends[0]


def _first_decode_items(engine: Engine, prompts, *, max_new_tokens: int = 16,
                        prefills: list[Item] | None = None) -> list[Item]:
    """Submit `prompts` (their prefills are sent, and appended to `prefills`), return each prefill's
    result (token 42), and collect the first decode item of every sequence, as sent."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    sent = engine.step([Submit(seq_id=i, prompt_ids=tuple(p), params=params) for i, p in enumerate(prompts)]).sends
    assert all(it.kind == ItemKind.PREFILL for b in sent for it in b), sent
    if prefills is not None:
        prefills.extend(it for b in sent for it in b)
    decodes = []
    for batch in sent:
        out = engine.step([Result(items=batch, token_ids=torch.full((len(batch),), 42, dtype=torch.int64))])
        decodes.extend(it for b in out.sends for it in b)
    assert decodes and all(it.kind == ItemKind.DECODE for it in decodes), decodes
    return decodes


# -- the decision ---------------------------------------------------------------------------------------
def test_a_lone_speculating_sequence_wants_the_exit_guess():
    prefills: list[Item] = []
    [item] = _first_decode_items(_sched(2), PROMPTS[:1], prefills=prefills)
    assert item.want_exit
    assert not prefills[0].want_exit, "no draft follows a prefill"


@pytest.mark.parametrize("reason", ["no-speculation", "ngram-needs-no-head", "max-inflight-1", "budget-end",
                                    "pipeline-full"])
def test_the_exit_guess_is_not_wanted_when_no_draft_could_be_sent(reason):
    num_prompts, max_new, kwargs = 1, 16, {}
    if reason == "no-speculation":
        kwargs = {"speculate": False}
    elif reason == "ngram-needs-no-head":
        kwargs = {"predictor": NGramPredictor()}
    elif reason == "max-inflight-1":
        kwargs = {"max_inflight": 1}
    elif reason == "budget-end":
        max_new = 2  # the first decode item yields the last budget token: nothing may follow it
    else:
        num_prompts = 2  # two running sequences on two stages: real work fills every slot
    items = _first_decode_items(_sched(2, **kwargs), PROMPTS[:num_prompts], max_new_tokens=max_new)
    assert not any(it.want_exit for it in items), items


def test_the_budget_end_is_exactly_where_the_ledger_refuses_drafts():
    """The first decode item wants the guess iff the ledger would let a draft follow it."""
    for max_new in range(2, 6):
        sched = _sched(2)
        [item] = _first_decode_items(sched, PROMPTS[:1], max_new_tokens=max_new)
        ledger = sched.scheduler.seqs[0].ledger
        allowed = ledger.can_draft_after(item.end - 1, item.epoch, max_inflight=2)
        assert item.want_exit == allowed, (max_new, item)


def test_a_full_run_ahead_still_wants_the_guess():
    """S = 2, max_inflight 2: the draft after the first decode item is the second item in flight; a
    draft after *it* is proposed from its guess once the older result frees room."""
    sched = _sched(2)
    [first] = _first_decode_items(sched, PROMPTS[:1])
    assert first.want_exit
    [draft] = _send_one(sched, [ExitPassed(items=(first,), guesses=(ExitGuess(7, 0.9),))])
    assert draft.kind == ItemKind.DRAFT and len(sched.scheduler.seqs[0].ledger.inflight) == 2
    assert draft.want_exit


def test_a_finished_sequence_frees_the_pipeline_for_guesses_again():
    sched = _sched(2)
    items = _first_decode_items(sched, PROMPTS[:2])
    assert not any(it.want_exit for it in items)
    [nxt] = _send_one(sched, [Abort(seq_id=1), Result(items=(items[0],), token_ids=torch.tensor([43]))])
    assert nxt.seq_id == 0 and nxt.want_exit


def test_on_exit_counts_rows_with_and_without_the_head():
    sched = _sched(2)
    mk = lambda kind, want: Item(seq_id=99, slot=0, start=5, num_tokens=1, kind=kind, want_exit=want)  # noqa: E731
    items = [mk(ItemKind.PREFILL, False), mk(ItemKind.DECODE, True), mk(ItemKind.DRAFT, False),
             mk(ItemKind.DRAFT, True), mk(ItemKind.PREFILL, True)]
    sched.step([ExitPassed(items=tuple(items), guesses=(None,) * len(items))])
    assert (sched.spec.exit_rows, sched.spec.exit_rows_skipped) == (2, 1)
    ngram = _sched(2, predictor=NGramPredictor())
    ngram.step([ExitPassed(items=tuple(items), guesses=(None,) * len(items))])
    assert (ngram.spec.exit_rows, ngram.spec.exit_rows_skipped) == (0, 0), "no exit head, nothing to count"


# -- end to end on the fake pipeline (tests/unit/test_speculation_scheduler.py) ---------------------------
def _always_want(monkeypatch) -> None:
    monkeypatch.setattr(Scheduler, "_wants_exit", lambda self, seq, item, *, pipeline_full: True)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_a_single_sequence_keeps_every_guess_and_its_schedule(num_stages, monkeypatch):
    """A perfect logit lens on one sequence: the same steps, drafts and output as with the head on
    every item, and only budget-end items skip it."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = greedy_reference(PROMPTS[0], params.max_new_tokens)
    out, sched, fake = _generate(num_stages, PROMPTS[:1], params, predictor=LogitLensPredictor())
    assert out == [reference]
    assert sched.spec.exit_rows > 0 and sched.spec.exit_rows_skipped <= 1, sched.spec
    _always_want(monkeypatch)
    out_all, sched_all, fake_all = _generate(num_stages, PROMPTS[:1], params, predictor=LogitLensPredictor())
    assert out_all == out
    assert fake.stats.busy_per_step == fake_all.stats.busy_per_step, "skipping the head changed the schedule"
    assert sched.spec.drafted_tokens == sched_all.spec.drafted_tokens
    assert sched.spec.accepted_tokens == sched_all.spec.accepted_tokens == sched.spec.verified_drafts


@pytest.mark.parametrize("lens_offset", [0, 1], ids=["right-lens", "wrong-lens"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_sequences_that_fill_the_pipeline_skip_the_head_and_keep_their_output(num_stages, lens_offset, monkeypatch):
    prompts = PROMPTS[:num_stages + 1]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    references = [greedy_reference(p, params.max_new_tokens) for p in prompts]
    out, sched, _ = _generate(num_stages, prompts, params, predictor=LogitLensPredictor(), lens_offset=lens_offset)
    assert out == references
    spec = sched.spec
    assert spec.exit_rows_skipped > 2 * spec.exit_rows, spec
    _always_want(monkeypatch)
    _, sched_all, _ = _generate(num_stages, prompts, params, predictor=LogitLensPredictor(), lens_offset=lens_offset)
    assert sched_all.spec.exit_rows_skipped == 0
    assert spec.exit_rows + spec.exit_rows_skipped <= sched_all.spec.exit_rows + 2 * num_stages
    assert spec.exit_rows < sched_all.spec.exit_rows / 2, (spec, sched_all.spec)


# -- the simulator (pipeline/engine/simulator.py) mirrors the exit stage ------------------------------------------
def test_the_simulator_charges_the_exit_head_only_when_an_item_wants_it():
    """A costly exit head slows a lone speculating sequence, but not two sequences that fill two stages."""
    stage_s = 1e-3

    def tokens_per_s(concurrency: int, predictor_s: float) -> float:
        cost = CostModel.uniform(num_stages=2, stage_s=stage_s, predictor_s=predictor_s)
        cfg = SimConfig(num_stages=2, prompt_lens=(4,) * concurrency, max_new_tokens=40, speculate=True)
        res = Simulator(cfg, cost, acceptance=Bernoulli(0.5, seed=1), record_timeline=False).run()
        assert res.tokens_per_s > 0
        return res.tokens_per_s

    assert tokens_per_s(1, stage_s) < 0.85 * tokens_per_s(1, 0.0)
    assert tokens_per_s(2, stage_s) == pytest.approx(tokens_per_s(2, 0.0), rel=0.05)


# -- the exit stage ------------------------------------------------------------------------------------------
class CountingHead(ExitHead):
    """ExitHead that records how many rows each call got."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def forward(self, hidden: torch.Tensor):
        self.calls.append(hidden.shape[0])
        return super().forward(hidden)


@pytest.fixture(scope="module")
def stage0():
    torch.manual_seed(0)
    cfg = tiny_config()
    state = random_state_dict(cfg, seed=2, std=0.2)
    r = balanced_split(cfg.num_hidden_layers, 2)[0]
    model = build_stage_model(cfg, r, is_first=True, is_last=False, tensors=state)
    head = CountingHead(cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps)
    return model, head, r.stop - 1


def _run(stage0, wants: list[bool]) -> tuple[StageExecutor, CountingHead, object]:
    model, head, exit_layer = stage0
    head.calls.clear()
    executor = StageExecutor(model, model.new_kv_cache(max_num_seqs=4, max_model_len=32), exit_layer=exit_layer,
                             exit_head=head)
    prompts = [[11, 22, 33], [44, 55], [66, 77, 88, 99]]
    items = [Item(seq_id=i, slot=i, start=0, num_tokens=len(p), kind=ItemKind.PREFILL, token_ids=tuple(p))
             for i, p in enumerate(prompts)]
    executor.run(items, torch.tensor([t for p in prompts for t in p]))
    head.calls.clear()
    items = [Item(seq_id=i, slot=i, start=len(p), num_tokens=1, kind=ItemKind.DECODE, token_ids=(5 + i,),
                  want_exit=w) for i, (p, w) in enumerate(zip(prompts, wants, strict=True))]
    return executor, head, executor.run(items, torch.tensor([5, 6, 7]))


def test_the_exit_stage_runs_its_head_only_on_rows_that_want_it(stage0):
    _, _, every = _run(stage0, [True, True, True])
    _, head, some = _run(stage0, [True, False, True])
    assert head.calls == [2], "the head must run once, on the two rows that want it"
    assert some.exit_tokens.tolist() == [every.exit_tokens[0], -1, every.exit_tokens[2]]
    assert some.exit_probs[1] == 0.0 and torch.equal(some.exit_probs[[0, 2]], every.exit_probs[[0, 2]])
    assert torch.equal(some.hidden, every.hidden), "skipping the head must not change the hidden states"


def test_the_exit_stage_skips_the_head_when_no_row_wants_it(stage0):
    _, _, every = _run(stage0, [True, True, True])
    _, head, none = _run(stage0, [False, False, False])
    assert head.calls == [] and none.exit_tokens is None and none.exit_probs is None
    assert torch.equal(none.hidden, every.hidden)


def test_one_rule_says_which_items_get_an_exit_guess():
    """`Item.may_precede_draft` / `wants_exit_guess`: the rule the scheduler, the exit stage and the
    simulator all ask. A prefill never gets a guess, whatever its `want_exit`."""
    mk = lambda kind, want: Item(seq_id=0, slot=0, start=4, num_tokens=1, kind=kind, want_exit=want)  # noqa: E731
    for kind in ItemKind:
        for want in (False, True):
            item = mk(kind, want)
            assert item.may_precede_draft == (kind != ItemKind.PREFILL)
            assert item.wants_exit_guess == (kind != ItemKind.PREFILL and want)
