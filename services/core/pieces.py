"""A compact zone summarised in pieces that each fit the summariser's window.

The summariser's call is a model call like any other: what it sends must fit
its window (`COMPACTION_NUM_CTX`), with room kept for the summary it writes,
or Ollama cuts the prompt from the front and the summary loses the first
request and the oldest facts, exactly what it exists to keep. A zone too
large for one call is summarised piece by piece: notes₁ from the first
piece, notes₂ from notes₁ and the next piece, and so on. Each piece is
checked with the same calibrated estimate and margin as a turn, and with the
notes the previous piece actually produced. One entry too large for any
piece is cut with a marker (`cutting`).

`next_piece` is pure; the shell calls it once per piece with the notes so
far, so the pieces are easy to follow (and to report on) as they go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from schemas.history import ChatMessage
from services.core.cutting import cut_text, left_out, longest_fitting_cut
from services.core.decision import check_fit
from services.core.summary_prompt import summary_request, transcript_entries
from services.core.tokens import Calibration, budget, default_headroom, estimate_prompt

# The quoted first request may use at most this share of a piece: the rest is
# for the transcript (a pasted spec as first request must not crowd it out).
FIRST_REQUEST_SHARE = 0.5


class NothingFits(Exception):
    """Not even the instructions and the notes so far fit the summariser's window."""


@dataclass(frozen=True)
class SummaryWindow:
    """The summariser's window, the room kept for the summary it writes, and
    the calibration its prompts are estimated with."""

    num_ctx: int
    output_tokens: int
    calibration: Calibration

    @classmethod
    def for_summaries(cls, num_ctx: int, calibration: Calibration) -> SummaryWindow:
        return cls(num_ctx, default_headroom(num_ctx), calibration)

    @property
    def prompt_budget(self) -> int:
        return budget(self.num_ctx, self.output_tokens)

    def fits(self, messages: Sequence[Mapping[str, Any]], share: float = 1.0) -> bool:
        """Does this call fit (within `share` of the budget), margin kept?"""
        return check_fit(estimate_prompt(messages, self.calibration),
                         int(share * self.prompt_budget)).fits

    def with_more_room(self) -> SummaryWindow | None:
        """Twice the room for the summary (its pieces get smaller), or None when
        the summary already has half the window."""
        most = self.num_ctx // 2
        if self.output_tokens >= most:
            return None
        return replace(self, output_tokens=min(most, 2 * self.output_tokens))


@dataclass(frozen=True)
class Zone:
    """What is summarised: transcript entries, the first request (None once a
    summary carries it) and the user's instructions."""

    entries: tuple[str, ...]
    first_request: str | None = None
    instructions: str | None = None

    @classmethod
    def of(cls, to_compact: Sequence[ChatMessage], first_request: str | None,
           instructions: str | None = None) -> Zone:
        if not to_compact:
            raise ValueError("nothing to summarise: the compact zone is empty")
        return cls(tuple(transcript_entries(to_compact, first_request)), first_request,
                   instructions)


@dataclass(frozen=True)
class Piece:
    """One summariser call: `messages` covers entries[start:end] of the zone."""

    messages: list[dict[str, str]]
    start: int
    end: int
    # Characters left out of this piece by cutting (0: everything sent whole).
    cut_chars: int
    output_tokens: int


def next_piece(zone: Zone, start: int, notes: str | None, window: SummaryWindow) -> Piece:
    """The summariser call for the entries from `start` on: as many as fit
    beside `notes` (the notes so far), at least one, cut if it must be."""
    if not 0 <= start < len(zone.entries):
        raise ValueError(f"start {start} outside 0..{len(zone.entries) - 1}")
    first = _first_request(zone, start, notes, window)

    def request(entries: Sequence[str]) -> list[dict[str, str]]:
        return summary_request(entries, notes, first, zone.instructions)

    end = _longest_fitting_run(zone.entries, start, lambda n: window.fits(
        request(zone.entries[start:start + n])))
    cut = 0
    if end == start:  # the entry alone is too large: cut it
        entry = zone.entries[start]
        kept = longest_fitting_cut(entry, lambda text: window.fits(request([text])))
        if kept is None:
            raise NothingFits(_nothing_fits(window, request([cut_text(entry, 0)])))
        cut, end = left_out(kept) - left_out(entry), start + 1
        messages = request([kept])
    else:
        messages = request(zone.entries[start:end])
    return Piece(messages, start, end, cut, window.output_tokens)


def count_pieces(zone: Zone, notes: str | None, window: SummaryWindow, start: int = 0) -> int:
    """How many pieces the zone takes (from entry `start` on) if every
    piece's notes weigh as `notes` (for progress; the real pieces are planned
    with the real notes)."""
    pieces = 0
    while start < len(zone.entries):
        start = next_piece(zone, start, notes, window).end
        pieces += 1
    return pieces


def _first_request(zone: Zone, start: int, notes: str | None,
                   window: SummaryWindow) -> str | None:
    """The first request as quoted in this piece: only in the first one (the
    notes carry it on), cut to its share of the window if it must be."""
    if start != 0 or zone.first_request is None:
        return None
    quoted = longest_fitting_cut(zone.first_request, lambda text: window.fits(
        summary_request((), notes, text, zone.instructions), FIRST_REQUEST_SHARE))
    return quoted if quoted is not None else cut_text(zone.first_request, 0)


def _longest_fitting_run(entries: Sequence[str], start: int,
                         fits: Callable[[int], bool]) -> int:
    """The largest end such that fits(end - start) holds, by doubling then
    bisecting: each probe renders about the size of the piece, not the zone."""
    left = len(entries) - start
    good, step = 0, 1
    while step <= left and fits(step):
        good, step = step, step * 2
    bad = min(step, left + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return start + good


def _nothing_fits(window: SummaryWindow, messages: list[dict[str, str]]) -> str:
    need = estimate_prompt(messages, window.calibration)
    return (f"the summary instructions and the notes so far need about {need} tokens, more "
            f"than the summariser's window allows ({window.prompt_budget} of num_ctx "
            f"{window.num_ctx}, {window.output_tokens} kept for the summary)")
