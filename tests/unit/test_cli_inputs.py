"""Odd but plausible inputs to `launch` that a reviewer found mishandled: a prompts file with a
byte-order mark or that is a device, a whitespace prompt, an empty --model, a non-finite memory
budget, and flags that do nothing in the mode asked for."""

from __future__ import annotations

import pytest

from launcher.cli.main import UsageError, _parse, build_parser, main
from launcher.cli.options import options_and_reason
from launcher.cli.parsing import read_prompts, read_prompts_file


def test_a_byte_order_mark_is_not_prompt_text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffHello there\r\nSecond\r\n".encode())
    assert read_prompts_file(str(path)) == ["Hello there", "Second"]
    path.write_bytes('\ufeff{"prompt": "one"}\n'.encode())
    assert read_prompts_file(str(path)) == ["one"]


def test_a_device_is_not_called_missing():
    with pytest.raises(UsageError, match="--prompts-file /dev/null is not a regular file"):
        read_prompts_file("/dev/null")
    with pytest.raises(UsageError, match="/no/such/file does not exist"):
        read_prompts_file("/no/such/file")


def test_a_whitespace_prompt_is_text_and_an_empty_one_is_refused():
    assert read_prompts(_parse(build_parser(), ["launch", "--prompt", "   "])) == ["   "]
    with pytest.raises(UsageError, match="prompt 1 is empty"):
        read_prompts(_parse(build_parser(), ["launch", "--prompt", "a", "--prompt", ""]))


@pytest.mark.parametrize("budget", ["inf", "nan", "0"])
def test_a_memory_budget_must_be_finite_and_positive(capsys, budget):
    assert main(["launch", "--stages", "auto", "--stage-memory-gib", budget, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a finite --stage-memory-gib > 0" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_an_empty_model_is_refused(capsys):
    assert main(["launch", "--model", "", "--prompt", "hi"]) == 2
    assert "model is empty" in capsys.readouterr().err


def test_flags_that_do_nothing_here_are_named(capsys):
    args = _parse(build_parser(), ["launch", "--stages", "2", "--speculate", "none", "--stage-memory-gib", "4",
                                   "--quantization", "int4", "--dtype", "float16"])
    options_and_reason(args, progress=False)
    err = capsys.readouterr().err
    assert "note: --stage-memory-gib has no effect without --stages auto" in err
    assert "note: --quantization int4 computes in bfloat16 whatever --dtype says" in err


@pytest.mark.parametrize(("argv", "noted", "feed"), [
    (["--stages", "2", "--speculate", "none", "--decode-feed", "stage"], False, "stage"),  # the feed link
    (["--stages", "1", "--speculate", "firp", "--decode-feed", "stage"], True, "stage"),
    (["--stages", "3", "--speculate", "speed", "--decode-feed", "stage"], True, "stage"),
    (["--stages", "1", "--speculate", "none", "--decode-feed", "stage"], False, "stage"),
    (["--stages", "2", "--speculate", "speed"], False, "stage"),  # the default, not given: nothing to say
    (["--stages", "2", "--speculate", "none", "--decode-feed", "coordinator"], False, "coordinator"),
])
def test_an_explicit_decode_feed_stage_where_it_cannot_apply_is_named(capsys, argv, noted, feed):
    options, _ = options_and_reason(_parse(build_parser(), ["launch", *argv]), progress=False)
    err = capsys.readouterr().err
    assert ("note: --decode-feed stage has no effect with --speculate " in err) == noted, err
    assert options.decode_feed == feed


def test_ray_only_flags_without_ray_are_named(capsys):
    args = _parse(build_parser(), ["launch", "--stages", "2", "--speculate", "none", "--ray-address", "10.0.0.1:6379",
                                   "--placement-strategy", "SPREAD"])
    options_and_reason(args, progress=False)
    assert "note: --ray-address, --placement-strategy have no effect without --backend ray" in capsys.readouterr().err


def test_ray_backend_without_ray_installed_is_a_one_line_error(monkeypatch):
    import importlib.util

    from launcher.backends.placement import PlacementError, PlacementOptions

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(PlacementError, match=r"--backend ray needs the ray package: pip install 'speedpipe\[ray\]'"):
        PlacementOptions(backend="ray")


def test_an_unreachable_or_malformed_ray_address_fails_fast():
    import socket
    import time

    from launcher.backends.placement import PlacementError
    from launcher.backends.placement import probe_ray_address as _probe_cluster

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(PlacementError, match=f"--ray-address 127.0.0.1:{port}: no Ray cluster reachable there"):
        _probe_cluster(f"127.0.0.1:{port}", timeout_s=5)
    assert time.monotonic() - start < 5
    with pytest.raises(PlacementError, match="--ray-address must be HOST:PORT"):
        _probe_cluster("garbage", timeout_s=1)
    _probe_cluster("auto", timeout_s=1)  # left to Ray
