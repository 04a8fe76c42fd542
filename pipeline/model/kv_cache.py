"""Per-stage KV cache: one slot per sequence, for the layers one stage holds.

Owns the key/value buffers of a stage and each slot's committed length. Writing at positions past a
slot's length extends it; `truncate` rolls a slot back to any shorter length (the squash primitive:
see ARCHITECTURE.md §5 and [Note: in-band squash] in pipeline/engine/stage_executor.py).
Must not: decide which slot a sequence gets (the coordinator does) or know about the wire.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values for `num_layers` layers and `max_num_seqs` slots.

    Buffers: k, v: [num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim].
    Layer indices are local to the stage (0 .. num_layers-1).
    """

    def __init__(self, *, num_layers: int, max_num_seqs: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        # Invariants: the run configuration validated both (pipeline/run_config.py).
        assert max_num_seqs >= 1 and max_model_len >= 2, (max_num_seqs, max_model_len)
        shape = (num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.lengths = [0] * max_num_seqs

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
        Positions past max_model_len read as zeros; past a slot's length they hold stale entries."""
        if length > self.max_model_len:
            k, v = self.gather(layer, slots, self.max_model_len)
            pad = (0, 0, 0, length - self.max_model_len)
            return torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        if slots.shape[0] == 1:
            s = int(slots[0])
            return self.k[layer, s:s + 1, :, :length], self.v[layer, s:s + 1, :, :length]
        return (self.k[layer, :, :, :length].index_select(0, slots),
                self.v[layer, :, :, :length].index_select(0, slots))

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
        """Release a slot (its length becomes 0)."""
        self.lengths[slot] = 0

    def slots_in_use(self) -> int:
        """Number of slots holding at least one position."""
        return sum(1 for n in self.lengths if n > 0)
