"""train-predictor refuses bad flags, unwritable --out paths and damaged caches up front, in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from launcher.cli.main import main
from launcher.cli.training import train_predictor
from launcher.cli.training.train_predictor import add_train_args, cmd_train
from pipeline.training.data import HiddenStates, load_hidden_states, save_hidden_states
from pipeline.training.self_distill import Generation, SequenceStates, load_generation, save_generation
from tests.tiny_model import write_tiny_model

NO_MODEL = "/nonexistent/speedpipe-model"  # resolving it would fail: a check that names a flag came first


def _args(*flags: str, out: str = "/tmp/speedpipe-test-out.safetensors") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return parser.parse_args(["--model", NO_MODEL, "--out", out, "--no-progress", *flags])


@pytest.mark.parametrize("out, words", [("/etc/passwd/x.safetensors", "is not a directory"),
                                        ("/proc/x.safetensors", "cannot write"),
                                        ("/sys/x.safetensors", "cannot write")])
def test_unwritable_out_is_refused_before_the_model_is_read(out, words):
    if not Path(out).parent.exists():
        pytest.skip(f"{Path(out).parent} does not exist here")
    with pytest.raises(ValueError, match=f"^--out {out}: .*{words}"):
        cmd_train(_args(out=out))


def test_out_in_a_new_folder_under_a_writable_one_passes_the_check(tmp_path):
    from launcher.cli.training.train_checks import check_out_path

    check_out_path(tmp_path / "new" / "sub" / "p.safetensors")
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # the probe leaves nothing


@pytest.mark.parametrize("flags, message", [
    (["--weight-decay", "-1"], "--weight-decay must be a number >= 0, got -1.0"),
    (["--sampled", "1", "--temperature", "nan"], "--temperature must be a number > 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--lr", "inf"], "--lr must be a number > 0"),
])
def test_bad_training_flags_name_the_flag_before_the_model_is_read(flags, message):
    with pytest.raises(ValueError) as exc:
        cmd_train(_args(*flags))
    assert str(exc.value).startswith(message)


def test_bad_flag_exits_2_with_one_line(capsys):
    code = main(["train-predictor", "--model", NO_MODEL, "--out", "/tmp/x.safetensors", "--weight-decay", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "--weight-decay" in err and "Traceback" not in err


def test_failed_final_save_is_one_line_naming_the_path(tmp_path, monkeypatch):
    model_dir = write_tiny_model(tmp_path / "model")
    out = tmp_path / "p.safetensors"

    def refuse(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(out) + ".tmp")

    monkeypatch.setattr("pipeline.speculation.predictor_file.save_predictor", refuse)
    args = _args(out=str(out))
    args.exit_layer = 1
    with pytest.raises(ValueError, match=f"^--out {out}: cannot write the predictor file \\(Permission denied\\)$"):
        train_predictor._write(args, model_dir, {"proj.weight": torch.eye(4)}, {}, "line")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_self_distill_cache_names_the_file_and_says_delete_it(tmp_path):
    states = SequenceStates(token_ids=torch.arange(3), hidden=torch.zeros(3, 4, dtype=torch.float16),
                            targets=torch.arange(3), teacher_ids=torch.zeros(3, 2, dtype=torch.int64),
                            teacher_probs=torch.zeros(3, 2, dtype=torch.float16))
    path = tmp_path / "gen.safetensors"
    save_generation(path, [[1, 2]], Generation([[3, 4, 5, 6]], states), meta={})
    assert load_generation(path)[0] == [[1, 2]]
    _truncate(path)
    with pytest.raises(ValueError, match=f"^cache file {path} cannot be read .*delete it"):
        load_generation(path)


def test_truncated_hidden_state_cache_names_the_file(tmp_path):
    path = tmp_path / "h.safetensors"
    save_hidden_states(path, HiddenStates(token_ids=torch.zeros(2, 3, dtype=torch.int64),
                                          targets=torch.zeros(2, 3, dtype=torch.int64),
                                          hidden={0: torch.zeros(2, 3, 4, dtype=torch.float16)}), meta={})
    _truncate(path)
    with pytest.raises(ValueError, match=f"^cache file {path} cannot be read .*delete it"):
        load_hidden_states(path)
