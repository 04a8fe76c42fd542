"""Layer partition: which contiguous half-open layer range each stage holds.

Owns `LayerRange` and the balanced split. Pure arithmetic; no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """Half-open interval [start, stop) of decoder layer indices held by one stage."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid layer range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"


# [Note: partition cost]
# The first stage also runs the token embedding (a gather: cheap) and the last stage the final norm
# plus the LM head, a [hidden, vocab] matmul that on small models costs about as much as a decoder
# layer of compute per token. The split starts from the even split (leftover layers to the earliest
# stages, as vLLM's get_pp_indices does) and then moves layers off the last stage only while that
# strictly lowers the most expensive stage's cost, counting the head as HEAD_COST_LAYERS layers.
HEAD_COST_LAYERS = 1.0


def balanced_split(num_layers: int, num_stages: int) -> list[LayerRange]:
    """Split `num_layers` decoder layers into `num_stages` contiguous, non-empty ranges.

    Even split first (30 layers on 4 stages -> 8,8,7,7), then the last stage, which also runs the
    LM head, gives layers to the cheapest earlier stage while that strictly lowers the maximum stage
    cost. See [Note: partition cost]. Raises ValueError when num_stages < 1 or > num_layers.
    """
    if num_stages < 1:
        raise ValueError(f"--stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"--stages {num_stages} is more than the model's {num_layers} layers")
    base, leftover = divmod(num_layers, num_stages)
    sizes = [base + (1 if i < leftover else 0) for i in range(num_stages)]

    def costs(sz: list[int]) -> list[float]:
        return [s + (HEAD_COST_LAYERS if i == num_stages - 1 else 0.0) for i, s in enumerate(sz)]

    while num_stages > 1 and sizes[-1] > 1:
        cheapest = min(range(num_stages - 1), key=lambda i: (sizes[i], i))
        moved = list(sizes)
        moved[-1] -= 1
        moved[cheapest] += 1
        if max(costs(moved)) >= max(costs(sizes)):
            break
        sizes = moved
    return split_from_sizes(sizes, num_layers)


def split_from_sizes(sizes: Sequence[int], num_layers: int) -> list[LayerRange]:
    """Turn per-stage layer counts (e.g. from `--layer-split 8,8,7,7`) into ranges.

    Raises ValueError when a count is < 1 or the counts do not sum to `num_layers`.
    """
    if not sizes:
        raise ValueError("--layer-split is empty")
    if any(s < 1 for s in sizes):
        raise ValueError(f"--layer-split {','.join(map(str, sizes))}: every stage needs at least 1 layer")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"--layer-split {','.join(map(str, sizes))} sums to {sum(sizes)}, but the model has {num_layers} layers"
        )
    ranges, start = [], 0
    for s in sizes:
        ranges.append(LayerRange(start, start + s))
        start += s
    return ranges


def parse_layer_split(text: str) -> list[int]:
    """Parse '8,8,7,7' into [8, 8, 7, 7]. Raises ValueError naming the bad part."""
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--layer-split {text!r} must be comma-separated integers, e.g. 8,8,7,7") from None
