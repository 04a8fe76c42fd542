"""The `launch` command line as a user runs it: subprocesses of the installed entry points.

Happy paths on the tiny model (fast) and one on the real default model: the `--json` report's shape,
`launch` == `speedpipe launch`, `--prompts-file` in plain and JSONL form. Bad input: every case
exits 2 with a one-line error naming the value and the limit, no traceback, and no stage process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from launcher.backends.placement import usable_cpus
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
LAUNCH = [str(BIN / "launch")]
SPEEDPIPE_LAUNCH = [str(BIN / "speedpipe"), "launch"]
MODULE_LAUNCH = [sys.executable, "-m", "launcher.cli.main", "launch"]
TAG_ENV = "SPEEDPIPE_TEST_CLI_TAG"
PIPELINE_RUN_TIMEOUT_S = 180
BAD_INPUT_TIMEOUT_S = 60
PROMPTS = ("Hello there", "The answer is")


@dataclasses.dataclass(frozen=True)
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    workers_left: list[str]  # stage-worker command lines still alive after the command exited

    def report(self) -> dict:
        """The `--json` report: the last stdout line."""
        assert self.returncode == 0, f"{self.args} exited {self.returncode}:\n{self.stderr[-3000:]}"
        return json.loads(self.stdout.strip().splitlines()[-1])


def _workers_with_tag(tag: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if ("workers.stage_worker" in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE
                    and proc.environ().get(TAG_ENV) == tag):
                found.append(f"pid {proc.pid}: {cmdline}")
                proc.kill()  # never leak it into later tests
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def run_cli(command: list[str], args: list[str], *, timeout_s: float) -> CliResult:
    """Run a CLI command to completion with a marker in its environment that its stage workers
    inherit, then list any stage worker carrying the marker that is still alive."""
    if not Path(command[0]).exists():
        pytest.fail(f"console script {command[0]} is not installed (pip install -e .)")
    tag = uuid.uuid4().hex
    env = dict(os.environ, **{TAG_ENV: tag})
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout_s, env=env,
                          stdin=subprocess.DEVNULL)
    return CliResult([*command, *args], proc.returncode, proc.stdout, proc.stderr, _workers_with_tag(tag))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli-tiny") / "model")


# -- happy paths on the tiny model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompts")
    plain = root / "prompts.txt"
    plain.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")  # blank lines are skipped
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return {"plain": plain, "jsonl": jsonl}


def _tiny_args(tiny_dir: Path, prompts_file: Path) -> list[str]:
    return ["--model", str(tiny_dir), "--stages", "2", "--prompts-file", str(prompts_file),
            "--max-new-tokens", "6", "--ignore-eos", "--json"]


@pytest.fixture(scope="module")
def speedpipe_launch_plain(tiny_dir: Path, prompt_files) -> CliResult:
    """`speedpipe launch --json` with a plain prompts file."""
    return run_cli(SPEEDPIPE_LAUNCH, _tiny_args(tiny_dir, prompt_files["plain"]), timeout_s=PIPELINE_RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def launch_jsonl(tiny_dir: Path, prompt_files) -> CliResult:
    """`launch --json` with the same prompts as a JSONL prompts file."""
    return run_cli(LAUNCH, _tiny_args(tiny_dir, prompt_files["jsonl"]), timeout_s=PIPELINE_RUN_TIMEOUT_S)


def check_report_schema(report: dict, *, num_prompts: int, num_stages: int, max_new_tokens: int) -> None:
    """outputs[].{prompt,text,token_ids,finish_reason}; stats.{wall_s,generated_tokens,tokens_per_s,
    stages[].{stage,layers,busy_fraction,rss_mb,weights_mb}} with consistent values."""
    outputs, stats = report["outputs"], report["stats"]
    assert len(outputs) == num_prompts
    for out in outputs:
        assert isinstance(out["prompt"], str) and isinstance(out["text"], str)
        assert isinstance(out["token_ids"], list) and all(isinstance(t, int) for t in out["token_ids"])
        assert len(out["token_ids"]) == max_new_tokens and out["finish_reason"] == "length"
    assert stats["generated_tokens"] == sum(len(o["token_ids"]) for o in outputs)
    assert stats["wall_s"] > 0 and stats["tokens_per_s"] > 0
    assert stats["tokens_per_s"] == pytest.approx(stats["generated_tokens"] / stats["wall_s"], rel=0.01)
    stages = stats["stages"]
    assert [s["stage"] for s in stages] == list(range(num_stages))
    assert stages[0]["layers"][0] == 0
    assert all(a["layers"][1] == b["layers"][0] for a, b in zip(stages, stages[1:], strict=False))
    for s in stages:
        assert 0.0 <= s["busy_fraction"] <= 1.0
        assert s["rss_mb"] > s["weights_mb"] > 0
    documented = readme_stats_names()
    undocumented = sorted((set(stats) | {k for s in stages for k in s}) - documented - {"stage"})
    assert not undocumented, f"README's `--json` stats paragraph does not name {undocumented}"


def readme_stats_names() -> set[str]:
    """Every `name` (and both halves of `a/b`-style `x_p50/p99`) in the README paragraph that starts
    with `--json` stats."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    start = text.index("`--json` stats:")
    names = set()
    for tok in re.findall(r"`([a-z0-9_/]+)`", text[start:text.index("\n\n", start)]):
        head, _, tail = tok.partition("/")
        names.add(head.strip("_"))
        if tail:  # ttft_ms_p50/p99 -> ttft_ms_p50, ttft_ms_p99
            names.add(head.rsplit("_", 1)[0] + "_" + tail)
    return names


def test_json_last_stdout_line_has_outputs_and_stage_stats(speedpipe_launch_plain: CliResult):
    report = speedpipe_launch_plain.report()
    check_report_schema(report, num_prompts=2, num_stages=2, max_new_tokens=6)
    assert report["stats"]["stages"][-1]["layers"][1] == 4
    # the default --speculate auto, and why it chose none: nothing trained ships for a tiny model
    assert report["stats"]["speculate"] == "none"
    assert report["stats"]["speculate_reason"].startswith("no trained exit head ships for"), report["stats"]
    assert speedpipe_launch_plain.workers_left == []


def test_prompts_file_plain_and_jsonl_give_the_prompts_in_order(speedpipe_launch_plain, launch_jsonl):
    for result in (speedpipe_launch_plain, launch_jsonl):
        assert [o["prompt"] for o in result.report()["outputs"]] == list(PROMPTS)


def test_launch_and_speedpipe_launch_are_the_same_command(speedpipe_launch_plain, launch_jsonl):
    def outputs(result: CliResult):
        return [(o["prompt"], o["text"], o["token_ids"], o["finish_reason"]) for o in result.report()["outputs"]]

    assert outputs(launch_jsonl) == outputs(speedpipe_launch_plain)
    assert launch_jsonl.workers_left == []


# -- happy path on the real model ---------------------------------------------------------------------

def test_real_model_json_run(smollm2_dir: Path, smollm2_cache: Path):
    result = run_cli(LAUNCH, ["--cache-dir", str(smollm2_cache), "--stages", "2", "--prompt",
                              "What is the capital of France?", "--max-new-tokens", "8", "--ignore-eos", "--json"],
                     timeout_s=PIPELINE_RUN_TIMEOUT_S)
    report = result.report()
    check_report_schema(report, num_prompts=1, num_stages=2, max_new_tokens=8)
    assert report["stats"]["stages"][-1]["layers"][1] == 30
    assert report["outputs"][0]["text"].strip()
    assert sum(s["weights_mb"] for s in report["stats"]["stages"]) > 400  # 134.5 M float32 parameters
    stats = report["stats"]
    own_cpus = usable_cpus() >= 2  # auto speculates where each stage has its own CPU
    assert stats["speculate"] == ("speed" if own_cpus else "none"), stats["speculate_reason"]
    if own_cpus and "speedup_estimate" in stats:  # absent on a host busier than its CPUs (tests/unit/test_launch_report.py)
        assert stats["plain_tpot_ms_estimate"] > 0 and 0.3 < stats["speedup_estimate"] < 3, stats
    if not own_cpus:
        assert "speedup_estimate" not in stats
    assert result.workers_left == []


# -- bad input ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BadInput:
    args: tuple[str, ...]
    expected: tuple[str, ...]  # substrings of the one-line error: the value and the limit


def bad_inputs(tiny_dir: Path, tmp: Path) -> dict[str, BadInput]:
    truncated = shutil.copytree(tiny_dir, tmp / "truncated-model")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    bad_jsonl = tmp / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    no_field = tmp / "no-field.jsonl"
    no_field.write_text('{"text": "where is the prompt"}\n')
    missing_file = tmp / "no-such-prompts.txt"
    missing_dir = tmp / "no" / "such" / "model"
    return {
        "unknown-model-name": BadInput(("--model", "no-such-model"), ("'no-such-model'", "smollm2-135m")),
        "model-path-missing": BadInput(("--model", str(missing_dir)), (str(missing_dir),)),
        "truncated-safetensors": BadInput(("--model", str(truncated)), (str(weights), "truncated")),
        "stages-0": BadInput(("--stages", "0"), ("--stages", "got 0", ">= 1")),
        "stages-5-on-4-layers": BadInput(("--stages", "5"), ("--stages 5", "4 layers")),
        "layer-split-sum": BadInput(("--layer-split", "1,2"), ("1,2", "sums to 3", "4 layers")),
        "layer-split-stage-count": BadInput(("--stages", "3", "--layer-split", "2,2"), ("2,2", "2 stages", "3")),
        "empty-prompt": BadInput(("--prompt", ""), ("prompt 0", "empty")),
        "prompt-plus-new-tokens-over-max-model-len": BadInput(
            ("--prompt", "hello world", "--max-new-tokens", "10", "--max-model-len", "16"),
            ("11 tokens", "10", "21", "--max-model-len 16")),
        "max-new-tokens-0": BadInput(("--max-new-tokens", "0"), ("--max-new-tokens", "got 0", "> 0")),
        "temperature-negative": BadInput(("--temperature", "-1"), ("--temperature", "-1", ">= 0")),
        "top-p-0": BadInput(("--top-p", "0"), ("--top-p", "got 0", "(0, 1]")),
        "top-p-1.5": BadInput(("--top-p", "1.5"), ("--top-p", "got 1.5", "(0, 1]")),
        "prompts-file-missing": BadInput(("--prompts-file", str(missing_file)), (str(missing_file), "does not exist")),
        "prompts-file-bad-jsonl-line": BadInput(("--prompts-file", str(bad_jsonl)), (f"{bad_jsonl}:2", "JSON")),
        "prompts-file-jsonl-without-prompt": BadInput(("--prompts-file", str(no_field)), (f"{no_field}:1", "'prompt'")),
        "min-acceptance-1.5": BadInput(("--speculate", "speed", "--min-acceptance", "1.5"),
                                       ("--min-acceptance", "'1.5'", "[0, 1]")),
        "stage-resources-not-json": BadInput(("--backend", "ray", "--stage-resources", "{GPU: 1}"),
                                             ("--stage-resources", "not valid JSON", "{GPU: 1}")),
        "nnodes-with-ray": BadInput(("--backend", "ray", "--nnodes", "2"), ("--nnodes > 1", "drop --backend ray")),
        "nnodes-over-stages": BadInput(("--nnodes", "3"), ("--nnodes 3", "--stages 2")),
        "firp-k-0": BadInput(("--speculate", "firp", "--firp-k", "0"), ("--firp-k", "got 0", ">= 1")),
        "firp-without-a-file": BadInput(("--speculate", "firp"), ("--speculate firp", "--firp-file", "no FIRP maps are shipped")),
        "firp-file-missing": BadInput(("--speculate", "firp", "--firp-file", str(missing_file)),
                                      (str(missing_file), "does not exist")),
        "draft-tree-where-auto-chose-none": BadInput(("--draft-tree", "3"),
                                                     ("--draft-tree", "auto chose none", "--speculate speed")),
        "firp-k-under-auto": BadInput(("--firp-k", "2"), ("--firp-k", "FIRP", "--speculate firp")),
    }


BAD_INPUT_NAMES = [  # test ids, in the order of bad_inputs()
    "unknown-model-name", "model-path-missing", "truncated-safetensors", "stages-0", "stages-5-on-4-layers",
    "layer-split-sum", "layer-split-stage-count", "empty-prompt", "prompt-plus-new-tokens-over-max-model-len",
    "max-new-tokens-0", "temperature-negative", "top-p-0", "top-p-1.5", "prompts-file-missing",
    "prompts-file-bad-jsonl-line", "prompts-file-jsonl-without-prompt", "min-acceptance-1.5", "stage-resources-not-json",
    "nnodes-with-ray", "nnodes-over-stages", "firp-k-0", "firp-without-a-file", "firp-file-missing",
    "draft-tree-where-auto-chose-none", "firp-k-under-auto",
]


def _full_args(tiny_dir: Path, case: BadInput) -> list[str]:
    args = list(case.args)
    if "--model" not in args:
        args = ["--model", str(tiny_dir), *args]
    if "--stages" not in args:
        args += ["--stages", "2"]
    if "--prompt" not in args and "--prompts-file" not in args:
        args += ["--prompt", "hello"]
    return args


@pytest.fixture(scope="module")
def bad_input_results(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[BadInput, CliResult]]:
    """Every bad-input case run once (`python -m launcher.cli.main launch`), two at a time."""
    cases = bad_inputs(tiny_dir, tmp_path_factory.mktemp("bad-input"))
    assert list(cases) == BAD_INPUT_NAMES
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, MODULE_LAUNCH, _full_args(tiny_dir, case), timeout_s=BAD_INPUT_TIMEOUT_S)
                   for name, case in cases.items()}
        return {name: (cases[name], fut.result()) for name, fut in futures.items()}


@pytest.mark.parametrize("name", BAD_INPUT_NAMES)
def test_bad_input_exits_2_with_a_one_line_error_and_no_stage_process(name, bad_input_results):
    case, result = bad_input_results[name]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"exit {result.returncode}; stderr:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("speedpipe launch: error: "), lines[0]
    for expected in case.expected:
        assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"
    assert result.workers_left == []
