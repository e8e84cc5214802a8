"""A NATS cluster of real nats-server processes on loopback, with clustered
JetStream: each node has its own store, so a node killed and restarted comes
back with what it had and catches up from the others."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
from nats.errors import Error as NatsError
from nats.js.api import StreamConfig
from nats.js.errors import Error as JetStreamError

from tests.nats_server import NatsServer, free_port


class NatsCluster:
    def __init__(self, root: Path, size: int = 3, advertise: bool = True) -> None:
        self.names = [f"n{i}" for i in range(1, size + 1)]
        route_ports = {name: free_port() for name in self.names}
        self.nodes: dict[str, NatsServer] = {}
        for name in self.names:
            store = root / name
            store.mkdir()
            routes = ", ".join(f"nats://127.0.0.1:{route_ports[other]}"
                               for other in self.names if other != name)
            self.nodes[name] = NatsServer(str(store), extra_config=(
                f"server_name: {name}\n"
                # Read by `NatsServer.log` when a test needs to say what went on.
                f'log_file: "{store / "server.log"}"\n'
                f"cluster {{ name: chat, listen: 127.0.0.1:{route_ports[name]},"
                f" routes: [{routes}], no_advertise: {str(not advertise).lower()} }}\n"))

    @property
    def url(self) -> str:
        """NATS_URL as a service takes it: every node, comma-separated."""
        return ",".join(node.url for node in self.nodes.values())

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def kill(self, name: str) -> None:
        self.nodes[name].signal(signal.SIGKILL)
        self.nodes[name].stop()  # reaps it; the store stays

    def restart(self, name: str) -> None:
        self.nodes[name].start()


async def wait_for_jetstream(url: str, replicas: int, timeout_s: float = 30.0) -> None:
    """Until the cluster can place a stream on `replicas` nodes: its meta
    leader is elected and knows its peers."""
    deadline = time.monotonic() + timeout_s
    nc = await nats.connect(url.split(","))
    probe = StreamConfig(name="CLUSTER_READY", subjects=["cluster.ready"],
                         num_replicas=replicas)
    try:
        while True:
            try:
                await nc.jetstream().add_stream(probe)
                await nc.jetstream().delete_stream("CLUSTER_READY")
                return
            except (NatsError, JetStreamError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def running_cluster(size: int = 3, advertise: bool = True) -> AsyncIterator[NatsCluster]:
    """`advertise=False`: clients learn no other node than the ones they name."""
    root = Path(tempfile.mkdtemp(prefix="nats-cluster-"))
    cluster = NatsCluster(root, size, advertise)
    try:
        cluster.start()
        await wait_for_jetstream(cluster.url, size)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
