"""Grammar-aware drafting's rules ([Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py).

What breaks when these fail: a constrained sequence drafts a token its grammar forbids (a row wasted,
a squash), misses a token the grammar forces (a sure draft lost, or held back waiting for the exit
head), a forbidden draft is neither replaced by the predictor's allowed candidate nor dropped, a FIRP
chain goes on past a forbidden draft, token-tree siblings include forbidden tokens, or the counters
(SpecCounters.grammar_*) miss what happened or count runs never sent; jump-forward: a forced run is not
sent as one draft item, or not carried by the real item it follows when nothing is in flight (the
corrected token after a squash), or runs past EOS, the budget or the cap (one slow point of the row-cost
table shortening it), its rows do not all commit, they are counted as FIRP drafts (FIRP's counters,
RowBudget's depth table), the drafting matcher is not rolled back after a squash, or the exit head runs
on an item whose next draft is forced. Exactness under these rules is tested in
tests/unit/test_grammar_paths.py (which runs with grammar-aware drafting on and off). The byte
tokenizer of tests/tiny_model.py: every token is one byte.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.grammar_drafts import GRAMMAR_SOURCE, MAX_JUMP_ROWS, GrammarDrafts, max_jump_rows
from pipeline.engine.records import SchedulerConfig, SpecCounters
from pipeline.engine.scheduler import Scheduler
from pipeline.measure.row_cost import RowCostTable
from pipeline.speculation.grammar import GrammarSpec, GrammarVocab
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import Draft
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer
from tests.unit.test_grammar_paths import SPECS, ledger_in_step

OPEN, QUOTE, CLOSE, A, NUL, COLON = ord("{"), ord('"'), ord("}"), ord("a"), 0, ord(":")


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    return GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID])


class Ranked:
    """A predictor proposing `token` with ranked `alternatives` (None: it has no such method)."""

    name, needs_exit_head = "ranked", False

    def __init__(self, token: int, alternatives: list[int] | None = None) -> None:
        self.token, self.num_proposed = token, 0
        if alternatives is not None:
            self.alternatives = lambda context, guess: [Draft(t, 0.5, self.name) for t in alternatives]

    def propose(self, context, guess) -> Draft:
        self.num_proposed += 1
        return Draft(self.token, 0.9, self.name)


def _committed(vocab, spec: GrammarSpec, first: int, predictor, *, num_stages: int = 2, max_new_tokens: int = 16,
               max_model_len: int = 64, sampling: dict | None = None, **config):
    """A scheduler whose one constrained sequence committed `first` after its prefill (its real item
    pending, not yet sent), and that sequence."""
    sched = Scheduler(SchedulerConfig(num_stages=num_stages, max_num_seqs=2, max_model_len=max_model_len, speculate=True,
                                      eos_token_ids=(TINY_EOS_ID,), **config), predictor, grammar_vocab=vocab)
    seq = sched.add(0, [72, 105], SamplingParams(max_new_tokens=max_new_tokens, grammar=spec, **(sampling or {})))
    (prefill,) = sched.next_batch(num_inflight=0).items
    row = torch.zeros(1, vocab.ll.vocab_size)
    row[0, first] = 10.0
    [commit] = sched.on_result([prefill], torch.tensor([first]), row)
    assert commit.token_ids == (first,)
    return sched, seq


@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "one-per-item"])
def test_a_forced_token_is_drafted_at_send_time_without_the_exit_head(vocab, jump):
    """json_schema {"n", "s"}: after `{` the grammar forces `"n": ` (5 tokens); an exit-head predictor
    (always wrong) is neither waited for nor asked. Jump-forward: the real item `{` carries the whole
    run as its own rows (nothing in flight before it: [Note: grammar-aware drafting], riding); the
    digit after it is not forced, so that item wants the exit head's guess. One per item: the forced
    `"` is queued as a draft as soon as the real item is sent, and the real item does not ask the exit
    stage for a guess nobody reads. Off: no draft until an exit event, and the real item wants its
    guess. grammar_forced / grammar_jump_tokens count what was sent, not what waits."""
    for on in (True, False):
        predictor = AlwaysWrongPredictor(ReferenceTable([]), vocab_size=256, needs_exit_head=True)
        sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, predictor, grammar_drafts=on, grammar_jump=jump)
        (real,) = sched.next_batch(num_inflight=0).items
        if on and jump:
            assert real.token_ids == (OPEN, *b'"n": ') and real.kind == ItemKind.FIRP and seq.ledger.inflight[0].jump
            assert real.want_exit and seq.pending is None
            assert (sched.spec.grammar_forced, sched.spec.grammar_jump_tokens, sched.spec.firp_drafted) == (0, 5, 0)
            assert predictor.num_proposed == 0, "the predictor was asked at a forced position"
            continue
        assert real.token_ids == (OPEN,)
        assert real.want_exit is not on, "the exit head runs on an item whose next draft is forced"
        if on:
            assert seq.pending is not None and seq.pending.kind == ItemKind.DRAFT
            assert seq.pending.token_ids == (QUOTE,) and seq.pending.start == real.end
            assert sched.spec.grammar_forced == 0, "a draft counted before it was sent"
            sched.next_batch(num_inflight=1)
            assert (sched.spec.grammar_forced, sched.spec.grammar_jump_tokens) == (1, 0)
            assert predictor.num_proposed == 0, "the predictor was asked at a forced position"
        else:
            assert seq.pending is None and sched.spec.grammar_forced == 0


def _rows(vocab, n: int, seed: int) -> torch.Tensor:
    """[n, vocab] random logits rows: the grammar's mask, not the row, decides a forced token."""
    return torch.randn(n, vocab.ll.vocab_size, generator=torch.Generator().manual_seed(seed))


def _result(sched, item, vocab, seed: int = 0):
    rows = _rows(vocab, item.num_result_rows, seed)
    return sched.on_result([item], rows.argmax(-1), rows)


@pytest.mark.parametrize("setting", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("firp_k", [0, 2], ids=["speed", "speed+firp"])
def test_a_jump_run_on_a_real_item_commits_in_its_pass_and_is_not_counted_as_firp(vocab, setting, firp_k):
    """After `{`, nothing in flight: the real item `{` carries the forced `"n": ` as its own rows (riding).
    Its one result commits `"n": ` (the mask forces each: p = 1, greedy or sampled) plus the first digit,
    on random logits. Its 5 later rows are jump_verified / jump_accepted, never FIRP's (firp_drafted,
    firp_verified, RowBudget.verified per depth: with FIRP off RowBudget.record's `verified <= max_firp_k`
    fails if they are); FIRP rows hang off its last row only (the run is sure); the ledger stays contiguous;
    nothing left in flight, the next real item carries the digit."""
    sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, Ranked(NUL), firp_k=firp_k, sampling=setting)
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.kind == ItemKind.FIRP and real.token_ids == (OPEN, *b'"n": ') and real.start == seq.ledger.known_len - 1
    assert seq.ledger.inflight[0].jump and seq.ledger.inflight[0].drafts == tuple(b'"n": ')
    assert real.firp_anchors == (1 if real.firp_k else 0), "FIRP rows hang off the jump run's last row"
    ledger_in_step(seq)
    [rest] = _result(sched, real, vocab, seed=2)
    assert rest.token_ids[:5] == tuple(b'"n": ') and len(rest.token_ids) == 6
    assert chr(rest.token_ids[5]) in "-0123456789", rest.token_ids
    spec = sched.spec
    assert (spec.jump_verified, spec.jump_accepted, spec.grammar_jump_tokens) == (5, 5, 5)
    assert (spec.firp_drafted, spec.firp_verified, spec.firp_accepted) == (0, 0, 0)
    assert sched.rows.verified == [0] * firp_k
    assert (spec.verified_drafts, spec.accepted_tokens, spec.drafted_tokens) == (5, 5, 5)
    assert spec.squashed_items == 0 and not seq.ledger.inflight
    ledger_in_step(seq)
    assert seq.output_ids == [OPEN, *b'"n": ', rest.token_ids[5]]
    assert seq.pending.start == seq.ledger.known_len - 1 and seq.pending.token_ids[0] == seq.output_ids[-1]


@pytest.mark.parametrize(("speculate", "firp_k", "rides"), [(False, 0, False), (False, 2, True), (True, 0, True)],
                         ids=["plain", "firp", "speed"])
def test_a_forced_run_rides_only_where_drafts_are_verified(vocab, speculate, firp_k, rides):
    """Plain decoding (`--speculate none`) stays one row per pass; with FIRP alone (no run-ahead chain, so no
    jump draft item could ever go) or SPEED, the real item after `{` carries the forced `"n": `."""
    sched = Scheduler(SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=64, speculate=speculate,
                                      firp_k=firp_k, eos_token_ids=(TINY_EOS_ID,)),
                      Ranked(NUL) if speculate else None, grammar_vocab=vocab)
    sched.add(0, [72, 105], SamplingParams(max_new_tokens=16, grammar=SPECS["json_schema"]))
    (prefill,) = sched.next_batch(num_inflight=0).items
    row = torch.zeros(1, vocab.ll.vocab_size)
    row[0, OPEN] = 10.0
    sched.on_result([prefill], torch.tensor([OPEN]), row)
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.token_ids == ((OPEN, *b'"n": ') if rides else (OPEN,))
    assert sched.spec.grammar_jump_tokens == (5 if rides else 0) and sched.spec.firp_drafted == 0


@pytest.mark.parametrize(("num_stages", "send_jump"), [(2, False), (3, True), (3, False)],
                         ids=["no-room", "jump-sent", "jump-waits"])
def test_after_a_squash_the_corrected_real_item_carries_the_forced_run(vocab, num_stages, send_jump):
    """choice ["abxyz", "acuvw"] after `a`: the predictor drafts `b`. On 3 stages the jump item `xyz` is made
    behind it and sent, or left waiting (no free micro-batch slot: never sent); on 2 there is no room for it
    and the drafting matcher's last answer is the one at `ab` (`x` forced). grammar_forced and
    grammar_jump_tokens count what was sent: a run made and never sent counts nothing. The real token is
    `c`: everything after it is squashed (a waiting draft too), and the corrected real item `c` carries the
    forced run `uvw` as its own rows (riding, [Note: grammar-aware drafting]), made at the rolled-back prefix
    `ac` (a drafting matcher that kept an answer of the squashed chain, e.g. one cached by prefix length or
    position, sends `x`). Its one result commits `uvw` and EOS, with the ledger in step throughout."""
    sched, seq = _committed(vocab, GrammarSpec.choice(["abxyz", "acuvw"]), A, Ranked(ord("b")), num_stages=num_stages)
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.token_ids == (A,), "`a` is followed by `b` or `c`: nothing is forced after it"
    (draft,) = sched.next_batch(num_inflight=1).items
    assert draft.token_ids == (ord("b"),)
    if num_stages == 3:  # room behind the draft: the jump item is made
        assert seq.pending.token_ids == tuple(b"xyz")
        if send_jump:  # and sent, then squashed in flight
            (jump,) = sched.next_batch(num_inflight=2).items
            assert jump.token_ids == tuple(b"xyz") and seq.ledger.inflight[-1].jump
    else:
        assert seq.pending is None and seq.draft_grammar.last.prefix == (A, ord("b"))
    assert (sched.spec.grammar_forced, sched.spec.grammar_jump_tokens) == ((1, 2) if send_jump else (0, 0))
    ledger_in_step(seq)
    rows = torch.full((1, vocab.ll.vocab_size), -5.0)
    rows[0, ord("c")] = 5.0
    [c] = sched.on_result([real], rows.argmax(-1), rows)
    assert c.token_ids == (ord("c"),) and not seq.ledger.inflight
    assert sched.spec.squashed_items == (2 if send_jump else 1)  # `b` (and `xyz` when it was sent)
    assert seq.pending is None or seq.pending.kind != ItemKind.DRAFT, "a squashed chain's draft waits on"
    (real2,) = sched.next_batch(num_inflight=0).items
    assert real2.token_ids == (ord("c"), *b"uvw"), real2.token_ids
    assert real2.kind == ItemKind.FIRP and real2.epoch == seq.epoch and seq.ledger.inflight[0].jump
    assert seq.draft_grammar.state.tokens[:5] == [*b"acuvw"], "the drafting matcher kept the squashed tokens"
    ledger_in_step(seq)
    [rest] = _result(sched, real2, vocab, seed=4)
    assert rest.token_ids == (*b"uvw", TINY_EOS_ID) and seq.output_ids == [*b"acuvw", TINY_EOS_ID]
    spec = sched.spec
    assert (spec.jump_verified, spec.jump_accepted) == (3, 3) and spec.firp_verified == spec.firp_drafted == 0
    assert spec.grammar_jump_tokens == 3 + (2 if send_jump else 0) >= spec.jump_verified


@pytest.mark.parametrize(("spec", "max_new", "want"), [
    (GrammarSpec.choice(["alpha", "beta"]), 16, b"lpha"),         # stops before the forced EOS
    (GrammarSpec.choice(["alpha", "beta"]), 4, b"lp"),            # at the token budget
    (GrammarSpec.choice(["a" + "bcdefghijklmnopqrstuvwxyz" * 2]), 60, b"bcdefghijklmnopqrstuvwxyz"[:MAX_JUMP_ROWS - 1]),
], ids=["eos", "budget", "cap"])
def test_a_jump_run_stops_before_eos_at_the_budget_and_at_the_cap(vocab, spec, max_new, want):
    """After `a` the rest is forced: the real item `a` carries the run. The run never holds EOS (the last
    row's result commits it), never passes the last position an item may hold (prompt + budget - 2), and
    the item holds at most MAX_JUMP_ROWS rows, the real token's included."""
    sched, seq = _committed(vocab, spec, A, Ranked(NUL), max_new_tokens=max_new, max_model_len=80)
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.token_ids == (A, *want)
    assert real.end - 1 <= seq.ledger.last_item_position and real.num_tokens <= MAX_JUMP_ROWS


def test_a_tree_draft_behind_a_jump_item_never_shares_a_scratch_in_flight(vocab):
    """4 stages, --draft-tree 3, choice of `ab1234x` / `ab1234y` / `ac`: after `a` the tree draft `b` (sibling `c`)
    at p, the jump item `1234` at p+1..p+4, then the draft `x` at p+5, whose sibling `y` would use the scratch of
    p's sibling (p mod (max_inflight + 1)) while that one may still be rescued: it goes without siblings
    ([Note: token trees], scratch)."""
    spec = GrammarSpec.choice(["ab1234x", "ab1234y", "ac"])
    sched, seq = _committed(vocab, spec, A, Ranked(ord("b"), [ord("c"), ord("x"), ord("y")]), num_stages=4, draft_tree=3)
    items = [sched.next_batch(num_inflight=i).items[0] for i in range(3)]
    assert [it.token_ids for it in items] == [(A,), (ord("b"),), tuple(b"1234")]
    assert items[1].alt_token_ids == (ord("c"),)
    late = seq.pending
    assert late.token_ids == (ord("x"),) and late.start == items[1].start + 5
    assert sched.tree.scratch_of(late.start) == sched.tree.scratch_of(items[1].start) and late.alt_token_ids == ()


def test_jump_rows_stay_out_of_the_run_ahead_acceptance():
    """The table-driven run-ahead depth (RowBudget.run_ahead) reads SPEED's acceptance per draft item: a jump
    item's later rows, always accepted, must not lift it (40 run-ahead drafts all rejected: no run-ahead, with
    or without 200 jump rows beside them)."""
    from pipeline.engine.row_budget import RowBudget

    table = RowCostTable(mode="t", num_rows=(1, 2), pass_s=(1.0, 1.05))
    config = SchedulerConfig(num_stages=4, speculate=True, max_inflight=4, row_costs=table, run_ahead_from_table=True)
    rows = RowBudget(max_firp_k=0, row_costs=table)
    alone = SpecCounters(verified_drafts=40)
    beside = SpecCounters(verified_drafts=240, accepted_tokens=200, jump_verified=200, jump_accepted=200)
    assert rows.run_ahead(config, alone, shared_rows=0, explore=False) == 1
    assert rows.run_ahead(config, beside, shared_rows=0, explore=False) == 1


def _lowest_cost_per_row(table: RowCostTable) -> float:
    return min(table.cost_s(n) / n for n in range(1, MAX_JUMP_ROWS + 1))


def test_the_row_cost_table_caps_a_jump_run():
    """A jump item holds the rows of the lowest cost per row the table prices ([Note: rows worth sending]
    with sure drafts): no n up to MAX_JUMP_ROWS is cheaper per row than the one chosen."""
    assert max_jump_rows(None) == MAX_JUMP_ROWS
    for table in (RowCostTable(mode="t", num_rows=(1, 2, 3, 4), pass_s=(1.0, 1.2, 1.4, 4.0)),
                  RowCostTable(mode="t", num_rows=(1, 8), pass_s=(1.0, 2.0))):
        n = max_jump_rows(table)
        assert 1 <= n <= MAX_JUMP_ROWS and table.cost_s(n) / n <= _lowest_cost_per_row(table) * (1 + 1e-9), n
    assert max_jump_rows(RowCostTable(mode="t", num_rows=(1, 2, 3, 4), pass_s=(1.0, 1.2, 1.4, 4.0))) < 4
    assert max_jump_rows(RowCostTable(mode="t", num_rows=(1, 8), pass_s=(1.0, 2.0))) == MAX_JUMP_ROWS


def test_one_slow_point_in_the_row_cost_table_does_not_shorten_jump_runs():
    """A measured table whose 3-row point is slow (a timing that caught interference: noise only adds
    time) is as cheap per row as the clean table at 16 rows; one noisy point must not cap every jump run
    at 2 rows (a rule that stops at the first rise of the cost per row does)."""
    rows = (1, 2, 3, 4, 8, 16)
    clean = RowCostTable(mode="t", num_rows=rows, pass_s=(1.0, 1.05, 1.1, 1.15, 1.35, 1.75))
    noisy = RowCostTable(mode="t", num_rows=rows, pass_s=(1.0, 1.05, 1.9, 1.15, 1.35, 1.75))
    assert noisy.cost_s(3) / 3 > noisy.cost_s(2) / 2, "the noisy point does raise the cost per row"
    assert max_jump_rows(noisy) == max_jump_rows(clean) == MAX_JUMP_ROWS
    assert noisy.cost_s(MAX_JUMP_ROWS) / MAX_JUMP_ROWS <= _lowest_cost_per_row(noisy) * (1 + 1e-9)


def test_a_forced_token_overrides_the_predictor(vocab):
    """A predictor without an exit head proposing a forbidden token: the forced `"` is drafted instead."""
    sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, Ranked(NUL), grammar_jump=False)
    sched.next_batch(num_inflight=0)
    assert seq.pending.token_ids == (QUOTE,)
    sched.next_batch(num_inflight=1)
    assert (sched.spec.grammar_forced, sched.spec.grammar_replaced, sched.spec.grammar_dropped) == (1, 0, 0)


@pytest.mark.parametrize(("predictor", "want", "counts"), [
    (Ranked(QUOTE), QUOTE, (0, 0)),                     # allowed: kept
    (Ranked(NUL, [NUL, A, CLOSE]), CLOSE, (1, 0)),      # forbidden: the best allowed alternative
    (Ranked(NUL, [NUL, A]), None, (0, 1)),              # forbidden, no allowed alternative: dropped
    (Ranked(NUL), None, (0, 1)),                        # forbidden, no alternatives at all: dropped
], ids=["allowed-kept", "forbidden-replaced", "no-allowed-alternative", "no-alternatives"])
def test_a_forbidden_draft_is_replaced_by_an_allowed_alternative_or_dropped(vocab, predictor, want, counts):
    """json_object after `{`: `"` or `}` allowed (not forced). (replaced, dropped) counted."""
    sched, seq = _committed(vocab, SPECS["json_object"], OPEN, predictor)
    spec = SpecCounters()
    draft = sched.grammar_drafts.draft(seq, predictor, None, sched.grammar_drafts.forced(seq), spec)
    assert (None if draft is None else draft.token) == want
    assert (spec.grammar_replaced, spec.grammar_dropped) == counts and spec.grammar_forced == 0


def test_off_or_unconstrained_drafts_are_the_predictors(vocab):
    """grammar_drafts off, or a sequence without a grammar: the predictor's draft as it is, nothing counted."""
    sched, seq = _committed(vocab, SPECS["json_object"], OPEN, Ranked(NUL))
    spec, off = SpecCounters(), GrammarDrafts(enabled=False)
    assert off.forced(seq) is None and off.draft(seq, Ranked(NUL), None, None, spec).token == NUL
    seq.grammar = None
    assert sched.grammar_drafts.draft(seq, Ranked(NUL), None, None, spec).token == NUL
    assert spec == SpecCounters()


def test_firp_chains_are_cut_at_a_forbidden_draft_and_take_forced_tokens(vocab):
    """json_object after `{`: chain `"a"` then NUL: after `{"a"` the grammar forces `:` (the NUL is
    replaced by it); chain `"a` then NUL (forbidden in a string): cut before the NUL."""
    sched, seq = _committed(vocab, SPECS["json_object"], OPEN, Ranked(QUOTE))
    spec = SpecCounters()
    assert sched.grammar_drafts.chain(seq, (QUOTE, A, QUOTE, NUL), spec) == (QUOTE, A, QUOTE, COLON)
    assert (spec.grammar_replaced, spec.grammar_dropped) == (1, 0)
    assert sched.grammar_drafts.chain(seq, (QUOTE, A, NUL, A), spec) == (QUOTE, A)
    assert (spec.grammar_replaced, spec.grammar_dropped) == (1, 1)
    assert sched.grammar_drafts.chain(seq, (), spec) == ()


def test_tree_siblings_are_only_allowed_tokens(vocab):
    """The token tree's candidates after `{` (json_object) lose the forbidden ones."""
    sched, seq = _committed(vocab, SPECS["json_object"], OPEN, Ranked(QUOTE))
    filtered = sched.grammar_drafts.filtered(seq, Ranked(QUOTE, [NUL, CLOSE, A, QUOTE]))
    assert [d.token for d in filtered.alternatives(seq.context(), None)] == [CLOSE, QUOTE]


def test_the_forced_draft_has_its_own_gate_bucket(vocab):
    """A forced draft's source is "grammar" at confidence 1: the draft gate learns its acceptance apart."""
    sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, Ranked(NUL))
    forced = sched.grammar_drafts.forced(seq)
    assert forced == Draft(QUOTE, 1.0, GRAMMAR_SOURCE)
    assert sched.gate.key(forced) == (GRAMMAR_SOURCE, sched.gate.num_buckets - 1)


def test_the_counters_reach_launch_json_and_its_summary_line():
    """`launch --json` stats carry grammar_forced / replaced / dropped / grammar_jump_tokens; the summary line
    names them."""
    from launcher.cli.launch import speculation_stats, speculation_text

    spec = SpecCounters(drafted_tokens=6, verified_drafts=6, accepted_tokens=5, passes=4, committed_tokens=9,
                        grammar_forced=3, grammar_replaced=1, grammar_dropped=2, grammar_jump_tokens=12)
    stats = speculation_stats(spec)
    assert (stats["grammar_forced"], stats["grammar_replaced"], stats["grammar_dropped"]) == (3, 1, 2)
    assert stats["grammar_jump_tokens"] == 12
    assert "grammar drafts: 3 forced, 1 replaced, 2 dropped, 12 jump-forward rows" in speculation_text(stats)
    assert "grammar" not in speculation_text(speculation_stats(SpecCounters(drafted_tokens=1)))
    riding = speculation_stats(SpecCounters(drafted_tokens=5, verified_drafts=5, accepted_tokens=5, grammar_jump_tokens=5))
    assert "grammar drafts: 0 forced, 0 replaced, 0 dropped, 5 jump-forward rows" in speculation_text(riding), (
        "rows of runs riding on real items (no forced draft item) left out of the summary line")


def test_a_jump_run_made_again_one_token_on_computes_one_mask(vocab, monkeypatch):
    """choice ["abcdefghijklmnopqrstuvwx", "z"] after `a`, real items without riding runs (patched out: the
    draft-item path alone): a draft after the real item is forced; the pipeline has no room for drafts (the draft item waits, and is
    dropped when the real item's result comes), the steady state of a loaded pipeline; each real item makes
    the jump run again, one token further on. The drafting matcher reads the run's masks from the last run
    (`DraftMatcher.forced_after`): about one new mask per committed token, not a run's worth (up to
    MAX_JUMP_ROWS, ~0.1 ms each on a real vocabulary) per token. (With riding on, each real item carries the
    run and the same reuse holds: `test_riding_runs_compute_about_one_mask_per_committed_token`.)"""
    text = "abcdefghijklmnopqrstuvwx"
    monkeypatch.setattr(GrammarDrafts, "real_rows", lambda self, seq, firp, spec, row_costs=None: ((), False))
    sched, seq = _committed(vocab, GrammarSpec.choice([text, "z"]), A, Ranked(ord("q")), max_new_tokens=30)
    (real,) = sched.next_batch(num_inflight=0).items
    assert seq.pending.token_ids == tuple(text[1:].encode())[:MAX_JUMP_ROWS]
    state, masks = seq.draft_grammar.state, []
    allowed = state.allowed
    monkeypatch.setattr(state, "allowed", lambda *a: masks.append(a) or allowed(*a))
    for i in range(1, 8):
        [commit] = _result(sched, real, vocab, seed=i)
        assert commit.token_ids == (ord(text[i]),) and not seq.ledger.inflight
        (real,) = sched.next_batch(num_inflight=0).items
        assert seq.pending.token_ids == tuple(text[i + 1:].encode())[:MAX_JUMP_ROWS]
    assert len(masks) <= 7, f"{len(masks)} masks for 7 committed tokens"
    assert sched.spec.grammar_jump_tokens == sched.spec.grammar_forced == 0, "runs never sent were counted"


def test_riding_runs_compute_about_one_mask_per_committed_token(vocab, monkeypatch):
    """The same choice with riding: the real item `a` carries 15 forced rows (MAX_JUMP_ROWS with its own),
    the next real item the rest; the whole output commits in two passes, every token of it computed by
    one mask or so (the forced run after each pass's end is read from the run the last one made)."""
    text = "abcdefghijklmnopqrstuvwx"
    sched, seq = _committed(vocab, GrammarSpec.choice([text, "z"]), A, Ranked(ord("q")), max_new_tokens=30)
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.token_ids == tuple(text.encode())[:MAX_JUMP_ROWS]
    state, masks = seq.draft_grammar.state, []
    allowed = state.allowed
    monkeypatch.setattr(state, "allowed", lambda *a: masks.append(a) or allowed(*a))
    [first] = _result(sched, real, vocab, seed=1)
    assert first.token_ids == tuple(text[1:].encode())[:MAX_JUMP_ROWS]
    (real,) = sched.next_batch(num_inflight=0).items
    assert real.token_ids == tuple(text[MAX_JUMP_ROWS:].encode())
    [rest] = _result(sched, real, vocab, seed=2)
    assert seq.output_ids == [*text.encode(), TINY_EOS_ID] and rest.finish_reason is not None
    assert len(masks) <= len(text) - MAX_JUMP_ROWS + 2, f"{len(masks)} masks for {len(seq.output_ids)} tokens"


def test_jump_rows_share_of_the_verified_and_accepted_drafts_reaches_launch_json_and_prometheus():
    """SpecCounters.jump_verified / jump_accepted (a jump item's later rows, always accepted) are in
    `launch --json` and Prometheus, as FIRP's share is: without them acceptance_rate, which counts them,
    cannot be told apart from the predictor's own."""
    import types

    from launcher.cli.launch import speculation_stats
    from launcher.serving.prometheus import PREFIX, _PipelineCollector

    spec = SpecCounters(drafted_tokens=12, verified_drafts=10, accepted_tokens=8, grammar_jump_tokens=6,
                        jump_verified=5, jump_accepted=5)
    stats = speculation_stats(spec)
    assert (stats["jump_verified"], stats["jump_accepted"]) == (5, 5)
    collector = _PipelineCollector(types.SimpleNamespace(spec=spec), "m", engine=None)
    want, got = {PREFIX + "grammar_jump_verified_tokens": 5, PREFIX + "grammar_jump_accepted_tokens": 5}, {}
    for family in collector.collect():
        if family.name in want:
            got[family.name] = family.samples[0].value
        if len(got) == len(want):
            break
    assert got == want


@pytest.mark.parametrize("stop", ['"ki', "nd", '"kind": "alph'])
def test_a_stop_string_inside_a_jump_run_ends_the_tokens_where_token_by_token_decoding_does(tmp_path, stop):
    """A commit of several tokens (a jump-forward run `, "kind": "` with the token after it, or a FIRP
    chain) in which a stop string ends: the request's tokens (usage's completion_tokens, logprobs) stop
    at the token that completes it, as when each token is its own commit; the text is cut at its start."""
    from launcher.coordinator.request_handle import RequestHandle
    from pipeline.engine.records import Commit
    from pipeline.model.tokenizer import Tokenizer
    from tests.tiny_model import write_tiny_model

    tok = Tokenizer(write_tiny_model(tmp_path / "m"))
    params, ids = SamplingParams(max_new_tokens=64, stop=(stop,)), tuple(b'{"name": "x", "kind": "alph')
    handles = [RequestHandle("r", "p", [1], params, tok.detokenizer(prompt_ids=[1])) for _ in range(2)]
    hits = [handles[0].emit(Commit(0, ids[:9], None)), handles[0].emit(Commit(0, ids[9:], None))]  # `, "kind": "alph` as one
    for t in ids:  # token-by-token decoding: the coordinator finishes the sequence at the first hit
        if handles[1].emit(Commit(0, (t,), None)):
            break
    assert hits == [False, True] and handles[0].finish_reason == handles[1].finish_reason == "stop"
    assert handles[0].token_ids == handles[1].token_ids
    assert handles[0].text == handles[1].text == bytes(ids).decode()[:bytes(ids).decode().index(stop)]
