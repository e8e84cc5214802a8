"""The compose healthcheck of the NATS services: healthy only when the named
service on this host answers on NATS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.nats_server import NatsServer
from tests.processes import REPO_ROOT
from tests.system import running_system


def healthcheck(service: str, nats_url: str, config_file: Path | None = None
                ) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key.upper() != "NATS_URL"}
    if config_file is None:
        env["NATS_URL"] = nats_url
    else:
        env["CONFIG_FILE"] = str(config_file)
    return subprocess.run([sys.executable, "-m", "services.shared.healthcheck", service],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)


def test_a_service_configured_by_its_file_alone_is_checked_on_its_nats(
        private_nats: NatsServer, stub_url: str, tmp_path: Path) -> None:
    """The service read NATS_URL from CONFIG_FILE; the check, from the
    environment alone, looked for it on another server: unhealthy for good."""
    config = tmp_path / "settings.yaml"
    config.write_text(f"NATS_URL: {private_nats.url}\n")
    with running_system(private_nats.url, stub_url, services=("tools",)):
        assert healthcheck("tools", "", config).returncode == 0


def test_healthy_only_while_the_service_here_answers(private_nats: NatsServer,
                                                    stub_url: str) -> None:
    with running_system(private_nats.url, stub_url, services=("tools",)) as system:
        assert healthcheck("tools", private_nats.url).returncode == 0
        absent = healthcheck("generator", private_nats.url)
        assert absent.returncode == 1 and "no generator on" in absent.stderr
        # Told by the server at once, not found out at the timeout.
        assert "none is connected to NATS" in absent.stderr
        system["tools"].stop()
        stopped = healthcheck("tools", private_nats.url)
        assert stopped.returncode == 1
        assert "none is connected to NATS" in stopped.stderr
    private_nats.stop()
    unreachable = healthcheck("tools", private_nats.url)
    assert unreachable.returncode == 1 and "unhealthy:" in unreachable.stderr
