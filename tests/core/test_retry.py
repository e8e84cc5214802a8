"""Where a retried answer goes, and how the stored retry folds."""

from __future__ import annotations

from schemas.history import ChatMessage, Conversation, HistoryEntry, fold
from schemas.messages import ErrorCode
from services.core.retry import RetryPoint, RetryRefused, retry_point, retry_verdict


def user(text: str, qid: str) -> ChatMessage:
    return ChatMessage(role="user", content=text, query_id=qid)


def answer(text: str, qid: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text, query_id=qid)


def test_nothing_to_retry_without_a_user_message() -> None:
    assert retry_point(Conversation()) is None
    assert retry_point(Conversation(summary="s", messages=(answer("a", "q0"),))) is None


def test_the_retry_replaces_the_answer_after_the_last_user_message() -> None:
    messages = (user("one", "q1"), answer("a1", "q1"), user("two", "q2"),
                ChatMessage(role="assistant", tool_calls=(), content="", query_id="q2"),
                ChatMessage(role="tool", content="r", tool_name="t", query_id="q2"),
                answer("a2", "q2"))
    point = retry_point(Conversation(messages=messages))
    assert point is not None
    assert point.supersedes == "q2"
    assert point.context.messages == messages[:3]


def test_a_last_message_without_an_answer_is_answered_again_superseding_nothing() -> None:
    point = retry_point(Conversation(messages=(user("one", "q1"),)))
    assert point is not None and point.supersedes is None


def test_the_folded_history_holds_the_new_answer_and_the_entries_both() -> None:
    entries = [HistoryEntry.of_turn((user("one", "q1"), answer("first", "q1"))),
               HistoryEntry.of_turn((answer("second", "r1"),), supersedes="q1"),
               HistoryEntry.of_turn((answer("third", "r2"),), supersedes="r1")]
    assert fold(entries).messages == (user("one", "q1"), answer("third", "r2"))
    assert entries[0].messages[1].content == "first"  # kept, for the transcript


def test_entries_written_before_the_flags_existed_still_read() -> None:
    old = '{"kind": "turn", "messages": [{"role": "assistant", "content": "a"}]}'
    entry = HistoryEntry.model_validate_json(old)
    assert entry.supersedes is None and not entry.messages[0].stopped


def test_the_verdict_names_why_a_retry_cannot_be() -> None:
    empty = retry_verdict(Conversation(), "anything")
    assert isinstance(empty, RetryRefused) and empty.code == ErrorCode.nothing_to_retry
    asked = Conversation(messages=(user("one", "q1"), answer("a1", "q1"), user("two", "q2")))
    outdated = retry_verdict(asked, "one")  # "two" was sent since the retry was asked for
    assert isinstance(outdated, RetryRefused) and outdated.code == ErrorCode.retry_outdated
    for known in ("two", None):
        point = retry_verdict(asked, known)
        assert isinstance(point, RetryPoint) and point.supersedes is None
        assert point.context.messages[-1].content == "two"


def test_a_retry_of_an_answer_replaced_since_is_outdated() -> None:
    """Two retries asked at once of the same answer (two tabs): the first
    replaces it, the second finds another answer in its place."""
    asked = Conversation(messages=(user("one", "q1"), answer("a1", "q1")))
    point = retry_verdict(asked, "one", replacing="q1")
    assert isinstance(point, RetryPoint) and point.supersedes == "q1"
    retried = Conversation(messages=(user("one", "q1"), answer("b1", "r1")))
    late = retry_verdict(retried, "one", replacing="q1")
    assert isinstance(late, RetryRefused) and late.code == ErrorCode.retry_outdated
    assert "replaced" in late.message
    assert isinstance(retry_verdict(retried, "one"), RetryPoint)  # not said: not checked


def test_a_retry_of_a_message_without_an_answer_is_outdated_once_one_is_written() -> None:
    unanswered = Conversation(messages=(user("one", "q1"),))
    assert isinstance(retry_verdict(unanswered, "one", replacing=""), RetryPoint)
    answered = Conversation(messages=(user("one", "q1"), answer("b1", "r1")))
    late = retry_verdict(answered, "one", replacing="")
    assert isinstance(late, RetryRefused) and late.code == ErrorCode.retry_outdated
