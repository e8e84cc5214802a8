"""Services outlive NATS going away and coming back."""

from __future__ import annotations

import time

import httpx

from services.shared.runner import SHUTDOWN_TIMEOUT_S
from tests.nats_server import NatsServer
from tests.system import ask, new_session, running_system


def wait_for_status(client: httpx.Client, path: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get(path).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{path} never answered {status} within {timeout_s} s")


def test_services_reconnect_after_nats_restarts(private_nats: NatsServer, stub_url: str) -> None:
    with running_system(private_nats.url, stub_url) as system, system.client() as client:
        sid = new_session(client)
        assert ask(client, sid, "before").status_code == 200
        private_nats.stop()
        wait_for_status(client, "/healthz", 503, 10)
        private_nats.start()
        wait_for_status(client, "/healthz", 200, 15)
        answer = ask(client, sid, "after")
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Echo: after (turn 2)"
        for name in ("generator", "decider", "gateway"):
            assert system[name].proc is not None and system[name].proc.poll() is None


def test_sigterm_while_nats_is_away_exits_cleanly(private_nats: NatsServer,
                                                  stub_url: str) -> None:
    every_service = ("generator", "decider", "gateway", "tools")
    with running_system(private_nats.url, stub_url, services=every_service) as system:
        private_nats.stop()
        for name in every_service:
            system[name].wait_for("nats_disconnected", 10)
        for name in every_service:
            # Bounded: the runner gives up on NATS after SHUTDOWN_TIMEOUT_S.
            code = system[name].stop(timeout_s=SHUTDOWN_TIMEOUT_S + 5)
            log = system[name].log()
            assert code == 0, f"{name} exited with {code}:\n{log[-3000:]}"
            assert "Traceback" not in log, log[-3000:]
            assert log.count("nats_unreachable_at_shutdown") == 1, log[-3000:]
            assert "service_stopped" in log
