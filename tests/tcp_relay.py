"""A TCP relay between one service and NATS, whose link a test can cut and
restore: the service alone loses NATS, which stays up, with its memory
buckets and every other client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from tests.ports import free_port


class Relay:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 4222)
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def restore(self) -> None:
        """Take connections again."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        """Close every relayed connection, and take no new one until restored."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for each in (writer, up_writer):
                self._writers.discard(each)
                each.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()


@contextlib.asynccontextmanager
async def relay_to(upstream_url: str) -> AsyncIterator[Relay]:
    relay = Relay(upstream_url)
    await relay.restore()
    try:
        yield relay
    finally:
        await relay.cut()
