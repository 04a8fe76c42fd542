"""Attention over the packed spans of one micro-batch: one batched call per layer.

Owns `AttentionPlan` (built once per stage forward from the spans and the FIRP pseudo layout: KV
write indices, query gather indices, and the causal / pseudo mask of every item) and
`span_attention`, which writes a layer's keys/values into the KV cache and attends every query row.
Must not: own the KV buffers (pipeline/model/kv_cache.py) or the projections (pipeline/model/stage_model.py).

[Note: batch-invariant attention]
Decode, draft and verify items (at most `SMALL_ITEM_ROWS` rows) of a micro-batch are attended
together in one float32 computation whose result for a query row depends only on that row, its
keys and values, never on how many rows or items share the pass nor on the padding. Matmul-based
attention over all queries at once (SDPA, or one GEMM per KV head with every query row of the head
as M) is not batch-invariant on CPU: MKL picks its kernel and blocking by the number of queries,
which moves a row's output by ~1e-7 between a 1-row decode and the same row inside a FIRP verify
chain, and can flip a greedy near-tie. So every (query row, KV head) is its own small product of a
shape that depends only on the model: scores [group, d] x [d, L] and output [group, L] x [L, d],
all of them in one `torch.bmm` each (the keys of an item are expanded over its rows). Masked keys
add exact zeros to the softmax and to the weighted sum, and every item's keys are read in whole
blocks of KEY_BLOCK positions, so the reductions over keys never take a length-dependent tail path
(a 7-key softmax and the same 7 keys padded to 10 differ in the last bit; padded to 32 and to 64
they do not). This is checked empirically, bitwise, over every item size up to SMALL_ITEM_ROWS,
row offsets, other items, key paddings and pseudo rows (tests/unit/test_attention_invariance.py;
a grouped-GEMM formulation fails it); the bmm is ~1.4x cheaper than the elementwise
product-and-sum it replaced (tests/benchmarks/row_cost.py, README "Fast passes"). Longer items
(prefills) are attended one by one with SDPA: a prefill has the same shape in every speculation
mode, so it needs no invariance.

[Note: attention soft-capping]
Gemma 2 caps every attention score at `softcap` (scores = softcap * tanh(scores / softcap), after
the query scale and BEFORE the mask; Gemma 2 paper, arXiv 2408.00118 §2, as transformers' eager
attention does it). The batched path caps its float32 scores in place, an elementwise step that
keeps its batch invariance. SDPA has no cap, so a capped prefill takes `_capped_attention`, the
same maths written out (float32 scores, GQA by expanding the keys, CAPPED_QUERY_BLOCK query rows at a
time so that a long prompt needs no [heads, n, n] buffer); without a cap both paths run
exactly the ops they ran before (one Python branch, no extra tensor op).

[Note: windowed pseudo rows]
On a sliding-window layer whose window binds, every query row, real or FIRP pseudo, sees key j only when
`inside_window` (pipeline/model/family_blocks.py, the one copy of the rule) says so for its own position.
A pseudo row of chain a sits at position p = p_a + 1 + i ([Note: pseudo rows] in pipeline/model/row_layout.py)
and its keys are the cached ones at 0..p_a and its chain's rows at p_a + 1 .. p; with the window it keeps
those above p - window, from either side, exactly the keys the chain's tokens would see run as real tokens
at those positions. So `masked_out_for` masks by key position (cached key j at j, pseudo key at its row's
position) and `pseudo_mask_for` does the same to a prefill's pseudo mask (tests/unit/test_firp_window.py).
Both depend only on the plan and the window (and the item), never on the layer, so each is built once per plan
and window (per item and window for a prefill) and reused by every sliding layer of the stage forward.
Both look a pseudo row's position up only for a window that binds: the plan of a pass without one (every
family without sliding layers, every global layer) runs exactly the ops it ran before pseudo rows had a window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeline.model.family_blocks import inside_window, window_binds, window_mask
from pipeline.model.kv_cache import KVCache
from pipeline.model.row_layout import PseudoLayout, Span

SMALL_ITEM_ROWS = 16  # items with at most this many real rows take the batched, batch-invariant path
KEY_BLOCK = 32  # cached keys are read in whole blocks of this many positions (see the note)
CAPPED_QUERY_BLOCK = 256  # query rows per float32 scores block of a soft-capped prefill (`_capped_attention`)


@dataclasses.dataclass
class AttentionPlan:
    """Index tensors and masks of one micro-batch, shared by every layer of a stage forward.

    spans, pseudo: as given to StageModel.forward_rows. Real rows [0, num_real), pseudo rows after.
    write_slots, write_positions: [num_real] KV slot and position of every real row.
    small: indices (into spans) of the items on the batched path; large: the others.
    q_index: [num_small, max_q] packed row of each query (padding: row num_rows, a zero row).
    key_slots: [num_small]; max_len: cached keys read per item; pseudo_keys: [num_small, max_p]
        packed rows whose keys follow the cached ones (padding: the zero row), or None.
    masked_out: [num_small, max_q, max_len + max_p] bool, True = may not attend (built once, used by
        every layer). max_len is a multiple of KEY_BLOCK.
    dense_rows: True when the batched queries are exactly the packed rows in order (every item one
        real row, no pseudo rows, no large items): no gather and no scatter.
    src, dst: [num_valid] flat query index into [num_small * max_q] and packed row it fills.
    q_positions: [num_small, max_q] position of every batched real query (pseudo rows and padding: 0; a
        pseudo row's position is looked up only for a window that binds: `masked_out_for`).
    sibling_batch, sibling_positions, sibling_rows: [num_siblings] batched-item index, position
        and packed row of every token-tree sibling span, whose own key/value replace the cached
        ones at its position ([Note: sibling rows] in pipeline/model/row_layout.py); None if none.
    """

    spans: Sequence[Span]
    pseudo: PseudoLayout | None
    num_rows: int
    write_slots: torch.Tensor
    write_positions: torch.Tensor
    small: list[int]
    large: list[int]
    q_index: torch.Tensor | None
    key_slots: torch.Tensor | None
    max_len: int
    pseudo_keys: torch.Tensor | None
    masked_out: torch.Tensor | None = None
    dense_rows: bool = False
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    sibling_batch: torch.Tensor | None = None
    sibling_positions: torch.Tensor | None = None
    sibling_rows: torch.Tensor | None = None
    _window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _pseudo_window_masks: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)

    def masked_out_for(self, window: int | None) -> torch.Tensor | None:
        """`masked_out` of the batched items, with a key at position j also hidden from a query at
        position i when j <= i - window (a sliding-window layer, pseudo rows and pseudo keys included:
        [Note: windowed pseudo rows]; built once per window per forward)."""
        if window is None:
            return self.masked_out
        if window not in self._window_masks:
            self._window_masks[window] = self.masked_out | ~inside_window(*self._window_positions(), window)
        return self._window_masks[window]

    def _window_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the batched items' queries [num_small, max_q] and keys [1 or num_small, max_len + max_p]
        for a window's mask: cached key j at j, a pseudo row, as query and as key, at its `Span.pseudo_positions`
        entry (as its RoPE: `StageModel._add_pseudo`). Looked up here, never in the build, so that a pass
        whose layers have no binding window pays nothing for them ([Note: windowed pseudo rows])."""
        key_pos = torch.arange(self.max_len, device=self.masked_out.device)[None, :]
        if self.pseudo_keys is None:
            return self.q_positions, key_pos
        num_real = self.write_slots.shape[0]
        row_pos = torch.zeros(self.num_rows + 1, dtype=torch.int64)  # packed row -> position; real rows, padding: 0
        row_pos[num_real:self.num_rows] = torch.tensor([p for s in self.spans for p in s.pseudo_positions()])
        row_pos = row_pos.to(self.masked_out.device)
        q_pos = self.q_positions + row_pos[self.q_index]  # a real row's position plus 0, a pseudo row's 0 plus its own
        return q_pos, torch.cat([key_pos.expand(len(self.small), -1), row_pos[self.pseudo_keys]], 1)

    def pseudo_mask_for(self, i: int, window: int | None) -> torch.Tensor:
        """Span i's pseudo mask (`Span.pseudo_mask`: [n + p, end + p] bool, True = may attend) with a key
        at position j also hidden from a row at position i when j <= i - window ([Note: windowed pseudo
        rows]); the mask of a large item with pseudo rows (batched items use `masked_out_for`). Built once
        per (i, window) per plan: every sliding layer of the stage forward with that window reuses it."""
        mask = self.pseudo.masks[i]
        if window is None:
            return mask
        if (i, window) not in self._pseudo_window_masks:
            span = self.spans[i]
            end = span.start + span.num_tokens
            pseudo_pos = torch.tensor(span.pseudo_positions(), device=mask.device)
            query_pos = torch.cat([torch.arange(span.start, end, device=mask.device), pseudo_pos])
            key_pos = torch.cat([torch.arange(end, device=mask.device), pseudo_pos])
            self._pseudo_window_masks[i, window] = mask & inside_window(query_pos, key_pos, window)
        return self._pseudo_window_masks[i, window]

    @classmethod
    def build(cls, spans: Sequence[Span], pseudo: PseudoLayout | None, device: torch.device, *,
              scratch_base: int = 0) -> AttentionPlan:
        """Plan for packed real rows of `spans` (+ pseudo rows of `pseudo`). Pure index maths.
        scratch_base: buffer index of scratch position 0 (`KVCache.max_model_len`), where sibling
        spans write ([Note: sibling rows] in pipeline/model/row_layout.py)."""
        if spans and pseudo is None and all(s.num_tokens == 1 and not s.is_sibling for s in spans):
            return cls._build_rows(spans, device)
        return cls._build_general(spans, pseudo, device, scratch_base=scratch_base)

    @classmethod
    def _build_rows(cls, spans: Sequence[Span], device: torch.device) -> AttentionPlan:
        """[Note: one-row plans] The plan of items of one real row each (decode, one-token drafts), no
        pseudo rows, no siblings: the fields `_build_general` gives them (tests/unit/test_attention_invariance.py
        compares every one), from 6 tensor ops instead of ~25 (0.11 ms warm, 0.3 ms with cold caches,
        on the critical path of every stage of every token)."""
        n = len(spans)
        slots = torch.tensor([s.slot for s in spans], dtype=torch.int64, device=device)
        positions = torch.tensor([s.start for s in spans], dtype=torch.int64, device=device)
        rows = torch.arange(n, device=device)
        max_len = -(-max(s.start + 1 for s in spans) // KEY_BLOCK) * KEY_BLOCK
        # key j is hidden from the row at position p when j > p (the general build's causal mask)
        masked_out = torch.arange(max_len, device=device)[None, None, :] > positions[:, None, None]
        return cls(spans, None, n, slots, positions, list(range(n)), [], rows[:, None], slots, max_len, None,
                   masked_out=masked_out, dense_rows=True, src=rows, dst=rows, q_positions=positions[:, None])

    @classmethod
    def _build_general(cls, spans: Sequence[Span], pseudo: PseudoLayout | None, device: torch.device, *,
                       scratch_base: int = 0) -> AttentionPlan:
        """`build` for any spans and pseudo rows."""
        num_real = sum(s.num_tokens for s in spans)
        num_pseudo = sum(s.num_pseudo for s in spans) if pseudo is not None else 0
        slots = torch.tensor([s.slot for s in spans for _ in range(s.num_tokens)], dtype=torch.int64)
        assert scratch_base > 0 or not any(s.is_sibling for s in spans), "sibling spans need scratch_base"
        positions = torch.cat([torch.arange(s.start, s.start + s.num_tokens) if not s.is_sibling
                               else torch.tensor([scratch_base + s.scratch]) for s in spans])
        small = [i for i, s in enumerate(spans) if s.num_tokens <= SMALL_ITEM_ROWS]
        large = [i for i, s in enumerate(spans) if s.num_tokens > SMALL_ITEM_ROWS]
        plan = cls(spans, pseudo, num_real + num_pseudo, slots.to(device), positions.to(device), small, large,
                   None, None, 0, None)
        if small:
            plan._build_small(device)
        return plan

    def _build_small(self, device: torch.device) -> None:
        """Gather indices and the mask of the batched items ([Note: pseudo rows] in pipeline/model/row_layout.py)."""
        spans, pad = self.spans, self.num_rows
        row_of = [0]
        for s in spans:
            row_of.append(row_of[-1] + s.num_tokens)
        num_p = [s.num_pseudo if self.pseudo is not None else 0 for s in spans]
        max_q = max(spans[i].num_tokens + num_p[i] for i in self.small)
        max_p = max(num_p[i] for i in self.small)
        longest = max(spans[i].start + spans[i].num_tokens for i in self.small)
        self.max_len = -(-longest // KEY_BLOCK) * KEY_BLOCK
        q_index = torch.full((len(self.small), max_q), pad, dtype=torch.int64)
        q_pos = torch.zeros(len(self.small), max_q, dtype=torch.int64)  # padding rows: position 0
        p_index = torch.full((len(self.small), max_p), pad, dtype=torch.int64)
        mask = torch.zeros(len(self.small), max_q, self.max_len + max_p, dtype=torch.bool)
        mask[:, :, 0] = True  # padding queries attend to one key (no NaN); their rows are never read
        for b, i in enumerate(self.small):
            s, n, end = spans[i], spans[i].num_tokens, spans[i].start + spans[i].num_tokens
            q_index[b, :n] = torch.arange(row_of[i], row_of[i] + n)
            q_pos[b, :n] = torch.arange(s.start, end)
            if num_p[i]:
                prows = torch.arange(self.pseudo.offsets[i], self.pseudo.offsets[i] + num_p[i])
                q_index[b, n:n + num_p[i]] = prows
                p_index[b, :num_p[i]] = prows
                m = self.pseudo.masks[i].cpu()  # [n + p, end + p]
                mask[b, :n + num_p[i], :end] = m[:, :end]
                mask[b, :n + num_p[i], self.max_len:self.max_len + num_p[i]] = m[:, end:]
            else:
                mask[b, :n, :end] = torch.arange(end)[None, :] <= torch.arange(s.start, end)[:, None]
        self.dense_rows = not self.large and max_q == 1 and len(self.small) == num_real_rows(spans)
        valid = (q_index < pad).reshape(-1)
        self.src = valid.nonzero()[:, 0].to(device)
        self.dst = q_index.reshape(-1)[valid].to(device)
        self.q_index, self.q_positions = q_index.to(device), q_pos.to(device)
        self.masked_out = (~mask).to(device)
        self.key_slots = torch.tensor([spans[i].slot for i in self.small], dtype=torch.int64, device=device)
        self.pseudo_keys = p_index.to(device) if max_p else None
        siblings = [(b, spans[i].start, row_of[i]) for b, i in enumerate(self.small) if spans[i].is_sibling]
        if siblings:
            b_idx, pos, rows = (torch.tensor(c, dtype=torch.int64, device=device) for c in zip(*siblings, strict=True))
            self.sibling_batch, self.sibling_positions, self.sibling_rows = b_idx, pos, rows


def num_real_rows(spans: Sequence[Span]) -> int:
    """Real rows of a micro-batch."""
    return sum(s.num_tokens for s in spans)


def _invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         masked_out: torch.Tensor | None, scale: float | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """q: [B, Q, kv_heads, group, d]; keys/values: [B, kv_heads, L, d]; masked_out: [B, Q, L] bool
    (True = may NOT attend) or None; scale: softmax scale (default 1/sqrt(d)); softcap: the scores'
    cap ([Note: attention soft-capping]) or None.

    Returns [B, Q, kv_heads, group, d] float32 ([Note: batch-invariant attention]): one `torch.bmm`
    for the scores and one for the weighted sum, each over B * Q * kv_heads products of the same
    shape ([group, d] x [d, L], [group, L] x [L, d]) however many rows share the pass; the keys of
    an item are expanded over its Q rows (a copy when Q > 1; a view when every item has one row).
    """
    b, nq, kvh, g, d = q.shape
    length = keys.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qq = q.reshape(b * nq * kvh, g, d).float()
    # expanded, cast and made contiguous in one copy (a view when every item has one float32 row)
    kk = keys[:, None].expand(b, nq, kvh, length, d).float().reshape(-1, length, d)
    vv = values[:, None].expand(b, nq, kvh, length, d).float().reshape(-1, length, d)
    scores = torch.bmm(qq, kk.transpose(1, 2)).view(b, nq, kvh, g, length).mul_(scale)  # in place: our own tensor
    if softcap is not None:  # before the mask ([Note: attention soft-capping])
        scores.div_(softcap).tanh_().mul_(softcap)
    if masked_out is not None:
        scores.masked_fill_(masked_out[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs.view(-1, g, length), vv).view(b, nq, kvh, g, d)


def span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, kv: KVCache,
                   layer: int, *, window: int | None = None, scale: float | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Write the real rows' k/v into `kv` at `layer`, then attend every query row.

    q: [num_rows, heads, d]; k, v: [num_rows, kv_heads, d] (RoPE applied); pseudo rows are never
    written to the cache. window: sliding-window size of this layer (Mistral, Gemma 2/3) or None;
    scale: softmax scale (default 1/sqrt(d)); softcap: cap of the attention scores (Gemma 2,
    [Note: attention soft-capping]) or None. Returns [num_rows, heads, d] in q's dtype.
    A window that cannot bind in `kv` (window >= kv.max_model_len) is full attention, bit for bit
    ([Note: a window that never binds] in pipeline/model/family_blocks.py); one that binds applies to
    FIRP pseudo rows as to real rows ([Note: windowed pseudo rows]).
    """
    if not window_binds(window, kv.max_model_len):
        window = None
    num_real = plan.write_slots.shape[0]
    if len(plan.spans) == 1 and not plan.spans[0].is_sibling:  # one item (a single sequence's decode, verify or prefill): a slice copy
        span = plan.spans[0]
        kv.write(layer, span.slot, span.start, k[:num_real].transpose(0, 1), v[:num_real].transpose(0, 1))
    else:
        kv.write_rows(layer, plan.write_slots, plan.write_positions, k[:num_real], v[:num_real])
    out = None if plan.dense_rows else torch.empty_like(q)
    if plan.small:
        h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
        if plan.dense_rows:
            qp = q.reshape(q.shape[0], 1, kvh, h // kvh, d)
        else:
            qp = torch.cat([q, q.new_zeros(1, h, d)])[plan.q_index].reshape(*plan.q_index.shape, kvh, h // kvh, d)
        keys, values = kv.gather(layer, plan.key_slots, plan.max_len)  # [B, kvh, max_len, d]
        if plan.pseudo_keys is not None:
            kp = torch.cat([k, k.new_zeros(1, kvh, d)])[plan.pseudo_keys].transpose(1, 2)
            vp = torch.cat([v, v.new_zeros(1, kvh, d)])[plan.pseudo_keys].transpose(1, 2)
            keys, values = torch.cat([keys, kp.to(keys.dtype)], 2), torch.cat([values, vp.to(values.dtype)], 2)
        if plan.sibling_rows is not None:  # [Note: sibling rows] in pipeline/model/row_layout.py
            if len(plan.small) == 1:  # a view of the cache: never write into it
                keys, values = keys.clone(), values.clone()
            b, pos, rows = plan.sibling_batch, plan.sibling_positions, plan.sibling_rows
            keys[b, :, pos] = k[rows].to(keys.dtype)
            values[b, :, pos] = v[rows].to(values.dtype)
        o = _invariant_attention(qp, keys, values, plan.masked_out_for(window), scale, softcap).to(q.dtype)
        if plan.dense_rows:
            return o.reshape(q.shape)
        out[plan.dst] = o.reshape(-1, h, d)[plan.src]
    row_of = [0]
    for s in plan.spans:
        row_of.append(row_of[-1] + s.num_tokens)
    for i in plan.large:
        _large_item(out, q, k, v, plan, kv, layer, i, row_of[i], window=window, scale=scale, softcap=softcap)
    return out


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float | None, softcap: float) -> torch.Tensor:
    """SDPA with soft-capped scores ([Note: attention soft-capping]). q: [1, heads, n, d];
    keys/values: [1, kv_heads, L, d]; mask: [n, L] bool, True = attend. Returns [1, heads, n, d] in q's dtype.
    Query rows go in blocks of CAPPED_QUERY_BLOCK, so a long prompt's float32 scores are [heads, block, L]
    at a time, never [heads, n, L] (SDPA's kernels hold no n x L buffer either)."""
    group = q.shape[1] // keys.shape[1]
    kk, vv = (t.float().repeat_interleave(group, dim=1) for t in (keys, values))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for lo in range(0, q.shape[2], CAPPED_QUERY_BLOCK):
        rows = slice(lo, lo + CAPPED_QUERY_BLOCK)
        scores = torch.matmul(q[:, :, rows].float(), kk.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_()
        probs = torch.softmax(scores.mul_(softcap).masked_fill_(~mask[rows], float("-inf")), dim=-1)
        out[:, :, rows] = torch.matmul(probs, vv).to(q.dtype)
    return out


def _sdpa(q, keys, values, mask, scale: float | None, softcap: float | None) -> torch.Tensor:
    """GQA SDPA of q [1, heads, n, d] over keys/values [1, kv_heads, L, d] with mask [n, L] (True =
    attend), or `_capped_attention` when `softcap` is set."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    return _capped_attention(q, keys, values, mask, scale, softcap)


def _large_item(out, q, k, v, plan: AttentionPlan, kv: KVCache, layer: int, i: int, row: int, *,
                window: int | None, scale: float | None, softcap: float | None) -> None:
    """SDPA of item i's real rows (a prefill) over its cached keys, and of its pseudo rows if it has
    any ([Note: pseudo rows] in pipeline/model/row_layout.py); writes them into `out`."""
    span = plan.spans[i]
    n, end = span.num_tokens, span.start + span.num_tokens
    keys, values = kv.view(layer, span.slot, end)  # [kv_heads, end, d]
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    rows = slice(row, row + n)
    if plan.pseudo is None or plan.pseudo.masks[i] is None:
        mask = window_mask(torch.arange(span.start, end, device=q.device), end, window)  # [n, end]
        o = _sdpa(q[rows].transpose(0, 1)[None], keys[None], values[None], mask, scale, softcap)
        out[rows] = o[0].transpose(0, 1)
        return
    mask = plan.pseudo_mask_for(i, window)
    prows = slice(plan.pseudo.offsets[i], plan.pseudo.offsets[i] + span.num_pseudo)
    keys = torch.cat([keys, k[prows].transpose(0, 1)], dim=1)
    values = torch.cat([values, v[prows].transpose(0, 1)], dim=1)
    both = torch.cat([q[rows], q[prows]]).transpose(0, 1)[None]
    o = _sdpa(both, keys[None], values[None], mask, scale, softcap)[0].transpose(0, 1)
    out[rows], out[prows] = o[:n], o[n:]
