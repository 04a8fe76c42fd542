"""Unit tests for pipeline.engine.stage_executor: epochs, in-band squash, releases and last-stage outputs.

What breaks when these fail: stale (squashed) work reaching the KV cache or the coordinator, a squash
that leaves wrong keys/values behind (so output after a rejected draft differs from a clean run), or
slots that are never freed. See [Note: in-band squash] in pipeline/engine/stage_executor.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.records import NON_FINITE_TOKEN
from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import forward_tensors
from pipeline.model.config import tiny_config
from pipeline.model.partition import balanced_split
from pipeline.model.stage_model import build_stage_model
from pipeline.speculation.items import Item, ItemKind
from pipeline.speculation.logprobs import token_logprob
from pipeline.speculation.sampling import MAX_LOGPROBS
from tests.tiny_model import random_state_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 32
GOOD = [11, 22, 33, 44, 55, 66]
WRONG = [11, 22, 33, 200, 201, 202]  # positions 3..5 are bad drafts



@pytest.fixture(scope="module")
def weights():
    cfg = tiny_config()
    return cfg, random_state_dict(cfg, seed=2, std=0.2)


def _pipeline(weights, *, num_stages: int = 2, max_num_seqs: int = 3) -> list[StageExecutor]:
    cfg, state = weights
    ranges = balanced_split(cfg.num_hidden_layers, num_stages)
    executors = []
    for i, r in enumerate(ranges):
        model = build_stage_model(cfg, r, is_first=i == 0, is_last=i == len(ranges) - 1, tensors=state)
        executors.append(StageExecutor(model, model.new_kv_cache(max_num_seqs=max_num_seqs,
                                                                 max_model_len=MAX_MODEL_LEN)))
    return executors


def _item(tokens: list[int], *, seq_id: int = 1, slot: int = 0, start: int = 0, epoch: int = 0,
          want_logits: bool = False) -> Item:
    return Item(seq_id=seq_id, slot=slot, start=start, num_tokens=len(tokens), epoch=epoch,
                kind=ItemKind.PREFILL if start == 0 else ItemKind.DECODE, token_ids=tuple(tokens),
                want_logits=want_logits)


def _ids(items: list[Item]) -> torch.Tensor:
    return torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64)


def _run(executors: list[StageExecutor], items: list[Item]):
    """Run a micro-batch through every stage (with the tensors a FORWARD carries); returns the list
    of StageOutputs, first to last."""
    outs, tensors = [], forward_tensors(items)
    x, prompt_next = tensors["x"], tensors.get("prompt_next")
    for ex in executors:
        out = ex.run(items, x, prompt_next=prompt_next)
        outs.append(out)
        items, x, prompt_next = out.items, out.hidden, out.prompt_next
    return outs


# -- epochs -------------------------------------------------------------------------------------------

def test_items_of_an_older_epoch_are_dropped_and_produce_no_rows(weights):
    first, _ = _pipeline(weights)
    first.run([_item([1, 2, 3], seq_id=1, slot=0, epoch=2)], _ids([_item([1, 2, 3])]))
    stale = _item([4], seq_id=1, slot=0, start=3, epoch=1)
    fresh = _item([7, 8], seq_id=5, slot=1)
    out = first.run([stale, fresh], _ids([stale, fresh]))
    assert [it.seq_id for it in out.items] == [5]
    assert out.hidden.shape == (2, weights[0].hidden_size), "the stale item's row must not be in the output"
    assert first.kv.lengths[0] == 3, "a stale item must not touch its slot's KV cache"
    assert first.counters.items_processed == 2 and first.counters.tokens_processed == 5


def test_a_micro_batch_of_only_stale_items_returns_nothing(weights):
    first, last = _pipeline(weights)
    _run([first, last], [_item([1, 2], epoch=1)])
    out = last.run([_item([3], start=2, epoch=0)], torch.zeros(1, weights[0].hidden_size))
    assert out.items == [] and out.token_ids is None and out.hidden is None and out.logits is None
    assert last.counters.items_processed == 1 and last.kv.lengths[0] == 2


def test_dropped_item_rows_are_removed_from_the_middle_of_a_packed_batch(weights):
    first, last = _pipeline(weights)
    _run([first, last], [_item([9], seq_id=2, slot=1, epoch=3)])
    items = [_item([1, 2], seq_id=1, slot=0), _item([5], seq_id=2, slot=1, start=1, epoch=2),
             _item([6, 7, 8], seq_id=3, slot=2)]
    outs = _run([first, last], items)
    # The same two live items alone give the same hidden rows.
    alone_first, _ = _pipeline(weights)
    want = alone_first.run([items[0], items[2]], _ids([items[0], items[2]])).hidden
    torch.testing.assert_close(outs[0].hidden, want, rtol=1e-5, atol=1e-5)
    assert [it.seq_id for it in outs[1].items] == [1, 3]
    assert outs[1].token_ids.shape == (2,)


def test_newer_epoch_truncates_the_slot_to_the_item_start_before_running(weights):
    first, last = _pipeline(weights)
    _run([first, last], [_item(WRONG, epoch=0)])
    assert first.kv.lengths[0] == last.kv.lengths[0] == 6
    keep = first.admit([_item(GOOD[3:], start=3, epoch=1)])
    assert keep == [True]
    assert first.kv.lengths[0] == 3 and first.epochs[1] == 1


def test_squash_and_rerun_at_the_same_positions_equals_a_clean_run(weights):
    """Run positions 0..5 with wrong tokens at 3..5 under epoch 0, then an epoch-1 item at start=3 with
    the right tokens: every stage must end with exactly the clean run's hidden states, KV and logits."""
    squashed = _pipeline(weights)
    _run(squashed, [_item(WRONG, epoch=0, want_logits=True)])
    redo = _run(squashed, [_item(GOOD[3:], start=3, epoch=1, want_logits=True)])

    clean = _pipeline(weights)
    _run(clean, [_item(GOOD[:3])])
    want = _run(clean, [_item(GOOD[3:], start=3, want_logits=True)])

    torch.testing.assert_close(redo[0].hidden, want[0].hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(redo[1].logits, want[1].logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(redo[1].token_ids, want[1].token_ids)
    for a, b in zip(squashed, clean, strict=True):
        assert a.kv.lengths[0] == b.kv.lengths[0] == 6
        torch.testing.assert_close(a.kv.k[:, 0, :, :6], b.kv.k[:, 0, :, :6], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.kv.v[:, 0, :, :6], b.kv.v[:, 0, :, :6], rtol=1e-5, atol=1e-5)
    # Decoding on from there agrees too, and the wrong run really was different.
    nxt = int(want[1].token_ids[0])
    a = _run(squashed, [_item([nxt], start=6, epoch=1, want_logits=True)])[1].logits
    b = _run(clean, [_item([nxt], start=6, want_logits=True)])[1].logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    wrong = _run(_pipeline(weights), [_item(WRONG, want_logits=True)])[1].logits
    assert (wrong - _run(_pipeline(weights), [_item(GOOD, want_logits=True)])[1].logits).abs().max() > 1e-3


def test_old_epoch_item_after_a_squash_is_dropped_on_a_later_stage(weights):
    """A stale draft created by stage 0 before the squash reaches stage 1 after the corrected item."""
    first, last = _pipeline(weights)
    stale = _run([first], [_item(WRONG, epoch=0)])[0]
    fixed = _run([first], [_item(GOOD[:3], epoch=1)])[0]
    out = last.run(fixed.items, fixed.hidden)
    assert out.token_ids.shape == (1,)
    dropped = last.run(stale.items, stale.hidden)
    assert dropped.items == [] and last.counters.items_processed == 1
    assert last.kv.lengths[0] == 3


# -- releases -----------------------------------------------------------------------------------------

def test_release_frees_slots_and_forgets_epochs(weights):
    first, last = _pipeline(weights)
    _run([first, last], [_item([1, 2, 3], seq_id=4, slot=2, epoch=5), _item([1], seq_id=6, slot=0)])
    for ex in (first, last):
        ex.release([4], [2])
        assert ex.kv.lengths == [1, 0, 0]
        assert 4 not in ex.epochs and ex.epochs[6] == 0
    # The slot takes a new sequence from position 0, and seq id 4 may come back at epoch 0.
    outs = _run([first, last], [_item([7, 8], seq_id=4, slot=2, epoch=0)])
    assert [it.seq_id for it in outs[1].items] == [4]
    assert first.kv.lengths[2] == 2


def test_clear_frees_every_slot(weights):
    first, _ = _pipeline(weights)
    first.run([_item([1], seq_id=1, slot=0), _item([2, 3], seq_id=2, slot=1)], torch.tensor([1, 2, 3]))
    first.clear()
    assert first.kv.slots_in_use() == 0 and first.epochs == {}


# -- outputs ----------------------------------------------------------------------------------------

def test_last_stage_returns_argmax_token_ids_and_logits_only_for_want_logits_items(weights):
    executors = _pipeline(weights)
    items = [_item([1, 2, 3], seq_id=1, slot=0, want_logits=False),
             _item([4, 5], seq_id=2, slot=1, want_logits=True),
             _item([6], seq_id=3, slot=2, want_logits=False)]
    outs = _run(executors, items)
    first, last = outs
    assert first.hidden.shape == (6, weights[0].hidden_size) and first.token_ids is None and first.logits is None
    assert all(it.token_ids == () for it in first.items), "stages after the first get no token ids"
    assert last.hidden is None
    assert last.token_ids.dtype == torch.int64 and last.token_ids.shape == (3,)
    assert last.logits.shape == (1, weights[0].vocab_size) and last.logits.dtype == torch.float32
    # token_ids are each item's last-row argmax: compare against each item run alone with logits.
    for i, it in enumerate(items):
        alone = _run(_pipeline(weights), [_item(list(it.token_ids), seq_id=it.seq_id, slot=it.slot,
                                                 want_logits=True)])[1]
        assert int(last.token_ids[i]) == int(alone.logits[0].argmax())
        if it.want_logits:
            torch.testing.assert_close(last.logits[0], alone.logits[0], rtol=1e-5, atol=1e-5)


def test_a_row_whose_logits_are_not_finite_gets_the_non_finite_token_and_its_neighbours_do_not(weights):
    """[Note: non-finite logits] in pipeline/engine/records.py: NaN in one sequence's KV cache (as NaN
    weights or a float16 overflow leave it) marks that sequence's result NON_FINITE_TOKEN; the other
    sequence of the same micro-batch keeps its argmax."""
    executors = _pipeline(weights)
    _run(executors, [_item([1, 2, 3], seq_id=1, slot=0), _item([4, 5, 6], seq_id=2, slot=1)])
    reference = _pipeline(weights)
    _run(reference, [_item([1, 2, 3], seq_id=1, slot=0), _item([4, 5, 6], seq_id=2, slot=1)])
    last_kv = executors[-1].kv
    last_kv.k[:, 1] = float("nan")  # [layers, slots, ...]: slot 1 only
    decode = [_item([7], seq_id=1, slot=0, start=3), _item([8], seq_id=2, slot=1, start=3)]
    tokens = _run(executors, decode)[-1].token_ids
    expected = _run(reference, decode)[-1].token_ids
    assert int(tokens[1]) == NON_FINITE_TOKEN and int(tokens[0]) == int(expected[0]) != NON_FINITE_TOKEN


def test_a_released_slot_that_held_nan_does_not_fail_its_next_sequence(weights):
    """Attention reads whole key blocks (and up to the longest item of a micro-batch), so a new
    sequence reads its slot's old positions with weight 0, and 0 x NaN is NaN: releasing a slot zeroes
    what it held, and the next sequence in it is finite, alone or beside a longer one."""
    executors = _pipeline(weights)
    _run(executors, [_item(list(range(1, 11)), seq_id=1, slot=1)])  # 10 positions written in slot 1
    for ex in executors:
        ex.kv.v[:, 1, :, :10] = float("nan")  # as NaN weights or a float16 overflow leave them
        ex.release([1], [1])
    batched = _run(executors, [_item(list(range(1, 9)), seq_id=5, slot=0), _item([4, 5], seq_id=6, slot=1)])
    assert NON_FINITE_TOKEN not in batched[-1].token_ids.tolist()
    for ex in executors:
        ex.release([5, 6], [0, 1])
    alone = _run(executors, [_item([4, 5, 6], seq_id=7, slot=1)])
    assert NON_FINITE_TOKEN not in alone[-1].token_ids.tolist()


def test_last_stage_without_want_logits_items_returns_no_logits(weights):
    outs = _run(_pipeline(weights), [_item([1, 2]), _item([3], seq_id=2, slot=1)])
    assert outs[1].logits is None and outs[1].token_ids.shape == (2,)


def test_an_item_past_its_kv_slot_is_a_value_error(weights):
    first, _ = _pipeline(weights)
    with pytest.raises(ValueError, match="gap"):
        first.run([_item([1], start=4)], torch.tensor([1]))


def test_prompt_logits_items_return_prompt_logprobs_and_the_same_result_row(weights):
    """A prefill with want_prompt_logits (OpenAI echo + logprobs) returns, per prompt row, the
    logprob of the next prompt token and the top MAX_LOGPROBS (not a vocab-size row), beside other
    items' result rows; its result row's logits and argmax are those of a plain prefill."""
    cfg, _ = weights
    echo = Item(seq_id=1, slot=0, start=0, num_tokens=4, kind=ItemKind.PREFILL, token_ids=(5, 6, 7, 8),
                want_logits=True, want_prompt_logits=True)
    other = _item([9, 10, 11], seq_id=2, slot=1, want_logits=True)
    outs = _run(_pipeline(weights), [echo, other])
    last = outs[-1]
    assert outs[0].prompt_next.tolist() == [6, 7, 8]  # passed on by the first stage
    assert last.logits.shape == (2, cfg.vocab_size) and last.token_ids.shape == (2,)
    plain = _run(_pipeline(weights), [_item([5, 6, 7, 8], want_logits=True), other])[-1]
    assert torch.equal(last.logits, plain.logits)  # bitwise: [Note: prompt rows apart]
    assert last.token_ids.tolist() == [int(last.logits[0].argmax()), int(last.logits[1].argmax())]
    chosen, top_ids, top_lp, ranks = last.prompt_logprobs
    assert chosen.shape == ranks.shape == (3,) and top_ids.shape == top_lp.shape == (3, MAX_LOGPROBS)
    for j, prefix in enumerate(([5], [5, 6], [5, 6, 7])):  # row j: the logits after the first j + 1 tokens
        logits = _run(_pipeline(weights), [_item(prefix, want_logits=True)])[-1].logits[0]
        want = token_logprob(logits, (6, 7, 8)[j], MAX_LOGPROBS)
        assert float(chosen[j]) == pytest.approx(want.logprob, abs=1e-5)
        assert top_ids[j].tolist() == [t for t, _ in want.top]
        assert top_lp[j].tolist() == pytest.approx([v for _, v in want.top], abs=1e-5)
        logp = torch.log_softmax(logits, dim=-1)  # vLLM's rank: entries at least as likely, itself included
        assert int(ranks[j]) == int((logp >= logp[(6, 7, 8)[j]]).sum())


def test_result_rows_do_not_depend_on_the_prompt_rows_beside_them_whatever_the_gemm_does(weights):
    """[Note: prompt rows apart] in pipeline/engine/stage_executor.py: the LM head here is made to
    depend on how many rows share its matmul (as a float32 GEMM may, by a few ulps: AMD EPYC), and
    the result rows of a prefill that wants prompt logprobs are still bitwise those of a plain one."""
    def row_count_dependent(executors):
        head = executors[-1].model._logits
        executors[-1].model._logits = lambda h: head(h) + 1e-3 * h.shape[0]
        return executors

    echo = Item(seq_id=1, slot=0, start=0, num_tokens=4, kind=ItemKind.PREFILL, token_ids=(5, 6, 7, 8),
                want_logits=True, want_prompt_logits=True)
    other = _item([9, 10, 11], seq_id=2, slot=1, want_logits=True)
    last = _run(row_count_dependent(_pipeline(weights)), [echo, other])[-1]
    plain = _run(row_count_dependent(_pipeline(weights)), [_item([5, 6, 7, 8], want_logits=True), other])[-1]
    assert torch.equal(last.logits, plain.logits)
    assert last.token_ids.tolist() == plain.token_ids.tolist()


def test_a_last_stage_without_the_next_prompt_tokens_refuses_the_item(weights):
    echo = Item(seq_id=1, slot=0, start=0, num_tokens=3, kind=ItemKind.PREFILL, token_ids=(5, 6, 7),
                want_logits=True, want_prompt_logits=True)
    first, last = _pipeline(weights)
    hidden = first.run([echo], torch.tensor([5, 6, 7])).hidden
    with pytest.raises(ValueError, match="prompt rows, but prompt_next is None"):
        last.run([echo.without_tokens()], hidden)


def test_the_last_stage_token_of_each_row_is_torch_argmax_or_the_non_finite_token():
    """[Note: cheap finiteness check]: the result token of each logits row equals torch.argmax (the
    first of tied maxima) where every value is finite, and NON_FINITE_TOKEN where one is NaN or
    +-inf; a finite row whose sum overflows to inf is still finite."""
    from pipeline.engine.stage_executor import _argmax_or_non_finite

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(11, 1000, generator=g)
    rows[1, [3, 500, 900]] = 50.0  # tied maxima: the first one counts
    rows[2, 7] = float("nan")
    rows[3, 10] = float("inf")
    rows[4, 20] = float("-inf")
    rows[5, :] = 3.0e38  # finite, but the sum overflows
    rows[6, [1, 2]] = torch.tensor([float("inf"), float("-inf")])  # the sum is NaN
    rows[7, :] = -3.0e38  # finite, the sum overflows to -inf
    rows[8, 999] = float("nan")  # in the last (tail) lane of the vectorised reductions
    rows[9, 998] = float("-inf")
    for batch in (rows, rows[[0, 1]], rows[[0, 5]], rows[[5]], rows[[2]], rows[[0, 7, 1]], rows[[8]], rows[[9, 0]], rows[:, :999]):
        finite = torch.isfinite(batch).all(dim=-1)
        expected = torch.where(finite, torch.argmax(batch, dim=-1), NON_FINITE_TOKEN)
        assert _argmax_or_non_finite(batch).tolist() == expected.tolist()
    assert _argmax_or_non_finite(rows[[1]]).tolist() == [3]
