"""Grammar-aware drafting's rules ([Note: grammar-aware drafting] in pipeline/engine/grammar_drafts.py).

What breaks when these fail: a constrained sequence drafts a token its grammar forbids (a row wasted,
a squash), misses a token the grammar forces (a sure draft lost, or held back waiting for the exit
head), a forbidden draft is neither replaced by the predictor's allowed candidate nor dropped, a FIRP
chain goes on past a forbidden draft, token-tree siblings include forbidden tokens, or the counters
(SpecCounters.grammar_*) miss what happened. Exactness under these rules is tested in
tests/unit/test_grammar_paths.py (which runs with grammar-aware drafting on and off). The byte
tokenizer of tests/tiny_model.py: every token is one byte.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.grammar_drafts import GRAMMAR_SOURCE, GrammarDrafts
from pipeline.engine.records import SchedulerConfig, SpecCounters
from pipeline.engine.scheduler import Scheduler
from pipeline.speculation.grammar import GrammarSpec, GrammarVocab
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import Draft
from pipeline.speculation.sampling import SamplingParams
from tests.adversarial_predictors import AlwaysWrongPredictor, ReferenceTable
from tests.tiny_model import TINY_EOS_ID, byte_tokenizer
from tests.unit.test_grammar_paths import SPECS

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


def _committed(vocab, spec: GrammarSpec, first: int, predictor, **config):
    """A scheduler whose one constrained sequence committed `first` after its prefill (its real item
    pending, not yet sent), and that sequence."""
    sched = Scheduler(SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=64, speculate=True,
                                      eos_token_ids=(TINY_EOS_ID,), **config), predictor, grammar_vocab=vocab)
    seq = sched.add(0, [72, 105], SamplingParams(max_new_tokens=16, grammar=spec))
    (prefill,) = sched.next_batch(num_inflight=0).items
    row = torch.zeros(1, vocab.ll.vocab_size)
    row[0, first] = 10.0
    [commit] = sched.on_result([prefill], torch.tensor([first]), row)
    assert commit.token_ids == (first,)
    return sched, seq


def test_a_forced_token_is_drafted_at_send_time_without_the_exit_head(vocab):
    """json_schema {"n", "s"}: after `{` the grammar forces `"`; an exit-head predictor (always wrong) is
    neither waited for nor asked: the draft is queued as soon as the real item is sent. Off: no draft
    until an exit event."""
    for on in (True, False):
        predictor = AlwaysWrongPredictor(ReferenceTable([]), vocab_size=256, needs_exit_head=True)
        sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, predictor, grammar_drafts=on)
        (real,) = sched.next_batch(num_inflight=0).items
        assert real.token_ids == (OPEN,)
        if on:
            assert seq.pending is not None and seq.pending.kind == ItemKind.DRAFT
            assert seq.pending.token_ids == (QUOTE,) and sched.spec.grammar_forced == 1
            assert predictor.num_proposed == 0, "the predictor was asked at a forced position"
        else:
            assert seq.pending is None and sched.spec.grammar_forced == 0


def test_a_forced_token_overrides_the_predictor(vocab):
    """A predictor without an exit head proposing a forbidden token: the forced `"` is drafted instead."""
    sched, seq = _committed(vocab, SPECS["json_schema"], OPEN, Ranked(NUL))
    sched.next_batch(num_inflight=0)
    assert seq.pending.token_ids == (QUOTE,)
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
    """`launch --json` stats carry grammar_forced / replaced / dropped; the summary line names them."""
    from launcher.cli.launch import speculation_stats, speculation_text

    spec = SpecCounters(drafted_tokens=6, verified_drafts=6, accepted_tokens=5, passes=4, committed_tokens=9,
                        grammar_forced=3, grammar_replaced=1, grammar_dropped=2)
    stats = speculation_stats(spec)
    assert (stats["grammar_forced"], stats["grammar_replaced"], stats["grammar_dropped"]) == (3, 1, 2)
    assert "grammar drafts: 3 forced, 1 replaced, 2 dropped" in speculation_text(stats)
    assert "grammar" not in speculation_text(speculation_stats(SpecCounters(drafted_tokens=1)))
