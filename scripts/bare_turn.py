"""The hops a turn cannot do without, and nothing else: the floor that the
benchmark's turn overhead and throughput are set against (rows `turn_floor`
and `throughput_floor` of scripts/bench.py).

Two processes, started like the services and on the same libraries, event
loop and consumer (`BARE_ROLE=gateway` or `generator`, then
`python -m scripts.bare_turn`):

- gateway: one HTTP route (Starlette on uvicorn). It publishes the query into
  a work-queue stream, then answers with the reply that comes back on a core
  subject.
- generator: takes each query as it lands. It takes the session's lock (a KV
  write by compare-and-swap) while checking that no earlier query waits, and
  calls the model through the product's provider. Then it appends the turn
  to a stream by compare-and-swap, acknowledges, replies and frees the lock.

Nothing else: no envelopes or validation, no published states, no history
view or prompt fitting, no tools, no report. The product's turn overhead
minus this floor is what all of that costs.

With `BARE_CONTRACT=1` it also sends, as cheaply as it can, the messages the
product's contract asks of every turn (row `turn_contract_floor`): a state
change on each of the four transitions into a stream that keeps the latest,
the query acknowledged with the server's confirmation, and a report into a
stream that a third process (`BARE_ROLE=decider`) reads, lingering between
reads as the product's decider does. Set against it, the product's overhead
is what its own code costs beyond what the contract makes every turn pay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from typing import Any

import nats
import uvicorn
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from schemas.subjects import is_valid_session_id
from services.generator.provider import ChatRequest, OllamaProvider
from services.shared.consumer import PullLoop, ensure_consumer
from services.shared.runner import main
from services.shared.together import together

QUERIES = "BARE_QUERIES"
HISTORY = "BARE_HISTORY"
LOCKS = "bare_locks"
CONSUMER = "bare"
STATES = "BARE_STATES"
REPORTS = "BARE_REPORTS"
DECIDER = "bare_decider"
# As the product's decider (REPORT_LINGER_S): one read for the reports of 50 ms.
DECIDER_LINGER_S = 0.05
READY = "service_started"  # what tests/processes.py waits for
REPLY_TIMEOUT_S = 10.0
SLOTS = 64


def stream_configs(contract: bool) -> list[StreamConfig]:
    """The queries and the history; with the contract, the states (the latest
    of each session, in memory, as the product keeps them) and the reports."""
    configs = [
        StreamConfig(name=QUERIES, subjects=["bare.q.*"], retention=RetentionPolicy.WORK_QUEUE,
                     allow_direct=True),
        StreamConfig(name=HISTORY, subjects=["bare.h.*"], allow_direct=True),
    ]
    if contract:
        configs += [
            StreamConfig(name=STATES, subjects=["bare.s.*"], storage=StorageType.MEMORY,
                         max_msgs_per_subject=1, discard=DiscardPolicy.OLD),
            StreamConfig(name=REPORTS, subjects=["bare.g"]),
        ]
    return configs


async def set_up(nc: NATS, contract: bool) -> KeyValue:
    """The streams and the lock bucket; the lock bucket is returned."""
    js = nc.jetstream()
    for config in stream_configs(contract):
        with contextlib.suppress(BadRequestError):  # made by the other process already
            await js.add_stream(config)
    try:
        return await js.key_value(LOCKS)
    except NotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=LOCKS, history=1, ttl=5.0))


class BareGateway:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._waiting: dict[str, asyncio.Future[bytes]] = {}

    async def start(self) -> None:
        await self._nc.subscribe("bare.r.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        reply = json.loads(msg.data)
        waiter = self._waiting.get(reply["id"])
        if waiter is not None and not waiter.done():
            waiter.set_result(msg.data)

    async def ask(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        if not is_valid_session_id(sid):
            return JSONResponse({"error": "invalid session id"}, status_code=400)
        content = json.loads(await request.body())["content"]
        query_id = uuid.uuid4().hex
        waiter = self._waiting[query_id] = asyncio.get_running_loop().create_future()
        try:
            await self._js.publish(f"bare.q.{sid}",
                                   json.dumps({"id": query_id, "content": content}).encode(),
                                   headers={"Nats-Msg-Id": query_id})
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                reply = json.loads(await waiter)
        finally:
            del self._waiting[query_id]
        return JSONResponse({"reply": reply["reply"]})


class BareGenerator:
    def __init__(self, nc: NATS, locks: KeyValue, ollama_host: str, model: str,
                 contract: bool = False) -> None:
        self._nc = nc
        self._contract = contract
        self._js = nc.jetstream()
        self._kv = locks
        self._provider = OllamaProvider(ollama_host, timeout_s=30.0, connections=SLOTS)
        self._model = model
        self._busy = 0
        self._prompts: dict[str, list[dict[str, Any]]] = {}
        self._history_seq: dict[str, int] = {}
        self._freed_at: dict[str, int] = {}
        # Acknowledged queries the server may not have dropped yet.
        self._answered: set[int] = set()
        self._order: dict[str, asyncio.Lock] = {}
        self._loop: PullLoop | None = None

    async def start(self) -> None:
        await ensure_consumer(self._nc, QUERIES, ConsumerConfig(
            durable_name=CONSUMER, filter_subject="bare.q.*", ack_policy=AckPolicy.EXPLICIT))
        self._loop = PullLoop(self._nc, QUERIES, CONSUMER, self._spawn,
                              capacity=lambda: SLOTS - self._busy)
        await self._loop.start()

    async def _spawn(self, msg: Msg) -> None:
        self._busy += 1
        task = asyncio.create_task(self._answer(msg))
        task.add_done_callback(self._room_freed)

    def _room_freed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            print(f"query failed: {task.exception()!r}", file=sys.stderr, flush=True)
        self._busy -= 1
        assert self._loop is not None
        self._loop.room_freed()

    async def _answer(self, msg: Msg) -> None:
        # As in the product, a session's next query waits here for the
        # previous one to free the lock.
        sid = msg.subject.rsplit(".", 1)[1]
        async with self._order.setdefault(sid, asyncio.Lock()):
            await self._answer_in_order(sid, msg)

    async def _answer_in_order(self, sid: str, msg: Msg) -> None:
        query = json.loads(msg.data)
        revision, earlier = await together(self._lock(sid), self._earlier_query(msg))
        if isinstance(revision, Exception) or isinstance(earlier, Exception) or earlier:
            raise RuntimeError("the floor runs one query at a time: nothing may compete")
        await self._state(sid, "receiving")
        await self._state(sid, "generating")
        prompt = self._prompts.setdefault(sid, [])
        prompt.append({"role": "user", "content": query["content"]})
        result = await self._provider.chat(ChatRequest(self._model, prompt, num_ctx=8192))
        prompt.append({"role": "assistant", "content": result.content})
        await self._state(sid, "publishing")
        ack = await self._js.publish(
            f"bare.h.{sid}", json.dumps(prompt[-2:]).encode(),
            headers={"Nats-Expected-Last-Subject-Sequence": str(self._history_seq.get(sid, 0))})
        self._history_seq[sid] = ack.seq
        await self._state(sid, "idle")
        self._answered.add(msg.metadata.sequence.stream)
        if not self._contract:
            await msg.ack()
        await self._nc.publish(f"bare.r.{sid}",
                               json.dumps({"id": query["id"], "reply": result.content}).encode())
        self._freed_at[sid] = await self._kv.update(sid, b"free", last=revision)
        if self._contract:  # as the product: after the reply, confirmed, then the report
            await msg.ack_sync()
            await self._nc.publish("bare.g", json.dumps(
                {"session_id": sid, "prompt_tokens": result.prompt_tokens,
                 "completion_tokens": result.completion_tokens}).encode())

    async def _state(self, sid: str, state: str) -> None:
        """A transition, for whoever watches the session (with the contract only)."""
        if self._contract:
            await self._nc.publish(f"bare.s.{sid}", json.dumps(
                {"session_id": sid, "state": state}).encode())

    async def _lock(self, sid: str) -> int:
        """One compare-and-swap: a new key, or the free marker this process left."""
        try:
            return await self._kv.update(sid, b"held", last=self._freed_at.get(sid, 0))
        except KeyWrongLastSequenceError as err:
            raise RuntimeError(f"session {sid} is held elsewhere") from err

    async def _earlier_query(self, msg: Msg) -> bool:
        ours, start = msg.metadata.sequence.stream, 1
        while True:
            oldest = await self._js.get_msg(QUERIES, seq=start, subject=msg.subject,
                                            next=True, direct=True)
            seq = int(oldest.seq or 0)
            if seq >= ours or seq not in self._answered:
                return seq < ours
            start = seq + 1


async def read_reports(nc: NATS) -> None:
    """The decider's part of the contract: read each report (AckPolicy.NONE,
    as the product's), lingering between reads."""
    await ensure_consumer(nc, REPORTS, ConsumerConfig(
        durable_name=DECIDER, filter_subject="bare.g", ack_policy=AckPolicy.NONE))

    async def read(msg: Msg) -> None:
        json.loads(msg.data)

    await PullLoop(nc, REPORTS, DECIDER, read, linger_s=DECIDER_LINGER_S).start()


async def run(role: str) -> None:
    nc = await nats.connect(os.environ["NATS_URL"])
    contract = os.environ.get("BARE_CONTRACT") == "1"
    locks = await set_up(nc, contract)
    if role == "generator":
        await BareGenerator(nc, locks, os.environ["OLLAMA_HOST"], os.environ["MODEL"],
                            contract).start()
    elif role == "decider":
        await read_reports(nc)
    if role != "gateway":
        print(READY, flush=True)
        await asyncio.Event().wait()
    gateway = BareGateway(nc)
    await gateway.start()
    app = Starlette(routes=[Route("/q/{sid}", gateway.ask, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1",
                                           port=int(os.environ["BARE_PORT"]),
                                           log_config=None, access_log=False, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            await serving  # raises the bind error
        await asyncio.sleep(0.02)
    print(READY, flush=True)
    await serving


if __name__ == "__main__":
    main(run(os.environ["BARE_ROLE"]))
