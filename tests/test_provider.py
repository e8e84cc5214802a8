"""The Ollama provider against the stand-in, through a TCP relay that cuts the
first connection: what a kept-alive connection closed by the server at the
moment it is reused looks like to the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import ollama
import pytest

from services.generator.provider import ChatRequest, OllamaProvider, ProviderError
from tests.events import eventually
from tests.stub_server import configure_stub, running_stub, stub_stats


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


# --------------------------------------------------------------------------- models as they are

TOOL = {"type": "function", "function": {"name": "echo", "description": "Echo.",
                                         "parameters": {"type": "object", "properties": {}}}}
SUMMARY_REQUEST = [
    {"role": "system", "content": "Write a COMPACTION SUMMARY of the conversation."},
    {"role": "user", "content": "[user]: plan a trip to Lisbon\n[assistant]: sure"},
]
MODEL_FLAGS = (
    "--models", "plain,thinker,small",
    "--capabilities", "plain=completion",
    "--capabilities", "thinker=completion,tools,thinking",
    "--context-length", "small=4096",
)  # fmt: skip


@pytest.fixture(scope="module")
def models_url() -> Iterator[str]:
    with running_stub(*MODEL_FLAGS) as url:
        yield url


@contextlib.asynccontextmanager
async def provider_on(url: str, timeout_s: float = 10, gap_s: float | None = None
                      ) -> AsyncIterator[OllamaProvider]:
    provider = OllamaProvider(url, timeout_s=timeout_s, gap_s=gap_s)
    try:
        yield provider
    finally:
        await provider.close()


def asking(model: str, content: str, **fields: Any) -> ChatRequest:
    return ChatRequest(model=model, messages=[{"role": "user", "content": content}],
                       num_ctx=8192, **fields)


async def test_facts_come_from_the_model_server_once_per_model(models_url: str) -> None:
    async with provider_on(models_url) as provider:
        plain, again = await provider.facts("plain"), await provider.facts("plain:latest")
        thinker, small = await provider.facts("thinker"), await provider.facts("small")
    assert plain is again and not plain.tools and not plain.thinking
    assert thinker.tools and thinker.thinking
    assert small.tools and small.context_length == 4096


async def test_tools_are_not_offered_to_a_model_without_them(models_url: str) -> None:
    async with provider_on(models_url) as provider:
        result = await provider.chat(asking("plain", "!tool echo", tools=[TOOL]))
    assert result.content.startswith("Echo: !tool echo") and not result.tool_calls


async def test_a_refusal_of_tools_anyway_is_answered_without_them_and_remembered() -> None:
    """A server that does not describe capabilities (older Ollama): tools are
    offered, refused once, then the model is known to lack them."""
    with running_stub("--show-without-capabilities", "--capabilities", "plain=completion") as url:
        async with provider_on(url) as provider:
            assert (await provider.facts("plain")).tools
            first = await provider.chat(asking("plain", "hi", tools=[TOOL]))
            assert (await stub_stats(url))["requests"] == 2  # refused, then asked without tools
            second = await provider.chat(asking("plain", "again", tools=[TOOL]))
            assert (await stub_stats(url))["requests"] == 3
            assert not (await provider.facts("plain")).tools
    assert first.content.startswith("Echo: hi") and second.content.startswith("Echo: again")


async def test_a_missing_model_names_the_pull_command(models_url: str) -> None:
    async with provider_on(models_url) as provider:
        with pytest.raises(ProviderError) as raised:
            await provider.chat(asking("absent:7b", "hi"))
    assert raised.value.cause == "model_not_found"
    assert "absent:7b" in str(raised.value) and "ollama pull absent:7b" in str(raised.value)


async def test_think_is_sent_as_asked_and_only_to_thinking_models(models_url: str) -> None:
    async with provider_on(models_url) as provider:
        default = await provider.chat(asking("thinker", "hi"))
        off = await provider.chat(asking("thinker", "hi", think="off"))
        on = await provider.chat(asking("thinker", "hi", think="on"))
        plain = await provider.chat(asking("plain", "hi", think="on"))
    assert default.thinking and on.thinking and not off.thinking
    assert not plain.thinking and plain.content.startswith("Echo: hi")
    assert off.content == default.content == on.content


async def test_a_summary_without_thinking_is_not_empty(models_url: str) -> None:
    async with provider_on(models_url) as provider:
        thought = await provider.chat(ChatRequest("thinker", SUMMARY_REQUEST, 8192))
        told = await provider.chat(ChatRequest("thinker", SUMMARY_REQUEST, 8192, think="off",
                                               watch_gaps=True))
    assert thought.content == "" and thought.thinking
    assert told.content.startswith("Goal: plan a trip to Lisbon")


async def test_num_ctx_never_exceeds_the_models_window(models_url: str) -> None:
    """A 5,000-token prompt fits 8192 but not the model's 4096: sent with the
    model's window, the server refuses it as longer than the window (asked
    not to cut it, as Ollama would have, to 4096), not answers it in 8192."""
    long_prompt = "word " * 4000
    async with provider_on(models_url) as provider:
        with pytest.raises(ProviderError) as refused:
            await provider.chat(asking("small", long_prompt))
        plain = await provider.chat(asking("plain", long_prompt))
    assert refused.value.cause == "context_overflow"
    assert plain.prompt_tokens is not None and 4096 < plain.prompt_tokens < 8192


async def test_a_slow_first_token_is_waited_for_beyond_the_gap_limit() -> None:
    # A gap limit a stall between the answer's few quick tokens never reaches.
    with running_stub("--load-ms", "5000") as url:
        async with provider_on(url, timeout_s=60, gap_s=4) as provider:
            tokens: list[str] = []

            async def on_token(text: str) -> None:
                tokens.append(text)

            result = await provider.chat(question("hello"), on_token)
    assert result.content.startswith("Echo: hello") and "".join(tokens) == result.content


async def test_a_model_that_stalls_midway_is_stopped_by_the_gap_limit() -> None:
    # About 1.5 s between two streamed words; the answer's first word is welcome within 60 s.
    with running_stub("--ms-per-token", "1200") as url:
        async with provider_on(url, timeout_s=60, gap_s=0.3) as provider:
            # Streamed to a watcher, or streamed for the limit's sake only (summaries).
            for on_token, watch_gaps in ((_ignore, False), (None, True)):
                request = ChatRequest("stub-model", question("hello").messages, 2048,
                                      watch_gaps=watch_gaps)
                with pytest.raises(ProviderError) as raised:
                    await provider.chat(request, on_token)
                assert raised.value.cause == "timeout"
                assert "stopped for more than 0.3 s" in str(raised.value)


async def test_a_model_that_sends_nothing_is_stopped_by_the_first_token_limit() -> None:
    with running_stub("--quirk", "hang") as url:
        async with provider_on(url, timeout_s=0.5, gap_s=30) as provider:
            for on_token in (None, _ignore):
                with pytest.raises(ProviderError) as raised:
                    await provider.chat(question("hello"), on_token)
                assert raised.value.cause == "timeout"
                assert "sent nothing within 0.5 s" in str(raised.value)


async def _ignore(text: str) -> None:
    pass


async def stub_slots(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        answer: dict[str, Any] = (await http.get(f"{url}/_stub/slots")).json()
    return answer


async def test_on_a_one_slot_server_a_summary_waits_for_a_waiting_answer() -> None:
    """The model's only slot is taken; an answer queues at the server. A
    summary asked for meanwhile is held here, not queued there, until the
    answer's first token came."""
    with running_stub("--parallel", "1") as url:
        async with provider_on(url) as provider:
            await provider.chat(question("load"))
            await configure_stub(url, ms_per_token=50)
            async with ollama.AsyncClient(host=url) as holder:
                stream = await holder.chat(model="stub-model", stream=True,
                                           messages=[{"role": "user", "content": "!long 4000"}])
                await anext(aiter(stream))  # the slot is the holder's now
                answer = asyncio.create_task(provider.chat(question("waiting"), _ignore))

                async def answer_queued() -> bool:
                    return bool((await stub_slots(url))["waiting"].get("stub-model:latest"))

                await eventually(answer_queued, "the answer queued at the server")
                summary = asyncio.create_task(provider.chat(ChatRequest(
                    "stub-model", SUMMARY_REQUEST, 2048, think="off", background=True)))

                async def summary_held() -> bool:
                    return provider.traffic()["stub-model:latest"]["summaries_held"] == 1

                await eventually(summary_held, "the summary held back")
                assert (await stub_slots(url))["waiting"]["stub-model:latest"] == 1
                await configure_stub(url, ms_per_token=0)
            # The holder is gone: the answer has the slot, then the summary.
            assert (await answer).content.startswith("Echo: waiting")
            assert (await summary).content.startswith("Goal: ")


async def test_an_error_in_a_stream_under_way_says_the_answer_failed_midway() -> None:
    """Ollama writes an {"error": ...} line once a stream has begun (its HTTP
    status long sent); the client calls that status -1, which the caller was
    told as "Ollama answered HTTP -1"."""
    with running_stub("--quirk", "error-midway") as url:
        async with provider_on(url) as provider:
            tokens: list[str] = []

            async def on_token(text: str) -> None:
                tokens.append(text)

            with pytest.raises(ProviderError) as failed:
                await provider.chat(question("a longer question, to be cut"), on_token)
    assert failed.value.cause == "provider_error"
    assert "failed during the answer: stub: simulated internal error" in str(failed.value)
    assert tokens  # it had begun
