"""Test-only draft predictors that make SPEED's squash path run on purpose.

Owns predictors implementing pipeline.speculation.predictors.Predictor for speculation tests: one that is
always wrong, a (mostly) uniformly random one, one that is right about half of the time (so
accepts AND squashes happen), one that is always right, and a switchable wrapper so one pipeline
session can be reused with several predictors. "Right" and "wrong" are judged against reference continuations
(the greedy output of a plain run), which the tests compute first.
Must not: import the runtime beyond the predictor types, or touch processes.

Context lookups: a predictor sees `context` = prompt + committed + in-flight draft tokens, up to
the chain's end (pipeline/speculation/predictors.py). If that context is a prefix of a reference sequence
(prompt + its greedy continuation), the true next token is known; otherwise the chain already holds
a wrong draft and whatever is proposed will be squashed anyway.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Sequence

from pipeline.speculation.predictors import Draft, ExitGuess


class ReferenceTable:
    """Maps every prefix (of length >= the prompt's) of each reference sequence to its next token.

    references: full sequences, prompt + continuation. Two references that agree on a prefix must
    agree on its next token (greedy decoding is a function of the prefix); a disagreement is a
    ValueError, since it means the references are not greedy outputs of one model.
    """

    def __init__(self, references: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.next: dict[tuple[int, ...], int] = {}
        for prompt, continuation in references:
            full = [*prompt, *continuation]
            for length in range(len(prompt), len(full)):
                key, token = tuple(full[:length]), full[length]
                if self.next.setdefault(key, token) != token:
                    raise ValueError(f"references disagree after {key[-4:]}: {self.next[key]} vs {token}")

    def true_next(self, context: Sequence[int]) -> int | None:
        """The reference's next token after `context`, or None if no reference continues it."""
        return self.next.get(tuple(context))


class AlwaysWrongPredictor:
    """Proposes a token that differs from the reference's next token whenever it is known
    ((truth + 1) % vocab_size), and a fixed token otherwise. Acceptance must come out exactly 0.

    needs_exit_head: declare the predictor exit-driven (the scheduler then drafts only after the
    chain's end passed the exit layer) instead of drafting as soon as an item is sent."""

    name = "always-wrong"

    def __init__(self, table: ReferenceTable, *, vocab_size: int, needs_exit_head: bool = False) -> None:
        self.table, self.vocab_size, self.needs_exit_head = table, vocab_size, needs_exit_head
        self.num_proposed = 0

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        truth = self.table.true_next(context)
        self.num_proposed += 1
        token = 0 if truth is None else (truth + 1) % self.vocab_size
        return Draft(token, 1.0, self.name)


class PerfectPredictor:
    """Proposes the reference's next token; no draft where the reference does not continue."""

    name = "perfect"
    needs_exit_head = False

    def __init__(self, table: ReferenceTable) -> None:
        self.table = table

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        truth = self.table.true_next(context)
        return None if truth is None else Draft(truth, 1.0, self.name)


class RandomPredictor:
    """Uniform random draft tokens in [0, vocab_size) from its own seeded generator; with
    `candidates`, a share `p_candidate` of the drafts is instead a uniform choice among those
    (tokens the model finds likely, so that under sampling drafts are accepted often)."""

    name = "random"

    def __init__(self, *, seed: int, vocab_size: int, candidates: Sequence[int] = (), p_candidate: float = 0.5,
                 needs_exit_head: bool = False) -> None:
        self.rng = random.Random(seed)
        self.vocab_size, self.candidates, self.needs_exit_head = vocab_size, list(candidates), needs_exit_head
        self.p_candidate = p_candidate

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        if self.candidates and self.rng.random() < self.p_candidate:
            return Draft(self.rng.choice(self.candidates), 0.5, self.name)
        return Draft(self.rng.randrange(self.vocab_size), 0.0, self.name)


class SometimesRightPredictor:
    """With probability `p_right` proposes the reference's true next token, otherwise a different
    random one; a random token where the reference does not continue the context."""

    name = "sometimes-right"

    def __init__(self, table: ReferenceTable, *, seed: int, vocab_size: int, p_right: float = 0.5,
                 needs_exit_head: bool = False) -> None:
        self.table, self.vocab_size, self.p_right = table, vocab_size, p_right
        self.rng = random.Random(seed)
        self.needs_exit_head = needs_exit_head

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        truth = self.table.true_next(context)
        if truth is not None and self.rng.random() < self.p_right:
            return Draft(truth, 1.0, self.name)
        token = self.rng.randrange(self.vocab_size)
        if token == truth:
            token = (token + 1) % self.vocab_size
        return Draft(token, 0.5, self.name)


class SwitchablePredictor:
    """Delegates to `inner`, which a test swaps between runs of one pipeline session (only while
    the session is idle) so that several predictors share one set of stage processes."""

    def __init__(self, inner) -> None:
        self._lock = threading.Lock()
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def needs_exit_head(self) -> bool:
        return self.inner.needs_exit_head

    def use(self, inner) -> None:
        with self._lock:
            self.inner = inner

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        with self._lock:
            return self.inner.propose(context, guess)

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        with self._lock:
            more = getattr(self.inner, "alternatives", None)
            return [] if more is None else more(context, guess)


class SiblingRescuePredictor(SometimesRightPredictor):
    """Token trees ([Note: token trees] in pipeline/speculation/tree.py): the primary draft is
    always wrong and the reference's true next token is among its `alternatives` (after a wrong
    one), so nearly every draft is rescued by a sibling; a fixed token where the reference does not
    continue. With `p_right` the primary is right instead that share of the time."""

    name = "sibling-rescue"

    def __init__(self, table: ReferenceTable, *, vocab_size: int, seed: int = 0, p_right: float = 0.0,
                 needs_exit_head: bool = False) -> None:
        super().__init__(table, seed=seed, vocab_size=vocab_size, p_right=p_right, needs_exit_head=needs_exit_head)

    def propose(self, context: Sequence[int], guess: ExitGuess | None) -> Draft | None:
        truth = self.table.true_next(context)
        if truth is not None and self.rng.random() < self.p_right:
            return Draft(truth, 1.0, self.name)
        return Draft(0 if truth is None else (truth + 1) % self.vocab_size, 1.0, self.name)

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        truth = self.table.true_next(context)
        if truth is None:
            return [Draft(1, 0.5, self.name)]
        return [Draft((truth + 2) % self.vocab_size, 0.5, self.name), Draft(truth, 0.4, self.name)]


class RandomTreePredictor(RandomPredictor):
    """RandomPredictor whose drafts also carry random siblings (token trees)."""

    name = "random-tree"

    def alternatives(self, context: Sequence[int], guess: ExitGuess | None) -> list[Draft]:
        return [Draft(self.rng.randrange(self.vocab_size), 0.1, self.name) for _ in range(3)]
