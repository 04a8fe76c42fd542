"""Token-tree rebase property tests: the real Engine (scheduler, ledger, tree) against token-level stages.

What breaks when these fail: a rescue loses, duplicates or reorders a committed token; a result
is committed from a row whose context (the KV it attended to) was not the committed context; the
KV fix-up keeps the wrong scratch entry or none, or a stale item overwrites scratch before its
fix-up; after any result, a stage's valid KV holds anything but committed tokens.

The stages here hold, per KV slot, the token id at each position (and per scratch position), and
apply the stage rules of pipeline/engine/stage_executor.py ([Note: in-band squash]: the epoch rule
`admit_epochs`, `keep_sibling` fix-up, truncation to the item's start; sibling rows write scratch).
The last stage's "model" is a hash of the row's whole attended context, so a committed token is
right only if the row saw exactly the committed context. Drafts: a seeded predictor whose primary
and siblings are right or wrong at random (the real token is among the siblings often).
"""

from __future__ import annotations

import collections
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.engine.engine import Engine
from pipeline.engine.events import ReplayRunning, Result, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.stage_executor import admit_epochs
from pipeline.speculation.predictors import Draft
from pipeline.speculation.sampling import SamplingParams

VOCAB = 50


def model(context: tuple[int, ...]) -> int:
    """The fake model's greedy next token after `context` (deterministic, context-sensitive)."""
    return hash(context) % VOCAB


def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(model(tuple(out)))
    return out[len(prompt):]


class TreePredictor:
    """Primary right with p_primary; else the truth is among the siblings with p_sibling."""

    name, needs_exit_head = "tree-fake", False

    def __init__(self, refs: dict[tuple[int, ...], int], rng: random.Random, p_primary: float, p_sibling: float,
                 width: int) -> None:
        self.refs, self.rng, self.p_primary, self.p_sibling, self.width = refs, rng, p_primary, p_sibling, width
        self.alts: list[Draft] = []

    def propose(self, context, guess):
        truth = self.refs.get(tuple(context), self.rng.randrange(VOCAB))
        wrong = [(truth + k) % VOCAB for k in range(1, self.width + 1)]
        self.rng.shuffle(wrong)
        if self.rng.random() < self.p_primary:
            primary, self.alts = truth, [Draft(w, 0.5, self.name) for w in wrong]
        else:
            primary, alts = wrong[0], wrong[1:]
            if self.rng.random() < self.p_sibling:
                alts.insert(self.rng.randrange(len(alts) + 1), truth)
            self.alts = [Draft(t, 0.5, self.name) for t in alts]
        return Draft(primary, 1.0, self.name)

    def alternatives(self, context, guess):
        return list(self.alts)  # the ones made with the last proposal (the scheduler asks right after)


class TokenStage:
    """One stage's KV as token ids: slot -> list, and (slot, scratch) -> token."""

    def __init__(self, truth: dict[int, list[int]]) -> None:
        self.truth = truth  # seq_id -> prompt + reference continuation
        self.real_items = 0
        self.kv: dict[int, list[int]] = collections.defaultdict(list)
        self.scratch: dict[tuple[int, int], int] = {}
        self.epochs: dict[int, int] = {}

    def run(self, items):
        keep = admit_epochs(self.epochs, list(items))
        kept, results = [], []
        for it, current in zip(items, keep, strict=True):
            if not current:
                continue
            kv = self.kv[it.slot]
            if it.keep_sibling >= 0:
                kv[it.start - 1] = self.scratch[(it.slot, it.keep_sibling)]
            assert it.start <= len(kv), "a write after a gap"
            del kv[it.start:]
            context = tuple(kv)
            if it.kind in (0, 1):  # a real item: the valid KV is exactly the committed context
                assert list(context) == self.truth[it.seq_id][:it.start], (it, context)
                self.real_items += 1
            kv.extend(it.token_ids)
            rows = [tuple(kv[:it.start + i + 1]) for i in range(it.num_tokens)]
            for j, alt in enumerate(it.alt_token_ids):
                self.scratch[(it.slot, it.tree_scratch + j)] = alt
                rows.append((*context, alt))  # a sibling attends to [0, start) and itself
            results.extend(model(r) for r in (rows[-1:] if it.kind == 0 else rows))
            kept.append(it)
        return kept, results

    def release(self, slots):
        for s in slots:
            self.kv.pop(s, None)


def run(prompts, budgets, *, num_stages, width, seed, p_primary, p_sibling, max_num_seqs, replay_at=(), log=None):
    """Generate under the real Engine; at each step number in `replay_at` every stage loses its KV and
    the work in flight (a stage restart: ReplayRunning), whatever rescue is pending."""
    refs, truth = {}, {}
    for seq_id, (prompt, n) in enumerate(zip(prompts, budgets, strict=True)):
        full = truth[seq_id] = [*prompt, *reference(prompt, n)]
        for i in range(len(prompt), len(full)):
            refs[tuple(full[:i])] = full[i]
    rng = random.Random(seed)
    predictor = TreePredictor(refs, rng, p_primary, p_sibling, width)
    engine = Engine(SchedulerConfig(num_stages=num_stages, max_num_seqs=max_num_seqs, max_model_len=64,
                                    speculate=True, draft_tree=width), predictor, record_timeline=False)
    stages = [TokenStage(truth) for _ in range(num_stages)]
    queues = [collections.deque() for _ in stages]
    outputs = collections.defaultdict(list)
    out = engine.step([Submit(seq_id=i, prompt_ids=tuple(p), params=SamplingParams(max_new_tokens=n, ignore_eos=True))
                       for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))])
    for _ in range(10_000):
        for c in out.commits:
            outputs[c.seq_id].extend(c.token_ids)
        if out.releases:
            queues[0].append(("release", [r.slot for r in out.releases]))
        for batch in out.sends:
            queues[0].append(("batch", batch))
        if not engine.has_unfinished and not any(queues):
            break
        events = []
        if engine.spec.passes in replay_at and any(queues):
            replay_at = tuple(r for r in replay_at if r != engine.spec.passes)
            if log is not None:
                log["replays_during_rescue"] = log.get("replays_during_rescue", 0) + bool(engine._scheduler.tree.rescues)
            for q in queues:
                q.clear()
            stages = [TokenStage(truth) for _ in range(num_stages)]
            out = engine.step([ReplayRunning()])
            continue
        for j in reversed(range(num_stages)):  # lock-step, one micro-batch per stage per step
            if not queues[j]:
                continue
            kind, payload = queues[j].popleft()
            if kind == "release":
                stages[j].release(payload)
            else:
                kept, results = stages[j].run(payload)
                if j == num_stages - 1:
                    events.append(Result(items=tuple(it.without_tokens() for it in kept),
                                         token_ids=torch.tensor(results, dtype=torch.int64)))
                    continue
                payload = tuple(kept)
            if j + 1 < num_stages:
                queues[j + 1].append((kind, payload))
        out = engine.step(events)
    return outputs, engine, stages


scenarios = st.fixed_dictionaries({
    "num_stages": st.integers(2, 5), "width": st.integers(2, 4), "seed": st.integers(0, 2**32),
    "p_primary": st.floats(0.0, 0.9), "p_sibling": st.floats(0.3, 1.0), "max_num_seqs": st.integers(1, 3),
    "prompts": st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3),
    "budget": st.integers(1, 24),
    "replay_at": st.lists(st.integers(1, 30), max_size=2),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_rescues_lose_duplicate_or_reorder_no_token_and_kv_holds_only_committed_tokens(sc):
    prompts = [tuple(p) for p in sc["prompts"]]
    budgets = [max(1, sc["budget"] - 5 * i) for i in range(len(prompts))]
    outputs, engine, stages = run(prompts, budgets, num_stages=sc["num_stages"], width=sc["width"], seed=sc["seed"],
                                  p_primary=sc["p_primary"], p_sibling=sc["p_sibling"],
                                  max_num_seqs=sc["max_num_seqs"], replay_at=tuple(sc["replay_at"]))
    for i, (prompt, n) in enumerate(zip(prompts, budgets, strict=True)):
        assert outputs[i] == reference(prompt, n), (i, engine.tree)
    assert not engine.has_unfinished and all(not s.kv for s in stages)  # every slot released (after any replay too)
    tree = engine.tree
    assert tree.rescues <= tree.tree_hits <= tree.tree_verified <= tree.tree_drafts


def test_the_rescue_path_runs_and_every_real_item_finds_the_committed_kv():
    prompts, budgets = [(3, 1, 4)], [30]
    outputs, engine, stages = run(prompts, budgets, num_stages=4, width=3, seed=7, p_primary=0.2, p_sibling=1.0,
                                  max_num_seqs=1)
    assert outputs[0] == reference(prompts[0], 30)
    assert engine.tree.rescues >= 5, engine.tree

    assert all(s.real_items > 0 for s in stages)  # (each checked its KV against the committed context)


def test_a_stage_restart_while_a_rescue_waits_replays_exactly():
    prompts, log = [(3, 1, 4)], {}
    for replay in range(2, 20):
        outputs, engine, _ = run(prompts, [30], num_stages=4, width=3, seed=replay, p_primary=0.2, p_sibling=1.0,
                                 max_num_seqs=1, replay_at=(replay,), log=log)
        assert outputs[0] == reference(prompts[0], 30), replay
        assert not engine._scheduler.tree.rescues and not engine._scheduler.tree.fixups
    assert log["replays_during_rescue"] >= 3, log  # the case this test is for happened


def test_a_missing_fix_up_is_caught(monkeypatch):
    """The checks bite: stages that ignore keep_sibling keep the primary's KV at the rescued position."""
    monkeypatch.setattr(TokenStage, "run", _run_without_fix_up)
    try:
        run([(3, 1, 4)], [30], num_stages=4, width=3, seed=7, p_primary=0.2, p_sibling=1.0, max_num_seqs=1)
    except AssertionError:
        return
    raise AssertionError("a stage without the KV fix-up went unnoticed")


_original_run = TokenStage.run


def _run_without_fix_up(self, items):
    import dataclasses

    return _original_run(self, [dataclasses.replace(it, keep_sibling=-1) for it in items])


def test_tree_size_follows_the_row_cost_table_and_the_measured_rescue_rate():
    from pipeline.measure.row_cost import RowCostTable
    from pipeline.speculation.tree import EXPLORE_EVERY, TokenTree

    class Three:
        def alternatives(self, context, guess):
            return [Draft(t, 0.5, "x") for t in (1, 2, 3, 4)]

    cheap = RowCostTable(mode="bf16", num_rows=(1, 2, 4), pass_s=(0.05, 0.052, 0.056))  # 2nd row: 4 %
    dear = RowCostTable(mode="fp32", num_rows=(1, 2, 4), pass_s=(0.05, 0.09, 0.11))  # 2nd row: 80 %
    primary = Draft(1, 1.0, "x")
    assert TokenTree(width=3, num_stages=2, max_inflight=2, row_costs=None).siblings(Three(), (), None, primary) == (2, 3)
    assert TokenTree(width=4, num_stages=4, max_inflight=4, row_costs=cheap).siblings(Three(), (), None, primary) == (2, 3, 4)
    tree = TokenTree(width=3, num_stages=2, max_inflight=2, row_costs=dear)
    sent = [tree.siblings(Three(), (), None, primary) for _ in range(2 * EXPLORE_EVERY)]
    assert sent.count(()) == 2 * EXPLORE_EVERY - 2 and sent.count((2,)) == 2  # only the exploring decisions
    # a rank that rescues often becomes worth its row even where rows are dear
    tree.trials[1], tree.hits[1] = 1000, 990
    assert tree.worth_sending(1) is False  # 0.99 * 1/2 * 0.05 < 0.04
    tree4 = TokenTree(width=3, num_stages=10, max_inflight=10, row_costs=dear)
    tree4.trials[1], tree4.hits[1] = 1000, 990
    assert tree4.worth_sending(1) is True  # 0.99 * 9/10 * 0.05 > 0.04
