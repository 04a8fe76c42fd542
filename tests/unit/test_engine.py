"""The one engine (pipeline/engine/engine.py), as the simulator and as the coordinator drive it.

What breaks when these fail: the coordinator and the simulator no longer run the same engine the
same way, so simulated studies stop predicting the runtime: the same events give other sends or
other commits once they travel as data-plane messages and come back through the coordinator's
receivers (launcher/coordinator/stage_receivers.py), or an event trace with drafts and a squash commits
tokens that the model did not produce.

The trace: a simulated run (pipeline/engine/simulator.py) of a few sequences with speculation, whose
replayed draft outcomes include rejections, recorded as the list of `Engine.step` calls (events
and outputs). It is replayed into a fresh engine the way the coordinator feeds its own: every
result and exit event is encoded as the RESULT / EXIT_GUESS message a stage sends, decoded as the
coordinator's channel does, and turned back into an event by the coordinator's receiver code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.coordinator.stage_receivers import exit_event, result_event
from pipeline.engine.engine import Engine
from pipeline.engine.events import ExitPassed, Result, StepOutput
from pipeline.engine.simulator import CostModel, Replay, SimConfig, SimPredictor, Simulator, true_token
from pipeline.engine.wire import (
    Message,
    MessageKind,
    decode_header,
    encode_header,
    header_end,
    inline_tensors,
)

OUTCOMES = (True, True, False, True, True, True, False)  # the simulated predictor's draft outcomes, cyclic
FRAME_BYTES = 1 << 16


@dataclasses.dataclass
class Recorded:
    """One `Engine.step` call of the simulated run."""

    events: list
    now_ns: int
    out: StepOutput


def _record() -> tuple[Simulator, list[Recorded]]:
    """Run the simulator with its engine's steps recorded."""
    # 3 sequences on 4 stages leave a stage slot idle for drafts; uneven stage costs and a hop
    # latency make the sequences drift apart.
    cfg = SimConfig(num_stages=4, prompt_lens=(3, 5, 2), max_new_tokens=9, speculate=True)
    cost = CostModel(stage_base_s=(1.0e-3, 1.3e-3, 0.7e-3, 0.9e-3), stage_per_token_s=(1e-5,) * 4,
                     hop_latency_s=1e-4)
    sim = Simulator(cfg, cost, acceptance=Replay(OUTCOMES))
    steps: list[Recorded] = []
    step = sim.engine.step

    def recording_step(events=(), now_ns=0):
        out = step(events, now_ns)
        steps.append(Recorded(list(events), now_ns, out))
        return out

    sim.engine.step = recording_step
    sim.run()
    return sim, steps


def _over_the_wire(msg: Message) -> Message:
    """`msg` encoded as a stage sends it and decoded as the coordinator's channel does (inline)."""
    frame, inline = encode_header(msg, frame_bytes=FRAME_BYTES)
    assert inline, "the test's messages fit one frame"
    header = decode_header(memoryview(bytes(frame)), max_payload_bytes=FRAME_BYTES)
    tensors = inline_tensors(bytes(frame), header_end(frame), header)
    return Message(header.kind, header.items, tensors, header.timing, header.releases)


def _as_the_coordinator_sees_it(event):
    """A simulated Result / ExitPassed as a stage's message, back through the coordinator's receiver."""
    if isinstance(event, Result):
        msg = Message(MessageKind.RESULT, [it.without_tokens() for it in event.items],
                      {"token_ids": event.token_ids}, list(event.timing))
        return result_event(_over_the_wire(msg), now_ns=event.at_ns)
    if isinstance(event, ExitPassed):  # the simulated exit stage has no head: no guess tensors
        assert all(g is None for g in event.guesses)
        msg = Message(MessageKind.EXIT_GUESS, [it.without_tokens() for it in event.items], {}, None)
        return exit_event(_over_the_wire(msg), now_ns=event.at_ns)
    return event  # Submit: the coordinator builds it from the request (launcher/coordinator/coordinator.py)


def _commits_by_seq(commits) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in commits:
        out.setdefault(c.seq_id, []).extend(c.token_ids)
    return out


def test_the_recorded_trace_has_sequences_drafts_and_a_squash():
    sim, steps = _record()
    spec = sim.engine.spec
    assert len({c.seq_id for s in steps for c in s.out.commits}) == 3
    assert spec.drafted_tokens >= 3 and spec.accepted_tokens >= 1, spec
    assert spec.squashed_items >= 1 and spec.verified_drafts > spec.accepted_tokens, "no squash in the trace"
    assert any(isinstance(e, ExitPassed) for s in steps for e in s.events)


def test_one_trace_gives_the_same_sends_and_commits_as_the_coordinator_and_the_simulator_feed_it():
    sim, steps = _record()
    engine = Engine(sim.engine.scheduler.config, SimPredictor(Replay(OUTCOMES)))
    replayed = []
    for step in steps:
        out = engine.step([_as_the_coordinator_sees_it(e) for e in step.events], step.now_ns)
        assert out.sends == step.out.sends, f"other micro-batches at t={step.now_ns} ns"
        assert list(out.releases) == list(step.out.releases)
        replayed.extend(out.commits)
    recorded = [c for s in steps for c in s.out.commits]
    assert replayed == recorded
    assert engine.spec == sim.engine.spec, "other drafts, verifies or squashes"
    prompt_lens = sim.config.prompt_lens
    want = {i: [true_token(i, n + k) for k in range(sim.config.max_new_tokens)] for i, n in enumerate(prompt_lens)}
    assert _commits_by_seq(replayed) == want, "the trace committed tokens the simulated model did not produce"
    assert engine.num_sequences == 0 and engine.num_inflight == 0


def test_the_timeline_is_recorded_alike_from_both_feeds():
    sim, steps = _record()
    engine = Engine(sim.engine.scheduler.config, SimPredictor(Replay(OUTCOMES)))
    for step in steps:
        engine.step([_as_the_coordinator_sees_it(e) for e in step.events], step.now_ns)
    assert [s.to_json() for s in engine.timeline.slices] == [s.to_json() for s in sim.engine.timeline.slices]
    assert engine.timeline.wasted_ns == sim.engine.timeline.wasted_ns and any(engine.timeline.wasted_ns)


def test_a_result_token_tensor_survives_the_wire_exactly():
    tokens = torch.tensor([3, 49_999, 17], dtype=torch.int64)
    msg = _over_the_wire(Message(MessageKind.RESULT, [], {"token_ids": tokens}, []))
    assert torch.equal(msg.tensors["token_ids"], tokens) and msg.timing == []


def test_a_calibrated_table_prices_the_token_tree_too():
    """`Engine.use_row_costs` (the `--row-cost calibrate` table, arriving after the engine exists)
    reaches the token tree's sibling decision, as a table given at construction does."""
    from pipeline.engine.records import SchedulerConfig
    from pipeline.measure.row_cost import RowCostTable
    from pipeline.speculation.predictors import LogitLensPredictor

    table = RowCostTable(mode="fp32", num_rows=(1, 2, 4, 8), pass_s=(1.0, 1.7, 3.0, 5.0))  # a 2nd row: +70 %
    cfg = SchedulerConfig(num_stages=2, max_num_seqs=2, max_model_len=64, eos_token_ids=(0,), speculate=True,
                          draft_tree=3)
    engine = Engine(cfg, LogitLensPredictor())
    engine.use_row_costs(table)
    at_start = Engine(dataclasses.replace(cfg, row_costs=table), LogitLensPredictor()).scheduler.tree
    assert engine.scheduler.tree.row_costs is table
    assert [engine.scheduler.tree.worth_sending(r) for r in (1, 2)] == [at_start.worth_sending(r) for r in (1, 2)]
    assert not engine.scheduler.tree.worth_sending(1)  # this table says the sibling row costs more than it saves


# -- EXIT_GUESS / RESULT decoding in the coordinator's receivers ---------------------------------------
def _exit_msg(num_items: int, **tensors) -> Message:
    from pipeline.speculation.items import Item
    items = [Item(seq_id=i, slot=i, start=5, num_tokens=1, exit_top_k=3) for i in range(num_items)]
    return Message(MessageKind.EXIT_GUESS, items, tensors, None)


GOOD_EXIT = {"exit_tokens": torch.tensor([7, 8]), "exit_probs": torch.tensor([0.5, 0.25])}


def test_well_formed_exit_guesses_and_stage_drafts_are_accepted():
    event = exit_event(_exit_msg(2, **GOOD_EXIT, self_drafts=torch.tensor([7, -1]),
                                 self_draft_keys=torch.tensor([13, -1])), now_ns=5)
    assert event.self_drafts == ((7, 13), (-1, -1)) and [g.token for g in event.guesses] == [7, 8]
    top_k = exit_event(_exit_msg(2, exit_tokens=torch.tensor([[7, 1, 2], [8, 3, -1]]),
                                 exit_probs=torch.rand(2, 3)), now_ns=5)
    assert [len(g.alternatives) for g in top_k.guesses] == [2, 2]


@pytest.mark.parametrize("tensors", [
    {**GOOD_EXIT, "self_drafts": torch.tensor([7.0, -1.0]), "self_draft_keys": torch.tensor([3.5, -1.0])},
    {**GOOD_EXIT, "self_drafts": torch.tensor([7, -1]), "self_draft_keys": torch.tensor([10**6, -1])},
    {**GOOD_EXIT, "self_drafts": torch.tensor([7, -1]), "self_draft_keys": torch.tensor([-2, -1])},
    {**GOOD_EXIT, "self_drafts": torch.tensor([-9, -1]), "self_draft_keys": torch.tensor([1, -1])},
    {**GOOD_EXIT, "self_drafts": torch.tensor([7, -1])},
    {"exit_tokens": torch.tensor([7, 8, 9]), "exit_probs": torch.tensor([0.5, 0.5, 0.5])},
    {"exit_tokens": torch.tensor([7, 8]), "exit_probs": torch.tensor([0.5])},
    {"exit_tokens": torch.tensor([7.0, 8.0]), "exit_probs": torch.tensor([0.5, 0.5])},
    {"exit_tokens": torch.tensor([7, 8])},
    {"exit_tokens": torch.zeros(2, 4, dtype=torch.int64), "exit_probs": torch.zeros(2, 4)},  # k past exit_top_k
    {"exit_tokens": torch.zeros(2, 1, 1, dtype=torch.int64), "exit_probs": torch.zeros(2, 1, 1)},
])
def test_malformed_exit_tensors_are_a_receiver_error(tensors):
    from launcher.coordinator.stage_receivers import ReceiverError
    with pytest.raises(ReceiverError, match="EXIT_GUESS with 2 items has malformed"):
        exit_event(_exit_msg(2, **tensors), now_ns=0)


@pytest.mark.parametrize("kind,is_last", [(MessageKind.EXIT_GUESS, False), (MessageKind.RESULT, True)])
def test_any_decode_failure_in_the_receiver_becomes_an_error_event(kind, is_last):
    """A message the decoder chokes on (here a RESULT without token_ids, or an EXIT_GUESS with
    mismatched tensors) fences the stage like a receive error; the thread does not die silently."""
    import queue
    import threading

    from launcher.coordinator.stage_receivers import ReceiverError, _receive_loop

    bad = _exit_msg(2, exit_tokens=torch.tensor([7, 8, 9]), exit_probs=torch.tensor([0.5, 0.5, 0.5]))
    msg = bad if kind == MessageKind.EXIT_GUESS else Message(MessageKind.RESULT, bad.items, {}, None)

    class OneMessage:
        def recv(self, rank):
            return msg

    events: queue.Queue = queue.Queue()
    _receive_loop(OneMessage(), 1, is_last, events, threading.Event(), 7, is_exit=not is_last)
    what, (generation, error) = events.get_nowait()
    assert (what, generation) == ("error", 7) and isinstance(error, ReceiverError), error
    assert kind.name in str(error) or "EXIT_GUESS" in str(error)


@pytest.mark.parametrize("kind", [MessageKind.EXIT_GUESS])
def test_exit_messages_are_taken_only_from_the_exit_stage(kind):
    """An EXIT_GUESS from a rank that is not the exit stage (here the last stage, whose RESULTs the
    receiver reads) is an error event, not a draft event: only the exit stage drafts."""
    import queue
    import threading

    from launcher.coordinator.stage_receivers import ReceiverError, _receive_loop

    good = _exit_msg(2)
    msg = good if kind == MessageKind.EXIT_GUESS else Message(MessageKind.WITHDRAWN, good.items, {}, None)

    class OneMessage:
        def recv(self, rank):
            return msg

    events: queue.Queue = queue.Queue()
    _receive_loop(OneMessage(), 2, True, events, threading.Event(), 3, is_exit=False)
    what, (generation, error) = events.get_nowait()
    assert (what, generation) == ("error", 3) and isinstance(error, ReceiverError)
    assert f"unexpected {kind.name} from" in str(error)


@pytest.mark.parametrize("self_made", [True, False])
def test_the_last_stage_passes_on_fed_items_stage_0_withdrew_and_nothing_else(self_made: bool):
    """At --stages >= 2 a fed decode item stage 0 withdrew reaches the coordinator as a WITHDRAWN
    from the last stage (rank 2 here, neither stage 0 nor the exit stage): a Withdrawn event when
    its items are self-made ([Note: self-fed decode] 6), an error event otherwise."""
    import queue
    import threading

    from launcher.coordinator.stage_receivers import ReceiverError, _receive_loop
    from pipeline.engine.events import Withdrawn
    from pipeline.speculation.items import Item

    items = [Item(seq_id=4, slot=0, start=9, num_tokens=1, self_made=self_made, feed_upto=12)]
    sent = [Message(MessageKind.WITHDRAWN, items, {}, None), Message(MessageKind.SHUTDOWN)]

    class Script:
        def recv(self, rank):
            return sent.pop(0)

    events: queue.Queue = queue.Queue()
    _receive_loop(Script(), 2, True, events, threading.Event(), 3, is_exit=False)
    what, (generation, payload) = events.get_nowait()
    assert generation == 3
    if self_made:
        assert what == "event" and isinstance(payload, Withdrawn) and payload.items == tuple(items)
    else:
        assert what == "error" and isinstance(payload, ReceiverError) and "WITHDRAWN" in str(payload)
