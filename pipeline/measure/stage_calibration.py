"""Start-up row-cost calibration of one stage: time its own passes by number of rows.

Owns `calibration_rows` (which row counts a stage times, from the most rows the scheduler could
send it) and `calibrate_stage` (a short warm-up, then min-of-n seconds of a decode-style pass of
n rows over a cached context, on the stage's own layers, in its own numeric mode and device).
The timing loop and the pass are pipeline/measure/row_cost.py's (`measure_row_costs`,
`decode_pass`); this module only chooses the shapes, the context and the clock. The stage worker
(workers/stage_worker.py) runs it right after loading its weights with `--row-cost calibrate`
and reports the table in its Load response; the coordinator sums the stages' tables
([Note: combining stage tables] in pipeline/measure/row_cost.py).
Must not: know about processes or the wire, or touch the stage's own KV cache (it uses a scratch one).

Min-of-n, not the median of `measure_row_costs`' default: start-up timing runs while the other
stages calibrate and load on the same host, and the least disturbed repeat is the best estimate of
what a pass costs (the interference is one-sided: it only ever adds time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.measure.row_cost import RowCostTable, decode_pass, measure_row_costs
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel

ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # candidates (a stage times those up to its max rows; cost_s interpolates)
MAX_CALIBRATION_ROWS = 32
CONTEXT = 64  # cached positions before each timed pass


def calibration_rows(max_rows: int) -> tuple[int, ...]:
    """Row counts to time for a stage that may get passes of up to `max_rows` rows: the candidates
    up to it (at least 1, 2, 4 and 8, so that the start-up line can report their ratios), and
    `max_rows` itself, at most MAX_CALIBRATION_ROWS. Raises ValueError for max_rows < 1."""
    if max_rows < 1:
        raise ValueError(f"calibration max_rows must be >= 1, got {max_rows}")
    top = min(max(max_rows, 8), MAX_CALIBRATION_ROWS)
    return tuple(sorted({n for n in ROW_COUNTS if n <= top} | {top}))


def stage_clock(device: str, num_threads: int) -> Callable[[], float]:
    """The clock to time a stage with: CPU seconds of this thread on a CPU stage with one torch
    thread (robust to other processes sharing the cores: wall time would mostly measure waiting),
    wall time otherwise (several intra-op threads, or a device whose work the CPU clock misses)."""
    return time.thread_time if device == "cpu" and num_threads <= 1 else time.perf_counter


@torch.inference_mode()
def calibrate_stage(model: StageModel, *, mode: str, max_rows: int, device: str = "cpu", num_threads: int = 1,
                    repeats: int = 3, context: int = CONTEXT) -> RowCostTable:
    """Seconds of this stage's pass of n rows, n from `calibration_rows(max_rows)`, after `context`
    cached positions (a scratch KV cache of one slot); the last stage scores every row, as in a
    verify pass. The first round warms up and is dropped; each count's time is the minimum of
    `repeats` rounds, counts interleaved round by round. mode: the numeric mode's name (as in
    row_cost.py reports). Raises ValueError for repeats < 1 or context < 1."""
    if repeats < 1 or context < 1:
        raise ValueError(f"calibration needs repeats >= 1 and context >= 1, got {repeats}, {context}")
    rows = calibration_rows(max_rows)
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=context + rows[-1] + 1)
    weight = next(iter(model.parameters()))
    if model.is_first:
        ctx = torch.arange(context, device=weight.device) % model.config.vocab_size
    else:
        ctx = torch.zeros(context, model.config.hidden_size, device=weight.device, dtype=weight.dtype)
    model.forward_rows(ctx, [Span(0, 0, context)], kv)  # the cached context
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    run = decode_pass(model, kv, context=context, all_logits=True, sync=sync)
    times = measure_row_costs(run, [(n, 0) for n in rows], repeats=repeats, clock=stage_clock(device, num_threads),
                              reduce=min)
    return RowCostTable(mode=mode, num_rows=rows, pass_s=tuple(max(times[(n, 0)], 1e-9) for n in rows))


@torch.inference_mode()
def time_exit_head(exit_head, *, hidden_size: int, dtype: torch.dtype, device: str = "cpu", num_threads: int = 1,
                   repeats: int = 5) -> float:
    """Seconds the exit stage's exit head (pipeline/speculation/predictors.py `ExitHead`) takes on
    one row, the cost it adds per item that wants a guess (min of `repeats` after a warm-up,
    through `measure_row_costs`)."""
    weight_device = torch.device(device)
    hidden = torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(0)).to(weight_device, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def run(num_rows: int, _k: int) -> None:
        exit_head(hidden[:num_rows])
        if sync is not None:
            sync()

    times = measure_row_costs(run, [(1, 0)], repeats=repeats, clock=stage_clock(device, num_threads), reduce=min)
    return times[(1, 0)]
