"""Self-fed decode: the last stage, when it is stage 0, turns the token it just produced into the
next DECODE item itself, without the ring return through the coordinator.

Owns both halves of [Note: self-fed decode]: the coordinator side (`authorise` an item it sends,
`register` the fed item a RESULT announced) and the stage side (`fed_items`: the decision). It
reuses the machinery of [Note: stage-local drafting] in pipeline/engine/local_draft.py: a fed item
is `self_made`, runs next on stage 0 before any other message, is matched to its announcement by
the engine (`Engine._local`), and is withdrawn by PassInterrupted when a RELEASE overtakes it.
Pure: no I/O, no clock. Must not: commit, stop or stream (the coordinator's scheduler alone does),
or feed where the coordinator could choose another token than the stage's argmax.

[Note: self-fed decode]
In plain greedy decode every token makes a ring return: the last stage sends its RESULT to the
coordinator, the engine commits it, checks the stops, streams, and sends the next FORWARD (one
DECODE item with that token) to stage 0: ~2 ms of a ~30 ms token at --stages 1 (README "Handoff
latency"). With `--decode-feed stage` the last stage feeds the next item itself: at --stages 1
(the last stage is stage 0) it runs it next; at --stages >= 2 it sends it straight to stage 0 (6):
1. Authorise. The scheduler marks an item it sends (`authorise`) with `feed_upto` (a fed item may
   start at position s only while s < feed_upto: the last position whose result is still within
   max_tokens, `SequenceLedger.last_item_position` + 1; max_model_len bounds the prompt plus
   max_tokens already) and `feed_stop` (the ids that end the sequence: EOS unless ignore_eos, and
   the request's stop_token_ids, `ends_sequence`), only where the stage cannot get the next token
   wrong and nobody else waits: plain decode (no speculation, no FIRP), a greedy
   request whose logits rows are not needed from the item's result on
   (`SamplingParams.needs_logits_at`: sampling, logprobs, penalties, logit_bias, a grammar,
   allowed ids / bad words, and min_tokens before min_tokens tokens; needs_logits_at only falls
   with the position, so no later fed item needs them either), a DECODE or PREFILL item (not
   want_logits), and it is the only running sequence with nothing waiting for a slot.
2. Feed. After running an authorised item, the last stage takes its result token t (the argmax the
   coordinator will commit) and, unless t is in feed_stop, the fed item would start at
   feed_upto or later, t is NON_FINITE_TOKEN, or a message waits in its inbox, makes the DECODE
   item (start = item.end, same slot and epoch, token t, `self_made`, the same feed fields: the
   chain inherits the authorisation) and runs it next, alone, before any other message (stage 0),
   or sends it to stage 0 at once, before its RESULT (6).
3. Announce. The item's RESULT carries "fed" ([num_items] int64, 1: fed); the engine registers
   the fed micro-batch in flight (`Engine._local`, in `Engine._fed` too) and `register` turns the
   real item the result just queued (`Scheduler._queue_real`) into the fed one in the ledger, as
   if the coordinator had sent it. It commits, stops and streams every token itself, as before.
4. Stop. The coordinator stops a chain by sending anything: a last stage with a message in its
   inbox does not feed (at --stages >= 2 the message reaches it after the stages before it ran it,
   and a message it took since the chain's root counts too, 6(c): a chain goes on for at most a
   pipeline's worth of tokens). A new request is sent at once (a fed micro-batch does not count as filling the
   pipeline, `Engine._live_inflight`), and is not authorised (two running sequences): the chain
   ends after at most one more token (a pipeline's worth), the batches are formed as without this mode, and the
   single sequence left is authorised again. A stop string or an abort finishes the sequence: its
   RELEASE withdraws the running fed item (PassInterrupted between layers, WITHDRAWN, `Withdrawn`),
   or that item's result and any fed item announced after it, of a finished sequence, are ignored
   (`register` refuses it; the engine still matches its result). The coordinator sends a KEEPALIVE
   after `keepalive_s` without a send while fed items are in flight, or stage 0's receive would
   reach its deadline during a long chain ([Note: deadlines] in workers/channel.py); it stops the
   chain for a token.
5. Exact. A fed item is the item the coordinator would have sent: same start, token, slot and
   epoch (`register` checks the queued one), so greedy output is unchanged; it only starts earlier.
6. --stages >= 2: the feed link (`FeedLink` in workers/feed_link.py). The last stage sends the
   fed item straight to stage 0 over the data-plane group (gloo, a pair the group connects at
   start-up like the others), in a FORWARD of its own, and announces it in its RESULT as above.
   (a) Two upstreams: once an authorised item ran there, stage 0 takes its next message from the
       coordinator or the last stage, whichever arrives first (a reader thread per sender, one
       queue: a hand-over costs ~0.1 ms; gloo's receive from any rank cost ~4 ms a message on this
       machine, and a posted gloo receive does not complete until waited for, so it cannot be
       polled). Each sender keeps its own order, with none between the two: a fed item may come
       before or after a coordinator message sent meanwhile.
   (b) Released sequences: a fed item of a sequence whose RELEASE stage 0 has applied is not run
       (its slot may have a new owner) but WITHDRAWN downstream, in order with the work: later
       stages pass it on and the last stage sends it to the coordinator, after the RESULT that
       announced the item (one channel, in order), so the engine matches it as at one stage. A fed
       item that arrives before the RELEASE runs, and the later stages see it before the RELEASE
       too (stage 0's one downstream order), so every stage's KV cache agrees.
   (c) Stopping: the last stage feeds only while it took nothing but the chain's own items since
       the chain's root, the authorised item the coordinator sent (`FeedLink.stops`): at 1 stage
       nothing runs between a fed item and the next, but here another request's items do, one
       between every two of the chain's, and an inbox test would find it empty each time (the
       chain would then run beside them for as long as they ran, never batched with them). A new
       request therefore stops a chain once its first item passed the last stage (4).
   (d) One item: a fed micro-batch holds the one sequence authorised (alone in 1), so withdrawing
       it never stalls a sequence that goes on.
   (e) Deadlines and shutdown: stage 0's reader of the link waits with the deadline too, so the
       last stage copies each KEEPALIVE it passes on to stage 0 and sends one itself after a
       quarter of the deadline without a send (`FeedLink.after`); at SHUTDOWN the last stage sends
       SHUTDOWN on the link and stage 0 drains the link up to it, so no send is left unmatched.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch

from pipeline.engine.records import SchedulerConfig, SequenceState, SpecCounters
from pipeline.speculation.items import Item, ItemKind


# -- coordinator side -------------------------------------------------------------------------------
def authorise(config: SchedulerConfig, seq: SequenceState, item: Item, *, alone: bool) -> Item:
    """`item` (just sent) with the self-fed decode fields when the last stage may feed after it; unchanged
    otherwise (see the note, 1). alone: it is the only running sequence and none waits."""
    if (not config.decode_feed or config.speculate or config.firp_k or not alone
            or item.kind not in (ItemKind.DECODE, ItemKind.PREFILL) or item.want_logits
            or seq.wants_logits(item.end - 1)):
        return item
    upto = seq.ledger.last_item_position + 1
    if item.end >= upto:
        return item
    p = seq.params
    stop = tuple(dict.fromkeys((*(() if p.ignore_eos else config.eos_token_ids), *p.stop_token_ids)))
    return dataclasses.replace(item, feed_upto=upto, feed_stop=stop)


def register(spec: SpecCounters, ready: collections.deque[int], seq: SequenceState | None, parent: Item,
             token: int) -> bool:
    """The last stage fed `token` after `parent` (a RESULT announced it; that result is applied): record
    the fed item in the sequence's ledger in place of the real item the result queued, as if the
    coordinator had sent it (see the note, 3). Returns False, recording nothing, when the sequence
    is gone, finished or at another epoch (the fed item's result will be ignored)."""
    if seq is None or seq.finished or parent.epoch != seq.epoch:
        return False
    pending = seq.pending
    assert (pending is not None and pending.kind == ItemKind.DECODE and pending.start == parent.end
            and pending.token_ids == (token,) and pending.epoch == parent.epoch), (
        f"fed item of seq {seq.seq_id} at {parent.end} does not match the queued {pending}")
    seq.pending = None
    ready.remove(seq.seq_id)
    seq.ledger.add_real(token)
    spec.fed_items += 1
    return True


def result_tokens(items: Sequence[Item], token_ids: torch.Tensor) -> list[int]:
    """Each item's last result row token (the token a fed item after it carries). token_ids:
    [sum of items' num_result_rows] int64 (`Result.token_ids`)."""
    ends, row = [], 0
    for it in items:
        row += it.num_result_rows
        ends.append(row - 1)
    return [int(t) for t in token_ids[ends]] if ends else []


# -- stage side -------------------------------------------------------------------------------------
def fed_items(ran: Sequence[Item], token_ids: torch.Tensor) -> tuple[list[Item], list[int]]:
    """The DECODE items stage 0 runs next (token ids included), and per item of `ran` 1 where one
    follows it, else 0 (see the note, 2). ran: the items that ran, in order; token_ids: their
    result rows' argmax [sum of num_result_rows] int64 (NON_FINITE_TOKEN = -1 for a bad row)."""
    fed, flags = [], [0] * len(ran)
    for i, (it, token) in enumerate(zip(ran, result_tokens(ran, token_ids), strict=True)):
        if not it.feed_upto or token < 0 or token in it.feed_stop or it.end >= it.feed_upto:
            continue
        flags[i] = 1
        fed.append(Item(seq_id=it.seq_id, slot=it.slot, start=it.end, num_tokens=1, epoch=it.epoch,
                        kind=ItemKind.DECODE, token_ids=(token,), want_exit=it.want_exit, self_made=True,
                        feed_upto=it.feed_upto, feed_stop=it.feed_stop))
    return fed, flags
