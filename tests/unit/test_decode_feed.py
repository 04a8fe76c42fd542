"""Self-fed decode ([Note: self-fed decode] in pipeline/engine/decode_feed.py), without processes.

What breaks when these fail: the coordinator authorises a feed where the stage could pick another
token than the coordinator (sampling, logprobs, penalties, logit_bias, token masks, min_tokens
before it is reached), at more than one stage, with speculation, or while another sequence runs or
waits; the stage feeds past a stop token id, past the token budget, or after a non-finite row; the
engine registers a fed item twice, loses its result, counts it as filling the pipeline (a new
request waits for the whole stream), or leaks it after a RELEASE withdrew it; greedy output changes.

The fake stage 0 (`FeedFake`) is workers/stage_loop.py's decision in one process: it runs one
micro-batch per tick, a fed item first (before any message in its inbox, and only when the inbox
is empty at the decision), with a hash "model" (tests/unit/test_speculation_scheduler.py's).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from pipeline.engine import decode_feed
from pipeline.engine.engine import Engine
from pipeline.engine.events import Abort, Result, Submit, Withdrawn
from pipeline.engine.records import SchedulerConfig
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.sampling import SamplingParams
from tests.unit.test_speculation_scheduler import MAX_MODEL_LEN, fake_next, greedy_reference

EOS = 60  # outside fake_next's [3, 53): only the tests that pick an EOS see one
PROMPTS = [[5, 9, 11], [20, 4], [33, 33, 33, 33, 33]]


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"num_stages": 1, "max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN,
                              "eos_token_ids": (EOS,), "decode_feed": True, **kw})


class FeedFake:
    """One stage (first and last) around a real Engine; `pump` is the coordinator's step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: collections.deque = collections.deque()
        self.fed_next: list[Item] = []  # the fed micro-batch to run before the inbox
        self.events: list = []  # for the coordinator's next step
        self.kv: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)
        self.finish: dict[int, str] = {}
        self.announced: list[tuple[int, int, int]] = []  # (seq, fed start, token)
        self.sent_batches = 0

    def pump(self, events=()) -> None:
        out = self.engine.step([*self.events, *events])
        self.events = []
        if out.releases:
            self.inbox.append(("release", [r.seq_id for r in out.releases]))
        for batch in out.sends:
            self.sent_batches += 1
            self.inbox.append(("batch", list(batch)))
        for c in out.commits:
            self.outputs[c.seq_id].extend(c.token_ids)
            if c.finish_reason is not None:
                self.finish[c.seq_id] = c.finish_reason.value

    def tick(self) -> None:
        """Run the fed micro-batch (withdrawn if a RELEASE of its sequence waits), else one message."""
        if self.fed_next:
            items, self.fed_next = self.fed_next, []
            if any(m[0] == "release" and items[0].seq_id in m[1] for m in self.inbox):
                self.events.append(Withdrawn(items=tuple(items)))
                return
            self._run(items)
        elif self.inbox:
            kind, payload = self.inbox.popleft()
            if kind == "release":
                for seq_id in payload:
                    self.kv.pop(seq_id, None)
            else:
                self._run(payload)

    def _run(self, items: list[Item]) -> None:
        tokens = []
        for it in items:
            ctx = self.kv.setdefault(it.seq_id, [])
            del ctx[it.start:]
            ctx.extend(it.token_ids)
            tokens.append(fake_next(ctx))
        token_ids = torch.tensor(tokens, dtype=torch.int64)
        ran = [it.without_tokens() for it in items]  # as StageOutput.items
        fed, flags = ([], []) if self.inbox else decode_feed.fed_items(ran, token_ids)
        self.announced += [(it.seq_id, it.start, it.token_ids[0]) for it in fed]
        self.events.append(Result(items=tuple(ran), token_ids=token_ids, fed=tuple(flags) if fed else ()))
        self.fed_next = fed

    def run(self, submits: dict[int, Submit], max_ticks: int = 2000) -> None:
        """Submit `submits[t]` at tick t; run until every sequence finished and nothing is in flight."""
        for t in range(max_ticks):
            self.pump([submits[t]] if t in submits else [])
            self.tick()
            if t > max(submits) and not self.engine.has_unfinished and not self.engine.num_inflight \
                    and not self.inbox and not self.fed_next and not self.events:
                return
        raise AssertionError("the fake pipeline did not drain")


def submit(seq_id: int, prompt, **params) -> Submit:
    return Submit(seq_id=seq_id, prompt_ids=tuple(prompt), params=SamplingParams(**params))


def test_a_single_greedy_stream_feeds_every_decode_item_and_keeps_its_tokens():
    fake = FeedFake(Engine(config()))
    fake.run({0: submit(0, PROMPTS[0], max_new_tokens=20, ignore_eos=True)})
    assert fake.outputs[0] == greedy_reference(PROMPTS[0], 20)
    # the prefill is the only item the coordinator sent; each of the 19 decode items was fed
    assert (fake.sent_batches, fake.engine.spec.fed_items, len(fake.announced)) == (1, 19, 19)
    assert fake.engine.num_inflight == 0 and fake.engine.num_fed == 0


def test_feeding_off_sends_every_item_from_the_coordinator():
    fake = FeedFake(Engine(config(decode_feed=False)))
    fake.run({0: submit(0, PROMPTS[0], max_new_tokens=20, ignore_eos=True)})
    assert fake.outputs[0] == greedy_reference(PROMPTS[0], 20)
    assert (fake.sent_batches, fake.engine.spec.fed_items, fake.announced) == (20, 0, [])


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_the_stage_never_feeds_past_the_token_budget(budget: int):
    fake = FeedFake(Engine(config()))
    fake.run({0: submit(0, PROMPTS[1], max_new_tokens=budget, ignore_eos=True)})
    assert fake.outputs[0] == greedy_reference(PROMPTS[1], budget) and fake.finish[0] == "length"
    assert len(fake.announced) == budget - 1  # nothing fed whose result the coordinator would drop


def _eos_at(prompt, n: int = 40) -> tuple[int, int]:
    """(a token of `prompt`'s greedy output that first appears at index k >= 2, k)."""
    out = greedy_reference(prompt, n)
    k = next(i for i in range(2, n) if out[i] not in out[:i])
    return out[k], k


@pytest.mark.parametrize("how", ["eos", "stop_token_ids", "ignore_eos"])
def test_the_stage_never_feeds_after_a_token_that_ends_the_sequence(how: str):
    stop, k = _eos_at(PROMPTS[2])
    params = {"max_new_tokens": 30}
    eos = EOS
    if how == "eos" or how == "ignore_eos":
        eos = stop
        params["ignore_eos"] = how == "ignore_eos"
    else:
        params["stop_token_ids"] = (stop,)
    fake = FeedFake(Engine(config(eos_token_ids=(eos,))))
    fake.run({0: submit(0, PROMPTS[2], **params)})
    expected = greedy_reference(PROMPTS[2], 30, eos=None if how == "ignore_eos" else stop)
    assert fake.outputs[0] == expected
    assert all(token != stop for _, _, token in fake.announced) == (how != "ignore_eos")
    assert len(fake.announced) == len(expected) - 1  # t0 .. t(n-2): never the stop token, nor past it


def test_a_second_request_is_sent_at_once_and_stops_the_chain():
    fake = FeedFake(Engine(config()))
    fake.run({0: submit(0, PROMPTS[0], max_new_tokens=60, ignore_eos=True),
              8: submit(1, PROMPTS[1], max_new_tokens=5, ignore_eos=True)})
    assert fake.outputs[0] == greedy_reference(PROMPTS[0], 60)
    assert fake.outputs[1] == greedy_reference(PROMPTS[1], 5)
    fed_1 = [a for a in fake.announced if a[0] == 1]
    assert fed_1 == [], "a sequence was fed while another one ran"
    # seq 0 fed before seq 1 arrived and again after it finished; not while both ran
    starts = [s for seq, s, _ in fake.announced if seq == 0]
    gap = [s for s in range(starts[0], 60 + len(PROMPTS[0]) - 1) if s not in starts]
    assert starts and gap and max(starts) > max(gap), (starts, gap)
    # seq 1 (5 tokens) finished long before seq 0's 60: it did not wait for the chain
    assert fake.engine.spec.fed_items == len(fake.announced)


def test_an_abort_withdraws_the_fed_item_and_nothing_leaks():
    fake = FeedFake(Engine(config()))
    fake.run({0: submit(0, PROMPTS[0], max_new_tokens=60, ignore_eos=True), 10: Abort(seq_id=0),
              11: submit(1, PROMPTS[2], max_new_tokens=8, ignore_eos=True)})
    assert 0 < len(fake.outputs[0]) < 60 and fake.outputs[0] == greedy_reference(PROMPTS[0], 60)[:len(fake.outputs[0])]
    assert fake.outputs[1] == greedy_reference(PROMPTS[2], 8)
    assert fake.engine.spec.fed_withdrawn == 1  # the fed item running when the RELEASE came
    assert fake.engine.num_inflight == 0 and fake.engine.num_fed == 0


# -- authorisation -----------------------------------------------------------------------------------
def _authorised(cfg: SchedulerConfig, *, alone: bool = True, kind: ItemKind = ItemKind.DECODE, start: int = 4,
                **params) -> Item:
    engine = Engine(cfg)
    engine.step([submit(0, [1, 2, 3], max_new_tokens=params.pop("max_new_tokens", 10), **params)])
    seq = engine.scheduler.seqs[0]
    item = Item(seq_id=0, slot=0, start=0 if kind == ItemKind.PREFILL else start,
                num_tokens=3 if kind == ItemKind.PREFILL else 1, kind=kind)
    return decode_feed.authorise(cfg, seq, item, alone=alone)


@pytest.mark.parametrize(("cfg", "kw"), [
    ({"decode_feed": False}, {}),
    ({}, {"alone": False}),
    ({}, {"temperature": 0.7}),
    ({}, {"logprobs": 0}),
    ({}, {"presence_penalty": 0.5}),
    ({}, {"repetition_penalty": 1.2}),
    ({}, {"logit_bias": {5: 1.0}}),
    ({}, {"allowed_token_ids": (5, 6)}),
    ({}, {"min_tokens": 6}),  # the item at 4 chooses output token 2 < 6: EOS is masked there
    ({}, {"start": 11}),  # its result is the budget's last token: nothing after it
    ({}, {"kind": ItemKind.FIRP}),
], ids=lambda v: str(v))
def test_not_authorised_where_the_stage_could_differ_or_others_wait(cfg, kw):
    assert _authorised(config()).feed_upto > 0  # the baseline is authorised
    assert _authorised(config(**cfg), **kw).feed_upto == 0


@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_authorised_at_any_number_of_stages_the_feed_link_serves(num_stages):
    """Beyond --stages 1 the last stage sends the fed item to stage 0 ([Note: self-fed decode] 6)."""
    item = _authorised(config(num_stages=num_stages))
    assert item.feed_upto == _authorised(config()).feed_upto > 0


def test_the_authorisation_carries_the_budget_bound_and_the_stop_ids():
    item = _authorised(config(eos_token_ids=(EOS, 9)), stop_token_ids=(11, EOS), min_tokens=2)
    assert item.feed_upto == 3 + 10 - 1 and item.feed_stop == (EOS, 9, 11)  # min_tokens 2 reached at output 2
    assert _authorised(config(), ignore_eos=True, stop_token_ids=(11,)).feed_stop == (11,)
    assert _authorised(config(), kind=ItemKind.PREFILL).feed_upto == 12


def test_fed_items_inherit_the_authorisation_and_skip_stops_bounds_and_bad_rows():
    base = Item(seq_id=3, slot=1, start=5, num_tokens=1, epoch=2, feed_upto=9, feed_stop=(7,))
    fed, flags = decode_feed.fed_items([base], torch.tensor([12]))
    assert flags == [1] and fed == [dataclasses.replace(base, start=6, token_ids=(12,), self_made=True)]
    for item, token in ((base, 7), (base, -1), (dataclasses.replace(base, start=8), 12),
                        (dataclasses.replace(base, feed_upto=0), 12)):
        assert decode_feed.fed_items([item], torch.tensor([token])) == ([], [0])


# -- the deadline during a long chain ----------------------------------------------------------------
class _Sends:
    def __init__(self) -> None:
        self.sent = []

    def send(self, msg, dst) -> None:
        self.sent.append(msg.kind.name)


@pytest.mark.parametrize(("feeding", "idle_s", "expected"), [
    (True, 31.0, ["KEEPALIVE"]),  # a quarter of the 120 s deadline without a send: stage 0 hears one
    (True, 5.0, []),
    (False, 31.0, []),  # nothing in flight: the engine loop's idle keepalive does it
])
def test_a_long_chain_still_sends_stage_0_a_keepalive_within_its_deadline(feeding, idle_s, expected):
    import time

    from launcher.coordinator.stage_link import StageLink
    from pipeline.engine.events import StepOutput

    link = StageLink(num_stages=1, master_addr="127.0.0.1", master_port=1, timeout_s=120.0, max_num_seqs=1,
                     record_timeline=False)
    link.sends = _Sends()
    link.last_send_s = time.monotonic() - idle_s
    link.send_step(StepOutput(), feeding=feeding)
    assert link.sends.sent == expected


def test_a_bad_decode_feed_value_is_named(tmp_path):
    from launcher.coordinator.pipeline_options import PipelineOptions

    with pytest.raises(ValueError, match="decode_feed must be one of coordinator, stage, got 'last'"):
        PipelineOptions(num_stages=1, model=str(tmp_path), decode_feed="last")
