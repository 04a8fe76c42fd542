"""Per-stage KV cache: one slot per sequence, for the layers one stage holds.

Owns the key/value buffers of a stage and each slot's committed length. Writing at positions past a
slot's length extends it; `truncate` rolls a slot back to any shorter length (the squash primitive:
see ARCHITECTURE.md §5 and [Note: in-band squash] in pipeline/engine/stage_executor.py).
Each slot also has `num_scratch` scratch positions past max_model_len, where the keys/values of
token-tree sibling rows go ([Note: sibling rows] in pipeline/model/row_layout.py); `keep_scratch`
copies one into a real position (the verified branch). A block read of keys near max_model_len also
covers them, as masked keys (zero weight: their values only need to be finite).
Must not: decide which slot a sequence gets (the coordinator does) or know about the wire.
"""

from __future__ import annotations

import torch


def buffer_positions(needed: int, read_block: int) -> int:
    """Positions a KV buffer holds for `needed` of them: rounded up to a multiple of `read_block`."""
    return -(-needed // read_block) * read_block


class KVCache:
    """Preallocated keys and values for `num_layers` layers and `max_num_seqs` slots.

    Buffers: k, v: [num_layers, max_num_seqs, num_kv_heads, num_positions, head_dim].
    Layer indices are local to the stage (0 .. num_layers-1). Positions [0, max_model_len) are the
    sequence's; scratch position j (0 <= j < num_scratch) sits at buffer index max_model_len + j.
    num_positions is max_model_len + num_scratch, rounded up to a multiple of `read_block`: a reader
    that reads keys in whole blocks (pipeline/model/attention.py KEY_BLOCK) then always gets views,
    never a padded copy, however close a sequence is to max_model_len. The extra positions are never
    written as a sequence's; readers mask them like any position past a slot's length.
    """

    def __init__(self, *, num_layers: int, max_num_seqs: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 num_scratch: int = 0, read_block: int = 1) -> None:
        # Invariants: the run configuration validated both (pipeline/run_config.py).
        assert max_num_seqs >= 1 and max_model_len >= 2 and num_scratch >= 0, (max_num_seqs, max_model_len)
        self.read_block = read_block
        shape = (num_layers, max_num_seqs, num_kv_heads, buffer_positions(max_model_len + num_scratch, read_block),
                 head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_scratch = num_scratch
        self.lengths = [0] * max_num_seqs
        self._written = [0] * max_num_seqs  # positions [0, n) of each slot written since it was last freed

    @property
    def nbytes(self) -> int:
        """Bytes held by both buffers."""
        return self.k.numel() * self.k.element_size() * 2

    def check_write(self, slot: int, start: int, num_tokens: int) -> None:
        """Validate a write of `num_tokens` positions at `start` into `slot`.

        Raises ValueError if the slot is out of range, the write would leave a gap after the slot's
        current length, or it runs past max_model_len.
        """
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"KV slot {slot} out of range [0, {self.max_num_seqs})")
        if start > self.lengths[slot]:
            raise ValueError(f"KV slot {slot}: write at position {start} leaves a gap after length {self.lengths[slot]}")
        self._written[slot] = max(self._written[slot], min(start + num_tokens, self.max_model_len))
        if start + num_tokens > self.max_model_len:
            raise ValueError(
                f"KV slot {slot}: positions up to {start + num_tokens} exceed max_model_len {self.max_model_len}"
            )

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [num_kv_heads, num_tokens, head_dim] at positions [start, start+num_tokens).

        Positions at or after the end of the write are dropped (the slot's length becomes
        start + num_tokens); call `check_write` first.
        """
        n = k.shape[1]
        self.k[layer, slot, :, start:start + n] = k
        self.v[layer, slot, :, start:start + n] = v

    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Store the rows of a packed micro-batch in one indexed copy per buffer.

        slots, positions: [num_rows] int64; k, v: [num_rows, num_kv_heads, head_dim]. Call
        `check_write` for every span first.
        """
        self.k[layer][slots, :, positions] = k.to(self.k.dtype)
        self.v[layer][slots, :, positions] = v.to(self.v.dtype)

    def gather(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) of `slots` [num_items]: two
        [num_items, num_kv_heads, length, head_dim] tensors (views for a single slot, else copies).
        Positions past a slot's length hold stale entries, scratch entries or zeros (mask them);
        past the buffer's positions they read as zeros (a padded copy)."""
        if length > self.k.shape[3]:
            k, v = self.gather(layer, slots, self.k.shape[3])
            pad = (0, 0, 0, length - self.k.shape[3])
            return torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        if slots.shape[0] == 1:
            s = int(slots[0])
            return self.k[layer, s:s + 1, :, :length], self.v[layer, s:s + 1, :, :length]
        return (self.k[layer, :, :, :length].index_select(0, slots),
                self.v[layer, :, :, :length].index_select(0, slots))

    def scratch_index(self, scratch: int) -> int:
        """Buffer index of scratch position `scratch`. Raises ValueError if out of range."""
        if not 0 <= scratch < self.num_scratch:
            raise ValueError(f"KV scratch position {scratch} out of range [0, {self.num_scratch})")
        return self.max_model_len + scratch

    def ensure_scratch(self, num_scratch: int) -> None:
        """Grow the scratch area to at least `num_scratch` positions per slot (a one-off copy of the
        buffers the first time a token tree needs more; call between forwards)."""
        if num_scratch <= self.num_scratch:
            return
        extra = buffer_positions(self.max_model_len + num_scratch, self.read_block) - self.k.shape[3]
        if extra > 0:
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:3], extra, t.shape[4])], dim=3)  # noqa: E731
            self.k, self.v = pad(self.k), pad(self.v)
        self.num_scratch = num_scratch

    def keep_scratch(self, slot: int, scratch: int, position: int) -> None:
        """Copy scratch position `scratch` of `slot` to `position` on every layer (a verified token-tree
        sibling becomes the real entry at `position`; [Note: sibling rows] in pipeline/model/row_layout.py).
        Raises ValueError if the slot, scratch position or position is out of range."""
        if not 0 <= slot < self.max_num_seqs or not 0 <= position < self.max_model_len:
            raise ValueError(f"KV fix-up to slot {slot} position {position} out of range")
        src = self.scratch_index(scratch)
        self._written[slot] = max(self._written[slot], position + 1)
        self.k[:, slot, :, position] = self.k[:, slot, :, src]
        self.v[:, slot, :, position] = self.v[:, slot, :, src]

    def set_length(self, slot: int, length: int) -> None:
        """Record that positions [0, length) of `slot` hold valid entries on every layer."""
        self.lengths[slot] = length

    def view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length): two [num_kv_heads, length, head_dim] views."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to `length` positions (no-op if already shorter). Entries past it are dead."""
        if length < self.lengths[slot]:
            self.lengths[slot] = length

    def free(self, slot: int) -> None:
        """Release a slot (its length becomes 0) and zero what it held: attention reads whole key
        blocks, so a later occupant reads positions past its length with weight 0, and 0 x NaN is
        NaN ([Note: non-finite logits] in pipeline/engine/records.py: a request that ended with NaN
        in its cache must not fail the next one in its slot). Costs about what its writes cost."""
        self.lengths[slot] = 0
        written, self._written[slot] = self._written[slot], 0
        for buf in (self.k, self.v):
            buf[:, slot, :, :written].zero_()
            buf[:, slot, :, self.max_model_len:].zero_()  # the token-tree scratch positions

    def slots_in_use(self) -> int:
        """Number of slots holding at least one position."""
        return sum(1 for n in self.lengths if n > 0)
