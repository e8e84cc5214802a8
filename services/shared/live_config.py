"""Settings that change without a restart: a `config` KV bucket, watched.

`nats kv put config compaction_threshold 0.6` reaches every watching service
within a moment. Only the settings in `LIVE_KEYS` change this way: the others
are read once, into parts built at start (a provider's timeout, the state
machine's compaction mode), and half-changing one would leave those parts
disagreeing. Any other known setting put there is logged (without its value:
it may be a secret) and ignored. A value that does not validate is logged and
taken as no value: the setting goes back to the value the service started
with, as a service started now would read the bucket, so that every service
agrees on what is in force. Deleting or purging a key (`nats kv del config
compaction_threshold`) does the same. A key is the setting's name in
lower case and nothing else: `COMPACTION_THRESHOLD` is logged and ignored, so
each setting has one key, and deleting that key always puts it back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from pydantic import ValidationError

from services.shared.jetstream import config_bucket
from services.shared.reconnects import cancel_until_done
from services.shared.settings import ServiceSettings

LIVE_KEYS = frozenset({"compaction_threshold", "compaction_cooldown_s", "compaction_min_relief"})
# KV operations that remove a key's value.
DELETIONS = frozenset({KV_DEL, KV_PURGE})
S = TypeVar("S", bound=ServiceSettings)
log = structlog.get_logger()


# A value refused is logged this long at most: anyone who may put a setting
# could otherwise write a megabyte into each service's log per put.
SHOWN_CHARS = 200


def shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text)} characters)"


class LiveSettings(Generic[S]):
    def __init__(self, js: JetStreamContext, initial: S,
                 on_change: Callable[[S], None] | None = None) -> None:
        self._js = js
        # What a deleted key goes back to: the environment's or file's value.
        self._initial = initial
        self.current = initial
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        kv = await config_bucket(self._js)  # made anew if NATS came back without its store
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(self._watcher))

    async def watch_again(self) -> None:
        """NATS came back: the watcher lived in the server's memory, and the
        bucket may be gone with a lost store. (nats-py would replace the
        watcher only after two missed heartbeats, starting past the revisions
        it saw, which a bucket made anew has not reached.) The bucket is the
        truth again once the new watch has read it: a setting it no longer
        holds (a lost store) goes back to the start-up value, as a service
        started now would have it, rather than live on where nobody sees it."""
        await self.stop()
        await self.start()

    async def stop(self) -> None:
        if self._task:
            await cancel_until_done(self._task)
        if self._watcher is not None:
            with contextlib.suppress(Exception):  # NATS away: nothing to unsubscribe from
                await self._watcher.stop()  # type: ignore[no-untyped-call]
            self._watcher = None

    async def _follow(self, watcher: object) -> None:
        held: set[str] | None = set()  # keys the bucket held at the start; None after
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is None:  # the end of the values the bucket held at the start
                for key in LIVE_KEYS - (held or set()):
                    self.restore(key)
                held = None
            elif entry.key:
                if held is not None and entry.operation not in DELETIONS:
                    held.add(entry.key)
                self._take(entry)

    def _take(self, entry: KeyValue.Entry) -> None:
        if entry.operation in DELETIONS:
            # nats-py hands a deletion over as an entry with an empty value.
            self.restore(entry.key)
            return
        if entry.value is None:
            return
        try:
            raw = entry.value.decode().strip()
        except UnicodeDecodeError:
            log.error("live_setting_rejected", key=entry.key, error="not UTF-8 text")
            return
        self.apply(entry.key, raw)

    def restore(self, key: str) -> None:
        """The key was deleted: back to the value this service started with
        (quietly when it has it already, as for a deletion replayed at start)."""
        if key not in LIVE_KEYS or key not in type(self.current).model_fields:
            return
        initial = getattr(self._initial, key)
        if getattr(self.current, key) != initial:
            self._change(key, initial)

    def apply(self, key: str, raw: str) -> None:
        if key != key.lower() and key.lower() in type(self.current).model_fields:
            # Taking it would give the setting two keys, each put and deleted
            # on its own: which value held would depend on which came last.
            log.warning("live_setting_ignored", key=key,
                        error=f"setting names are lower case: use {key.lower()!r}")
            return
        if key not in type(self.current).model_fields:
            return  # a setting of another service
        if key not in LIVE_KEYS:
            # Without its value: a token or a password put here is not to be
            # copied into every watching service's log.
            log.warning("live_setting_ignored", key=key,
                        error="not a live setting: set it in the environment or "
                        "the settings file")
            return
        self._change(key, raw)

    def _change(self, key: str, value: object) -> None:
        try:
            updated = type(self.current).model_validate(
                {**self.current.model_dump(), key: value})
        except ValidationError as err:
            log.error("live_setting_rejected", key=key, value=shown(value),
                      error=err.errors(include_url=False)[0]["msg"])
            self.restore(key)
            return
        log.info("live_setting_changed", key=key, value=getattr(updated, key))
        self.current = updated
        if self._on_change:
            self._on_change(updated)
