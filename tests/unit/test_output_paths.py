"""launcher/cli/output_paths.py: output paths checked before any work, and strict JSON.

What breaks when these fail: `launch --trace DIR` runs the whole pipeline and then dies with an
IsADirectoryError traceback (losing the --json result), `--out FILE` is a traceback, and results
files hold `Infinity`, which strict JSON readers reject.
"""

from __future__ import annotations

import json
import math

import pytest

from launcher.cli.main import main
from launcher.cli.output_paths import check_output_dir, check_output_file, dumps_strict
from launcher.cli.parsing import UsageError

pytestmark = pytest.mark.timeout(60)


def test_output_file_and_folder_checks(tmp_path):
    (tmp_path / "f").write_text("")
    check_output_file("--trace", tmp_path / "new" / "t.json")  # missing parents are fine
    check_output_dir("--out", tmp_path)
    check_output_dir("--out", tmp_path / "a" / "b")
    with pytest.raises(UsageError, match="--trace .*: is a directory"):
        check_output_file("--trace", tmp_path)
    with pytest.raises(UsageError, match="--out .*f: exists and is not a directory"):
        check_output_dir("--out", tmp_path / "f")
    with pytest.raises(UsageError, match=r"--trace .*f/t.json: .*f is not a directory"):
        check_output_file("--trace", tmp_path / "f" / "t.json")
    with pytest.raises(UsageError, match=r"--out .*f/x: .*f is not a directory"):
        check_output_dir("--out", tmp_path / "f" / "x")
    for empty in ("", "  "):  # Path("") is the current folder: results landed there without a word
        with pytest.raises(UsageError, match=r"--out is empty \(give a folder; \. for the current one\)"):
            check_output_dir("--out", empty)


def test_dumps_strict_writes_null_for_non_finite_floats():
    text = dumps_strict({"a": math.inf, "b": [1.5, -math.inf, math.nan], "c": (1, "x")})
    assert json.loads(text) == {"a": None, "b": [1.5, None, None], "c": [1, "x"]}


def test_launch_trace_into_a_directory_fails_before_the_model_is_resolved(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("launcher.cli.main.options_and_reason", lambda *a, **k: pytest.fail("work started"))
    assert main(["launch", "--prompt", "hi", "--json", "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"speedpipe launch: error: --trace {tmp_path}: is a directory (give a file path)"
