"""Who sends and who receives each subject: the routing half of the contract,
from which `scripts/export_asyncapi.py` writes `schemas/asyncapi.yaml`.
(The message half is `schemas.registry`.)"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import messages as m
from schemas import subjects

GATEWAY, GENERATOR, DECIDER, TOOLS = "gateway", "generator", "compaction-decider", "tools"
ANYONE = "anyone"  # an observer: the page's live feed, scripts/watch.py, your own tool


@dataclass(frozen=True)
class Channel:
    name: str
    address: str  # `{sessionId}` / `{toolName}` stand for the last token
    payload: type[m.Payload]
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    description: str
    stream: str | None = None  # the JetStream stream that keeps it, if any
    reply: type[m.Payload] | None = None  # a request answered on its reply subject


CHANNELS: tuple[Channel, ...] = (
    Channel("chatQuery", f"{subjects.QUERY_PREFIX}.{{sessionId}}", m.Query,
            (GATEWAY,), (GENERATOR,),
            "A user's message to answer; kept until a generator acknowledges it.",
            stream=subjects.QUERIES_STREAM),
    Channel("chatReply", f"{subjects.REPLY_PREFIX}.{{sessionId}}", m.Reply,
            (GENERATOR, GATEWAY), (GATEWAY,),
            "The answer to a query, or its error with a code; correlation id = the query's. "
            "The gateway answers a query still queued when its session is deleted."),
    Channel("chatToken", f"{subjects.TOKEN_PREFIX}.{{sessionId}}", m.Token,
            (GENERATOR,), (GATEWAY,),
            "One streamed piece of an answer, numbered across the turn."),
    Channel("chatStop", f"{subjects.STOP_PREFIX}.{{sessionId}}", m.StopRequest,
            (GATEWAY,), (GENERATOR,),
            "Stop the session's answer being written (a NATS request): only the generator "
            "writing it replies; a malformed request is answered with an ErrorReport.",
            reply=m.StopAccepted),
    Channel("responseGeneration", subjects.RESPONSE_GENERATION, m.GenerationReport,
            (GENERATOR,), (DECIDER, GATEWAY, ANYONE),
            "After every answer: the provider's token counts and what the next prompt holds.",
            stream=subjects.GENERATIONS_STREAM),
    Channel("compactionRequest", subjects.COMPACTION_REQUEST, m.CompactionRequest,
            (DECIDER, GATEWAY), (GENERATOR, GATEWAY, ANYONE),
            "Compact a session (auto from the decider, manual from the gateway); "
            "answered by exactly one compaction.result with the same correlation id.",
            stream=subjects.COMPACTIONS_STREAM),
    Channel("compactionEvent", subjects.COMPACTION_EVENT, m.CompactionEvent,
            (GENERATOR,), (GATEWAY, ANYONE),
            "A compaction has started (`started`), then one `progress` per summary piece written."),
    Channel("compactionResult", subjects.COMPACTION_RESULT, m.CompactionResult,
            (GENERATOR,), (DECIDER, GATEWAY, ANYONE),
            "How a compaction ended: completed, skipped or failed.",
            stream=subjects.RESULTS_STREAM),
    Channel("generatorState", f"{subjects.STATE_PREFIX}.{{sessionId}}", m.StateChange,
            (GENERATOR,), (GATEWAY, ANYONE), "A session's turn phase changed.",
            stream=subjects.STATE_STREAM),
    Channel("sessionDeleted", f"{subjects.SESSION_DELETED_PREFIX}.{{sessionId}}",
            m.SessionDeleted, (GATEWAY,), (GATEWAY, ANYONE),
            "A session was deleted, by any client: each page showing it closes it."),
    Channel("toolCall", f"{subjects.TOOL_PREFIX}.{{toolName}}", m.ToolInvocation,
            (GENERATOR,), (TOOLS,), "Run one tool (a NATS request).", reply=m.ToolOutcome),
    Channel("toolList", subjects.TOOL_LIST, m.ToolListRequest,
            (GENERATOR, GATEWAY), (TOOLS,),
            "The tools on offer, as Ollama tool definitions (a NATS request).",
            reply=m.ToolDefinitions),
    Channel("systemError", subjects.ERROR_SUBJECT, m.ErrorReport,
            (GATEWAY, GENERATOR, DECIDER, TOOLS), (ANYONE,),
            "A malformed message was received and dropped, or a transition refused."),
)
