"""Withdrawal of stale self-made drafts on the exit stage ([Note: stage-local drafting] 6 in
pipeline/engine/local_draft.py), without processes: `StageModel.forward_rows(interrupt=...)`, and
the data-plane loop of stage 0 (workers/stage_loop.py) on the tiny model with a recording channel.

What breaks when these fail: an interrupted pass leaves the KV cache longer than its committed
length, or different keys/values behind, so the next real item's output changes; a draft a squash
made stale still runs to the end and is sent on; a withdrawn draft is sent on *and* withdrawn, or
withdrawn without telling the coordinator (which would then count it in flight forever); a draft
whose sequence is still current is withdrawn.
"""

from __future__ import annotations

import queue
import types

import pytest
import torch

from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import COORDINATOR_RANK, Message, MessageKind, rank_of_stage
from pipeline.model.config import tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import PassInterrupted, Span
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.items import Item, ItemKind, SlotRelease
from tests.tiny_model import random_state_dict
from workers.stage_loop import RELEASED, StageLoop

PROMPT = [11, 22, 33]
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def weights():
    cfg = tiny_config()
    return cfg, random_state_dict(cfg, seed=3, std=0.2)


def _stage0(weights):
    cfg, state = weights
    model = build_stage_model(cfg, LayerRange(0, cfg.num_hidden_layers - 1), is_first=True, is_last=False,
                              tensors=state)
    return model, model.new_kv_cache(max_num_seqs=2, max_model_len=MAX_MODEL_LEN)


# -- the model: an interrupted pass changes nothing the next pass can see ---------------------------------
@pytest.mark.parametrize("stop_after", [0, 1])
def test_an_interrupted_pass_leaves_the_cache_as_it_was(weights, stop_after: int):
    model, kv = _stage0(weights)
    clean_model, clean_kv = _stage0(weights)
    for m, c in ((model, kv), (clean_model, clean_kv)):
        m.forward_rows(torch.tensor(PROMPT), [Span(0, 0, len(PROMPT))], c)
    calls = []

    def interrupt() -> bool:
        calls.append(1)
        return len(calls) > stop_after

    with pytest.raises(PassInterrupted) as info:  # a wrong draft at position 3
        model.forward_rows(torch.tensor([200]), [Span(0, 3, 1)], kv, interrupt=interrupt)
    assert info.value.layers_run == stop_after
    assert kv.lengths[0] == len(PROMPT), "an interrupted pass moved the committed length"
    real = model.forward_rows(torch.tensor([44]), [Span(0, 3, 1)], kv).out  # the real token there
    expected = clean_model.forward_rows(torch.tensor([44]), [Span(0, 3, 1)], clean_kv).out
    assert torch.equal(real, expected)


def test_a_pass_whose_interrupt_stays_false_is_the_plain_pass(weights):
    model, kv = _stage0(weights)
    plain = model.forward_rows(torch.tensor(PROMPT), [Span(0, 0, len(PROMPT))], kv).out
    model2, kv2 = _stage0(weights)
    checked = model2.forward_rows(torch.tensor(PROMPT), [Span(0, 0, len(PROMPT))], kv2, interrupt=lambda: False).out
    assert torch.equal(plain, checked)


# -- the stage loop: a superseded self-made draft is withdrawn, a current one is sent on ------------------
class _Recorder:
    """Stands in for the loop's SendQueue: keeps (kind, destination rank, message) of every send,
    and which sends were deferred ([Note: deferred posts] in workers/send_queue.py)."""

    def __init__(self) -> None:
        self.sent: list[tuple[MessageKind, int, Message]] = []
        self.deferred: list[bool] = []

    def send(self, msg: Message, dst: int, *, defer: bool = False) -> None:
        self.sent.append((msg.kind, dst, msg))
        self.deferred.append(defer)

    def flush(self) -> None:
        pass


def _loop(weights, *, squash_after_layers: int | None):
    """Stage 0 of 2 (exit layer 0) with the prompt cached, and a drafter that makes one draft
    (token 55 at position 4) after the decode item at position 3. The stage's reader thread
    'receives' a squash of the sequence (sets `_newest`) once the draft's pass has run
    `squash_after_layers` layers (0: while the parent ran); None: never."""
    model, kv = _stage0(weights)
    executor = StageExecutor(model, kv, exit_layer=0)
    executor.run([Item(seq_id=7, slot=0, start=0, num_tokens=3, epoch=0, kind=ItemKind.PREFILL,
                       token_ids=tuple(PROMPT))], torch.tensor(PROMPT))
    channel = types.SimpleNamespace(device=torch.device("cpu"), timeout_s=5.0, label="")
    loop = StageLoop(executor=executor, channel=channel, stage_index=0, num_stages=2)
    loop.sends = _Recorder()
    draft = Item(seq_id=7, slot=0, start=4, num_tokens=1, epoch=0, kind=ItemKind.DRAFT, token_ids=(55,),
                 self_made=True)
    made = [([draft], [55], [-1])]

    def drafts(ran, tokens, probs):
        if not made:
            return [], [-1] * len(ran), [-1] * len(ran)
        if squash_after_layers == 0:
            loop._newest[7] = 1
        return made.pop()

    loop.drafter.drafts = drafts
    if squash_after_layers:
        def squash(*_):
            if executor.kv.lengths[0] == 4:  # the parent is in: this is the draft's pass
                loop._newest[7] = 1
        model.layers[str(squash_after_layers - 1)].register_forward_hook(squash)
    return loop, executor


def _parent() -> Message:
    parent = Item(seq_id=7, slot=0, start=3, num_tokens=1, epoch=0, kind=ItemKind.DECODE, token_ids=(44,))
    return Message(MessageKind.FORWARD, [parent], {"x": torch.tensor([44])}, [])


@pytest.mark.parametrize("after_layers", [0, 1])
def test_a_self_made_draft_a_squash_made_stale_is_withdrawn_not_sent_on(weights, after_layers: int):
    loop, executor = _loop(weights, squash_after_layers=after_layers)
    loop._run_forward(_parent())
    kinds = [(kind, dst) for kind, dst, _ in loop.sends.sent]
    assert kinds == [(MessageKind.EXIT_GUESS, COORDINATOR_RANK), (MessageKind.FORWARD, rank_of_stage(1)),
                     (MessageKind.WITHDRAWN, COORDINATOR_RANK)], kinds
    withdrawn = loop.sends.sent[-1][2]
    assert [(it.seq_id, it.start, it.epoch, it.self_made) for it in withdrawn.items] == [(7, 4, 0, True)]
    assert [t.stage for t in withdrawn.timing] == [0], "the stopped pass's stage time was not reported"
    assert executor.kv.lengths[0] == 4, "the withdrawn draft moved the committed length"
    assert loop.sends.deferred == [True, True, False], "the parent's sends held up the draft after it"


def test_a_current_self_made_draft_runs_and_is_sent_on(weights):
    loop, executor = _loop(weights, squash_after_layers=None)
    loop._run_forward(_parent())
    kinds = [(kind, dst) for kind, dst, _ in loop.sends.sent]
    assert kinds == [(MessageKind.EXIT_GUESS, COORDINATOR_RANK), (MessageKind.FORWARD, rank_of_stage(1))] * 2, kinds
    assert executor.kv.lengths[0] == 5
    assert loop.sends.deferred == [True, True, False, False], "only the sends of a pass a draft follows wait"


def test_a_release_supersedes_every_epoch(weights):
    loop, _ = _loop(weights, squash_after_layers=None)
    draft = Item(seq_id=7, slot=0, start=4, num_tokens=1, epoch=3, kind=ItemKind.DRAFT, self_made=True)
    assert not loop._superseded([draft])
    loop._newest[7] = 3
    assert not loop._superseded([draft]), "the draft's own epoch is current"
    loop._newest[7] = RELEASED
    assert loop._superseded([draft])
    other = Item(seq_id=8, slot=1, start=2, num_tokens=1, epoch=0, kind=ItemKind.DRAFT, self_made=True)
    assert not loop._superseded([draft, other]), "one current sequence keeps a micro-batch running"


# -- the coordinator's side of the wire ---------------------------------------------------------------------
def test_a_withdrawn_message_crosses_the_wire_and_becomes_the_engine_event():
    from launcher.coordinator.stage_receivers import ReceiverError, withdrawn_event
    from pipeline.engine.events import Withdrawn
    from pipeline.engine.wire import decode_header, encode_header
    from pipeline.measure.timeline import StageTiming

    draft = Item(seq_id=7, slot=0, start=4, num_tokens=1, epoch=2, kind=ItemKind.DRAFT, self_made=True)
    frame, _ = encode_header(Message(MessageKind.WITHDRAWN, [draft], {}, [StageTiming(0, 10, 20)]), frame_bytes=1 << 16)
    header = decode_header(frame, max_payload_bytes=1 << 16)
    assert header.kind == MessageKind.WITHDRAWN
    msg = Message(header.kind, header.items, {}, header.timing)
    event = withdrawn_event(msg, now_ns=5)
    assert isinstance(event, Withdrawn) and event.items == (draft,) and event.timing[0].end_ns == 20
    with pytest.raises(ReceiverError, match="WITHDRAWN"):
        withdrawn_event(Message(MessageKind.WITHDRAWN, [Item(**{**draft.__dict__, "self_made": False})], {}), now_ns=5)
    with pytest.raises(ReceiverError, match="WITHDRAWN"):
        withdrawn_event(Message(MessageKind.WITHDRAWN, [], {}), now_ns=5)


def test_a_deep_draft_bar_outside_0_1_exits_2_naming_the_flag(capsys):
    from launcher.cli.main import main

    assert main(["launch", "--speculate", "speed", "--draft-at", "stage", "--deep-draft-min-acceptance", "1.5",
                 "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--deep-draft-min-acceptance must be in [0, 1]" in err, err


def test_the_reader_thread_records_newer_epochs_and_releases_and_the_loop_forgets_released_ones(weights):
    """What `_superseded` reads is filled by the reader thread from the messages it receives."""
    loop, _ = _loop(weights, squash_after_layers=None)
    draft = Item(seq_id=7, slot=0, start=4, num_tokens=1, epoch=0, kind=ItemKind.DRAFT, self_made=True)
    other = Item(seq_id=8, slot=1, start=2, num_tokens=1, epoch=0, kind=ItemKind.DRAFT, self_made=True)
    incoming = [Message(MessageKind.FORWARD, [Item(seq_id=7, slot=0, start=4, num_tokens=1, epoch=2)],
                        {"x": torch.tensor([1])}),
                Message(MessageKind.RELEASE, [], {}, None, [SlotRelease(seq_id=8, slot=1)]),
                Message(MessageKind.SHUTDOWN)]
    loop.channel = types.SimpleNamespace(recv=lambda rank: incoming.pop(0))
    loop._inbox = queue.Queue()
    loop._read()
    assert loop._superseded([draft]) and loop._superseded([other]) and loop._superseded([draft, other])
    assert [loop._inbox.get().kind for _ in range(3)] == [MessageKind.FORWARD, MessageKind.RELEASE, MessageKind.SHUTDOWN]
    loop._inbox.put(Message(MessageKind.RELEASE, [], {}, None, [SlotRelease(seq_id=8, slot=1)]))
    loop._inbox.put(Message(MessageKind.SHUTDOWN))
    loop.run()
    assert 8 not in loop._newest, "a released sequence stays in the reader's table for ever"
