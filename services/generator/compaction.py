"""Compaction execution: summarise the old part of a session's history and
splice the summary in, without freezing the session.

Background mode (the default): snapshot the history, announce `compacting`,
write the summary while the session goes on answering, then take the
session lock only for the splice: one snapshot message (the transcript's
marker, and where the context starts from then on), compare-and-swap on the
sequence just read, keeping every message appended since the snapshot.
Blocking mode holds the lock for the whole compaction: queries wait, or are
told `compacting`.

Every attempt ends with exactly one `compaction.result`: completed, skipped
(with the reason) or failed (with the error). History is only ever changed
by a successful splice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from schemas import subjects
from schemas.envelope import Envelope
from schemas.history import Conversation
from schemas.messages import (
    CompactionEvent,
    CompactionRequest,
    CompactionResult,
    ErrorCode,
    Level,
)
from schemas.session import SessionRecord
from services.core.boundary import tail_turns_for
from services.core.context import next_prompt_tokens
from services.core.decision import EMERGENCY_FRACTION
from services.core.overflow import relief_plan
from services.core.pieces import (
    NothingFits,
    Piece,
    SummaryWindow,
    Zone,
    count_pieces,
    next_piece,
)
from services.core.splice import (
    CompactionPlan,
    SpliceConflict,
    plan_compaction,
    splice,
    splice_elided,
)
from services.core.splice import first_user_request as first_request_of
from services.core.state_machine import Action, CompactionMode, IllegalTransition
from services.core.text_size import prompt_size
from services.core.tokens import (
    Calibration,
    prompt_budget,
    refused_as_too_long,
    stored_calibration,
)
from services.generator.models import capped_window
from services.generator.provider import ChatProvider, ChatRequest, ChatResult, ProviderError
from services.generator.session_lock import Lease, LockTimeout, SessionLocks
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.stops import StopSwitch
from services.shared import metrics
from services.shared.bus import Bus
from services.shared.history_store import HistoryConflict, HistoryStore, HistoryView
from services.shared.live_config import LiveSettings
from services.shared.nats_away import patiently
from services.shared.sessions import SessionNotFound, SessionStore
from services.shared.transcript import trim

log = structlog.get_logger()
# How long a compaction cut short by the generator's stop may take to say so:
# the stop must not wait on a NATS that does not answer.
ENDING_BOUND_S = 2.0
# Called after each piece of a summary is written (session id, the piece):
# where progress can be published.
PieceWritten = Callable[[str, Piece], Awaitable[None]]


class CompactionSkipped(Exception):
    """Nothing was changed, for a reason worth telling (not a failure)."""


class CompactionStopped(CompactionSkipped):
    """The turn whose emergency compaction this was is stopped: its summary
    is left unwritten, the history unchanged."""


class CompactionFailed(Exception):
    """Nothing was changed because something went wrong."""


@dataclass(frozen=True)
class Written:
    """A new summary, or None and why the summariser could not write one."""

    summary: str | None
    failure: str | None = None


@dataclass(frozen=True)
class Job:
    session_id: str
    level: Level
    auto: bool
    reason: str
    instructions: str | None
    correlation_id: str
    # The request's message id; None for an emergency compaction inside a turn.
    request_id: str | None = None


class ToolDefinitions(Protocol):
    async def definitions(self) -> list[dict[str, Any]]: ...


class NoTools:
    """Offers no tools: what a compactor without a tool catalogue counts."""

    async def definitions(self) -> list[dict[str, Any]]:
        return []


class Compactor:
    def __init__(self, bus: Bus, live: LiveSettings[GeneratorSettings], provider: ChatProvider,
                 history: HistoryStore, sessions: SessionStore, locks: SessionLocks,
                 states: SessionStates, tools: ToolDefinitions | None = None,
                 on_piece: PieceWritten | None = None) -> None:
        self._bus = bus
        self._live = live
        self._provider = provider
        self._history = history
        self._sessions = sessions
        self._locks = locks
        self._states = states
        # The offered tools count in the context's size, as everywhere: read
        # afresh when a compaction starts (the catalogue caches them).
        self._tools = tools or NoTools()
        self._offered: list[dict[str, Any]] = []
        self._running: set[str] = set()
        self._on_piece = on_piece

    @property
    def _settings(self) -> GeneratorSettings:
        # Read on every use: `compaction_threshold` may change while it runs.
        return self._live.current

    @property
    def blocking(self) -> bool:
        return self._settings.compaction_mode == CompactionMode.blocking.value

    def running(self, sid: str) -> bool:
        return sid in self._running

    async def handle(self, env: Envelope[CompactionRequest]) -> CompactionResult:
        request = env.payload
        job = Job(request.session_id, request.level, request.auto, request.reason,
                  request.instructions, env.correlation_id, env.message_id)
        result = await self._attempt(job)
        await self._publish(job, result)
        log.info("compaction_finished", status=result.status, error=result.error,
                 tokens_before=result.tokens_before, tokens_after=result.tokens_after)
        return result

    async def compact_within_turn(self, record: SessionRecord, view: HistoryView,
                                  correlation_id: str, switch: StopSwitch,
                                  tail_turns: int | None = None) -> HistoryView:
        """Emergency compaction by a turn that already holds the session lock,
        keeping `tail_turns` turns raw (the emergency level's, unless given);
        its summary is given up if the turn's `switch` is thrown (the splice,
        once begun, is not: its outcome must be known)."""
        job = _emergency(record.session_id, correlation_id)
        self._offered = await self._tools.definitions()
        plan = self._plan(view.conversation, job.level, tail_turns)
        before = self.tokens(record, view.conversation)
        await self._announce(job, before)
        try:
            written = await switch.unless_thrown(self._write_summary(record, plan, job))
            if written is None:
                raise CompactionStopped("the answer was stopped while it was written")
            spliced, before = await self._splice(record, view, plan, written, job)
        except CompactionSkipped as err:
            await self._publish(job, self._skipped(job, str(err), before))
            raise
        except CompactionFailed as err:
            await self._publish(job, self._failed(job, str(err), before))
            raise
        except Exception as err:  # a refused splice, NATS away: the turn deals with it
            with contextlib.suppress(Exception):
                await self._publish(job, self._failed(
                    job, f"compaction failed: {type(err).__name__}: {err}", before))
            raise
        except asyncio.CancelledError:  # the generator stopping: said, within a bound
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._publish(job, self._failed(
                    job, "the generator stopped while writing it", before))), ENDING_BOUND_S)
            raise
        await self._publish(job, self._completed(job, record, before, spliced, written))
        return spliced

    async def end_left_running(self, sid: str, correlation_id: str) -> None:
        """For a query delivered again: a compaction its earlier delivery began
        inside the turn, on a process that died before its result, is ended
        and reported failed. Nothing else would end it (the turn may not need
        one now), and the session would read compacting for good."""
        try:
            if not await self._states.compaction_recorded(sid, correlation_id):
                return
            job = _emergency(sid, correlation_id)
            await self._publish(job, self._failed(job, "the generator writing it stopped"))
        except Exception as err:  # best effort: the turn itself goes on
            log.warning("compaction_left_running_not_ended", error=f"{type(err).__name__}: {err}")

    async def _attempt(self, job: Job) -> CompactionResult:
        sid = job.session_id
        if sid in self._running:
            return self._skipped(job, "a compaction of this session is already running")
        self._running.add(sid)
        try:
            record = await self._sessions.get(sid)
            self._offered = await self._tools.definitions()
            async with self._exclusive_if_blocking(sid):
                return await self._compact(job, record)
        except SessionNotFound:
            return self._failed(job, f"session {sid} does not exist")
        except CompactionSkipped as err:
            return self._skipped(job, str(err))
        except SpliceConflict as err:
            # Another compaction (an emergency one inside a turn) got there first.
            return self._skipped(job, f"superseded: {err}")
        except HistoryConflict as err:
            if not await self._sessions.exists(sid):
                return self._skipped(job, "the session was deleted")
            return self._failed(job, str(err))
        except CompactionFailed as err:
            return self._failed(job, str(err))
        except IllegalTransition:
            return self._skipped(job, "session is busy (blocking mode compacts only when idle)")
        except LockTimeout as err:
            return self._skipped(job, f"session is busy: {err}")
        except Exception as err:  # every start ends in exactly one result, whatever happens
            log.exception("compaction_crashed")
            return self._failed(job, f"compaction failed: {type(err).__name__}: {err}")
        finally:
            self._running.discard(sid)

    async def _compact(self, job: Job, record: SessionRecord) -> CompactionResult:
        view = await self._history.read(job.session_id)
        if job.request_id is not None and view.conversation.compacted_by == job.request_id:
            # Spliced by an earlier delivery of this request, whose result or
            # acknowledgement was then lost: report it, do not compact again.
            return self._completed_before(job, record, view)
        if not view.conversation.messages:
            raise CompactionSkipped("no history to compact")
        before = self.tokens(record, view.conversation)
        plan = self._plan_for(job, record, view.conversation, before)
        await self._states.apply(job.session_id, Action.start_compaction, job.correlation_id)
        try:
            await self._announce(job, before)
            written = await self._write_summary(record, plan, job)
            async with self._splice_lock(job.session_id):
                current = await self._history.read(job.session_id)
                spliced, before = await self._splice(record, current, plan, written, job)
        finally:
            await self._states.apply(job.session_id, Action.complete_compaction,
                                     job.correlation_id)
        await self._trim(job.session_id, spliced)
        return self._completed(job, record, before, spliced, written)

    async def _trim(self, sid: str, spliced: HistoryView) -> None:
        """Retention: a compaction is when the context's start moves, so it
        is when older transcript entries may go. Best effort: a failure
        leaves them for the next compaction."""
        max_age = self._settings.transcript_max_age
        if max_age is None:
            return
        try:
            kept_from = await trim(self._bus.js, sid, spliced.base_seq, max_age)
        except Exception as err:  # the compaction itself succeeded
            log.warning("transcript_trim_failed", error=str(err))
            return
        if kept_from:
            log.info("transcript_trimmed", kept_from=kept_from)

    def _plan_for(self, job: Job, record: SessionRecord, conversation: Conversation,
                  tokens: int) -> CompactionPlan:
        """The level's plan; but one asked for by a person, on a context past
        the emergency line, keeps only as many turns raw as leave the context
        below it (down to none): with automatic compaction off, a long answer
        kept raw left every message refused (compact, said the refusal) and
        this compaction skipped or of no help."""
        line = EMERGENCY_FRACTION * prompt_budget(record.window(self._settings.num_ctx),
                                                  self._settings.output_headroom)
        if job.auto or tokens < line:
            return self._plan(conversation, job.level)
        level_tail = tail_turns_for(job.level, self._settings.compaction_tail_turns)
        plan = relief_plan(conversation, (level_tail, 1, 0),
                           lambda least: self.tokens(record, least) < line)
        if plan is None:
            raise CompactionSkipped("nothing to compact")
        return plan

    def _plan(self, conversation: Conversation, level: Level,
              tail_turns: int | None = None) -> CompactionPlan:
        tail = (tail_turns_for(level, self._settings.compaction_tail_turns)
                if tail_turns is None else tail_turns)
        plan = plan_compaction(conversation, tail)
        if plan is None:
            raise CompactionSkipped(
                f"nothing to compact: the whole history is within the last {tail} turn(s)")
        return plan

    async def _write_summary(self, record: SessionRecord, plan: CompactionPlan,
                             job: Job) -> Written:
        try:
            return Written(await self._summarise(record, plan, job))
        except CompactionFailed as err:
            log.warning("summary_failed_trying_elision", error=str(err))
            return Written(None, str(err))

    async def _summarise(self, record: SessionRecord, plan: CompactionPlan, job: Job) -> str:
        zone = Zone.of(plan.to_compact, first_request_of(plan.snapshot), job.instructions)
        timeout = self._settings.summary_timeout_s
        try:
            async with asyncio.timeout(timeout), metrics.timed(metrics.generator().summary_time):
                return await self._in_pieces(record, zone, plan.snapshot.summary, job)
        except TimeoutError as err:
            raise CompactionFailed(f"summariser failed: no summary within {timeout:g} s") from err
        except (ProviderError, NothingFits) as err:
            raise CompactionFailed(f"summariser failed: {err}") from err

    async def _in_pieces(self, record: SessionRecord, zone: Zone, notes: str | None,
                         job: Job) -> str:
        """notes₁ from the first piece, notes₂ from notes₁ and the next, ...
        Each piece is planned (and checked) with the notes it is sent with."""
        window, start, done = await self._summary_window(record), 0, 0
        while start < len(zone.entries):
            await self._progress(job, done, done + count_pieces(zone, notes, window, start))
            piece = next_piece(zone, start, notes, window)
            try:
                result = await self._provider.chat(self._piece_request(record, piece, window, job))
            except ProviderError as err:
                window = _counted_longer(window, piece, err)  # the same entries, smaller pieces
                continue
            if result.done_reason == "length":
                window = _more_room(window)  # the same entries again, with more room
                continue
            notes = _written(result)
            log.info("summary_piece_written", first=piece.start, end=piece.end,
                     entries=len(zone.entries), cut_chars=piece.cut_chars,
                     output_tokens=piece.output_tokens)
            if self._on_piece is not None:
                await self._on_piece(job.session_id, piece)
            start, done = piece.end, done + 1
        await self._progress(job, done, done)
        assert notes is not None  # the zone is never empty
        return notes

    def _piece_request(self, record: SessionRecord, piece: Piece, window: SummaryWindow,
                       job: Job) -> ChatRequest:
        return ChatRequest(
            model=self._summary_model(record), messages=piece.messages,
            num_ctx=self._sent_window(record, window), num_predict=window.output_tokens,
            # A thinking model could spend the whole output on thinking and
            # leave the summary empty; streamed so a stall is caught midway.
            # The model's answers go first, unless this is an emergency
            # compaction, itself part of an answer (it has no request).
            think="off", watch_gaps=True, background=job.request_id is not None)

    async def _progress(self, job: Job, done: int, total: int) -> None:
        """How far the summary is, for the page; the total is re-estimated
        before each piece, with the notes written so far. Never fails the
        compaction: a lost progress event costs only the display."""
        try:
            await self._bus.publish(
                subjects.COMPACTION_EVENT,
                CompactionEvent(session_id=job.session_id, event="progress", level=job.level,
                                auto=job.auto, reason=job.reason, pieces_done=done,
                                pieces_total=max(total, 1)),
                correlation_id=job.correlation_id, session_id=job.session_id)
        except Exception as err:
            log.warning("compaction_progress_not_published", error=str(err))

    def _summary_model(self, record: SessionRecord) -> str:
        return self._settings.compaction_model or record.model_or(self._settings.model)

    def _sent_window(self, record: SessionRecord, window: SummaryWindow) -> int:
        """The num_ctx a piece is sent with: the session's own window when the
        summariser is the session's model and the pieces fit that window.
        Ollama reloads a model asked with another num_ctx: each time an answer
        and a summary piece took turns, a load, and every request behind it."""
        answering = record.window(self._settings.num_ctx)
        same_model = self._summary_model(record) == record.model_or(self._settings.model)
        return answering if same_model and window.num_ctx <= answering else window.num_ctx

    async def _summary_window(self, record: SessionRecord) -> SummaryWindow:
        """The summariser's window, estimated with the session's calibration when
        the summariser is the session's own model (another model's is unknown:
        the conservative fallback). Never beyond the summariser's own window:
        the provider would send the smaller one, and a prompt planned for the
        larger would lose its start."""
        settings, model = self._settings, self._summary_model(record)
        own = model == record.model_or(settings.model)
        calibration = stored_calibration(record) if own else Calibration()
        # The session's model may have a smaller window than NUM_CTX (its record knows).
        num_ctx = settings.compaction_num_ctx or (
            record.window(settings.num_ctx) if own else settings.num_ctx)
        num_ctx = capped_window(num_ctx, await self._provider.facts(model))
        return SummaryWindow.for_summaries(num_ctx, calibration)

    async def _splice(self, record: SessionRecord, current: HistoryView, plan: CompactionPlan,
                      written: Written, job: Job) -> tuple[HistoryView, int]:
        """Splice over `current`; returns the new view and the size it replaced.

        Relief is judged against the history as it is now, turns answered
        during the summary included, not against the older snapshot. Without
        a summary, the structural fallback (old tool output elided) is spliced
        if it frees anything; otherwise the summariser's failure stands."""
        if current.last_seq == 0 and not await self._sessions.exists(record.session_id):
            raise CompactionSkipped("the session was deleted")
        before = self.tokens(record, current.conversation)
        if written.summary is None:
            snapshot = splice_elided(current.conversation, plan)
        else:
            snapshot = splice(current.conversation, plan, written.summary)
        after = self.tokens(record, Conversation(summary=snapshot.summary,
                                                 messages=snapshot.messages))
        if after >= before and written.failure is not None:
            raise CompactionFailed(f"{written.failure}; no tool output to elide instead")
        if after >= before:
            raise CompactionSkipped(
                f"the summary frees too little ({before} -> {after} tokens); history unchanged")
        snapshot = snapshot.model_copy(update={
            "request_id": job.request_id, "at": datetime.now(UTC), "auto": job.auto,
            "level": job.level, "tokens_before": before, "tokens_after": after})
        return await self._history.splice(record.session_id, current, snapshot), before

    def tokens(self, record: SessionRecord, conversation: Conversation) -> int:
        """Tokens in the context this conversation makes, as the gauge counts them."""
        return next_prompt_tokens(record.system, conversation, self._offered,
                                  stored_calibration(record))

    @contextlib.asynccontextmanager
    async def _exclusive_if_blocking(self, sid: str) -> AsyncIterator[None]:
        if not self.blocking:
            yield
            return
        async with self._locks.hold(sid, "compaction"):
            yield

    @contextlib.asynccontextmanager
    async def _splice_lock(self, sid: str) -> AsyncIterator[None]:
        # Blocking mode holds the lock already; background takes it only now,
        # which waits for a turn in flight to finish.
        if self.blocking:
            yield
            return
        # Taken patiently, as a turn's history write is: with its summary
        # written, a compaction meeting a NATS restart here lost it all. A take
        # tried again may find the one before it went through unanswered.
        async def take() -> Lease:
            return (await self._locks.taken_unanswered(sid, "compaction")
                    or await self._locks.acquire(sid, "compaction"))

        taken = await patiently(take, self._settings.nats_away_patience_s,
                                "compaction_lock_tried_again")
        async with self._locks.hold(sid, "compaction", taken=taken):
            yield

    async def _announce(self, job: Job, before: int) -> None:
        # Recorded first: whoever sees the start then reads the session compacting.
        await self._states.compaction_started(job.session_id, job.correlation_id)
        await self._bus.publish(
            subjects.COMPACTION_EVENT,
            CompactionEvent(session_id=job.session_id, event="started", level=job.level,
                            auto=job.auto, reason=job.reason, tokens_before=before),
            correlation_id=job.correlation_id, session_id=job.session_id,
        )

    async def _publish(self, job: Job, result: CompactionResult) -> None:
        # Ended first: whoever sees the result then reads the session not compacting
        # (unless another compaction runs). A redelivered request ends its
        # predecessor's entry too: they share the correlation id.
        await self._states.compaction_ended(job.session_id, job.correlation_id)
        metrics.generator().compaction_finished(result.status, job.level, job.auto,
                                                result.tokens_before, result.tokens_after)
        await self._bus.publish(subjects.COMPACTION_RESULT, result,
                                correlation_id=job.correlation_id, session_id=job.session_id)

    def _completed(self, job: Job, record: SessionRecord, before: int,
                   spliced: HistoryView, written: Written) -> CompactionResult:
        fallback = written.summary is None
        return CompactionResult(
            session_id=job.session_id, status="completed", tokens_before=before,
            tokens_after=self.tokens(record, spliced.conversation),
            summary=spliced.conversation.summary, auto=job.auto, level=job.level,
            method="elision" if fallback else "summary",
            note=f"{written.failure}; old tool output elided instead" if fallback else None,
            compactions=spliced.conversation.compactions,
        )

    def _completed_before(self, job: Job, record: SessionRecord,
                          view: HistoryView) -> CompactionResult:
        return CompactionResult(
            session_id=job.session_id, status="completed",
            tokens_after=self.tokens(record, view.conversation),
            summary=view.conversation.summary, auto=job.auto, level=job.level,
            note="compacted by an earlier delivery of this request; the size before "
                 "is not known any more, and the size after is the history's now",
            compactions=view.conversation.compactions,
        )

    @staticmethod
    def _skipped(job: Job, reason: str, tokens_before: int | None = None) -> CompactionResult:
        return CompactionResult(session_id=job.session_id, status="skipped", error=reason,
                                tokens_before=tokens_before, auto=job.auto, level=job.level)

    @staticmethod
    def _failed(job: Job, error: str, tokens_before: int | None = None) -> CompactionResult:
        return CompactionResult(session_id=job.session_id, status="failed", error=error,
                                tokens_before=tokens_before, auto=job.auto, level=job.level)


def _emergency(sid: str, correlation_id: str) -> Job:
    """A turn's own compaction: under the query's correlation id, with no request."""
    return Job(sid, Level.emergency, True, "the next prompt would not fit", None, correlation_id)


def _counted_longer(window: SummaryWindow, piece: Piece, err: ProviderError) -> SummaryWindow:
    """A piece the model server refused as longer than the window: the window
    is a count it exceeds, so the rates its pieces are planned with rise to it.
    Any other error, or a refusal that raises nothing, stands."""
    if err.cause != ErrorCode.context_overflow:
        raise err
    sent = prompt_size(piece.messages)
    raised = refused_as_too_long(window.calibration, sent, window.num_ctx)
    if raised == window.calibration:
        raise err
    log.warning("summary_piece_refused_as_too_long", num_ctx=window.num_ctx, chars=sent.chars)
    return replace(window, calibration=raised)


def _more_room(window: SummaryWindow) -> SummaryWindow:
    """A summary cut off at its length limit is never spliced: it is written
    again with twice the room, up to half the window."""
    roomier = window.with_more_room()
    if roomier is None:
        raise CompactionFailed(
            f"summariser failed: the summary was cut off at its length limit even with "
            f"{window.output_tokens} of the window's {window.num_ctx} tokens for it")
    return roomier


def _written(result: ChatResult) -> str:
    if not result.content.strip():
        where = " (all its output was in 'thinking')" if result.thinking else ""
        raise CompactionFailed(f"summariser failed: it returned an empty summary{where}")
    return result.content.strip()
