"""`PipelineOptions`: the run configuration of a launch, plus where its stages are placed.

Owns the launcher's part of the one config spine: `RunConfig` (pipeline/run_config.py: model,
limits, speculation; validated there) extended with the placement (launcher/backends/placement.py), the
stages' log level and whether model conversion shows a progress bar. Front ends (CLI, server,
benchmarks, tests) build one of these and nothing else; the coordinator's and the stages' views are
derived from it in launcher/coordinator/session.py.
Must not: parse command lines (launcher/cli/main.py) or resolve models (launcher/coordinator/run_plan.py).
"""

from __future__ import annotations

import dataclasses

from launcher.backends.placement import PlacementOptions, node_stages, parallel_stages
from pipeline.engine.records import DEEP_ACCEPTANCE
from pipeline.run_config import RunConfig
from workers.log_config import LOG_LEVELS, default_log_level

DRAFT_AT = ("coordinator", "stage")  # --draft-at: who makes a draft from an exit guess (first: default)
DECODE_FEED = ("coordinator", "stage")  # --decode-feed: who sends greedy decode's next item (pipeline/engine/decode_feed.py)
DEFAULT_DECODE_FEED = "stage"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions(RunConfig):
    """Where and how to run the pipeline (everything except the requests).

    Raises ValueError naming the parameter (RunConfig's checks), or PlacementError (a ValueError)
    when the placement cannot hold `num_stages` (every node runs at least one stage).
    """

    placement: PlacementOptions = dataclasses.field(default_factory=PlacementOptions)
    log_level: str = dataclasses.field(default_factory=default_log_level)  # of the stage processes
    progress: bool = True  # a progress bar while converting a model
    # "stage": the exit stage drafts itself when it is stage 0 (pipeline/engine/local_draft.py)
    draft_at: str = DRAFT_AT[0]
    # with draft_at "stage": a deep draft's parent bucket must be right this often (local_draft.py, 5-6)
    deep_draft_min_acceptance: float = DEEP_ACCEPTANCE
    # "stage": the last stage feeds plain greedy decode itself (pipeline/engine/decode_feed.py)
    decode_feed: str = DEFAULT_DECODE_FEED

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.draft_at not in DRAFT_AT:
            raise ValueError(f"draft_at must be one of {', '.join(DRAFT_AT)}, got {self.draft_at!r}")
        if self.decode_feed not in DECODE_FEED:
            raise ValueError(f"decode_feed must be one of {', '.join(DECODE_FEED)}, got {self.decode_feed!r}")
        if not 0.0 <= self.deep_draft_min_acceptance <= 1.0:
            raise ValueError(f"deep_draft_min_acceptance must be in [0, 1], got {self.deep_draft_min_acceptance}")
        if self.draft_at == "stage" and self.draft_tree > 1:
            # a stage-made draft carries no siblings and the rescue path assumes the coordinator
            # drafted (pipeline/speculation/tree.py); the two were not built or tested together
            raise ValueError(f"draft_tree {self.draft_tree} needs draft_at coordinator: token trees and "
                             f"stage-local drafting do not combine yet")
        if self.placement.multi_node:
            node_stages(num_stages=self.num_stages, nnodes=self.placement.nnodes, node_rank=self.placement.node_rank)

    @property
    def parallel_stages(self) -> int:
        """How many of the stages can compute at the same time, for the draft gate's break-even
        (launcher/backends/placement.py `parallel_stages`: reads this machine's CPUs for local CPU stages)."""
        return parallel_stages(self.placement, num_stages=self.num_stages, device=self.device,
                               threads_per_stage=self.threads_per_stage)
