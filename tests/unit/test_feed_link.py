"""The feed link of self-fed decode at --stages >= 2 ([Note: self-fed decode] 6 in
pipeline/engine/decode_feed.py), without processes: the data-plane loops of stage 0 and of the last
stage (workers/stage_loop.py) on the tiny model, with a scripted channel and a recording send queue.

What breaks when these fail: the last stage keeps a fed item to itself or sends it to the
coordinator instead of stage 0, sends it after its RESULT (the fed item then waits on the
coordinator's link), feeds while a message waits or after it took one between the chain's items
(a chain the coordinator cannot stop: it runs beside another request for as long as that runs), or forgets
to announce it (the coordinator waits for a result it never counted); stage 0 runs a fed item of a
sequence released meanwhile (in a KV slot that may already hold the next request) or drops it
without a WITHDRAWN (the coordinator counts it in flight for ever); a later stage refuses the
WITHDRAWN instead of passing it on; stage 0 times out on an idle feed link (no keepalive).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import COORDINATOR_RANK, Message, MessageKind, rank_of_stage
from pipeline.model.config import tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.items import Item, ItemKind, SlotRelease
from tests.tiny_model import random_state_dict
from workers.channel import ChannelError
from workers.stage_loop import StageLoop

PROMPT = (11, 22, 33)
WAIT_S = 10.0


@pytest.fixture(scope="module")
def weights():
    cfg = tiny_config()
    return cfg, random_state_dict(cfg, seed=5, std=0.2)


class _Channel:
    """Scripted receives (`put`) in arrival order, per source rank, each waiting up to WAIT_S like a
    real deadline."""

    def __init__(self) -> None:
        self.device, self.timeout_s, self.label = torch.device("cpu"), 60.0, ""
        self.arrived: list[tuple[int, Message]] = []
        self.cond = threading.Condition()

    def put(self, src: int, msg: Message) -> None:
        with self.cond:
            self.arrived.append((src, msg))
            self.cond.notify_all()

    def recv(self, src: int) -> Message:
        with self.cond:
            if not self.cond.wait_for(lambda: self._first(src) is not None, timeout=WAIT_S):
                raise ChannelError(f"nothing from rank {src}")
            return self.arrived.pop(self._first(src))[1]

    def _first(self, src: int) -> int | None:
        return next((i for i, (s, _) in enumerate(self.arrived) if s == src), None)


class _Recorder:
    """Stands in for the loop's SendQueue: (kind, destination, message) of every send, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[MessageKind, int, Message]] = []

    def send(self, msg: Message, dst: int, *, defer: bool = False) -> None:
        self.sent.append((msg.kind, dst, msg))

    def flush(self) -> None:
        pass

    def wait_for(self, kind: MessageKind, dst: int) -> Message:
        deadline = time.monotonic() + WAIT_S
        while not (found := [m for k, d, m in self.sent if (k, d) == (kind, dst)]):
            assert time.monotonic() < deadline, f"no {kind.name} to rank {dst}; sent {self.kinds()}"
            time.sleep(0.005)
        return found[-1]

    def kinds(self) -> list[tuple[MessageKind, int]]:
        return [(k, d) for k, d, _ in self.sent]


def _loop(weights, stage_index: int, num_stages: int = 2) -> tuple[StageLoop, _Channel]:
    """The loop of `stage_index` of `num_stages` (half the tiny model each), seq 7's prompt in slot 0."""
    cfg, state = weights
    half = cfg.num_hidden_layers // 2
    layers = LayerRange(0, half - 1) if stage_index == 0 else LayerRange(half, cfg.num_hidden_layers - 1)
    model = build_stage_model(cfg, layers, is_first=stage_index == 0, is_last=stage_index == num_stages - 1,
                              tensors=state)
    executor = StageExecutor(model, model.new_kv_cache(max_num_seqs=2, max_model_len=32))
    x = torch.tensor(PROMPT) if stage_index == 0 else torch.randn(len(PROMPT), cfg.hidden_size)
    executor.run([Item(seq_id=7, slot=0, start=0, num_tokens=3, epoch=0, kind=ItemKind.PREFILL,
                       token_ids=PROMPT)], x)
    channel = _Channel()
    loop = StageLoop(executor=executor, channel=channel, stage_index=stage_index, num_stages=num_stages)
    loop.sends = _Recorder()
    return loop, channel


def _decode(start: int = 3, token: int = 44, *, fed: bool = False) -> Item:
    """Seq 7's authorised DECODE item at `start` (fed: one the last stage made, `self_made`)."""
    return Item(seq_id=7, slot=0, start=start, num_tokens=1, epoch=0, kind=ItemKind.DECODE, token_ids=(token,),
                self_made=fed, feed_upto=20, feed_stop=(0,))


def _forward(item: Item, x: torch.Tensor) -> Message:
    return Message(MessageKind.FORWARD, [item.without_tokens()], {"x": x}, None)


# -- the last stage: it feeds stage 0 straight over the link --------------------------------------------
def test_the_last_stage_sends_the_fed_item_to_stage_0_before_its_result_announces_it(weights):
    loop, channel = _loop(weights, 1)
    channel.put(rank_of_stage(0), _forward(_decode(), torch.randn(1, weights[0].hidden_size)))
    loop._run_forward(loop._recv())
    assert loop.sends.kinds() == [(MessageKind.FORWARD, rank_of_stage(0)), (MessageKind.RESULT, COORDINATOR_RANK)]
    fed_msg, result = loop.sends.sent[0][2], loop.sends.sent[1][2]
    token = int(result.tensors["token_ids"][-1])
    assert result.tensors["fed"].tolist() == [1]
    (fed,) = fed_msg.items
    assert (fed.seq_id, fed.slot, fed.start, fed.epoch, fed.self_made, fed.feed_upto, fed.feed_stop) == (
        7, 0, 4, 0, True, 20, (0,))
    assert fed_msg.tensors["x"].tolist() == [token]


def test_the_last_stage_keeps_the_link_within_stage_0s_deadline_once_it_is_on(weights):
    """Stage 0 reads the link with the deadline: once on, the last stage copies each KEEPALIVE there
    and sends one itself after a quarter of the deadline without a send; before, nothing."""
    loop, channel = _loop(weights, 1)
    loop.link.after(MessageKind.KEEPALIVE, loop.sends)
    assert loop.sends.sent == [], "a last stage whose link is off sent on it"
    channel.put(rank_of_stage(0), _forward(_decode(), torch.randn(1, weights[0].hidden_size)))
    loop._run_forward(loop._recv())
    n = len(loop.sends.sent)
    loop.link.after(None, loop.sends)
    assert len(loop.sends.sent) == n, "a keepalive right after the fed item"
    loop.link.after(MessageKind.KEEPALIVE, loop.sends)
    loop.link._sent_s -= loop.channel.timeout_s  # a quarter of the deadline has passed since
    loop.link.after(None, loop.sends)
    assert loop.sends.kinds()[n:] == [(MessageKind.KEEPALIVE, rank_of_stage(0))] * 2


def test_the_last_stage_stops_feeding_once_it_took_another_message_between_the_chain_items(weights):
    """A message the coordinator sent that the last stage took between two items of a chain (here a
    KEEPALIVE; another request's FORWARD alike) ends the chain, though nothing waits when the next
    item has run; the coordinator's next authorised item (a root) starts a chain again."""
    loop, channel = _loop(weights, 1)
    hidden = weights[0].hidden_size
    channel.put(rank_of_stage(0), _forward(_decode(), torch.randn(1, hidden)))
    loop._run_forward(loop._recv())
    assert loop.sends.kinds()[0] == (MessageKind.FORWARD, rank_of_stage(0))
    channel.put(rank_of_stage(0), Message(MessageKind.KEEPALIVE))
    assert loop._recv().kind == MessageKind.KEEPALIVE
    channel.put(rank_of_stage(0), _forward(_decode(4, 55, fed=True), torch.randn(1, hidden)))
    loop._run_forward(loop._recv())  # nothing waits now
    assert loop.sends.kinds()[2:] == [(MessageKind.RESULT, COORDINATOR_RANK)], "the chain went on"
    assert "fed" not in loop.sends.sent[-1][2].tensors
    channel.put(rank_of_stage(0), _forward(_decode(5, 66), torch.randn(1, hidden)))  # a root again
    loop._run_forward(loop._recv())
    assert loop.sends.kinds()[3:] == [(MessageKind.FORWARD, rank_of_stage(0)), (MessageKind.RESULT, COORDINATOR_RANK)]


def test_the_last_stage_ends_the_link_at_shutdown_only_once_it_was_on(weights):
    for on in (False, True):
        loop, channel = _loop(weights, 1)
        if on:
            loop.link.saw([_decode()])
        channel.put(rank_of_stage(0), Message(MessageKind.SHUTDOWN))
        loop.run()
        expected = [(MessageKind.SHUTDOWN, COORDINATOR_RANK)] + [(MessageKind.SHUTDOWN, rank_of_stage(0))] * on
        assert loop.sends.kinds() == expected, on


@pytest.mark.parametrize("stage_index", [1, 2])
def test_later_stages_pass_a_withdrawn_fed_item_on(weights, stage_index: int):
    loop, channel = _loop(weights, stage_index, num_stages=3)
    withdrawn = Message(MessageKind.WITHDRAWN, [_decode(4, fed=True)], {}, None)
    for msg in (withdrawn, Message(MessageKind.SHUTDOWN)):
        channel.put(rank_of_stage(stage_index - 1), msg)
    loop.run()
    assert loop.sends.kinds()[0] == (MessageKind.WITHDRAWN, loop.next_rank)
    assert loop.sends.sent[0][2] is withdrawn


# -- stage 0: it reads the link, and withdraws a fed item of a released sequence ----------------------------
def _run_stage0(weights, *, release_first: bool, stray: bool = False) -> tuple[StageLoop, list[tuple]]:
    """Stage 0 of 2 runs seq 7's authorised decode item from the coordinator, then (after a RELEASE
    of seq 7 when `release_first`) the fed item from the link, then SHUTDOWN (with one more fed item
    on the link before the link's SHUTDOWN when `stray`); returns the loop and what it ran."""
    loop, channel = _loop(weights, 0)
    ran, run = [], loop.executor.run
    loop.executor.run = lambda items, *a, **k: ran.append([(it.seq_id, it.start) for it in items]) or run(items, *a, **k)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    channel.put(COORDINATOR_RANK, _forward(_decode(), torch.tensor([44])))
    loop.sends.wait_for(MessageKind.FORWARD, rank_of_stage(1))
    if release_first:
        channel.put(COORDINATOR_RANK, Message(MessageKind.RELEASE, releases=[SlotRelease(seq_id=7, slot=0)]))
        loop.sends.wait_for(MessageKind.RELEASE, rank_of_stage(1))
    channel.put(rank_of_stage(1), _forward(_decode(4, 55, fed=True), torch.tensor([55])))
    deadline = time.monotonic() + WAIT_S
    while len(loop.sends.sent) < 2 + release_first:
        assert time.monotonic() < deadline, loop.sends.kinds()
        time.sleep(0.005)
    channel.put(COORDINATOR_RANK, Message(MessageKind.SHUTDOWN))
    loop.sends.wait_for(MessageKind.SHUTDOWN, rank_of_stage(1))  # stage 0 drains the link from now on
    if stray:
        channel.put(rank_of_stage(1), _forward(_decode(5, 66, fed=True), torch.tensor([66])))
    channel.put(rank_of_stage(1), Message(MessageKind.SHUTDOWN))
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert not channel.arrived, "the link was not drained to its SHUTDOWN"
    return loop, ran


def test_stage_0_runs_a_fed_item_from_the_link_and_sends_it_on(weights):
    loop, ran = _run_stage0(weights, release_first=False)
    assert ran == [[(7, 3)], [(7, 4)]]
    forwards = [m for k, _, m in loop.sends.sent if k == MessageKind.FORWARD]
    assert [(it.start, it.self_made) for m in forwards for it in m.items] == [(3, False), (4, True)]
    assert loop.executor.kv.lengths[0] == 5


def test_stage_0_withdraws_a_fed_item_of_a_released_sequence_downstream_instead_of_running_it(weights):
    loop, ran = _run_stage0(weights, release_first=True)
    assert ran == [[(7, 3)]], "a fed item of a released sequence ran (its slot may have a new owner)"
    kinds = loop.sends.kinds()
    assert kinds[:3] == [(MessageKind.FORWARD, rank_of_stage(1)), (MessageKind.RELEASE, rank_of_stage(1)),
                         (MessageKind.WITHDRAWN, rank_of_stage(1))], kinds
    (withdrawn,) = loop.sends.sent[2][2].items
    assert (withdrawn.seq_id, withdrawn.start, withdrawn.epoch, withdrawn.self_made) == (7, 4, 0, True)


def test_stage_0_drops_what_the_link_carries_after_shutdown(weights):
    loop, ran = _run_stage0(weights, release_first=False, stray=True)
    assert ran == [[(7, 3)], [(7, 4)]], "a fed item that arrived after SHUTDOWN ran"
    assert loop.sends.kinds()[-1] == (MessageKind.SHUTDOWN, rank_of_stage(1))
