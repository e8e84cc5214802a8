"""An answer's tokens, published on `chat.token.<sid>` as the model writes them."""

from __future__ import annotations

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import Query, Token
from services.shared.bus import Bus


class TokenStream:
    """Numbers and publishes the tokens of one answer. A held stream keeps
    them until `release`: the answer may still be thrown away unseen."""

    def __init__(self, bus: Bus, env: Envelope[Query], held: bool = False) -> None:
        self._bus = bus
        self._env = env
        self._index = 0
        self._held: list[str] | None = [] if held else None

    async def release(self) -> None:
        while self._held:  # a token arriving meanwhile joins the queue, in order
            await self._publish(self._held.pop(0))
        self._held = None

    async def send(self, text: str) -> None:
        if self._held is not None:
            self._held.append(text)
            return
        await self._publish(text)

    async def _publish(self, text: str) -> None:
        sid = self._env.payload.session_id
        index, self._index = self._index, self._index + 1
        await self._bus.publish(
            subjects.token(sid),
            Token(session_id=sid, query_id=self._env.message_id, index=index, text=text),
            correlation_id=self._env.correlation_id, session_id=sid,
        )
