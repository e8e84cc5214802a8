"""A NATS server restarted without its memory streams (the session states,
the compactions running): the services make them again on reconnecting, so
reading a session works again without restarting anything."""

from __future__ import annotations

import time

import httpx

from tests.nats_server import NatsServer
from tests.system import ask, new_session, running_system


def wait_until_answered(client: httpx.Client, path: str, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = client.get(path)
            if response.status_code == 200 or time.monotonic() > deadline:
                return response
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_memory_streams_lost_in_a_nats_restart_are_made_again(
        private_nats: NatsServer, stub_url: str) -> None:
    with running_system(private_nats.url, stub_url) as system, system.client() as client:
        sid = new_session(client)
        assert ask(client, sid, "before").status_code == 200
        private_nats.restart()  # memory storage does not outlive the server
        response = wait_until_answered(client, f"/api/sessions/{sid}", 20)
        assert response.status_code == 200, response.text
        assert response.json()["state"] == "idle"
        assert ask(client, sid, "after").status_code == 200
