"""`make run`'s launcher, as a person uses it: start, chat, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.nats_server import free_port
from tests.processes import REPO_ROOT


def wait_until_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the launcher exited early"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never answered")


def test_the_launcher_starts_everything_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    gateway, dead_ollama = free_port(), free_port()
    env = {**os.environ, "DATA_DIR": str(tmp_path), "NATS_PORT": str(free_port()),
           "GATEWAY_PORT": str(gateway), "OLLAMA_STUB_PORT": str(free_port()),
           "OLLAMA_HOST": f"http://127.0.0.1:{dead_ollama}", "LOG_FORMAT": "json"}
    env.pop("NATS_URL", None)
    log = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen([sys.executable, "scripts/run.py"], cwd=REPO_ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{gateway}"
        wait_until_ready(f"{base}/healthz", proc, 60)
        sid = httpx.post(f"{base}/api/sessions", json={}).json()["session_id"]
        reply = httpx.post(f"{base}/api/sessions/{sid}/messages", json={"content": "hi"},
                           timeout=30)
        assert reply.json()["reply"] == "Echo: hi (turn 1)"
        assert "<!doctype html>" in httpx.get(base).text.lower()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does in a terminal
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = (tmp_path / "run.log").read_text()
    assert "DETERMINISTIC STAND-IN" in output
    assert f"Chat is ready: http://127.0.0.1:{gateway}/" in output
    assert (tmp_path / "nats" / "jetstream").is_dir()
    with pytest.raises(ProcessLookupError):  # nothing of the launcher's group is left
        os.killpg(proc.pid, 0)
