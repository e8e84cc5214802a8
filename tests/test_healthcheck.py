"""The compose healthcheck of the NATS services: healthy only when the named
service on this host answers on NATS."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.nats_server import NatsServer
from tests.processes import REPO_ROOT
from tests.system import running_system


def healthcheck(service: str, nats_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.shared.healthcheck", service],
                          cwd=REPO_ROOT, env={**os.environ, "NATS_URL": nats_url},
                          capture_output=True, text=True, timeout=30)


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
