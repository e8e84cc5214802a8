"""The compose healthcheck of the NATS services: healthy only when the named
service on this host answers on NATS."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.nats_server import NatsServer
from tests.processes import REPO_ROOT
from tests.system import running_system

Checked = subprocess.CompletedProcess[str]


def healthcheck(service: str, nats_url: str, config_file: Path | None = None
                ) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key.upper() != "NATS_URL"}
    if config_file is None:
        env["NATS_URL"] = nats_url
    else:
        env["CONFIG_FILE"] = str(config_file)
    return subprocess.run([sys.executable, "-m", "services.shared.healthcheck", service],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)


def checked(service: str, nats_url: str, holds: Callable[[Checked], bool],
            config_file: Path | None = None) -> Checked:
    """The check run until its outcome `holds`, as compose runs it again: one
    run meets a stall of the machine with the service's own time limits."""
    deadline = time.monotonic() + 60
    while not holds(result := healthcheck(service, nats_url, config_file)):
        if time.monotonic() > deadline:
            return result
    return result


def healthy(result: Checked) -> bool:
    return result.returncode == 0


def unhealthy_saying(*words: str) -> Callable[[Checked], bool]:
    return lambda result: result.returncode == 1 and all(w in result.stderr for w in words)


def test_a_service_configured_by_its_file_alone_is_checked_on_its_nats(
        private_nats: NatsServer, stub_url: str, tmp_path: Path) -> None:
    """The service read NATS_URL from CONFIG_FILE; the check, from the
    environment alone, looked for it on another server: unhealthy for good."""
    config = tmp_path / "settings.yaml"
    config.write_text(f"NATS_URL: {private_nats.url}\n")
    with running_system(private_nats.url, stub_url, services=("tools",)):
        assert healthy(checked("tools", "", healthy, config))


def test_healthy_only_while_the_service_here_answers(private_nats: NatsServer,
                                                    stub_url: str) -> None:
    with running_system(private_nats.url, stub_url, services=("tools",)) as system:
        assert healthy(checked("tools", private_nats.url, healthy))
        # Told by the server at once, not found out at the timeout.
        absent = unhealthy_saying("no generator on", "none is connected to NATS")
        assert absent(checked("generator", private_nats.url, absent))
        system["tools"].stop()
        stopped = unhealthy_saying("none is connected to NATS")
        assert stopped(checked("tools", private_nats.url, stopped))
    private_nats.stop()
    unreachable = unhealthy_saying("unhealthy:")
    assert unreachable(checked("tools", private_nats.url, unreachable))
