"""`make run`'s launcher, as a person uses it: start, chat, Ctrl-C."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from scripts.run import (
    DEFAULT_MODEL,
    METRICS_PORTS,
    SERVICES,
    START_ORDER,
    answers,
    check_models,
    ollama_url,
    page_url,
    pulled_models,
    service_envs,
    with_token,
)
from tests.events import until
from tests.nats_server import free_port
from tests.processes import REPO_ROOT
from tests.stub_server import running_stub

READY_LINE = "Chat is ready: "


def wait_until_announced(log: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the launcher says the chat is ready. The gateway's health alone is not
    that: the launcher polls it too, and a stop sent between the two polls lands
    while the launcher is still starting, so it never announces anything."""
    def announced() -> bool:
        if READY_LINE in log.read_text(errors="replace"):
            return True
        assert proc.poll() is None, "the launcher exited early"
        return False

    until(announced, f"the launcher said '{READY_LINE}'", timeout_s)


@dataclass
class Ports:
    nats: int = field(default_factory=free_port)
    gateway: int = field(default_factory=free_port)
    stub: int = field(default_factory=free_port)
    dead_ollama: int = field(default_factory=free_port)
    metrics: tuple[int, ...] = field(default_factory=lambda: tuple(free_port() for _ in range(3)))


def launch_env(tmp_path: Path, ports: Ports, **extra: str) -> dict[str, str]:
    env = {**os.environ, "DATA_DIR": str(tmp_path), "NATS_PORT": str(ports.nats),
           "GATEWAY_PORT": str(ports.gateway), "OLLAMA_STUB_PORT": str(ports.stub),
           "OLLAMA_HOST": f"http://127.0.0.1:{ports.dead_ollama}", "LOG_FORMAT": "json",
           "METRICS_PORTS": ",".join(str(port) for port in ports.metrics), **extra}
    env.pop("NATS_URL", None)
    return env


def launch(tmp_path: Path, ports: Ports, drop: tuple[str, ...] = (),
           **extra: str) -> subprocess.Popen[bytes]:
    env = launch_env(tmp_path, ports, **extra)
    for name in drop:
        env.pop(name, None)
    with (tmp_path / "run.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "scripts/run.py"], cwd=REPO_ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def launched(tmp_path: Path, ports: Ports, drop: tuple[str, ...] = (),
             **extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """The launcher, never left running: if a test ends before it stopped,
    its whole group is killed."""
    proc = launch(tmp_path, ports, drop, **extra)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def scraped(url: str, timeout_s: float = 30) -> str:
    """The metrics at `url`, once its service listens (the launcher waits for
    the gateway only)."""
    until(lambda: answers_http(url), f"{url} answered", timeout_s)
    return httpx.get(url).text


def answers_http(url: str) -> bool:
    try:
        httpx.get(url)
    except httpx.TransportError:
        return False
    return True


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_the_launcher_starts_everything_and_stops_it_all(tmp_path: Path, stop: str) -> None:
    # A space or a '#' ended the store's path in nats-server's reading of it.
    tmp_path = tmp_path / "chat data #1"
    tmp_path.mkdir()
    ports = Ports()
    with launched(tmp_path, ports) as proc:
        base = f"http://127.0.0.1:{ports.gateway}"
        wait_until_announced(tmp_path / "run.log", proc, 60)
        assert answered(base)  # a new session's first question
        assert "<!doctype html>" in httpx.get(base).text.lower()
        for url in (f"{base}/metrics", *(f"http://127.0.0.1:{p}/metrics" for p in ports.metrics)):
            assert "nats_connected" in scraped(url), url
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does in a terminal
        else:
            proc.terminate()  # the launcher alone, as `kill` or a supervisor does
        assert proc.wait(30) == 0
    output = (tmp_path / "run.log").read_text()
    # One at a time, whatever the signal: the tools outlive the generator.
    stops = [line for line in output.splitlines() if '"service_st' in line]
    generator_stopped = next(i for i, line in enumerate(stops)
                             if '"generator"' in line and "service_stopped" in line)
    tools_stopping = next(i for i, line in enumerate(stops)
                          if '"tools"' in line and "service_stopping" in line)
    assert generator_stopped < tools_stopping, stops
    assert "DETERMINISTIC STAND-IN" in output
    assert f"{READY_LINE}http://127.0.0.1:{ports.gateway}/" in output
    assert f"http://127.0.0.1:{ports.metrics[0]}/metrics" in output
    assert (tmp_path / "nats" / "jetstream").is_dir()
    kept = tmp_path / "nats-passwords.env"  # the NATS users' passwords, made on this first run
    assert kept.stat().st_mode & 0o777 == 0o600 and "NATS_ADMIN_PASSWORD=" in kept.read_text()
    assert f"passwords are in {kept}" in output
    with pytest.raises(ProcessLookupError):  # nothing of the launcher's group is left
        os.killpg(proc.pid, 0)
    # Every child runs in a session of its own: stopped by the launcher, in order.
    assert not any(listening(port) for port in (ports.nats, ports.stub, ports.gateway,
                                                 *ports.metrics))


STOP_BEGUN = "stopping: the services finish what they hold"


def ask_until_cut_off(base: str, sid: str) -> None:
    with contextlib.suppress(httpx.TransportError):
        httpx.post(f"{base}/api/sessions/{sid}/messages", json={"content": "hi"}, timeout=60)


def model_called(stub: str) -> bool:
    return int(httpx.get(f"{stub}/_stub/stats").json()["requests"]) > 0


def test_a_second_ctrl_c_hurries_the_stop_and_leaves_nothing_running(tmp_path: Path) -> None:
    ports = Ports()
    log = tmp_path / "run.log"
    with launched(tmp_path, ports) as proc:
        wait_until_announced(log, proc, 60)
        base, stub = f"http://127.0.0.1:{ports.gateway}", f"http://127.0.0.1:{ports.stub}"
        sid = httpx.post(f"{base}/api/sessions", json={}).json()["session_id"]
        # An answer that never comes: the services' stops wait on it for seconds.
        httpx.post(f"{stub}/_stub/config", json={"held_models": [DEFAULT_MODEL]})
        threading.Thread(target=ask_until_cut_off, args=(base, sid), daemon=True).start()
        until(lambda: model_called(stub), "the model called", 30)
        os.killpg(proc.pid, signal.SIGINT)
        # Said once the launcher has taken the first signal: the second is then
        # one more, never merged with it.
        until(lambda: STOP_BEGUN in log.read_text(), "the stop begun", 30)
        os.killpg(proc.pid, signal.SIGINT)  # the impatient second Ctrl-C
        assert proc.wait(30) == 0
    assert "hurrying" in log.read_text()
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert not any(listening(port) for port in (ports.nats, ports.stub, ports.gateway))


def take_the_terminal() -> None:
    # In the launcher, a session leader by now: the pseudo-terminal on its
    # stdin becomes its controlling terminal, as a terminal window's is.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def read_until(primary: int, text: str, timeout_s: float) -> None:
    """Read the terminal until `text` has been written to it (its line ends
    as the program wrote them, not as the terminal shows them)."""
    seen, deadline = b"", time.monotonic() + timeout_s
    while text.encode() not in seen.replace(b"\r\n", b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} on the terminal"
        if select.select([primary], [], [], left)[0]:
            seen = (seen + os.read(primary, 65536))[-65536:]


def test_closing_the_terminal_stops_everything_and_leaves_nothing_running(
        tmp_path: Path) -> None:
    """The window `make run` ran in is closed: its SIGHUP begins the stop, and
    from then on every write to the terminal fails (EIO). Neither may cut the
    stop short, or NATS and the stand-in run on and hold their ports."""
    ports = Ports()
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "scripts/run.py"], cwd=REPO_ROOT,
                            env=launch_env(tmp_path, ports), stdin=secondary, stdout=secondary,
                            stderr=secondary, start_new_session=True,
                            preexec_fn=take_the_terminal)
    os.close(secondary)
    try:
        read_until(primary, "(Ctrl-C stops everything)\n\n", 60)  # the whole announcement
        os.close(primary)  # the window closed
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # nothing of the launcher's group is left
        os.killpg(proc.pid, 0)
    assert not any(listening(port) for port in (ports.nats, ports.stub, ports.gateway))


def launched_by(launcher: int, command: str) -> int:
    """The pid of the launcher's child whose command line holds `command`."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == launcher and command in (entry / "cmdline").read_text():
                return int(entry.name)
    raise AssertionError(f"the launcher runs no {command!r}")


def answered(base: str) -> bool:
    """A new session's first question answers: NATS away, or the gateway not
    back on it yet, is only asked again."""
    try:
        created = httpx.post(f"{base}/api/sessions", json={})
        if created.status_code != 201:
            return False
        sid = created.json()["session_id"]
        reply = httpx.post(f"{base}/api/sessions/{sid}/messages", json={"content": "hi"},
                           timeout=60)
    except httpx.TransportError:
        return False
    return reply.status_code == 200 and reply.json()["reply"] == "Echo: hi (turn 1)"


def test_a_process_that_dies_is_started_again_and_the_chat_goes_on(tmp_path: Path) -> None:
    ports = Ports()
    log = tmp_path / "run.log"
    base = f"http://127.0.0.1:{ports.gateway}"
    with launched(tmp_path, ports) as proc:
        wait_until_announced(log, proc, 60)
        for command, name in (("services.generator", "services.generator"),
                              ("nats-server", "nats-server")):
            os.kill(launched_by(proc.pid, command), signal.SIGKILL)
            until(lambda name=name: f"{name} exited with -9" in log.read_text(),
                  f"the launcher saw {name} die", 30)
            until(lambda: answered(base), f"an answer after {name} died", 60)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    assert not any(listening(port) for port in (ports.nats, ports.stub, ports.gateway))


def test_a_launcher_killed_outright_leaves_nothing_running(tmp_path: Path) -> None:
    """kill -9 (or the OOM killer) gives the launcher no chance to stop its
    children: they ran on, NATS and the stand-in in sessions of their own,
    and their ports kept the next `make run` from starting."""
    ports = Ports()
    with launched(tmp_path, ports) as proc:
        wait_until_announced(tmp_path / "run.log", proc, 60)
        proc.kill()  # the launcher alone
        proc.wait(10)
        until(lambda: not any(listening(port) for port in
                              (ports.nats, ports.stub, ports.gateway, *ports.metrics)),
              "every child gone with the launcher", 60)


def test_the_launcher_refuses_a_nats_port_someone_else_listens_on(tmp_path: Path) -> None:
    ports = Ports()
    with socket.create_server(("127.0.0.1", ports.nats)):
        proc = launch(tmp_path, ports)
        assert proc.wait(30) != 0
    assert f"port {ports.nats}, wanted for NATS, is in use" in (tmp_path / "run.log").read_text()


def test_the_launcher_refuses_a_stand_in_port_someone_else_listens_on(tmp_path: Path) -> None:
    ports = Ports()
    with socket.create_server(("127.0.0.1", ports.stub)):
        proc = launch(tmp_path, ports)
        assert proc.wait(30) != 0
    told = (tmp_path / "run.log").read_text()
    assert f"port {ports.stub}, wanted for the Ollama stand-in, is in use" in told
    assert not listening(ports.nats)  # what had started was stopped


@pytest.mark.parametrize(("name", "value"), [("GATEWAY_PORT", "80a"), ("NATS_PORT", "0"),
                                           ("METRICS_PORTS", "9101,x,9103")])
def test_a_port_that_is_not_one_is_named_before_anything_starts(
        tmp_path: Path, name: str, value: str) -> None:
    proc = launch(tmp_path, Ports(), **{name: value})
    assert proc.wait(30) != 0
    told = (tmp_path / "run.log").read_text()
    assert f"{name}={value!r}: not a port number" in told
    assert "Traceback" not in told and "Starting nats-server" not in told


def test_ollama_is_found_by_its_short_address_and_not_through_a_proxy(
        stub_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    short = stub_url.removeprefix("http://")  # 127.0.0.1:PORT, as OLLAMA_HOST may say
    assert answers(ollama_url(short))


def test_each_service_takes_only_its_own_metrics_port() -> None:
    envs = dict(zip(SERVICES, service_envs({"METRICS_PORT": "9101"}, None), strict=True))
    assert "METRICS_PORT" not in envs["services.gateway"]  # not the generator's port too
    assert [envs[module].get("METRICS_PORT") for module in SERVICES[:3]] == [
        str(port) for port in METRICS_PORTS]


def test_the_tools_stop_after_the_generator_and_the_gateway_first() -> None:
    """Stopped in the reverse of their start: the tools went before the
    generator, whose last turns then found no tool to call."""
    assert sorted(START_ORDER) == sorted(SERVICES)
    stopping = list(reversed(START_ORDER))
    assert stopping[0] == "services.gateway"
    assert stopping.index("services.generator") < stopping.index("services.tools")


def test_the_token_in_the_page_address_is_read_back_as_it_is() -> None:
    assert with_token("http://127.0.0.1:8080/", "Ab+c/d=") == (
        "http://127.0.0.1:8080/?token=Ab%2Bc%2Fd%3D")
    assert with_token("http://127.0.0.1:8080/", "") == "http://127.0.0.1:8080/"


def test_the_page_address_is_one_a_browser_here_can_open() -> None:
    assert page_url("127.0.0.1", "8080") == "http://127.0.0.1:8080/"
    assert page_url("0.0.0.0", "8080") == "http://127.0.0.1:8080/"
    assert page_url("::1", "8080") == "http://[::1]:8080/"


def test_a_model_ollama_lacks_is_named_with_the_pull_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    with running_stub("--models", "other") as url:
        check_models(url, {"MODEL": "wanted:8b", "COMPACTION_MODEL": "other"})
        assert "wanted:8b:latest" not in pulled_models(url)
    told = capsys.readouterr().err
    assert "has no model 'wanted:8b'" in told and "`ollama pull wanted:8b`" in told
    assert "PULL=1" in told and "'other'" not in told


def test_pull_1_pulls_the_missing_model_with_its_progress(
        capsys: pytest.CaptureFixture[str]) -> None:
    with running_stub("--models", "other") as url:
        check_models(url, {"MODEL": "wanted", "PULL": "1"})
        assert "wanted:latest" in pulled_models(url)
    shown = capsys.readouterr().err
    assert "pulling wanted" in shown and "pulling manifest" in shown and "success" in shown
    assert "100%" in shown  # the layer's bar ran to its end


def test_the_launcher_pulls_model_at_start_when_asked(tmp_path: Path) -> None:
    ports = Ports()
    with running_stub("--models", "other") as ollama, \
            launched(tmp_path, ports, OLLAMA_HOST=ollama, MODEL="wanted", PULL="1") as proc:
        base = f"http://127.0.0.1:{ports.gateway}"
        wait_until_announced(tmp_path / "run.log", proc, 60)
        assert answered(base)  # a new session's first question
        proc.terminate()
        assert proc.wait(30) == 0
    output = (tmp_path / "run.log").read_text()
    assert "pulling wanted" in output and "DETERMINISTIC STAND-IN" not in output


def test_an_auto_token_is_made_once_kept_private_and_printed_in_the_address(
        tmp_path: Path) -> None:
    ports = Ports()
    # Left empty by a first run cut short: the gateway ran with no token at all.
    (tmp_path / "gateway-token").write_text("")
    with launched(tmp_path, ports, GATEWAY_TOKEN="auto") as proc:
        wait_until_announced(tmp_path / "run.log", proc, 60)
        kept = tmp_path / "gateway-token"
        token = kept.read_text().strip()
        assert len(token) >= 32 and kept.stat().st_mode & 0o777 == 0o600
        base = f"http://127.0.0.1:{ports.gateway}"
        assert f"{READY_LINE}{base}/?token={token}" in (tmp_path / "run.log").read_text()
        assert httpx.get(f"{base}/api/sessions").status_code == 401
        with httpx.Client(base_url=base, follow_redirects=True) as browser:  # as a browser
            assert browser.get(f"/?token={token}").status_code == 200  # redirected to /
            assert browser.get("/api/sessions").status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    again = launch(tmp_path, Ports(), GATEWAY_TOKEN="auto")
    try:
        wait_until_announced(tmp_path / "run.log", again, 60)
        assert (tmp_path / "gateway-token").read_text().strip() == token
    finally:
        os.killpg(again.pid, signal.SIGINT)
        again.wait(30)


def test_the_gateway_port_is_read_as_the_gateway_reads_it(tmp_path: Path) -> None:
    """A port set in CONFIG_FILE (or in lower case) is the gateway's, but the
    launcher read GATEWAY_PORT alone, waited for 8080 and stopped everything."""
    ports = Ports()
    config = tmp_path / "settings.yaml"
    config.write_text(f"gateway_port: {ports.gateway}\n")
    with launched(tmp_path, ports, ("GATEWAY_PORT",), CONFIG_FILE=str(config)) as proc:
        wait_until_announced(tmp_path / "run.log", proc, 60)
        base = f"http://127.0.0.1:{ports.gateway}"
        assert f"{READY_LINE}{base}/" in (tmp_path / "run.log").read_text()
        assert httpx.get(f"{base}/healthz").status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
