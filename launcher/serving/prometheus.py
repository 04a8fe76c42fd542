"""Serving metrics: Prometheus exposition (prometheus-client) and the periodic stats log line.

Owns the metric names (vLLM's where vLLM has one, under a `speedpipe:` prefix instead of `vllm:`;
see the table in README "Serving"), the per-request observations the serving engine reports, a
scrape-time collector for what the pipeline itself counts (speculation totals from the scheduler,
per-stage busy / useful / wasted / idle seconds and KV slots from the stages' GetStats and the
coordinator's timeline), and `StatsLogger`, a thread that logs one summary line every few seconds.
Must not: know about HTTP or gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The OpenAI / vLLM name of each finish reason of the pipeline (FinishReason values): responses
# (launcher/serving/openai_protocol.py) and the request_success label use these.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "aborted": "abort"}


if TYPE_CHECKING:
    from launcher.coordinator.coordinator import Coordinator

log = logging.getLogger("speedpipe.stats")
disable_created_metrics()  # no `*_created` series (as vLLM): they double the exposition for nothing

PREFIX = "speedpipe:"
SCRAPE_STATS_TIMEOUT_S = 2.0  # per-stage counters a scrape waits for (Prometheus' own timeout is 10 s)
# Buckets (seconds) as vLLM's: CPU pipelines are slower, so the tails reach further.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


class _EngineCounts(Protocol):
    num_running: int
    num_waiting: int
    fenced: str | None  # why new requests are refused, None while admitting
    heartbeat: object | None  # launcher/coordinator/stage_heartbeat.py, or None

    def healthy(self) -> tuple[bool, str]: ...


class _PipelineCollector:
    """Collected at scrape time: speculation totals and per-stage time accounts (the latter skipped
    while the engine is fenced: a scrape never waits on a dead or hung stage)."""

    def __init__(self, coordinator: Coordinator, model_name: str, engine: _EngineCounts) -> None:
        self.coordinator, self.model_name, self.engine = coordinator, model_name, engine

    def collect(self):
        spec = self.coordinator.spec
        for name, doc, value in (
            ("spec_decode_num_draft_tokens", "Draft tokens sent into the pipeline.", spec.drafted_tokens),
            ("spec_decode_num_verified_tokens", "Draft tokens verified against the last stage.", spec.verified_drafts),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.accepted_tokens),
            ("squashed_items", "In-flight items discarded by squashes (wrong drafts, finished sequences).",
             spec.squashed_items),
            ("grammar_forced_drafts", "Draft items sent whose token a structured output's grammar forced (one allowed token).",
             spec.grammar_forced),
            ("grammar_replaced_drafts", "Drafts the grammar forbids, replaced by an allowed candidate.",
             spec.grammar_replaced),
            ("grammar_dropped_drafts", "Drafts the grammar forbids with no allowed candidate, not sent.",
             spec.grammar_dropped),
            ("grammar_jump_tokens", "Forced tokens sent as the rows after an item's first (jump-forward: a draft item's, or a real item's riding run).",
             spec.grammar_jump_tokens),
            ("grammar_jump_verified_tokens", "Of the verified draft tokens, the forced rows of jump-forward items.",
             spec.jump_verified),
            ("grammar_jump_accepted_tokens", "Of the accepted draft tokens, the forced rows of jump-forward items.",
             spec.jump_accepted),
            ("spec_decode_disabled_steps", "Micro-batches sent while speculation was paused by load "
             "(--speculative-disable-by-batch-size).", spec.spec_disabled_steps),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        yield from self._failover_families()
        # a silent or restarting stage would hold every scrape
        if self.engine.fenced is not None or (self.engine.heartbeat is not None and not self.engine.healthy()[0]):
            return
        try:
            stats = self.coordinator.stage_stats(timeout_s=SCRAPE_STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead stage shows up in /health, not as a failed scrape
            return
        timeline, recorded = self.coordinator.timeline, getattr(self.coordinator, "record_timeline", True)
        families = {
            "busy": CounterMetricFamily(PREFIX + "stage_busy_seconds", "Seconds the stage spent computing.",
                                        labels=["stage"]),
            "useful": CounterMetricFamily(PREFIX + "stage_useful_seconds",
                                          "Seconds of compute whose results were committed.", labels=["stage"]),
            "wasted": CounterMetricFamily(PREFIX + "stage_wasted_seconds",
                                          "Seconds of compute whose results were squashed.", labels=["stage"]),
            "idle": CounterMetricFamily(PREFIX + "stage_idle_seconds", "Seconds the stage waited for work.",
                                        labels=["stage"]),
        }
        slots = GaugeMetricFamily(PREFIX + "stage_kv_slots_in_use", "KV-cache slots holding a sequence.",
                                  labels=["stage"])
        for i, st in enumerate(stats):
            label = [str(i)]
            # One source for busy = useful + wasted: the timeline's slices when recorded (the stage's
            # own busy counter is timed differently and can read slightly below their sum).
            busy_ns = timeline.useful_ns[i] + timeline.wasted_ns[i] if recorded else st.busy_ns
            families["busy"].add_metric(label, busy_ns / 1e9)
            families["useful"].add_metric(label, timeline.useful_ns[i] / 1e9)
            families["wasted"].add_metric(label, timeline.wasted_ns[i] / 1e9)
            families["idle"].add_metric(label, max(0, st.wall_ns - busy_ns) / 1e9)
            slots.add_metric(label, st.kv_slots_in_use)
        yield from families.values()
        yield slots

    def _failover_families(self):
        """Restarts so far, restarts left in the budget's window, a fail-over in progress, and
        whether new requests are admitted (launcher/coordinator/stage_failover.py)."""
        lab, coord = [self.model_name], self.coordinator
        restarts = CounterMetricFamily(PREFIX + "stage_restarts", "Stage restarts (fail-overs) so far.",
                                       labels=["model_name"])
        restarts.add_metric(lab, coord.num_restarts)
        yield restarts
        if coord.failover is not None:
            ledger = coord.failover.budget
            left = GaugeMetricFamily(PREFIX + "stage_restarts_left", "Restarts --max-stage-restarts still allows "
                                     "within --restart-window-s (0: the next stage failure fences the server).",
                                     labels=["model_name"])
            left.add_metric(lab, ledger.left(time.monotonic()))
            yield left
        for name, doc, value in (
            ("stage_recovering", "1 while failed stages are restarted and running requests replayed.",
             coord.recovering is not None),
            ("accepting_requests", "1 while new requests are admitted; 0 when draining or fenced after a "
             "failure (HTTP 503, gRPC UNAVAILABLE).", self.engine.fenced is None),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(lab, int(value))
            yield g


class ServingMetrics:
    """The serving metrics of one server, in a private registry (several servers per process in tests)."""

    def __init__(self, coordinator: Coordinator, *, model_name: str, engine: _EngineCounts) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", lab,
                               buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive output chunks "
                              "of a request (the tokens committed together are one chunk).", lab,
                              buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", lab,
                              buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", lab, registry=r).labels(model_name)
        self._gen = Counter(PREFIX + "generation_tokens", "Generated tokens.", lab, registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                [*lab, "finished_reason"], registry=r)
        self._rejected = Counter(PREFIX + "request_rejected", "Requests refused (queue_full).",
                                 [*lab, "reason"], registry=r)
        Gauge(PREFIX + "num_requests_running", "Requests holding a KV slot.", lab,
              registry=r).labels(model_name).set_function(lambda: engine.num_running)
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a KV slot.", lab,
              registry=r).labels(model_name).set_function(lambda: engine.num_waiting)
        r.register(_PipelineCollector(coordinator, model_name, engine))
        self._lock = threading.Lock()
        self.generation_tokens = 0  # plain totals for the stats log line
        self.finished_requests = 0

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def add_prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def add_generation_tokens(self, n: int) -> None:
        self._gen.inc(n)
        with self._lock:
            self.generation_tokens += n

    def observe_finish(self, reason: str, e2e_s: float) -> None:
        """A finished request; reason: the pipeline's (eos, stop, length, aborted), labelled as
        vLLM labels it (stop, length, abort)."""
        self._e2e.observe(e2e_s)
        self._success.labels(self.model_name, FINISH_REASONS.get(reason, reason)).inc()
        with self._lock:
            self.finished_requests += 1

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class StatsLogger:
    """Logs one line every `interval_s`: tokens/s, running/waiting requests, acceptance, bubble fraction
    (while idle: only the first interval's line).

    Bubble fraction = the stages' mean idle share of the interval's wall time (ARCHITECTURE.md §1).
    """

    def __init__(self, coordinator: Coordinator, metrics: ServingMetrics, engine: _EngineCounts, *,
                 interval_s: float) -> None:
        self.coordinator, self.metrics, self.engine, self.interval_s = coordinator, metrics, engine, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-logger", daemon=True)

    def start(self) -> None:
        if self.interval_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def line(self, prev: dict) -> tuple[str, dict]:
        """The stats line for the interval since `prev` (a snapshot dict), and the new snapshot."""
        now = time.perf_counter()
        spec = self.coordinator.spec
        try:
            stages = [(st.wall_ns, st.busy_ns) for st in self.coordinator.stage_stats()]
        except Exception:  # noqa: BLE001
            stages = []
        snap = {"t": now, "tokens": self.metrics.generation_tokens, "verified": spec.verified_drafts,
                "accepted": spec.accepted_tokens, "stages": stages}
        dt = now - prev.get("t", now) or 1e-9
        tps = (snap["tokens"] - prev.get("tokens", 0)) / dt
        verified = snap["verified"] - prev.get("verified", 0)
        acc = f"{(snap['accepted'] - prev.get('accepted', 0)) / verified:.0%}" if verified else "-"
        idle = []
        for (wall, busy), (pwall, pbusy) in zip(stages, prev.get("stages", []), strict=False):
            if wall > pwall:
                idle.append(1 - (busy - pbusy) / (wall - pwall))
        bubble = f"{sum(idle) / len(idle):.0%}" if idle else "-"
        text = (f"generation {tps:.1f} tokens/s, running {self.engine.num_running}, waiting {self.engine.num_waiting}, "
                f"draft acceptance {acc}, bubble fraction {bubble}")
        return text, snap

    def _run(self) -> None:
        _, snap = self.line({})
        was_idle = True
        while not self._stop.wait(self.interval_s):
            tokens_before = snap["tokens"]
            text, snap = self.line(snap)
            idle = snap["tokens"] == tokens_before and not self.engine.num_running and not self.engine.num_waiting
            if not (idle and was_idle):  # an idle server logs one line, not one every interval
                log.info("%s", text)
            was_idle = idle
