"""Speculation ledger: the per-sequence commit/squash state machine of SPEED (arXiv 2310.12072 §3).

Owns, for one sequence, which positions are in flight (a contiguous chain: the oldest item's
input token is committed, the rest are drafts), the epoch, and the verify rule applied when a
result arrives. Pure: no I/O, no torch; the scheduler feeds it events in arrival order.

Positions: the item at position p carries token x_p and its result is the model's next token
x_{p+1}. With prompt length n and k committed tokens, the next real item is at n + k - 1.

[Note: verify]
When the result r (= the real x_{p+1}) of the item at p arrives:
  * the draft injected after p (the in-flight item at p + 1, if any) is compared with r:
    equal -> commit r and keep the chain; different -> commit r, bump the epoch, forget every
    in-flight item (they are now stale: each stage drops or overwrites them, see
    [Note: in-band squash]) and ask for a real item at p + 1 carrying r;
  * with no item at p + 1, commit r and ask for a real item at p + 1.
Only committed tokens ever leave the coordinator. Greedy output is therefore identical with and
without speculation (ARCHITECTURE.md §5.3); sampling uses the accept rule of pipeline/speculation/sampling.py.

[Note: chain verify]
With FIRP (arXiv 2410.20488 §3.3) an item may carry several positions: its first token, then
drafts d_1 .. d_m (FIRP drafts from the previous result's pseudo rows). Its result holds one real
next token per row, r_0 .. r_m. Row i's result is checked against the draft that follows row i:
d_{i+1} for i < m, the next in-flight item's token for i = m. The caller commits r_0, r_1, ... and
stops after the first token that differs from its draft (that token is still committed: it is the
real one), so one pass commits the longest correct prefix plus one real token. Any rejection (inside
the item or of the next item) bumps the epoch and forgets every in-flight item; the next real item
starts right after the committed tokens and every stage truncates its KV cache there
([Note: in-band squash]), dropping the rejected drafts' keys and values. SPEED run-ahead items
and FIRP chains go through this one rule, so they combine freely. A run-ahead draft item may also
carry several positions: a structured output's forced run (jump-forward, [Note: grammar-aware
drafting] in pipeline/engine/grammar_drafts.py), `InFlight.jump`; once its first token is committed
it is verified as a chain like a FIRP item, its drafts being the run's later tokens. A real item
may carry such a run instead of FIRP drafts (`add_real(jump=True)`): the same chain, from its own row.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class InFlight:
    """One item of this sequence in the pipeline: its first position and input token, its epoch, the
    drafts it carries at the following positions (FIRP drafts; with `jump`, a grammar's forced run
    after the item's first token, a draft's or a real one's, counted apart from FIRP's), and for a run-ahead draft
    its adaptive-drafting bucket (pipeline/speculation/draft_gate.py; None if ungated)."""

    position: int
    token: int
    epoch: int
    drafts: tuple[int, ...] = ()
    gate_key: tuple[str, int] | None = None
    alts: tuple[int, ...] = ()  # token-tree siblings of a draft ([Note: token trees] in pipeline/speculation/tree.py)
    jump: bool = False  # `drafts` are a grammar's forced run (jump-forward), not FIRP drafts

    @property
    def last_position(self) -> int:
        """Position of the item's last row."""
        return self.position + len(self.drafts)

    @property
    def tokens(self) -> tuple[int, ...]:
        return (self.token, *self.drafts)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of one result ([Note: chain verify]): the committed tokens, how many drafts were
    checked and accepted, and how many in-flight items were squashed."""

    tokens: tuple[int, ...]
    num_verified: int
    num_accepted: int
    squashed: int


class SequenceLedger:
    """In-flight chain and epoch of one sequence. See [Note: verify].

    prompt_len: n; max_new_tokens: the token budget (drafts never go past it).
    """

    def __init__(self, *, prompt_len: int, max_new_tokens: int) -> None:
        assert prompt_len >= 1 and max_new_tokens >= 1
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.num_committed = 0
        self.epoch = 0
        self.inflight: collections.deque[InFlight] = collections.deque()

    @property
    def known_len(self) -> int:
        """Prompt plus committed tokens."""
        return self.prompt_len + self.num_committed

    @property
    def next_real_position(self) -> int:
        """Position of the next real (non-draft) item: the last committed token's position."""
        return self.known_len - 1

    @property
    def last_item_position(self) -> int:
        """The last position worth sending: its result is the last token of the budget."""
        return self.prompt_len + self.max_new_tokens - 2

    def max_firp_drafts(self) -> int:
        """How many FIRP drafts the next real item may carry without passing the budget."""
        return max(0, self.last_item_position - self.next_real_position)

    def add_real(self, token: int, drafts: Sequence[int] = (), *, jump: bool = False) -> InFlight:
        """Record the real item sent at next_real_position (nothing of this sequence in flight),
        carrying FIRP `drafts` at the following positions (at most `max_firp_drafts()`; with `jump`,
        a grammar's forced run instead, `InFlight.jump`)."""
        assert not self.inflight, "a real item is only sent when nothing is in flight"
        assert len(drafts) <= self.max_firp_drafts(), "FIRP drafts past the token budget"
        item = InFlight(self.next_real_position, token, self.epoch, tuple(drafts), jump=jump and bool(drafts))
        self.inflight.append(item)
        return item

    def can_draft_after(self, position: int, epoch: int, *, max_inflight: int) -> bool:
        """Whether a draft may follow the in-flight item at `position` (it just passed the exit layer).

        Not if: stale epoch, the item is not the chain's end, the per-sequence in-flight cap is
        reached, or the draft's own result would lie past the token budget (the last budget token
        is committed from the result of the item before it, so it is never drafted as an item).
        """
        if epoch != self.epoch or not self.inflight or self.inflight[-1].last_position != position:
            return False
        if len(self.inflight) >= max_inflight:
            return False
        last_budget_position = self.prompt_len + self.max_new_tokens - 1
        return position + 1 < last_budget_position

    def add_draft(self, token: int, *, gate_key: tuple[str, int] | None = None, alts: Sequence[int] = (),
                  jump: Sequence[int] = ()) -> InFlight:
        """Record a draft item injected right after the chain's end (gate_key: its DraftGate bucket;
        alts: its token-tree siblings; jump: the forced tokens it carries after `token`, jump-forward)."""
        assert self.inflight, "a draft follows an in-flight item"
        item = InFlight(self.inflight[-1].last_position + 1, token, self.epoch, tuple(jump), gate_key=gate_key,
                        alts=tuple(alts), jump=bool(jump))
        assert item.last_position <= self.last_item_position, "a forced run past the token budget"
        self.inflight.append(item)
        return item

    def on_result(self, position: int, epoch: int, real_token: int | Sequence[int]) -> Verdict | None:
        """Apply the result of the chain head, whose last row is at `position` (see [Note: verify]
        and [Note: chain verify]). None if stale.

        `real_token`: the tokens to commit, in row order (an int for one): the caller has applied
        the verify rule (greedy argmax or the sampler) to each row against `drafts_to_verify()`
        and stopped after the first mismatch (or at EOS / the budget). Every token before the last
        must equal its draft.
        """
        if epoch != self.epoch:
            return None
        tokens = (real_token,) if isinstance(real_token, int) else tuple(real_token)
        drafts = self.drafts_to_verify()
        head = self.inflight.popleft()
        assert head.last_position == position, f"result for position {position}, expected {head.last_position}"
        assert head.position == self.next_real_position, f"result at {position}, committed length {self.known_len}"
        assert 1 <= len(tokens) <= len(head.tokens), f"{len(tokens)} tokens from a {len(head.tokens)}-row item"
        assert all(t == d for t, d in zip(tokens[:-1], drafts, strict=False)), "committed past a rejected draft"
        self.num_committed += len(tokens)
        num_verified = min(len(tokens), len(drafts))
        num_accepted = sum(1 for t, d in zip(tokens, drafts, strict=False) if t == d)
        chain_goes_on = len(tokens) == len(head.tokens) and num_accepted == num_verified
        if chain_goes_on or (not self.inflight and num_accepted == num_verified):
            return Verdict(tokens, num_verified, num_accepted, squashed=0)
        squashed = len(self.inflight)
        self.inflight.clear()
        self.epoch += 1
        return Verdict(tokens, num_verified, num_accepted, squashed=squashed)

    def drafts_to_verify(self) -> list[int]:
        """The drafts that follow each row of the chain's head: its own FIRP drafts, then the next
        in-flight item's token (if any). Row i's result is verified against element i."""
        if not self.inflight:
            return []
        head = self.inflight[0]
        return list(head.drafts) + ([self.inflight[1].token] if len(self.inflight) > 1 else [])

    def finish(self) -> int:
        """The sequence ended: drop the chain; returns how many in-flight items became useless."""
        n = len(self.inflight)
        self.inflight.clear()
        self.epoch += 1
        return n
