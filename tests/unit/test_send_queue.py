"""`SendQueue` (workers/send_queue.py): messages to a rank arrive in the order they were queued,
whole, in both modes (posted gloo sends, and the send thread); the caller never
waits for its receiver up to `max_queued` messages; a full queue and a dead receiver are
ChannelErrors naming the peer ([Note: background sends], [Note: posted sends]).

What breaks when these fail: in-band squash relies on per-destination order (a stale draft
overtaking its squash corrupts a stage's KV cache), a stage that blocks on a busy neighbour puts
the next draft on the critical path, and a dead stage hangs the coordinator instead of failing.
Two ranks of one gloo group live in one process here (a thread per rank).
"""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.engine.wire import Message, MessageKind
from pipeline.speculation.items import Item, ItemKind
from workers.channel import Channel, ChannelError, DataPlaneGroup, hold_listener
from workers.send_queue import SendQueue

FRAME = 4096  # small frames: the big messages below need their separate payload message


def _pair(timeout_s: float) -> tuple[Channel, Channel]:
    """Channels of rank 0 and rank 1 of one fresh 2-rank group on loopback."""
    port = hold_listener("127.0.0.1")
    groups: dict[int, DataPlaneGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = DataPlaneGroup(master_addr="127.0.0.1", master_port=port, rank=rank, world_size=2,
                                      timeout_s=timeout_s, connect_timeout_s=20)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert set(groups) == {0, 1}, "rendezvous failed"
    return tuple(Channel(groups[r], timeout_s=timeout_s, frame_bytes=FRAME) for r in (0, 1))


def _message(i: int) -> Message:
    """Message i: a decode item at position i; every third one too big for its frame."""
    rows = 8 if i % 3 == 0 else 1
    item = Item(seq_id=i, slot=0, start=i, num_tokens=1, kind=ItemKind.DECODE)
    return Message(MessageKind.FORWARD, [item], {"x": torch.full((rows, 300), float(i))})


@pytest.fixture(params=[True, False], ids=["posted", "send-thread"])
def posted(request) -> bool:
    return request.param


@pytest.mark.timeout(60)
def test_messages_arrive_in_order_and_whole_while_the_receiver_starts_late(posted):
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=4, posted=posted)
    got: list[Message] = []
    started = threading.Event()

    def receive() -> None:
        started.wait(10)
        got.extend(receiver.recv(0) for _ in range(30))

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    for i in range(4):  # up to max_queued: queued without a receiver
        queue.send(_message(i), 1)
    started.set()
    for i in range(4, 30):
        queue.send(_message(i), 1)
    queue.flush()
    thread.join(timeout=30)
    assert [m.items[0].start for m in got] == list(range(30))
    for i, m in enumerate(got):
        assert torch.equal(m.tensors["x"], _message(i).tensors["x"])
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_a_full_queue_is_a_channel_error_naming_the_peer_after_the_deadline(posted):
    sender, receiver = _pair(timeout_s=1.5)
    queue = SendQueue(sender, max_queued=2, posted=posted)
    queue.send(_message(1), 1)
    queue.send(_message(2), 1)  # nobody receives: both wait
    with pytest.raises(ChannelError, match="stage 0|send queue to|timed out"):
        queue.send(_message(4), 1)
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_never_takes_the_message_fails_the_next_send_or_flush(posted):
    sender, receiver = _pair(timeout_s=1.5)
    queue = SendQueue(sender, max_queued=4, posted=posted)
    queue.send(_message(1), 1)  # returns at once; the send itself times out in the background
    with pytest.raises(ChannelError, match="stage 0"):
        queue.flush()
    with pytest.raises(ChannelError):
        queue.send(_message(2), 1)
    # kept as text, not as the exception: its frames would hold the failed work, and through it the
    # group a fail-over replaces (ports leak until the process exits)
    assert isinstance(queue._error, str)
    assert all(not lane.pending for lane in queue._lanes.values())
    sender.group.close()
    receiver.group.close()


def test_posting_refuses_tensors_on_an_accelerator():
    class FakeDevice:
        type = "cuda"

    class FakeTensor:
        device = FakeDevice()

    channel = Channel.__new__(Channel)
    with pytest.raises(ValueError, match="CPU tensors"):
        channel.post(Message(MessageKind.FORWARD, [], {"x": FakeTensor()}), 1)


@pytest.mark.timeout(60)
def test_abandon_drops_every_posted_send_and_fails_later_sends():
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=4, posted=True)
    for i in range(3):  # nobody receives: all three stay posted
        queue.send(_message(i), 1)
    assert sum(len(lane.pending) for lane in queue._lanes.values()) == 3
    lanes = list(queue._lanes.values())
    queue.abandon()
    assert all(not lane.pending for lane in lanes)  # no work keeps the group alive
    with pytest.raises(ChannelError, match="abandoned"):
        queue.send(_message(3), 1)
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_posted_sends_keep_at_most_max_kept_bytes_of_buffers(monkeypatch):
    monkeypatch.setattr("workers.send_queue.MAX_KEPT_BYTES", 10_000)
    sender, receiver = _pair(timeout_s=1.5)
    queue = SendQueue(sender, max_queued=8, posted=True)
    queue.send(_message(0), 1)  # 8 x 300 float32 rows: a 9.6 KB payload after its frame, kept
    with pytest.raises(ChannelError, match="stage 0"):  # over the byte bound: waits for it, in vain
        queue.send(_message(3), 1)
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_deferred_and_direct_sends_to_one_rank_arrive_in_the_order_they_were_queued():
    """[Note: deferred posts]: a deferred message is posted by the destination's post thread; a
    direct send queued after it must not overtake it (in-band squash relies on the order)."""
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=4, posted=True)
    got: list[Message] = []
    thread = threading.Thread(target=lambda: got.extend(receiver.recv(0) for _ in range(40)), daemon=True)
    thread.start()
    for i in range(40):
        queue.send(_message(i), 1, defer=i % 5 in (0, 1, 3))  # runs of deferred and direct sends
    queue.flush()
    thread.join(timeout=30)
    assert [m.items[0].start for m in got] == list(range(40))
    for i, m in enumerate(got):
        assert torch.equal(m.tensors["x"], _message(i).tensors["x"])
    assert all(not lane.deferred for lane in queue._lanes.values())
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_a_deferred_send_returns_before_it_is_posted_and_flush_waits_for_it():
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=4, posted=True)
    lane = queue._lane(1)
    with lane.cond:  # the post thread cannot take the lock: the message stays deferred
        queue.send(_message(1), 1, defer=True)
        assert [m.items[0].start for m in lane.deferred] == [1] and not lane.pending
    got = []
    thread = threading.Thread(target=lambda: got.append(receiver.recv(0)), daemon=True)
    thread.start()
    queue.flush()
    thread.join(timeout=30)
    assert [m.items[0].start for m in got] == [1]
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_abandon_drops_deferred_messages_and_stops_the_post_thread():
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=4, posted=True)
    lane = queue._lane(1)
    with lane.cond:
        for i in range(3):
            queue.send(_message(i), 1, defer=True)
    for _ in range(200):  # nobody receives: posted, they stay pending
        if not lane.deferred:
            break
        threading.Event().wait(0.01)
    queue.abandon()
    lane.thread.join(timeout=5)
    assert not lane.thread.is_alive() and not lane.deferred and not lane.pending
    with pytest.raises(ChannelError, match="abandoned"):
        queue.send(_message(3), 1, defer=True)
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_a_deferred_message_that_cannot_be_framed_fails_the_next_send_instead_of_hanging():
    sender, receiver = _pair(timeout_s=5)
    queue = SendQueue(sender, max_queued=4, posted=True)
    too_many = [Item(seq_id=i, slot=0, start=i, num_tokens=1, kind=ItemKind.DECODE) for i in range(2000)]
    queue.send(Message(MessageKind.FORWARD, too_many, {}), 1, defer=True)  # its header outgrows the frame
    for _ in range(500):  # the post thread fails it at once
        if queue._error is not None:
            break
        threading.Event().wait(0.01)
    assert queue._error is not None and not queue._lanes[1].deferred
    with pytest.raises(ChannelError, match="deferred send"):
        queue.send(_message(1), 1)
    sender.group.close()
    receiver.group.close()


@pytest.mark.timeout(60)
def test_flush_gives_each_deferred_message_its_own_deadline():
    """Five deferred messages, each posted 0.4 s after the last, with a 1.2 s channel deadline: the
    FIFO drains in 2 s, yet no message waited longer than its deadline, so flush succeeds (one
    deadline for the whole FIFO raised here)."""
    sender, receiver = _pair(timeout_s=20)
    queue = SendQueue(sender, max_queued=8, posted=True)
    sender.timeout_s = 1.2
    lane = queue._lane(1)
    posted_starts = []

    def slow_post(lane_, msg, dst):  # lets go of the lane while "posting", as a gloo post waiting would
        lane_.cond.wait(0.4)
        posted_starts.append(msg.items[0].start)

    queue._post = slow_post
    with lane.cond:
        for i in (1, 2, 4, 5, 7):
            queue.send(_message(i), 1, defer=True)
    queue.flush()
    assert posted_starts == [1, 2, 4, 5, 7] and not lane.deferred
    sender.group.close()
    receiver.group.close()
