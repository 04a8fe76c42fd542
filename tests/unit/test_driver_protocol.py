"""Tests for launcher.bench.driver_protocol: a real child process speaking the line protocol (no model, < 2 s each)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from launcher.bench.driver_protocol import DriverProcess

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parents[2]
ECHO_DRIVER = textwrap.dedent(
    """
    import sys
    from launcher.bench.driver_protocol import serve_requests, take_stdout_for_replies

    replies = take_stdout_for_replies()
    print("noise that must not reach the parent as a reply")

    def handle(request):
        if request.get("fail"):
            raise ValueError("asked to fail")
        if request.get("exit"):
            sys.exit(3)
        return {"echo": request["x"], "env": __import__("os").environ.get("OMP_NUM_THREADS")}

    sys.exit(serve_requests(replies, handle))
    """
)


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    proc = DriverProcess([sys.executable, "-c", ECHO_DRIVER], name="echo driver")
    yield proc
    proc.close()


def test_ready_then_one_reply_per_request_with_single_thread_env(driver):
    assert driver.reply(10.0) == {"ready": True}
    assert driver.request({"x": 1}, 10.0) == {"echo": 1, "env": "1"}
    assert driver.request({"x": [2, 3]}, 10.0) == {"echo": [2, 3], "env": "1"}


def test_a_failed_request_raises_with_the_drivers_error_and_the_driver_goes_on(driver):
    driver.reply(10.0)
    with pytest.raises(RuntimeError, match=r"^echo driver: ValueError: asked to fail$"):
        driver.request({"fail": True}, 10.0)
    assert driver.request({"x": 4}, 10.0)["echo"] == 4


def test_a_driver_that_exits_raises_naming_its_exit_code(driver):
    driver.reply(10.0)
    with pytest.raises(RuntimeError, match=r"^echo driver exited with code 3 "):
        driver.request({"exit": True}, 10.0)


def test_no_reply_within_the_timeout_raises():
    proc = DriverProcess([sys.executable, "-c", "import time; time.sleep(30)"], name="silent driver")
    try:
        with pytest.raises(RuntimeError, match=r"^silent driver: no reply within 0.2 s$"):
            proc.reply(0.2)
    finally:
        proc.proc.kill()
        proc.close()


def test_close_ends_the_driver_on_stdin_eof(driver):
    driver.reply(10.0)
    driver.close()
    assert driver.proc.returncode == 0


def test_ctrl_c_ends_a_driver_quietly_with_code_130(monkeypatch):
    """Ctrl-C reaches every driver of `bench sweep` (one process group): none may print a traceback."""
    import signal
    import subprocess

    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    code = textwrap.dedent(
        """
        import sys
        from launcher.bench.driver_protocol import driver_main, serve_requests, take_stdout_for_replies

        sys.exit(driver_main(lambda: serve_requests(take_stdout_for_replies(), lambda request: request)))
        """
    )
    # SIGINT as a terminal's foreground job has it: a test run started in the background (nohup,
    # `pytest &`) ignores SIGINT, and an ignored signal stays ignored across exec (the driver then
    # read stdin to its end and exited 0)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == '{"ready": true}'  # now blocked reading stdin
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "Traceback" not in err, err
