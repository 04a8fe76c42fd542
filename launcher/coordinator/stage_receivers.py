"""Stage receivers: the coordinator's threads that block on data-plane receives from the stages.

Owns turning what arrives from the last stage (RESULT) and from the exit stage (EXIT_GUESS, WITHDRAWN) into
engine events (pipeline/engine/events.py), ending on the in-band SHUTDOWN each of those stages
sends, and telling a stage death's report from the receive errors it caused (`await_death_report`). Must not: touch the engine (only the coordinator's engine thread does), or send.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from pipeline.engine.events import ExitPassed, Result, Withdrawn
from pipeline.engine.local_draft import NUM_KEYS
from pipeline.engine.wire import PROMPT_LOGPROB_TENSORS, Message, MessageKind, rank_name
from pipeline.speculation.predictors import exit_guesses
from workers.channel import Channel, ChannelError


class ReceiverError(RuntimeError):
    """A stage sent something the coordinator cannot use, or the data plane failed."""


def exit_event(msg: Message, *, now_ns: int) -> ExitPassed:
    """An EXIT_GUESS message as an engine event, with the drafts the exit stage made after its
    items ("self_drafts" / "self_draft_keys": [num_items] int64, -1 for none; [Note: stage-local
    drafting] in pipeline/engine/local_draft.py). Its time: when the exit stage finished the items
    (its StageTiming) if timed, else `now_ns` (when it arrived). Raises ReceiverError when the
    exit or draft tensors do not match the items: exit_tokens int64 and exit_probs floating, both
    [num_items] or [num_items, k] with k at most the items' `exit_top_k`; self_drafts / self_draft_keys
    int64, tokens >= -1 and key codes in [-1, NUM_KEYS)."""
    n = len(msg.items)
    tokens, probs = msg.tensors.get("exit_tokens"), msg.tensors.get("exit_probs")
    if tokens is not None or probs is not None:
        if (tokens is None or probs is None or tokens.dtype != torch.int64 or not probs.is_floating_point()
                or tokens.shape != probs.shape or tokens.shape[:1] != (n,) or tokens.dim() not in (1, 2)
                or (tokens.dim() == 2 and not 1 <= tokens.shape[1] <= max(it.exit_top_k for it in msg.items))):
            raise ReceiverError(f"EXIT_GUESS with {n} items has malformed exit_tokens / exit_probs tensors")
    guesses = tuple(exit_guesses(tokens, probs, n))
    at_ns = msg.timing[-1].end_ns if msg.timing else now_ns
    drafts, keys = msg.tensors.get("self_drafts"), msg.tensors.get("self_draft_keys")
    self_drafts = ()
    if drafts is not None or keys is not None:
        if (drafts is None or keys is None or drafts.shape != (n,) or keys.shape != drafts.shape
                or drafts.dtype != torch.int64 or keys.dtype != torch.int64
                or bool((drafts < -1).any()) or bool(((keys < -1) | (keys >= NUM_KEYS)).any())):
            raise ReceiverError(f"EXIT_GUESS with {n} items has malformed self_drafts / self_draft_keys tensors")
        self_drafts = tuple(zip(drafts.tolist(), keys.tolist(), strict=True))
    return ExitPassed(items=tuple(msg.items), guesses=guesses, at_ns=at_ns, self_drafts=self_drafts)


def withdrawn_event(msg: Message, *, now_ns: int) -> Withdrawn:
    """A WITHDRAWN message (self-made drafts the exit stage stopped) as an engine event. Raises
    ReceiverError when it names no item, or one the exit stage did not make."""
    if not msg.items or not all(it.self_made for it in msg.items):
        raise ReceiverError(f"WITHDRAWN names {len(msg.items)} items, not all made by the exit stage")
    return Withdrawn(items=tuple(msg.items), timing=tuple(msg.timing or ()), at_ns=now_ns)


def result_event(msg: Message, *, now_ns: int) -> Result:
    """A RESULT message as an engine event, stamped `now_ns` (when it arrived). Raises
    ReceiverError when its prompt-logprob tensors do not match its items, or its "fed" tensor
    (int64 [num_items] of 0 / 1; [Note: self-fed decode] in pipeline/engine/decode_feed.py) does not,
    or marks an item that was not authorised (`Item.feed_upto`)."""
    prompt = None
    rows = sum(it.num_prompt_rows for it in msg.items if it.want_logits)
    if rows or any(name in msg.tensors for name in PROMPT_LOGPROB_TENSORS):
        prompt = tuple(msg.tensors.get(name) for name in PROMPT_LOGPROB_TENSORS)
        chosen, ids, values, ranks = prompt
        if (chosen is None or ids is None or values is None or ranks is None or chosen.shape != (rows,)
                or ranks.shape != (rows,) or ids.dim() != 2 or ids.shape[0] != rows or values.shape != ids.shape):
            raise ReceiverError(f"RESULT for {rows} prompt rows has malformed {'/'.join(PROMPT_LOGPROB_TENSORS)} tensors")
    fed = msg.tensors.get("fed")
    if fed is not None:
        if fed.dtype != torch.int64 or fed.shape != (len(msg.items),) or bool(((fed != 0) & (fed != 1)).any()):
            raise ReceiverError(f"RESULT with {len(msg.items)} items has a malformed fed tensor")
        fed = tuple(fed.tolist())
        if any(f and not it.feed_upto for it, f in zip(msg.items, fed, strict=True)):
            raise ReceiverError("RESULT announces a fed decode item after an item that was not authorised")
    return Result(items=tuple(msg.items), token_ids=msg.tensors["token_ids"], logits=msg.tensors.get("logits"),
                  firp_tokens=msg.tensors.get("firp_tokens"), firp_probs=msg.tensors.get("firp_probs"),
                  prompt_logprobs=prompt, timing=tuple(msg.timing or ()), at_ns=now_ns, fed=fed or ())


def await_death_report(events: queue.SimpleQueue, generation: int, wait_s: float) -> str | None:
    """The backend's report of a dead stage of ring `generation` on `events`, if one arrives within
    `wait_s` (a stage's death breaks its neighbours' connections too, and those receive errors can
    arrive first). Other events are put back, in order."""
    deadline, later, death = time.monotonic() + wait_s, [], None
    while death is None and (left := deadline - time.monotonic()) > 0:
        try:
            kind, payload = events.get(timeout=left)
        except queue.Empty:
            break
        if kind == "error" and payload[0] == generation and not isinstance(payload[1], ReceiverError):
            death = str(payload[1])
        else:
            later.append((kind, payload))
    for event in later:
        events.put(event)
    return death


def start_receivers(channel: Channel, ranks: list[int], *, last_rank: int, events: queue.SimpleQueue,
                    stopping: threading.Event, generation: int = 0, exit_rank: int = -1) -> list[threading.Thread]:
    """One daemon thread per rank in `ranks`, each putting ("event", (generation, engine event)) or
    ("error", (generation, ReceiverError)) on `events`; a channel error while `stopping` is set ends
    the thread quietly. generation: the coordinator's data-plane generation (fail-over drops old ones);
    exit_rank: the exit stage's rank, the only one whose EXIT_GUESS and WITHDRAWN are taken (-1: none)."""
    threads = [threading.Thread(target=_receive_loop,
                                args=(channel, rank, rank == last_rank, events, stopping, generation),
                                kwargs={"is_exit": rank == exit_rank},
                                name=f"receiver-{rank}", daemon=True) for rank in ranks]
    for t in threads:
        t.start()
    return threads


def _receive_loop(channel: Channel, rank: int, is_last: bool, events: queue.SimpleQueue, stopping: threading.Event,
                  generation: int, *, is_exit: bool = False) -> None:
    """Blocking receives from `rank`: RESULTs if it is the last stage, EXIT_GUESS and WITHDRAWN if it
    is the exit stage (WITHDRAWN also if it is the last: fed items stage 0 withdrew); any other kind is an error event."""
    while True:
        try:
            msg = channel.recv(rank)
        except ChannelError as exc:
            if not stopping.is_set():
                events.put(("error", (generation, ReceiverError(str(exc)))))
            return
        if stopping.is_set():
            return  # a fail-over replaced this ring
        decode = {MessageKind.EXIT_GUESS: exit_event if is_exit else None,
                  # fed items stage 0 withdrew reach the coordinator from the last stage ([Note: self-fed decode])
                  MessageKind.WITHDRAWN: withdrawn_event if is_exit or is_last else None,
                  MessageKind.RESULT: result_event if is_last else None}.get(msg.kind)
        if decode is not None:
            try:
                events.put(("event", (generation, decode(msg, now_ns=time.perf_counter_ns()))))
            except Exception as exc:  # any malformed message fences the stage, as a receive error does
                error = exc if isinstance(exc, ReceiverError) else ReceiverError(
                    f"malformed {msg.kind.name} from {rank_name(rank)}: {type(exc).__name__}: {exc}")
                events.put(("error", (generation, error)))
                return
        elif msg.kind == MessageKind.SHUTDOWN:  # from the last stage, and from the exit stage
            return
        elif msg.kind == MessageKind.KEEPALIVE and (is_last or is_exit):  # the ring's, or the exit stage's copy
            continue
        elif msg.kind != MessageKind.RELEASE or not is_last:
            events.put(("error", (generation, ReceiverError(f"unexpected {msg.kind.name} from {rank_name(rank)}"))))
            return
