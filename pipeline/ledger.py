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
without speculation (ARCHITECTURE.md §5.3); sampling uses the accept rule of pipeline/sampling.py.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class InFlight:
    """One item of this sequence in the pipeline: its position, input token, draft flag, epoch."""

    position: int
    token: int
    is_draft: bool
    epoch: int


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of one result: the committed token, whether a draft was checked and accepted,
    and how many in-flight items a rejection squashed."""

    token: int
    drafted: bool
    accepted: bool
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

    def add_real(self, token: int) -> InFlight:
        """Record the real item sent at next_real_position (nothing of this sequence in flight)."""
        assert not self.inflight, "a real item is only sent when nothing is in flight"
        item = InFlight(self.next_real_position, token, False, self.epoch)
        self.inflight.append(item)
        return item

    def can_draft_after(self, position: int, epoch: int, *, max_inflight: int) -> bool:
        """Whether a draft may follow the in-flight item at `position` (it just passed the exit layer).

        Not if: stale epoch, the item is not the chain's end, the per-sequence in-flight cap is
        reached, or the draft's own result would lie past the token budget (the last budget token
        is committed from the result of the item before it, so it is never drafted as an item).
        """
        if epoch != self.epoch or not self.inflight or self.inflight[-1].position != position:
            return False
        if len(self.inflight) >= max_inflight:
            return False
        last_budget_position = self.prompt_len + self.max_new_tokens - 1
        return position + 1 < last_budget_position

    def add_draft(self, token: int) -> InFlight:
        """Record a draft item injected right after the chain's end."""
        assert self.inflight, "a draft follows an in-flight item"
        item = InFlight(self.inflight[-1].position + 1, token, True, self.epoch)
        self.inflight.append(item)
        return item

    def on_result(self, position: int, epoch: int, real_token: int) -> Verdict | None:
        """Apply the result of the item at `position` (see [Note: verify]). None if stale.

        `real_token` must already be the token to commit (greedy argmax, or the sampler's
        verify/sample outcome against the draft that follows, if any).
        """
        if epoch != self.epoch:
            return None
        head = self.inflight.popleft()
        assert head.position == position, f"result for position {position}, expected {head.position}"
        assert position == self.next_real_position, f"result at {position}, committed length {self.known_len}"
        self.num_committed += 1
        if not self.inflight:
            return Verdict(real_token, drafted=False, accepted=False, squashed=0)
        if self.inflight[0].token == real_token:
            return Verdict(real_token, drafted=True, accepted=True, squashed=0)
        squashed = len(self.inflight)
        self.inflight.clear()
        self.epoch += 1
        return Verdict(real_token, drafted=True, accepted=False, squashed=squashed)

    def next_draft_token(self) -> int | None:
        """The draft that follows the chain's head (what the head's result is verified against)."""
        return self.inflight[1].token if len(self.inflight) > 1 else None

    def finish(self) -> int:
        """The sequence ended: drop the chain; returns how many in-flight items became useless."""
        n = len(self.inflight)
        self.inflight.clear()
        self.epoch += 1
        return n
