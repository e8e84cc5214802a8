"""What the summariser model is asked.

The summary replaces the compact zone for the rest of the session, so it is
asked for in fixed sections, merged with any earlier summary (summaries
stack), with identifiers and errors kept verbatim, and written as notes for
continuing the same work, never as the opening of a new conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.history import ChatMessage
from services.core.prompt import compact_json

# The stand-in Ollama recognises summarisation requests by this marker.
SUMMARY_MARKER = "COMPACTION SUMMARY"

SECTIONS = (
    "Goal",
    "Decisions and their reasons",
    "Progress",
    "Files and identifiers",
    "Errors",
    "Open items",
    "Next step",
)

_SYSTEM = f"""You write the {SUMMARY_MARKER} of a conversation that is still going on.
The transcript you are given is the older part of that conversation; the newest
turns are kept elsewhere and follow your notes unchanged. The assistant will
read your notes instead of the transcript and carry on with the same task, so
write for it, not for the user.

Answer with exactly these seven Markdown sections, in this order, with bullet
points under each heading (after each dash: what belongs there):
## Goal - what the user is trying to achieve.{{goal_rule}}
## Decisions and their reasons - what was chosen, and why.
## Progress - what is done and what was learnt.
## Files and identifiers - every path, file name, URL, function, variable,
   command and id that matters, copied exactly.
## Errors - error messages copied verbatim, and whether each was resolved.
## Open items - questions and tasks still unresolved.
## Next step - what the assistant was about to do next.

Rules:
- If earlier notes are given, merge them with the transcript into one set of
  notes: keep everything in them that still matters, update what changed, and
  drop nothing the task still depends on.
- Copy identifiers, paths, numbers and error strings character for character;
  never paraphrase them.
- Write "none" under a section that has nothing to say.
- This is not a new conversation. Do not greet anyone, do not ask what the
  user wants to do, do not offer help, and do not address the user at all.
"""

_GOAL_VERBATIM = (
    "\n   Start it with the session's first request, quoted verbatim from the"
    "\n   FIRST REQUEST part below."
)
_GOAL_CARRIED = "\n   Keep the first request quoted in the earlier notes verbatim."


# The first request is quoted once, in its own part; where it stood in the
# transcript, this reference takes its place.
FIRST_REQUEST_REFERENCE = "[user]\n(the FIRST REQUEST quoted above)"

# The smallest summary the prompt allows: every section, with nothing to say.
# What an emergency compaction leaves at the very least in place of the
# history it summarises.
MINIMAL_SUMMARY = "\n".join(f"## {section}\n- none" for section in SECTIONS)


def summary_messages(
    previous_summary: str | None,
    to_compact: Sequence[ChatMessage],
    first_request: str | None,
    instructions: str | None = None,
) -> list[dict[str, str]]:
    """The system and user messages of one summarisation call over the whole zone."""
    if not to_compact:
        raise ValueError("nothing to summarise: the compact zone is empty")
    return summary_request(transcript_entries(to_compact, first_request), previous_summary,
                           first_request, instructions)


def summary_request(
    entries: Sequence[str],
    earlier_notes: str | None,
    first_request: str | None,
    instructions: str | None = None,
) -> list[dict[str, str]]:
    """One summarisation call over transcript entries (`transcript_entries`),
    merging `earlier_notes`. `first_request` is quoted when given (in the
    call that covers the session's start); later calls find it in the notes."""
    goal_rule = _GOAL_VERBATIM if first_request is not None else _GOAL_CARRIED
    system = _SYSTEM.format(goal_rule=goal_rule)
    parts: list[str] = []
    if first_request is not None:
        parts.append(f"FIRST REQUEST (quote it verbatim under Goal):\n{first_request}")
    if earlier_notes:
        parts.append(f"EARLIER NOTES (merge them):\n{earlier_notes}")
    parts.append("TRANSCRIPT TO CONDENSE:\n" + "\n\n".join(entries))
    if instructions and instructions.strip():
        parts.append(f"ADDITIONAL INSTRUCTIONS FROM THE USER:\n{instructions.strip()}")
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def transcript_entries(messages: Sequence[ChatMessage], first_request: str | None = None
                       ) -> list[str]:
    """One role-labelled entry per message. With `first_request`, the first user
    message holding it becomes a reference to the quoted part instead of
    sending the same text twice (a pasted spec would cost its size twice)."""
    entries = [_entry(m) for m in messages]
    if first_request is not None:
        for index, message in enumerate(messages):
            if message.role == "user":
                if message.content == first_request and not message.tool_calls:
                    entries[index] = FIRST_REQUEST_REFERENCE
                break
    return entries


def transcript(messages: Sequence[ChatMessage]) -> str:
    """Role-labelled text of the messages, with tool calls and their arguments."""
    return "\n\n".join(transcript_entries(messages))


def _entry(message: ChatMessage) -> str:
    if message.role == "tool":
        header = f"[tool result: {message.tool_name or 'unknown tool'}]"
    else:
        header = f"[{message.role}]"
    lines = [header]
    if message.content:
        lines.append(message.content)
    for call in message.tool_calls:
        lines.append(f"(calls tool {call.name} with {compact_json(call.arguments)})")
    return "\n".join(lines)
