"""`speedpipe serve` at start-up with real stage processes: a model a stage cannot load ends it as it
ends `launch`, and its HTTP port says nothing before the model is loaded.

What breaks when these fail: `serve` reports a stage's load failure differently from `launch` (a
traceback, another exit code, several lines), leaves a stage process or a listening socket behind,
or its /ready answers 200 (a load balancer sends traffic) before the stages have loaded.
The port-taken cases are unit tests of ServingStack (tests/unit/test_serving_http.py); a stage's
unexpected error with `launch`: tests/unit/test_stage_load_report.py, whose model this reuses.
"""

from __future__ import annotations

import re
import threading

import httpx
import psutil
import pytest

from launcher.backends.ports import free_port
from tests.unit.test_stage_load_report import _model_with_a_corrupt_block_table, _stage_processes

pytestmark = pytest.mark.timeout(120)


def _listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("stages", ["1", "2"])
def test_serve_reports_a_stage_s_unexpected_load_error_as_launch_does(tmp_path, capfd, stages):
    """One line, exit 1, no traceback, no stage process and no server socket left."""
    from launcher.cli.main import main

    model_dir = _model_with_a_corrupt_block_table(tmp_path)
    port, grpc_port = free_port(), free_port()
    code = main(["serve", "--model", str(model_dir), "--stages", stages, "--quantization", "auto",
                 "--speculate", "none", "--port", str(port), "--grpc-port", str(grpc_port)])
    err = capfd.readouterr().err
    assert code == 1, err
    assert re.fullmatch(r"speedpipe serve: pipeline failed: stage [01] failed to load the model: TypeError: ufunc "
                        r"'bitwise_and' not supported .*", err.strip()), err
    assert not _stage_processes()
    assert not {port, grpc_port} & _listening_ports()


def test_serve_s_ready_never_answers_200_before_the_model_loaded(tmp_path, monkeypatch):
    """A poller asks /ready from before the stages start; a 200 answered before the session finished
    loading would let a load balancer route requests to a server without a model."""
    from launcher.cli.main import main
    from launcher.coordinator.session import PipelineSession
    from launcher.serving import drain
    from tests.tiny_model import write_tiny_model

    loaded, stop, answers = threading.Event(), threading.Event(), []
    real_start = PipelineSession._start

    def start(self):
        real_start(self)
        loaded.set()

    port = free_port()
    url = f"http://127.0.0.1:{port}/ready"

    def poll() -> None:
        while not stop.is_set():
            try:
                status = httpx.get(url, timeout=5).status_code
            except httpx.TransportError:
                status = None
            # read after the answer: `loaded` is set before the ports open, so any answer the server gave
            # once it had loaded is seen as such (read before sending, a request that connected just
            # after the ports opened counted as sent too early: a flaky failure)
            answers.append((loaded.is_set(), status))
            stop.wait(0.05)

    def serve_once(session, stack, signals, **_):  # instead of serving until SIGTERM: ask once, stop
        answers.append((True, httpx.get(url, timeout=10).status_code))

    monkeypatch.setattr(PipelineSession, "_start", start)
    monkeypatch.setattr(drain, "serve_until_stopped", serve_once)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        code = main(["serve", "--model", str(write_tiny_model(tmp_path / "m")), "--stages", "2", "--speculate",
                     "none", "--port", str(port), "--grpc-port", "-1"])
    finally:
        stop.set()
        poller.join(timeout=10)
    assert code == 0
    assert (True, 200) in answers
    assert not [status for was_loaded, status in answers if not was_loaded and status is not None], answers
    assert not _stage_processes()



def test_serve_s_start_line_brackets_an_ipv6_host(tmp_path, monkeypatch, capfd):
    """`--host ::1` printed "on http://::1:PORT, gRPC on ::1:PORT", a URL no client parses; the line
    now writes [::1], as the address a client would type."""
    from launcher.cli.main import main
    from launcher.serving import drain
    from tests.tiny_model import write_tiny_model

    port, grpc_port = free_port("::1"), free_port("::1")
    monkeypatch.setattr(drain, "serve_until_stopped", lambda *args, **kwargs: None)  # start, then stop at once
    code = main(["serve", "--model", str(write_tiny_model(tmp_path / "m")), "--stages", "1", "--speculate", "none",
                 "--host", "::1", "--port", str(port), "--grpc-port", str(grpc_port)])
    assert code == 0
    assert f"on http://[::1]:{port}, gRPC on [::1]:{grpc_port}; Ctrl-C" in capfd.readouterr().err
    assert not _stage_processes()

@pytest.mark.parametrize("damage", ["truncated", "u16", "config"])
def test_serve_refuses_a_model_folder_as_launch_does_before_any_stage_starts(tmp_path, capfd, monkeypatch, damage):
    """A truncated safetensors file, a U16 tensor, a malformed config.json: one line, exit 2, the same
    line as `launch` but for the command's name, and no stage started."""
    import torch
    from safetensors.torch import load_file, save_file

    from launcher.cli.main import main
    from launcher.coordinator.session import PipelineSession
    from tests.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "m")
    weights_file = model_dir / "model.safetensors"
    if damage == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[:-100])
    elif damage == "u16":
        weights = load_file(weights_file)
        weights["model.norm.weight"] = torch.ones(weights["model.norm.weight"].shape, dtype=torch.uint16)
        save_file(weights, weights_file, metadata={"format": "pt"})
    else:
        (model_dir / "config.json").write_text('{"hidden_size": ')
    monkeypatch.setattr(PipelineSession, "_start", lambda self: pytest.fail("a stage was started"))
    lines = {}
    for command in (["launch", "--prompt", "hi", "--no-progress"], ["serve", "--port", "0", "--grpc-port", "0"]):
        code = main([command[0], "--model", str(model_dir), "--stages", "2", *command[1:]])
        lines[command[0]] = capfd.readouterr().err.strip().splitlines()
        assert code == 2, lines
    assert len(lines["serve"]) == 1 and lines["serve"][0].startswith("speedpipe serve: error: "), lines
    assert lines["serve"][0].removeprefix("speedpipe serve") == lines["launch"][-1].removeprefix("speedpipe launch")
