"""The services as real subprocesses (`python -m services.X`), for end-to-end
tests: start with an environment, wait until ready, SIGTERM/SIGKILL/SIGSTOP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_MARK = "service_started"


class ServiceProcess:
    def __init__(self, module: str, env: dict[str, str], root: Path = REPO_ROOT) -> None:
        """`root`: the checkout whose code runs (another one's, to compare two)."""
        self.module = module
        self.env = env
        self.root = root
        fd, path = tempfile.mkstemp(prefix=f"{module.rsplit('.', 1)[-1]}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_s: float = 20.0, ready: str = READY_MARK) -> ServiceProcess:
        """Start and wait for the line `ready` (by default, that it serves)."""
        # Restarts append to the same log: wait for one more ready line than before.
        before = self.log().count(ready)
        full_env = {**os.environ, "LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **self.env}
        with self.log_path.open("ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen([sys.executable, "-m", self.module], cwd=self.root,
                                         env=full_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_for(ready, wait_s, since=before)
        except BaseException:
            self.kill()  # never left running by a start that failed
            raise
        return self

    def wait_for(self, text: str, timeout_s: float, since: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.log().count(text) > since:
                return
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited early:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.module}: no '{text}' after {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait; returns the exit code (None if it had to be killed)."""
        if not self.proc or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


@contextlib.contextmanager
def running(*services: ServiceProcess) -> Iterator[tuple[ServiceProcess, ...]]:
    started: list[ServiceProcess] = []
    try:
        for service in services:
            started.append(service.start())
        yield services
    finally:
        for service in reversed(started):
            service.stop()
