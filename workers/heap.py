"""The garbage collector of a long-lived process on the per-token path (a stage, the coordinator).

Owns `freeze_startup_heap`. Must not: change what any object holds (it only tells the collector
what to scan).

[Note: the collector on the per-token path]
CPython's cyclic collector runs when allocations outnumber deallocations by a threshold, and a
full collection scans every tracked object. After start-up a stage or coordinator process holds
hundreds of thousands of them (torch, grpc, tokenizers, the model's modules), none of which ever
become garbage, and every token allocates a few hundred short-lived ones (items, messages,
tensors), so collections keep running on the per-token path and the full ones rescan the whole
start-up heap. Measured on the coordinator's engine alone, in a small process (2000 decode steps,
one sequence): 102–114 µs a step with the collector, 58–77 µs with it disabled, and 107 µs with a
frozen heap: there the young objects are most of the cost, which freezing does not remove. What it
removes are the rescans of a large start-up heap (not measured apart in the runtime's processes;
`tests/benchmarks/checkout_ab.py` measured it together with the data-plane changes).
`gc.freeze()` moves everything alive at the end of start-up into the permanent generation, which
no collection scans (what CPython documents for
forking servers, and what long-running inference servers do after loading); cycles made later are
still collected. Freeze after the heavy start-up (imports, tokenizer, a stage's model) and before
the pipeline's own objects exist (data-plane groups, loops, links): a fail-over replaces those, and
frozen ones that became cyclic garbage would never be freed.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then exclude every object alive now from later collections ([Note: the
    collector on the per-token path]). Call once per process, after its heavy start-up and before
    its pipeline objects exist. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
