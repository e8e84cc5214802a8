"""A session's history on a real HISTORY stream: compare-and-swap appends,
splices that keep the transcript, idempotent retries, and a bounded cache."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from datetime import UTC, datetime, timedelta

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import ServerError

from schemas import subjects
from schemas.history import ChatMessage, HistoryEntry, Snapshot
from services.core.transcript import items_of
from services.shared.history_store import HistoryConflict, HistoryStore, HistoryView
from services.shared.jetstream import STREAMS, ensure_layout
from services.shared.transcript import stored_entries, trim
from tests.events import eventually
from tests.nats_server import NatsServer


def turn(i: int) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=f"q{i}", query_id=f"q{i}"),
            ChatMessage(role="assistant", content=f"a{i}", query_id=f"q{i}")]


@pytest.fixture
async def store(nc: NATS) -> HistoryStore:
    await ensure_layout(nc.jetstream())
    return HistoryStore(nc.jetstream(), cached_sessions=2)


def new_sid() -> str:
    return uuid.uuid4().hex


async def test_a_turn_is_one_write_and_reads_back(store: HistoryStore, nc: NATS) -> None:
    sid = new_sid()
    view = await store.read(sid)
    assert view.last_seq == 0 and view.conversation.messages == ()
    view = await store.append(sid, view, turn(1))
    info = await nc.jetstream().stream_info(subjects.HISTORY_STREAM,
                                            subjects_filter=subjects.history(sid))
    assert info.state.subjects == {subjects.history(sid): 1}
    fresh = HistoryStore(nc.jetstream())
    assert (await fresh.read(sid)).conversation.messages == tuple(turn(1))


async def test_a_rollup_header_cannot_purge_a_transcript(store: HistoryStore, nc: NATS) -> None:
    """Only an explicit delete removes what was said; the stream allowed rollups."""
    sid = new_sid()
    await store.append(sid, await store.read(sid), turn(1))
    with pytest.raises(ServerError, match="rollup not permitted"):
        await nc.jetstream().publish(subjects.history(sid), b"{}",
                                     headers={"Nats-Rollup": "sub"})
    fresh = HistoryStore(nc.jetstream())
    assert [m.content for m in (await fresh.read(sid)).conversation.messages] == ["q1", "a1"]


async def test_an_entry_no_reader_can_take_in_is_passed_over(store: HistoryStore,
                                                               nc: NATS) -> None:
    """One record another program wrote into the session made every read of
    it fail (a 500 for each request) until the session was deleted."""
    sid = new_sid()
    view = await store.append(sid, await store.read(sid), turn(1))
    for junk in (b'{"not": "an entry"}', b"not json"):
        await nc.jetstream().publish(subjects.history(sid), junk)
    fresh = HistoryStore(nc.jetstream())
    read = await fresh.read(sid)
    assert read.conversation.messages == view.conversation.messages
    read = await fresh.append(sid, read, turn(2))  # its place in the stream is known
    assert [m.content for m in (await HistoryStore(nc.jetstream()).read(sid))
            .conversation.messages] == ["q1", "a1", "q2", "a2"]
    kinds = [e.entry.kind async for e in stored_entries(nc.jetstream(), sid)]
    assert kinds == ["turn", "turn"]  # and the junk is still there, two entries in between
    info = await nc.jetstream().stream_info(subjects.HISTORY_STREAM,
                                            subjects_filter=subjects.history(sid))
    assert info.state.subjects == {subjects.history(sid): 4}


async def test_an_entry_a_later_version_wrote_is_read_without_its_new_fields(
        store: HistoryStore, nc: NATS) -> None:
    """Refused for a field it did not know, a later version's turn was passed
    over: a redelivered query was answered again, a compaction left it out."""
    sid = new_sid()
    later = turn(1)[0].model_dump() | {"mood": "curious"}
    entry = {"kind": "turn", "messages": [later], "base": 0, "written_by": "a later version"}
    await nc.jetstream().publish(subjects.history(sid), json.dumps(entry).encode())
    read = await HistoryStore(nc.jetstream()).read(sid)
    assert [m.content for m in read.conversation.messages] == ["q1"]


def test_a_message_without_counts_is_written_as_the_version_before_them_read_it() -> None:
    question = ChatMessage(role="user", content="q", query_id="q1")
    answer = ChatMessage(role="assistant", content="a", query_id="q1", prompt_tokens=9,
                         completion_tokens=None)
    assert set(json.loads(question.model_dump_json())) == {
        "role", "content", "tool_calls", "tool_name", "query_id", "stopped"}
    written = json.loads(HistoryEntry.of_turn((question, answer)).model_dump_json())
    assert written["messages"][1]["prompt_tokens"] == 9
    assert "completion_tokens" not in written["messages"][1]
    assert HistoryEntry.model_validate(written).messages == (question, answer)


async def test_a_history_stream_made_allowing_rollups_is_mended(
        private_nats: NatsServer) -> None:
    nc = await nats.connect(private_nats.url)
    js = nc.jetstream()
    history = next(c for c in STREAMS if c.name == subjects.HISTORY_STREAM)
    await js.add_stream(history.evolve(allow_rollup_hdrs=True))
    await ensure_layout(js)  # not the owner: left as it is
    assert (await js.stream_info(subjects.HISTORY_STREAM)).config.allow_rollup_hdrs
    await ensure_layout(js, move_replicas=True)
    assert not (await js.stream_info(subjects.HISTORY_STREAM)).config.allow_rollup_hdrs
    await nc.close()


async def test_a_stale_view_cannot_write(store: HistoryStore) -> None:
    sid = new_sid()
    stale = await store.read(sid)
    await store.append(sid, stale, turn(1))
    with pytest.raises(HistoryConflict):
        await store.append(sid, stale, turn(2))
    assert [m.content for m in (await store.read(sid)).conversation.messages] == ["q1", "a1"]


async def test_a_retried_append_is_refused_and_the_turn_stored_once(
    store: HistoryStore, nc: NATS
) -> None:
    sid = new_sid()
    view = await store.read(sid)
    await store.append(sid, view, turn(1))
    with pytest.raises(HistoryConflict):  # the first attempt's ack was "lost"
        await store.append(sid, view, turn(1))
    assert len((await HistoryStore(nc.jetstream()).read(sid)).conversation.messages) == 2


async def test_a_splice_keeps_the_turns_before_it_and_the_context_starts_at_it(
    store: HistoryStore, nc: NATS,
) -> None:
    sid = new_sid()
    view = await store.read(sid)
    for i in range(3):
        view = await store.append(sid, view, turn(i))
    spliced = await store.splice(sid, view, Snapshot(summary="notes", messages=tuple(turn(2)),
                                                     compactions=1))
    info = await nc.jetstream().stream_info(subjects.HISTORY_STREAM,
                                            subjects_filter=subjects.history(sid))
    assert info.state.subjects == {subjects.history(sid): 4}  # the transcript stays
    reread = await HistoryStore(nc.jetstream()).read(sid)
    assert reread.conversation == spliced.conversation
    assert reread.conversation.summary == "notes" and reread.conversation.compactions == 1
    assert reread.base_seq == spliced.last_seq
    with pytest.raises(HistoryConflict):  # a splice over an old view is refused too
        await store.splice(sid, view, Snapshot(summary="x", compactions=1))
    after = await store.append(sid, spliced, turn(3))
    reread = await HistoryStore(nc.jetstream()).read(sid)
    assert reread.conversation == after.conversation and reread.base_seq == spliced.last_seq


async def test_reading_the_context_never_reads_the_transcript_before_its_snapshot(
    store: HistoryStore, nc: NATS,
) -> None:
    """An entry before the latest snapshot that no reader could parse: a fresh
    read of the context succeeds, so it never looked at it (the cost of the
    read does not grow with the transcript)."""
    sid, js = new_sid(), nc.jetstream()
    view = await store.read(sid)
    view = await store.append(sid, view, turn(0))
    ack = await js.publish(subjects.history(sid), b"not an entry")
    view = HistoryView(view.conversation, ack.seq)
    view = await store.splice(sid, view, Snapshot(summary="notes", compactions=1))
    view = await store.append(sid, view, turn(1))
    fresh = await HistoryStore(js).read(sid)
    assert fresh.conversation.summary == "notes"
    assert fresh.conversation.messages == tuple(turn(1))


async def test_the_cache_is_bounded_and_a_miss_reads_the_stream(store: HistoryStore) -> None:
    sids = [new_sid() for _ in range(4)]
    for i, sid in enumerate(sids):
        await store.append(sid, await store.read(sid), turn(i))
    assert len(store._cache) == 2
    for i, sid in enumerate(sids):
        assert (await store.read(sid)).conversation.messages == tuple(turn(i))


async def test_a_caller_that_knows_its_view_is_current_skips_the_server(
    store: HistoryStore, nc: NATS,
) -> None:
    """`current=True` (the lock came back from ourselves) returns the cached view
    as is; a write nobody told us of shows only in a plain read, and the
    compare-and-swap still refuses an append on the stale view."""
    sid = new_sid()
    mine = await store.append(sid, await store.read(sid), turn(1))
    behind_our_back = HistoryStore(nc.jetstream())
    await behind_our_back.append(sid, await behind_our_back.read(sid), turn(2))
    assert await store.read(sid, current=True) == mine
    with pytest.raises(HistoryConflict):
        await store.append(sid, mine, turn(3))
    assert len((await store.read(sid)).conversation.messages) == 4


async def test_a_followed_view_takes_in_what_other_processes_write(nc: NATS) -> None:
    await ensure_layout(nc.jetstream())
    ours, theirs = HistoryStore(nc.jetstream()), HistoryStore(nc.jetstream())
    following = await ours.follow()
    sid = new_sid()
    assert ours.cached(sid) is None  # never read here
    view = await ours.append(sid, await ours.read(sid), turn(1))
    await theirs.append(sid, await theirs.read(sid), turn(2))
    await theirs.append(sid, await theirs.read(sid), turn(3))

    def contents() -> list[str]:
        known = ours.cached(sid)
        return [m.content for m in known.conversation.messages] if known else []

    await eventually(lambda: len(contents()) == 6)
    assert contents() == ["q1", "a1", "q2", "a2", "q3", "a3"]
    known = ours.cached(sid)
    assert known is not None and known.last_seq > view.last_seq
    assert await ours.append(sid, known, turn(4))  # its sequence is the real one
    await following.unsubscribe()


async def test_a_write_a_followed_view_cannot_take_in_makes_it_stale(nc: NATS) -> None:
    await ensure_layout(nc.jetstream())
    ours, theirs = HistoryStore(nc.jetstream()), HistoryStore(nc.jetstream())
    sid = new_sid()
    await ours.append(sid, await ours.read(sid), turn(1))
    await theirs.append(sid, await theirs.read(sid), turn(2))  # unseen: not following yet
    following = await ours.follow()
    await theirs.append(sid, await theirs.read(sid), turn(3))
    await eventually(lambda: ours.cached(sid) is None)
    # Even a caller sure nobody else wrote gets the server's version now.
    current = await ours.read(sid, current=True)
    assert len(current.conversation.messages) == 6
    assert ours.cached(sid) is current
    await following.unsubscribe()


async def test_following_picks_up_again_after_the_server_restarts(
    private_nats: NatsServer,
) -> None:
    nc = await nats.connect(private_nats.url, reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1)
    try:
        await ensure_layout(nc.jetstream())
        ours = HistoryStore(nc.jetstream())
        following = await ours.follow(idle_heartbeat_s=0.5)
        sid = new_sid()
        await ours.append(sid, await ours.read(sid), turn(1))
        # Away for several heartbeat periods: each try to make a new consumer
        # fails until it is back. The old one lived only in its memory.
        private_nats.stop()
        await asyncio.sleep(3)
        private_nats.start()
        await eventually(lambda: nc.is_connected, timeout_s=10)
        other = await nats.connect(private_nats.url)
        try:
            theirs = HistoryStore(other.jetstream())
            await theirs.append(sid, await theirs.read(sid), turn(2))
        finally:
            await other.close()

        def messages() -> int:
            known = ours.cached(sid)
            return len(known.conversation.messages) if known else 0

        await eventually(lambda: messages() == 4, timeout_s=15)
        await following.unsubscribe()
    finally:
        await nc.close()


async def test_following_anew_after_the_store_is_lost_takes_in_new_writes(
    private_nats: NatsServer,
) -> None:
    nc = await nats.connect(private_nats.url, reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1)
    other = None
    try:
        await ensure_layout(nc.jetstream())
        ours = HistoryStore(nc.jetstream())
        following = await ours.follow()
        sid = new_sid()
        for i in range(1, 4):
            await ours.append(sid, await ours.read(sid), turn(i))
        private_nats.stop()
        private_nats.lose_store()
        private_nats.start()
        await eventually(lambda: nc.stats["reconnects"] == 1 and nc.is_connected,
                         timeout_s=10)
        await ensure_layout(nc.jetstream())
        following = await ours.follow_again(following)
        # Sequences of the lost stream mean nothing in the new one.
        assert ours.cached(sid) is None
        fresh = await ours.read(sid)
        assert fresh.conversation.messages == ()
        await ours.append(sid, fresh, turn(8))
        other = await nats.connect(private_nats.url)
        theirs = HistoryStore(other.jetstream())
        await theirs.append(sid, await theirs.read(sid), turn(9))

        def contents() -> list[str]:
            known = ours.cached(sid)
            return [m.content for m in known.conversation.messages] if known else []

        # The new stream numbers from 1: a follower resuming past the old
        # stream's last write would never see this one.
        await eventually(lambda: contents() == ["q8", "a8", "q9", "a9"])
        await following.unsubscribe()
    finally:
        if other is not None:
            await other.close()
        await nc.close()


async def test_a_write_left_unanswered_leaves_no_view_to_trust(
        private_nats: NatsServer) -> None:
    """The server does not answer the append in time (here: frozen), but stores it
    once it wakes. The cached view must not be offered as current after that."""
    client = await nats.connect(private_nats.url)
    try:
        js = client.jetstream(timeout=0.5)
        await ensure_layout(js)
        store, sid = HistoryStore(js), new_sid()
        view = await store.read(sid)
        private_nats.signal(signal.SIGSTOP)
        try:
            with pytest.raises(nats.errors.TimeoutError):
                await store.append(sid, view, turn(1))
        finally:
            private_nats.signal(signal.SIGCONT)
        assert store.cached(sid) is None
        async def stored() -> bool:
            return bool((await store.read(sid, current=True)).conversation.messages)

        await eventually(stored, "the append stored after all, once the server woke")
    finally:
        await client.close()


async def test_a_long_read_never_takes_the_cache_back_behind_a_write(nc: NATS) -> None:
    """A compaction reads without the lock, entry by entry, while this process
    appends a turn: the read ends last but must not put the older view back."""
    await ensure_layout(nc.jetstream())
    writer, ours, sid = HistoryStore(nc.jetstream()), HistoryStore(nc.jetstream()), new_sid()
    view = await writer.read(sid)
    for i in range(30):
        view = await writer.append(sid, view, turn(i))
    reading = asyncio.ensure_future(ours.read(sid))  # thirty round trips
    await asyncio.sleep(0)
    appended = await ours.append(sid, view, turn(30))
    assert (await reading).last_seq < appended.last_seq
    cached = ours.cached(sid)
    assert cached is not None and cached.last_seq == appended.last_seq


async def test_a_stale_mark_lasts_as_long_as_the_view_it_marks(nc: NATS) -> None:
    """Marks once had a bounded map of their own: marks of views the cache had
    let go pushed out the mark of a view still kept, which then read as
    current. Here the cache keeps two views; the mark of A must outlive B's."""
    js = nc.jetstream()
    await ensure_layout(js)
    ours = HistoryStore(js, cached_sessions=2)
    a, b, c = new_sid(), new_sid(), new_sid()
    for sid in (b, a):  # cached in that order: B is the least recently used
        await ours.append(sid, await ours.read(sid), turn(1))
    following = await ours.follow()

    async def write_unseen(sid: str) -> None:
        # No compare-and-swap header: a write a followed view cannot take in.
        await js.publish(subjects.history(sid), HistoryEntry.of_turn(tuple(turn(2)))
                         .model_dump_json().encode())
        await eventually(lambda: ours.cached(sid) is None)

    await write_unseen(a)
    await write_unseen(b)
    await ours.append(c, await ours.read(c), turn(1))  # the cache lets B go
    await write_unseen(c)
    assert ours.cached(a) is None, "A's view is stale, but its mark was dropped"
    assert len((await ours.read(a)).conversation.messages) == 4
    assert ours.cached(a) is not None  # read afresh: current again
    await following.unsubscribe()


async def test_retention_drops_old_entries_but_never_what_the_context_needs(
    store: HistoryStore, nc: NATS,
) -> None:
    sid, js = new_sid(), nc.jetstream()
    view = await store.read(sid)
    assert await trim(js, sid, 0, 1.0) == 0  # nothing there
    for i in range(4):
        view = await store.append(sid, view, turn(i))
    later = datetime.now(UTC) + timedelta(days=1)
    assert await trim(js, sid, view.base_seq, 60.0, now=later) == 0  # never compacted
    view = await store.splice(sid, view, Snapshot(summary="notes", messages=tuple(turn(3)),
                                                  compactions=1))
    view = await store.append(sid, view, turn(4))
    context = view.conversation
    assert await trim(js, sid, view.base_seq, 3600.0) == 0  # nothing old enough yet

    kept_from = await trim(js, sid, view.base_seq, 60.0, now=later)
    left = [item.body.get("content") async for stored in stored_entries(js, sid)
            for item in items_of(stored)]
    # Turns 0-2 went; turn 3 stays: the snapshot kept its messages, and the
    # transcript shows them before its marker.
    assert left == ["q3", "a3", None, "q4", "a4"] and kept_from > 0
    assert (await HistoryStore(js).read(sid)).conversation == context


async def test_a_caller_told_where_the_history_ends_trusts_a_view_that_ends_there(
    store: HistoryStore, nc: NATS,
) -> None:
    """`at` (the lock's previous holder said where the history stood): a cached
    view that ends there is returned as is, without asking the server (here the
    claim is false, to show it is taken on trust); one that ends elsewhere sends
    the read to the server."""
    sid = new_sid()
    mine = await store.append(sid, await store.read(sid), turn(1))
    behind_our_back = HistoryStore(nc.jetstream())
    theirs = await behind_our_back.append(sid, await behind_our_back.read(sid), turn(2))
    assert await store.read(sid, at=mine.last_seq) == mine
    fetched = await store.read(sid, at=theirs.last_seq)
    assert fetched.last_seq == theirs.last_seq and len(fetched.conversation.messages) == 4


async def test_following_tells_of_each_write_another_process_makes(nc: NATS) -> None:
    """Only another process's writes are told of (the lock uses it to know its
    own free marker is gone), not this process's own coming back."""
    await ensure_layout(nc.jetstream())
    told: list[str] = []
    ours = HistoryStore(nc.jetstream(), on_foreign_write=told.append)
    theirs = HistoryStore(nc.jetstream())
    following = await ours.follow()
    sid = new_sid()
    await ours.append(sid, await ours.read(sid), turn(1))
    await theirs.append(sid, await theirs.read(sid), turn(2))
    # Delivered in the stream's order: ours came back before theirs was told.
    await eventually(lambda: bool(told))
    assert told == [sid]
    await following.unsubscribe()
