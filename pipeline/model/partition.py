"""Layer partition: which contiguous half-open layer range each stage holds.

Owns `LayerRange` and the balanced split. Pure arithmetic; no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


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
# The first stage also runs the token embedding (a gather: free) and the last stage the final norm
# plus the LM head, a [hidden, vocab] matrix that on small models outweighs several decoder layers
# (SmolLM2-135M: 28.3 M head weights vs 3.5 M per layer). A stage hosting a logit-lens exit head
# pays the same again. Stage cost = its layer count + its extra cost in layer units; the split
# minimises the most expensive stage by water-filling: start every stage at one layer and give each
# further layer to the currently cheapest stage (ties to the earliest, so leftovers go to the first
# stages, as in vLLM's get_pp_indices). Layers are contiguous by construction (only counts change).
# A decode pass is memory-bound, so a head costs the BYTES it streams over the bytes a decoder
# layer's linears stream, in the run's numeric mode (pipeline/weights/quant.py `packed_weight_bytes`,
# launcher/coordinator/run_plan.py `head_costs`), times HEAD_EFFICIENCY: one large matrix-vector
# product runs more efficiently than a layer's small ones plus attention. The bytes matter because
# the modes pack the head and the layers differently: in `auto` on the default model's GGUF the
# layers are Q4_1 (int4, 0.625 bytes a weight) and the tied head Q8_0 (int8, ~1 byte), so the head
# streams 12.8 layers' bytes, not 8; an exit head is dense in the stage's activation dtype (bfloat16
# in the int modes: 25.6 layers' bytes in `auto`). Measured (tests/benchmarks/split_cost.py, 10 layers,
# 200 cached positions, 1 thread, median of 5 repeats of 40 passes, two runs, 2-core AMD EPYC VM
# under load 4-5) against the estimate with HEAD_EFFICIENCY = 0.6, in layer units:
#   mode   bytes ratio   measured head (run 1 / run 2)   estimate   --stages 2 split (measured / estimate)
#   fp32       8.0            6.50 / 6.28                   4.8        18/12 / 17/13
#   bf16       8.0            4.75 / 4.69                   4.8        17/13 / 17/13
#   int8       8.0            4.66 / 5.05                   4.8        17/13 / 17/13 (run 2: 18/12)
#   int4       8.0            3.36 / 2.85                   4.8        17/13 / 17/13 (run 2: 16/14)
#   auto      12.8            7.82 / 9.56                   7.7        19/11 / 19/11 (run 2: 20/10)
#   auto exit 25.6           11.98 / 11.84 (a)             15.4        (stage 0's logit lens)
# (a) the bf16 run's dense head over the auto run's layer. Efficiencies (measured / bytes ratio) are
# 0.36-0.81 by mode and run; 0.6 is their median. It gives run 1's best --stages 2 split in every mode
# but fp32 (an earlier machine measured fp32 at 4.0-5.8 layers, efficiency 0.50-0.73), and prices the
# auto exit head above its measured 12 layers (dense bfloat16 runs below the median efficiency). Traced
# `launch --stages 2 --quantization auto` runs: at 19/11 (1 prompt) 11.44 / 11.32 ms per item
# (balanced); at the old weight-count price's 17/13 (2 prompts) 11.5 / 14.9 ms.
HEAD_COST_LAYERS = 1.0  # default when the model is unknown (30 layers on 4 stages -> 8,8,7,7)
HEAD_EFFICIENCY = 0.6


def head_cost_layers(*, head_bytes: int, layer_bytes: float) -> float:
    """Estimated decode cost of a final norm + LM head (or an exit head) in decoder-layer units:
    HEAD_EFFICIENCY x the bytes its matrix streams / the bytes one decoder layer's linears stream,
    both in the run's numeric mode ([Note: partition cost]). Raises ValueError when layer_bytes <= 0."""
    if layer_bytes <= 0:
        raise ValueError(f"layer_bytes must be > 0, got {layer_bytes}")
    return HEAD_EFFICIENCY * head_bytes / layer_bytes


def balanced_split(num_layers: int, num_stages: int, *, extra_cost: Sequence[float] | None = None) -> list[LayerRange]:
    """Split `num_layers` decoder layers into `num_stages` contiguous, non-empty ranges.

    extra_cost: per-stage cost beyond its layers, in layer units (default: HEAD_COST_LAYERS on the
    last stage). Minimises the maximum stage cost by water-filling; see [Note: partition cost].
    30 layers on 4 stages with the default -> 8,8,7,7. Raises ValueError when num_stages < 1, or
    > num_layers, or extra_cost has the wrong length or a negative entry.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"num_stages {num_stages} is more than the model's {num_layers} layers")
    if extra_cost is None:
        extra_cost = [0.0] * (num_stages - 1) + [HEAD_COST_LAYERS]
    if len(extra_cost) != num_stages or any(c < 0 for c in extra_cost):
        raise ValueError(f"extra_cost needs {num_stages} non-negative entries, got {list(extra_cost)}")
    def cost(sz: list[int], i: int) -> float:
        return sz[i] + extra_cost[i]

    filled = [1] * num_stages  # water-filling gives the optimal maximum cost...
    for _ in range(num_layers - num_stages):
        filled[min(range(num_stages), key=lambda i: (cost(filled, i), i))] += 1
    best = max(cost(filled, i) for i in range(num_stages))
    base, leftover = divmod(num_layers, num_stages)  # ...reached from the even split with fewest moves
    sizes = [base + (1 if i < leftover else 0) for i in range(num_stages)]
    while max(cost(sizes, i) for i in range(num_stages)) > best:
        src = max(range(num_stages), key=lambda i: (cost(sizes, i), i))
        dst = min(range(num_stages), key=lambda i: (cost(sizes, i), i))
        sizes[src] -= 1
        sizes[dst] += 1
    return split_from_sizes(sizes, num_layers)


def split_from_sizes(sizes: Sequence[int], num_layers: int) -> list[LayerRange]:
    """Turn per-stage layer counts (e.g. from `--layer-split 8,8,7,7`) into ranges.

    Raises ValueError when a count is < 1 or the counts do not sum to `num_layers`.
    """
    if not sizes:
        raise ValueError("layer_split is empty")
    if any(s < 1 for s in sizes):
        raise ValueError(f"layer_split {','.join(map(str, sizes))}: every stage needs at least 1 layer")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"layer_split {','.join(map(str, sizes))} sums to {sum(sizes)}, but the model has {num_layers} layers"
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
        raise ValueError(f"layer_split {text!r} must be comma-separated integers, e.g. 8,8,7,7") from None


def smallest_fitting_split(layer_bytes: Sequence[int], *, first_bytes: int, last_bytes: int,
                           budget_bytes: int, stage_bytes: int | Callable[[int, int], int] = 0,
                           shared_bytes: int = 0) -> list[LayerRange]:
    """The fewest contiguous stages whose memory each fits `budget_bytes`, split to minimise the
    largest stage.

    layer_bytes[i]: bytes decoder layer i needs on its stage (weights + its KV cache); first_bytes:
    the first stage's extra (token embedding); last_bytes: the last stage's extra (final norm + LM
    head); stage_bytes: what a stage holds besides its layers' own bytes (its RoPE rotation tables),
    the same for every stage, or a function of its layers [start, stop) (Gemma 3's second set of tables
    only on a stage with a sliding layer); shared_bytes: what first_bytes and last_bytes both count
    but a stage that is first and last holds once (a tied embedding and LM head, one tensor). Exact
    for contiguous splits (dynamic programme over split points, O(stages x layers^2)).
    Raises ValueError naming the largest single need and the budget when no split fits.
    """
    n = len(layer_bytes)
    if n == 0 or budget_bytes <= 0:
        raise ValueError(f"need at least one layer and a positive budget, got {n} layers, {budget_bytes} bytes")
    own = stage_bytes if callable(stage_bytes) else lambda lo, hi: stage_bytes
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(lo: int, hi: int) -> int:
        return (prefix[hi] - prefix[lo] + (first_bytes if lo == 0 else 0) + (last_bytes if hi == n else 0)
                - (shared_bytes if lo == 0 and hi == n else 0) + own(lo, hi))

    best = {i: (cost(0, i), [0, i]) for i in range(1, n + 1)}  # best[i]: layers [0, i) on k stages
    for k in range(1, n + 1):
        if best[n][0] <= budget_bytes:
            bounds = best[n][1]
            return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        best = {i: min(((max(best[j][0], cost(j, i)), best[j][1] + [i]) for j in range(k, i) if j in best),
                       key=lambda c: c[0]) for i in range(k + 1, n + 1)}
    need = max(max(cost(i, i + 1) for i in range(n)), first_bytes, last_bytes)
    raise ValueError(f"no split fits a per-stage budget of {budget_bytes / 2**30:.2f} GiB: one layer alone "
                     f"(with the embedding or head) needs up to {need / 2**30:.2f} GiB")
