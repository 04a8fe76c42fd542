"""Failure paths of a running pipeline (ARCHITECTURE.md §9): a stage killed, hung or unable to load,
and the `launch` CLI interrupted or killed. Each must fail in-flight requests with an error naming
the stage, within a bounded time, and leave no stage process behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from launcher.coordinator.coordinator import PipelineError, RequestHandle
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from pipeline.speculation.sampling import SamplingParams
from tests.conftest import wait_for
from tests.distributed.conftest import (
    env_with_tag,
    pid_alive,
    session_options,
    stage_worker_processes,
    started_session,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

LONG = SamplingParams(max_new_tokens=4000, ignore_eos=True)  # far longer than any test waits
LONG_MODEL_LEN = 4096
DETECT_S = 30.0  # a dead stage must fail its requests within this
CLOSE_S = 20.0  # closing a failed session must stop every process within this
TAG_ENV = "SPEEDPIPE_TEST_FAILURES_TAG"


def wait_for_tokens(handle: RequestHandle, n: int, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until `handle` has committed `n` tokens (so generation is under way)."""
    def enough() -> bool:
        if handle.error is not None:
            raise handle.error
        return len(handle.token_ids) >= n

    if not wait_for(enough, timeout_s=timeout_s):
        pytest.fail(f"only {len(handle.token_ids)} tokens after {timeout_s} s")


def wait_until_dead(pids, timeout_s: float) -> list[int]:
    """Wait (bounded) until none of `pids` is alive; returns those still alive at the deadline."""
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout_s=timeout_s)
    return [p for p in pids if pid_alive(p)]


@dataclasses.dataclass
class FailedRun:
    """What happened when a stage was broken mid-generation."""

    pids: list[int]
    error: BaseException | None
    detect_s: float
    submit_error: BaseException | None  # submitting after the failure
    close_s: float
    alive_after_close: list[int]


def break_a_stage_mid_generation(model_dir: Path, *, num_stages: int, stage: int, sig: signal.Signals,
                                 stage_timeout_s: float) -> FailedRun:
    options = session_options(model_dir, num_stages, max_model_len=LONG_MODEL_LEN, stage_timeout_s=stage_timeout_s)
    session = PipelineSession(options, resolve(options)).__enter__()
    try:
        pids = list(session.processes.pids)
        handle = session.coordinator.submit("Once upon a time", LONG)
        wait_for_tokens(handle, 3)
        os.kill(pids[stage], sig)
        start = time.monotonic()
        error = None
        try:
            handle.result(timeout_s=DETECT_S)
        except (PipelineError, TimeoutError) as exc:
            error = exc
        detect_s = time.monotonic() - start
        submit_error = None
        try:
            session.coordinator.submit("x", SamplingParams(max_new_tokens=2)).result(timeout_s=5)
        except (PipelineError, TimeoutError) as exc:
            submit_error = exc
    finally:
        start = time.monotonic()
        session.close()
        close_s = time.monotonic() - start
    return FailedRun(pids, error, detect_s, submit_error, close_s, wait_until_dead(pids, 2.0))


# -- a stage killed -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed_stage(tiny_model_dir: Path) -> FailedRun:
    """Stage 1 of 3 SIGKILLed while a long request is being generated."""
    return break_a_stage_mid_generation(tiny_model_dir, num_stages=3, stage=1, sig=signal.SIGKILL,
                                        stage_timeout_s=60.0)


def test_kill_9_of_a_stage_fails_the_request_naming_that_stage(killed_stage: FailedRun):
    assert isinstance(killed_stage.error, PipelineError), killed_stage.error
    assert "stage 1" in str(killed_stage.error)
    assert killed_stage.detect_s < DETECT_S


def test_requests_submitted_after_a_stage_died_fail(killed_stage: FailedRun):
    assert isinstance(killed_stage.submit_error, PipelineError), killed_stage.submit_error
    assert "stage 1" in str(killed_stage.submit_error)


def test_closing_a_session_with_a_dead_stage_stops_every_stage_process(killed_stage: FailedRun):
    assert killed_stage.alive_after_close == []
    assert killed_stage.close_s < CLOSE_S


def test_a_new_session_starts_in_the_same_process_after_a_failed_one(killed_stage: FailedRun, tiny_model_dir):
    with started_session(session_options(tiny_model_dir, 1)) as session:
        out = session.coordinator.submit("abc", SamplingParams(max_new_tokens=4, ignore_eos=True)).result(60)
    assert len(out.token_ids) == 4


# -- a stage hung -------------------------------------------------------------------------------------

HUNG_STAGE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def hung_stage(tiny_model_dir: Path) -> FailedRun:
    """Stage 0 of 2 SIGSTOPped (alive but silent) mid-generation, with --stage-timeout-s 3."""
    return break_a_stage_mid_generation(tiny_model_dir, num_stages=2, stage=0, sig=signal.SIGSTOP,
                                        stage_timeout_s=HUNG_STAGE_TIMEOUT_S)


def test_a_hung_stage_fails_the_request_within_the_stage_timeout(hung_stage: FailedRun):
    assert isinstance(hung_stage.error, PipelineError), hung_stage.error
    assert hung_stage.detect_s < 3 * HUNG_STAGE_TIMEOUT_S
    assert isinstance(hung_stage.submit_error, PipelineError), hung_stage.submit_error


def test_the_timeout_message_names_the_hung_stage_not_the_one_waiting_for_it(tiny_model_dir: Path):
    """Stage 1 of 3 stopped: the first timeout to fire is the coordinator's receive from stage 2, or
    stage 0's / stage 2's own wait (they then exit 3); whichever it is, the error names stage 1."""
    run = break_a_stage_mid_generation(tiny_model_dir, num_stages=3, stage=1, sig=signal.SIGSTOP,
                                       stage_timeout_s=HUNG_STAGE_TIMEOUT_S)
    assert isinstance(run.error, PipelineError), run.error
    assert str(run.error).startswith("stage 1 is hung"), run.error
    assert run.alive_after_close == []


def test_closing_a_session_with_a_hung_stage_stops_every_stage_process(hung_stage: FailedRun):
    assert hung_stage.alive_after_close == []
    assert hung_stage.close_s < CLOSE_S


# -- a stage that cannot load -------------------------------------------------------------------------

def test_a_shard_deleted_after_validation_fails_load_naming_the_stage(tiny_sharded_dir: Path, tmp_path: Path):
    model_dir = shutil.copytree(tiny_sharded_dir, tmp_path / "model")
    options = session_options(model_dir, 2)
    model = resolve(options)  # validates every stage's tensors against the files
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage \d+ failed to load") as err:
        with PipelineSession(options, model):
            pass
    assert time.monotonic() - start < DETECT_S
    assert "model-00002-of-00002.safetensors" in str(err.value)


def test_a_corrupt_shard_of_the_last_stage_fails_load_naming_that_stage_promptly(tiny_sharded_dir: Path,
                                                                                  tmp_path: Path):
    model_dir = shutil.copytree(tiny_sharded_dir, tmp_path / "model")
    options = session_options(model_dir, 2, stage_timeout_s=60.0)  # failing within half of it = not waiting for it
    model = resolve(options)
    shard = model_dir / "model-00002-of-00002.safetensors"  # layers 2-3 + norm: only stage 1 reads it
    os.truncate(shard, shard.stat().st_size // 2)  # header intact, data cut: found only when loading
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        with PipelineSession(options, model):
            pass
    elapsed = time.monotonic() - start
    assert "stage 1 failed to load" in str(err.value) and "truncated" in str(err.value)
    assert str(err.value).count("stage 1") == 1, err.value  # before: "stage 1 failed to load: stage 1: ..."
    assert elapsed < 30.0, f"load failure took {elapsed:.1f} s: it waited for the data-plane timeout"


# -- the CLI interrupted or killed --------------------------------------------------------------------

def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it. A test run started in
    the background (`pytest &`, nohup) ignores SIGINT, and an ignored signal stays ignored across exec,
    so the launcher would never see the Ctrl-C this file sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class CliRun:
    """`launch` on the tiny model in its own session (process group), streaming one long prompt."""

    def __init__(self, model_dir: Path) -> None:
        self.tag = uuid.uuid4().hex
        launch = Path(sys.executable).with_name("launch")
        command = [str(launch)] if launch.exists() else [sys.executable, "-m", "launcher.cli.main", "launch"]
        self.proc = subprocess.Popen(
            [*command, "--model", str(model_dir), "--stages", "2", "--prompt", "Once upon a time",
             "--max-new-tokens", "4000", "--max-model-len", str(LONG_MODEL_LEN), "--ignore-eos"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env=env_with_tag(TAG_ENV, self.tag), preexec_fn=_terminal_sigint)
        self.stdout, self.stderr = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, buf: bytearray) -> None:
        while chunk := stream.read1(4096):
            buf.extend(chunk)

    def wait_for_generation(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded) until generated text is streamed after the echoed prompt."""
        want = len("Once upon a time") + 8
        wait_for(lambda: len(self.stdout) >= want or self.proc.poll() is not None, timeout_s=timeout_s)
        if len(self.stdout) < want:
            self.kill()
            pytest.fail(f"launch did not start generating (rc {self.proc.returncode}):\n"
                        f"{self.stderr.decode(errors='replace')[-3000:]}")

    def workers(self):
        return stage_worker_processes(env_tag=(TAG_ENV, self.tag))

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.kill()
            for t in self._readers:
                t.join(timeout=5)

    def kill(self) -> None:
        """Last resort: SIGKILL the whole process group (the CLI and its workers, orphans included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)


@dataclasses.dataclass
class InterruptedCli:
    returncode: int
    stderr: str
    workers_left: list


@pytest.fixture(scope="module")
def ctrl_c_cli(tiny_model_dir: Path) -> InterruptedCli:
    """`launch` mid-generation receiving SIGINT on its whole process group (a terminal's Ctrl-C)."""
    run = CliRun(tiny_model_dir)
    run.wait_for_generation()
    assert len(run.workers()) == 2
    os.killpg(run.proc.pid, signal.SIGINT)
    try:
        returncode = run.wait(timeout_s=30)
        left = wait_until_dead([w.pid for w in run.workers()], 5.0)
    finally:
        run.kill()  # no-op unless something survived
    return InterruptedCli(returncode, run.stderr.decode(errors="replace"), left)


def test_ctrl_c_of_launch_exits_130_and_leaves_no_stage_process(ctrl_c_cli: InterruptedCli):
    assert ctrl_c_cli.returncode == 130, ctrl_c_cli.stderr[-3000:]
    assert "interrupted" in ctrl_c_cli.stderr
    assert ctrl_c_cli.workers_left == []


def test_ctrl_c_of_launch_prints_no_traceback(ctrl_c_cli: InterruptedCli):
    assert "Traceback" not in ctrl_c_cli.stderr, ctrl_c_cli.stderr[-3000:]


def test_sigterm_of_launch_exits_143_and_leaves_no_stage_process(tiny_model_dir: Path):
    """SIGTERM to the CLI alone (systemd's default KillMode sends it to the main process first):
    the same teardown as Ctrl-C, reported as SIGTERM, with SIGTERM's conventional status 143
    (it exited 130, Ctrl-C's)."""
    run = CliRun(tiny_model_dir)
    run.wait_for_generation()
    pids = [w.pid for w in run.workers()]
    assert len(pids) == 2
    run.proc.send_signal(signal.SIGTERM)
    try:
        returncode = run.wait(timeout_s=30)
        left = wait_until_dead(pids, 5.0)
    finally:
        run.kill()
    stderr = run.stderr.decode(errors="replace")
    assert returncode == 143 and "terminated (SIGTERM); all stages stopped" in stderr, stderr[-3000:]
    assert left == [] and "Traceback" not in stderr


def test_sigkill_of_launch_makes_its_stage_processes_exit_within_10_s(tiny_model_dir: Path):
    run = CliRun(tiny_model_dir)
    run.wait_for_generation()
    pids = [w.pid for w in run.workers()]
    assert len(pids) == 2
    os.kill(run.proc.pid, signal.SIGKILL)  # the CLI only: its workers must notice on their own
    try:
        assert run.wait(timeout_s=10) == -signal.SIGKILL
        assert wait_until_dead(pids, 10.0) == []
    finally:
        run.kill()  # orphans are no longer our children: the leak fixture would not see them


# -- non-finite logits ----------------------------------------------------------------------------------

def test_nan_weights_fail_each_request_with_one_line_and_the_pipeline_stays_up(tiny_model_dir: Path, tmp_path: Path,
                                                                               capsys):
    """[Note: non-finite logits] in pipeline/engine/records.py: NaN in a layer of the last stage gives
    each request a RequestError naming the cause (it used to decode token 0 without a word); no stage
    is restarted and the pipeline keeps answering; `launch` exits 1 with one line."""
    from safetensors.torch import load_file, save_file

    from launcher.cli.main import main
    from launcher.coordinator.request_handle import RequestError

    model_dir = tmp_path / "nan-model"
    shutil.copytree(tiny_model_dir, model_dir)
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        tensors = {name: t.fill_(float("nan")) if name.startswith("model.layers.3.mlp.down_proj") else t
                   for name, t in tensors.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    with started_session(session_options(model_dir, 2)) as session:
        coord = session.coordinator
        for prompt in ("Once upon a time", "abc"):
            with pytest.raises(RequestError, match=r"not finite \(NaN or inf\) at output token 0"):
                coord.submit(prompt, SamplingParams(max_new_tokens=8)).result(timeout_s=60)
        assert coord.failure is None and coord.num_restarts == 0
    assert main(["launch", "--model", str(model_dir), "--stages", "2", "--max-new-tokens", "4",
                 "--prompt", "hi", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("speedpipe launch: request failed: the model's logits are not finite"), err[-3:]
    assert not any("Traceback" in line for line in err)
    # several prompts: every output is printed (the failed ones with their error), then exit 1
    assert main(["launch", "--model", str(model_dir), "--stages", "2", "--max-new-tokens", "4", "--json",
                 "--prompt", "hi", "--prompt", "abc", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    outputs = json.loads(out.strip().splitlines()[-1])["outputs"]
    assert [o["finish_reason"] for o in outputs] == ["error", "error"] and all("not finite" in o["error"] for o in outputs)
    assert [line.split(": ")[2] for line in err.strip().splitlines()[-2:]] == ["prompt 0", "prompt 1"], err[-500:]
