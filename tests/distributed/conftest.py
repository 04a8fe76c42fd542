"""Fixtures for multi-process tests over gloo on loopback, on the tiny random model.

Owns the tiny model folders these tests share (single file and 2-shard, written once per session),
the single-process greedy / sampling reference they are compared with, and small helpers for
starting a pipeline session and finding stage-worker processes.
Must not: use real weights, the network beyond loopback, or leave processes running.

[Note: sharpened tiny model]
`write_tiny_model` draws every weight with std 0.05, so the residual stream is dominated by the
(tied) token embedding and greedy decoding mostly repeats the last token ("aaaa..."): a broken
pipeline could still produce it. The fixtures multiply the decoder layers' projection weights by
SHARPEN_FACTOR, which gives varied continuations whose top-1/top-2 logit margin stays above ~1e-3
on the prompts used here, far above the float32 noise of a different micro-batch packing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import RunPlan, resolve
from launcher.coordinator.session import PipelineSession
from pipeline.model.config import ModelConfig
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import StageModel, build_stage_model
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import Sampler, SamplingParams
from pipeline.weights.checkpoint import CheckpointReader, all_tensor_names
from tests.tiny_model import write_tiny_model

SHARPEN_FACTOR = 8.0
WORKER_MODULE = "workers.stage_worker"


def sharpen_weights(model_dir: Path, factor: float = SHARPEN_FACTOR) -> Path:
    """Scale the decoder layers' projection weights in every safetensors file of `model_dir`.

    See [Note: sharpened tiny model]. Norms and the (tied) embedding are left alone.
    """
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        scaled = {name: t * factor if name.startswith("model.layers.") and "layernorm" not in name else t
                  for name, t in tensors.items()}
        save_file(scaled, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The test process computes references on one thread: on a 2-core machine torch's spinning
    intra-op threads would otherwise starve the stage processes the test is waiting for."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sharpened tiny model (4 layers, vocab 256, tied embeddings) in one model.safetensors."""
    return sharpen_weights(write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model"))


@pytest.fixture(scope="session")
def tiny_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as `tiny_model_dir`, in two shards listed by model.safetensors.index.json."""
    return sharpen_weights(write_tiny_model(tmp_path_factory.mktemp("tiny-sharded") / "model", num_shards=2))


def session_options(model_dir: Path, num_stages: int, **overrides) -> PipelineOptions:
    """Options for a test session on loopback: quiet, no progress bar, small KV cache."""
    kwargs = dict(num_stages=num_stages, model=str(model_dir), progress=False, max_model_len=512,
                  max_num_seqs=4, stage_timeout_s=60.0, min_acceptance=0.0,  # every draft sent: squashes happen
                  row_cost="none")  # fixed FIRP chains (no timing-dependent calibration): every pass verifies one
    kwargs.update(overrides)
    return PipelineOptions(**kwargs)


@contextlib.contextmanager
def started_session(options: PipelineOptions, model: RunPlan | None = None) -> Iterator[PipelineSession]:
    """A started PipelineSession (stage processes spawned and loaded); closed on exit."""
    with PipelineSession(options, model or resolve(options)) as session:
        yield session


def full_model(model_dir: Path) -> tuple[StageModel, Tokenizer]:
    """The whole model as one in-process StageModel (float32), read from the same safetensors."""
    config = ModelConfig.from_model_dir(model_dir)
    tensors = CheckpointReader(model_dir).read(all_tensor_names(config), dtype=torch.float32)
    model = build_stage_model(config, LayerRange(0, config.num_hidden_layers), is_first=True, is_last=True,
                              tensors=tensors)
    return model, Tokenizer(model_dir)


def reference_generate(model: StageModel, prompt_ids: Sequence[int], params: SamplingParams,
                       *, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Single-process generation with a KV cache: the oracle the pipeline must reproduce.

    Greedy or seeded sampling through `pipeline.speculation.sampling.Sampler` (the draw of output
    position i keyed by (seed, i), as the coordinator's). Stops at EOS unless `params.ignore_eos`, else after max_new_tokens.
    """
    sampler = Sampler(params)
    kv = model.new_kv_cache(max_num_seqs=1, max_model_len=len(prompt_ids) + params.max_new_tokens)
    ids = list(prompt_ids)
    logits = model(torch.tensor(ids), [Span(0, 0, len(ids))], kv)[0]  # [vocab]
    out: list[int] = []
    while True:
        token = sampler.sample(logits, len(out))
        out.append(token)
        if (token in eos_token_ids and not params.ignore_eos) or len(out) == params.max_new_tokens:
            return out
        logits = model(torch.tensor([token]), [Span(0, len(ids) + len(out) - 1, 1)], kv)[0]


@dataclasses.dataclass(frozen=True)
class WorkerProcess:
    pid: int
    cmdline: str


def stage_worker_processes(*, env_tag: tuple[str, str] | None = None,
                           pids: Sequence[int] = ()) -> list[WorkerProcess]:
    """Live (non-zombie) stage-worker processes: those whose environment holds `env_tag`
    (name, value), or whose pid is in `pids`. Other users' and other tests' workers are ignored."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if WORKER_MODULE not in cmdline or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.pid in pids or (env_tag is not None and proc.environ().get(env_tag[0]) == env_tag[1]):
                found.append(WorkerProcess(proc.pid, cmdline))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def env_with_tag(name: str, value: str) -> dict[str, str]:
    """This process's environment plus one marker variable that spawned workers inherit."""
    env = dict(os.environ)
    env[name] = value
    return env
