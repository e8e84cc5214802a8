"""compose.yaml's NATS configuration, run by a real nats-server: it must take
the messages the streams are made for, and keep them on disk."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import yaml

from schemas import subjects
from services.shared.jetstream import MAX_MESSAGE_BYTES, ensure_layout
from tests.nats_server import free_port, nats_server_binary, wait_for_port

COMPOSE = Path(__file__).resolve().parents[1] / "compose.yaml"


def compose() -> dict[str, object]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def test_the_nats_service_runs_the_configuration_it_mounts() -> None:
    nats_service = compose()["services"]["nats"]  # type: ignore[index]
    mounted = {c["source"]: c["target"] for c in nats_service["configs"]}
    assert nats_service["command"] == ["-c", mounted["nats-config"]]


@contextlib.contextmanager
def serving(content: str, store: Path) -> Iterator[int]:
    """nats-server on the compose configuration, moved to a free port and `store`."""
    port = free_port()
    config = store / "nats.conf"
    config.write_text(content.replace("0.0.0.0:4222", f"127.0.0.1:{port}")
                      .replace("http_port: 8222", f"http_port: {free_port()}")
                      .replace('"/data"', f'"{store}"'))
    server = subprocess.Popen([nats_server_binary(), "-c", str(config)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10)
        yield port
    finally:
        server.terminate()
        server.wait(10)


async def test_the_compose_configuration_takes_the_largest_history_entry(
        tmp_path: Path) -> None:
    content = compose()["configs"]["nats-config"]["content"]  # type: ignore[index]
    with serving(content, tmp_path) as port:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            assert nc.max_payload >= MAX_MESSAGE_BYTES
            js = nc.jetstream()
            await ensure_layout(js)
            entry = b"x" * (MAX_MESSAGE_BYTES - 64 * 1024)  # room for headers
            ack = await js.publish(subjects.history("big"), entry, timeout=10)
            assert ack.stream == subjects.HISTORY_STREAM
        finally:
            await nc.close()
    assert (tmp_path / "jetstream").is_dir()  # on the store the configuration names
