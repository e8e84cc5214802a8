"""Run the Ollama stand-in (scripts/ollama_stub/) as a subprocess for tests.

    with running_stub("--quirk", "cache-count") as url:
        client = ollama.AsyncClient(host=url)

Plain helper without pytest imports, so benchmarks and scripts can use it too.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.events import eventually
from tests.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
# A free port can be taken by someone else before the stub binds it; retry with a new one.
START_ATTEMPTS = 3


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=1) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_until_ready(process: subprocess.Popen[bytes], url: str, stderr_path: Path) -> bool:
    """True once the stub answers; False if it exited (e.g. port taken). Raises on timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if _answers(url):
            return True
        time.sleep(0.05)
    _stop(process)
    raise RuntimeError(
        f"ollama stand-in did not answer at {url} within {STARTUP_TIMEOUT_S:.0f}s:\n"
        + stderr_path.read_text(errors="replace")
    )


@contextlib.contextmanager
def running_stub(*flags: str) -> Iterator[str]:
    """Start the stand-in with ``flags``, yield its base URL, always stop it afterwards."""
    with tempfile.TemporaryDirectory(prefix="ollama-stub-") as tmp:
        stderr_path = Path(tmp) / "stderr.txt"
        for _ in range(START_ATTEMPTS):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = [sys.executable, "-m", "scripts.ollama_stub", "--port", str(port), *flags]
            # stderr goes to a file: a pipe nobody reads could fill up and stall the stub.
            with stderr_path.open("wb") as stderr:
                process = subprocess.Popen(
                    command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr
                )
            try:
                if _wait_until_ready(process, url, stderr_path):
                    yield url
                    return
            finally:
                _stop(process)
        raise RuntimeError(
            f"ollama stand-in failed to start ({' '.join(command)}):\n"
            + stderr_path.read_text(errors="replace")
        )


async def stub_stats(url: str) -> dict[str, Any]:
    """The running stand-in's counters: requests, streams cut, per model."""
    async with httpx.AsyncClient() as client:
        return dict((await client.get(f"{url}/_stub/stats")).json())


async def model_called(url: str, calls: int = 1) -> None:
    """Returns once the stand-in has been asked `calls` times in all."""
    async def called() -> bool:
        return int((await stub_stats(url))["requests"]) >= calls

    await eventually(called, f"{calls} model call(s) under way")


def configure_stub_now(url: str, **config: object) -> None:
    """`configure_stub` for a test without an event loop."""
    httpx.post(f"{url}/_stub/config", json=config, timeout=10).raise_for_status()


async def configure_stub(url: str, **config: object) -> None:
    """Change how the running stand-in behaves (latencies, quirks, failures)."""
    async with httpx.AsyncClient() as client:
        (await client.post(f"{url}/_stub/config", json=config)).raise_for_status()
