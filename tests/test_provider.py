"""The Ollama provider against the stand-in, through a TCP relay that cuts the
first connection: what a kept-alive connection closed by the server at the
moment it is reused looks like to the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from services.generator.provider import ChatRequest, OllamaProvider, ProviderError


class CutFirstConnection:
    """Accepts connections; drops the first one after reading from it and relays
    every later one to the stand-in."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.connections == 1:
            await reader.read(1)
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(self._host, self._port)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def relay(target: str) -> AsyncIterator[tuple[str, CutFirstConnection]]:
    cutter = CutFirstConnection(target)
    server = await asyncio.start_server(cutter.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", cutter
    finally:
        server.close()


def question(text: str) -> ChatRequest:
    return ChatRequest(model="stub-model", messages=[{"role": "user", "content": text}],
                       num_ctx=2048)


async def test_a_connection_cut_before_the_answer_is_retried_once(stub_url: str) -> None:
    async with relay(stub_url) as (url, cutter):
        provider = OllamaProvider(url, timeout_s=10)
        result = await provider.chat(question("hello"))
        await provider.close()
    assert result.content.startswith("Echo: hello")
    assert cutter.connections == 2


async def test_a_streamed_answer_cut_before_its_first_token_is_retried(stub_url: str) -> None:
    tokens: list[str] = []

    async def on_token(text: str) -> None:
        tokens.append(text)

    async with relay(stub_url) as (url, cutter):
        provider = OllamaProvider(url, timeout_s=10)
        result = await provider.chat(question("hello"), on_token)
        await provider.close()
    assert "".join(tokens) == result.content and result.content.startswith("Echo: hello")
    assert cutter.connections == 2


async def test_a_tool_call_without_a_usable_name_is_a_provider_error(stub_url: str) -> None:
    """The model names a tool no schema accepts (longer than 128 characters): the
    turn gets a clear provider error, not a crash retried as an internal one."""
    name = "t" * 200
    tool = {"type": "function", "function": {"name": name, "description": "x",
                                             "parameters": {"type": "object"}}}
    request = ChatRequest(model="stub-model", num_ctx=2048, tools=[tool],
                          messages=[{"role": "user", "content": f"!tool {name}"}])
    provider = OllamaProvider(stub_url, timeout_s=10)
    try:
        with pytest.raises(ProviderError) as raised:
            await provider.chat(request)
    finally:
        await provider.close()
    assert raised.value.cause == "provider_error"
    assert "could not be read" in str(raised.value) and "name" in str(raised.value)


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_answer_cut_at_num_predict_says_length(stub_url: str, streamed: bool) -> None:
    provider = OllamaProvider(stub_url, 10.0)
    tokens: list[str] = []

    async def collect(text: str) -> None:
        tokens.append(text)

    try:
        request = ChatRequest(model="stub-model", num_ctx=2048, num_predict=10,
                              messages=[{"role": "user", "content": "hi !long 500"}])
        cut = await provider.chat(request, collect if streamed else None)
        whole = await provider.chat(question("hi !long 500"))
    finally:
        await provider.close()
    assert (cut.done_reason, cut.completion_tokens, len(cut.content)) == ("length", 10, 40)
    assert whole.done_reason == "stop" and len(whole.content) > 500
