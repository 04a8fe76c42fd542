"""NGramPredictor's C-speed search (bytes.rfind over 8-byte token words) proposes exactly what the
plain scan it replaced proposes. What breaks when this fails: a draft from the wrong occurrence
(a word-misaligned hit, an occurrence overlapping the suffix's own last token, the window), so
acceptance drops or the stage and the coordinator disagree on a draft (they must not: [Note:
stage-local drafting] in pipeline/engine/local_draft.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.speculation.predictors import NGramPredictor


def reference(p: NGramPredictor, context: list[int]) -> tuple[int, float] | None:
    """The plain scan: longest suffix first, latest earlier occurrence first."""
    ctx = list(context[-p.window:])
    n = len(ctx)
    for size in range(min(p.max_ngram, n - 1), p.min_ngram - 1, -1):
        suffix = ctx[n - size:]
        for start in range(n - size - 1, -1, -1):
            if ctx[start:start + size] == suffix:
                return ctx[start + size], size / p.max_ngram
    return None


@settings(max_examples=400, deadline=None)
@given(context=st.lists(st.one_of(st.integers(0, 5), st.integers(0, 2**40)), max_size=80),
       max_ngram=st.integers(1, 5), window=st.integers(2, 100))
def test_the_search_matches_the_plain_scan(context, max_ngram, window):
    p = NGramPredictor(max_ngram=max_ngram, window=window)
    got = p.propose(context, None)
    assert (None if got is None else (got.token, got.confidence)) == reference(p, context)


def test_word_misaligned_byte_matches_are_not_occurrences():
    # little-endian words 1 << 56 = 00 00 00 00 00 00 00 01 and 0 = 00 ... 00: from byte 7 they
    # read 01 00 00 00 00 00 00 00, token 1, which is not an occurrence of the suffix [1]
    context = [1 << 56, 0, 9, 1]
    p = NGramPredictor(max_ngram=2)
    assert reference(p, context) is None and p.propose(context, None) is None


def test_tuples_and_single_tokens():
    p = NGramPredictor()
    assert p.propose((), None) is None and p.propose((5,), None) is None
    assert p.propose((3, 9, 3), None).token == 9
