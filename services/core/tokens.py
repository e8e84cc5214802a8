"""Token estimates calibrated on the provider's own counts.

The estimate is the text's characters times a tokens-per-character ratio
taken from the provider's last trustworthy report, plus a few tokens of
framing per message; before any such report a conservative fallback
over-estimates, so an uncalibrated session compacts early rather than
overflows. Dense scripts (CJK, kana, Hangul: three UTF-8 bytes a character)
are charged at a cautious rate of their own, told apart by their bytes
(`text_size`): at the text ratio they would be under-counted two- or
threefold.

Framing is counted in tokens, not characters, because that is how chat
templates add it (a role header and an end marker per message, whatever the
text's density). Counting it in characters would make the ratio learnt on a
short, framing-heavy prompt too high for the longer prompts that follow. Pass
the number of messages to use it; with 0 the whole prompt is charged at the
ratio, framing and all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from schemas.session import CountBasis, SessionRecord
from services.core import rates
from services.core.rates import Rates, Sample
from services.core.text_size import MESSAGE_OVERHEAD_CHARS, Size, prompt_size

# Tokens a chat template adds around each message (Llama 3 and ChatML add 4-5).
FRAMING_TOKENS_PER_MESSAGE = 4

# 2.5 characters per token is denser than almost any real text, so the
# fallback over-estimates until the provider's first usable count arrives.
FALLBACK_TOKENS_PER_CHAR = 1 / 2.5

# A character of three UTF-8 bytes is charged at least this many tokens,
# whatever the text ratio: common tokenizers charge CJK 0.6-0.8 (Cyrillic,
# two bytes, at least half as much on top of the ratio). The ratio is learnt
# from counts in which such text weighs little, so its cautious rate never
# pushes the ratio down.
DENSE_TOKENS = 1.0

# Fewer tokens than one per 12 characters means the provider did not count the
# whole prompt (Ollama's KV cache reuse reports only the uncached tokens).
MIN_TOKENS_PER_CHAR = 1 / 12
# Charged to all characters alike, more than one a character is dense text's
# cost (`_dense_cost`): a byte-level tokenizer never makes more tokens than bytes.
MAX_TOKENS_PER_CHAR = 1.0

# Dense text that owes at most this share of a prompt's expected tokens is
# taken out of the count at its cautious rate; above it, the ratio takes the
# whole count (an upper bound for the rest of the text).
DENSE_MINOR_SHARE = 0.05

# A count may be of the uncached part alone unless it exceeds this many
# times that part's expected cost (and its bytes)...
PARTIAL_SLACK = 2.0
# ...or the whole prompt should cost at least this many times that part and
# the count lies nearer (in ratio) the whole's cost.
DISTINGUISHABLE = 2.5

# A count at or above this share of num_ctx was capped by silent truncation.
TRUNCATION_FRACTION = 0.98


@dataclass(frozen=True)
class Calibration:
    tokens_per_char: float | None = None
    reports: int = 0
    # Learnt once the provider has counted enough dense text to tell its cost
    # from the rest's (`rates.solve`); None: the cautious rate.
    tokens_per_extra_byte: float | None = None
    # The last count folded in, which the next is solved against. Two
    # calibrations with the same rates estimate alike, so it takes no part in
    # comparisons.
    basis: Sample | None = field(default=None, compare=False)

    @property
    def char_rate(self) -> float:
        return self.tokens_per_char or FALLBACK_TOKENS_PER_CHAR

    @property
    def extra_byte_rate(self) -> float:
        """What each UTF-8 byte beyond a character's first adds: as learnt;
        nothing while `dense_bound` holds the dense text's cost; else enough
        that a three-byte character costs DENSE_TOKENS."""
        if self.tokens_per_extra_byte is not None:
            return self.tokens_per_extra_byte
        if self.dense_bound is not None:
            return 0.0
        return _cautious_byte_rate(self.char_rate)

    @property
    def rates(self) -> Rates:
        return Rates(self.char_rate, self.extra_byte_rate)

    @functools.cached_property
    def dense_bound(self) -> Rates | None:
        """The other end of what the last whole count allows, while it held
        dense text worth more than a trace and no rate of its own is learnt.

        That count was charged to all characters alike (`_ratio`): the
        character rate alone accounts for it, dense bytes at nothing. Every
        pair of rates that reproduces it lies on one line, from that pair to
        this one, where dense bytes carry the most they plausibly can
        (DENSE_TOKENS a three-byte character). The truth lies between, so
        the dearer of the two estimates bounds any prompt, and a prompt made
        up like that count is met exactly: a session in Chinese is not
        charged a cautious rate on top of a count that already holds it."""
        basis = self.basis
        if (self.tokens_per_extra_byte is not None or basis is None
                or basis.extra_bytes <= 0 or self.char_rate * basis.chars < basis.tokens):
            return None
        return _dense_end(basis)


def stored_calibration(record: SessionRecord) -> Calibration:
    """The calibration a session's record holds."""
    return calibration_from(record.tokens_per_char, record.tokens_per_extra_byte,
                            record.count_basis)


def calibration_from(tokens_per_char: float | None, tokens_per_extra_byte: float | None,
                     basis: CountBasis | None) -> Calibration:
    """A calibration as a record or a report carries it. A rate came from at
    least one usable count: a partial count can be charged against it."""
    return Calibration(
        tokens_per_char, int(tokens_per_char is not None), tokens_per_extra_byte,
        None if basis is None else Sample(basis.chars, basis.extra_bytes, basis.tokens))


# How far a session's stored rate may lag behind the latest count (`rate_moved`).
RATE_RISE_KEPT = 0.005
RATE_FALL_KEPT = 0.02


def worth_storing(stored: Calibration, updated: Calibration) -> bool:
    """Whether a recalibration is worth writing to the session's record. A
    newer basis alone is not: any earlier whole count of the session solves
    as well against the next."""
    return (rate_moved(stored.tokens_per_char, updated.tokens_per_char)
            or rate_moved(stored.tokens_per_extra_byte, updated.tokens_per_extra_byte)
            or (stored.basis is None and updated.basis is not None))


def rate_moved(before: float | None, after: float | None) -> bool:
    """Whether a rate changed enough to be worth a write: any rise beyond
    rounding, since an estimate below the truth is what overflows; a fall
    only beyond RATE_FALL_KEPT, since till then the estimate errs a little
    high, and a write every turn costs a store and two messages."""
    if after is None:
        return False
    if before is None:
        return True
    if before == 0:  # a rate may be learnt as exactly nothing
        return after > 0
    change = after / before - 1
    return change > RATE_RISE_KEPT or change < -RATE_FALL_KEPT


def with_calibration(record: SessionRecord, cal: Calibration) -> SessionRecord:
    basis = cal.basis
    return record.model_copy(update={
        "tokens_per_char": cal.tokens_per_char,
        "tokens_per_extra_byte": cal.tokens_per_extra_byte,
        "count_basis": None if basis is None else CountBasis(
            chars=basis.chars, extra_bytes=basis.extra_bytes, tokens=basis.tokens),
    })


class Reading(Enum):
    """What a count covers: the whole prompt, the part after the cached
    prefix, or either (the two would cost too nearly the same)."""

    whole = "whole"
    partial = "partial"
    either = "either"


def calibrate(
    previous: Calibration,
    reported_prompt_tokens: int | None,
    sent_chars: int,
    num_ctx: int,
    *,
    reused_chars: int = 0,
    messages: int = 0,
    extra_bytes: int = 0,
    reused_extra_bytes: int = 0,
    reused_messages: int = 0,
) -> Calibration:
    """Fold one provider report into the calibration; untrustworthy ones change nothing.

    `reused_*` is the part a prompt cache may have served this call
    (`prompt_cache.cached_size`, the longest common prefix with the
    session's previous call); Ollama leaves it out of its count. A count
    surely of the rest alone is read so, the cached part charged at the
    ratio the session has shown; one that may be partial never lowers the
    ratio (the cache may have held more than we know: a failed turn's call).
    """
    sent = Size(sent_chars, extra_bytes, messages)
    reused = Size(reused_chars, reused_extra_bytes, reused_messages)
    reported = reported_prompt_tokens
    if reported is None or not _usable(reported, sent, reused):
        return previous
    if reported >= TRUNCATION_FRACTION * num_ctx:
        # Capped by truncation: the prompt cost at least this much, likely
        # more. Thrown away, an estimate too low to stop the overflow would
        # never learn from the overflows it lets through.
        return _folded(previous, reported, sent, reused, Reading.either)
    return _folded(previous, reported, sent, reused)


def refused_as_too_long(previous: Calibration, sent: Size, num_ctx: int) -> Calibration:
    """The calibration after the model server refused a prompt of `sent` as
    longer than `num_ctx` tokens: the window is a count the prompt exceeds,
    so the rates may rise to it, never fall."""
    return calibrate(previous, num_ctx, sent.chars, num_ctx, messages=sent.messages,
                     extra_bytes=sent.extra_bytes)


def _folded(previous: Calibration, reported: int, sent: Size, reused: Size,
            reading: Reading | None = None) -> Calibration:
    """The calibration after a usable report (read as `reading` if given)."""
    reading = reading or _reading(reported, sent, reused, previous)
    whole = float(reported)
    if reading is Reading.partial:
        if not previous.reports:
            return previous  # no ratio shown yet to charge the cached part at
        whole += _expected(reused, previous)
    sample = _sample(whole, sent)
    if sample is None:
        return previous
    if reading is Reading.whole:
        learnt = _learnt(sample, previous)
    else:
        learnt = _one_rate(sample, previous)
        learnt = None if learnt is None else _never_lower(learnt, previous, reading)
    if learnt is None:
        return previous
    # The latest sample wins, no averaging: consecutive prompts share almost
    # all their text, so the last call's rates are the best predictor of the
    # next; an average would lag behind whenever the content mix changes
    # (say, code-heavy tool output arriving) and lag is what overflows.
    # Only a count surely of the whole prompt is solved against: a partial one
    # holds the cached part at the rates it is checking.
    basis = sample if reading is Reading.whole else previous.basis
    return Calibration(learnt[0], previous.reports + 1, learnt[1], basis)


# Rates learnt from a count: per character, and per extra byte (None: not
# learnt, so the cautious rate stays).
Learnt = tuple[float, float | None]


def _sample(whole: float, sent: Size) -> Sample | None:
    text_tokens = whole - FRAMING_TOKENS_PER_MESSAGE * sent.messages
    if text_tokens <= 0:
        return None  # less than the framing alone: not a count of this prompt
    return Sample(_text_chars(sent), sent.extra_bytes, text_tokens)


def _learnt(sample: Sample, previous: Calibration) -> Learnt | None:
    """Both rates when this whole count and the one before tell them apart;
    else as `_one_rate`.

    Only a count holding a larger share of dense text than the one before is
    solved against it: what the two differ by is then mostly dense text, and
    its cost is what the count measures. Where the share fell, what was added
    is mostly ASCII, whose rate differs by kind (code costs more than prose):
    solved, that difference was charged to the dense bytes, pricing a Chinese
    character at half its cost."""
    basis = previous.basis
    if basis is not None and previous.reports and sample.dense_share > basis.dense_share:
        solved = rates.solve(basis, sample)
        if solved is not None:
            return solved.per_char, solved.per_extra_byte
    return _one_rate(sample, previous)


def _one_rate(sample: Sample, previous: Calibration) -> Learnt | None:
    """The rate of the text that carries the count, once dense text has a
    rate of its own; else the character rate alone (`_ratio`)."""
    if previous.tokens_per_extra_byte is not None:
        fitted = rates.fit_dominant(sample, previous.rates)
        return None if fitted is None else (fitted.per_char, fitted.per_extra_byte)
    ratio = _ratio(sample, previous)
    return _dense_cost(sample, previous) if ratio is None else (ratio, None)


def _never_lower(learnt: Learnt, previous: Calibration, reading: Reading) -> Learnt | None:
    """A count that may cover less than we think raises rates, never lowers
    them: below what the session has shown, or for a count that may be whole
    or partial, below the cautious rate of dense text not yet counted. None
    when it raises nothing."""
    per_char, per_byte = learnt
    shown_byte = previous.tokens_per_extra_byte
    if shown_byte is None and reading is Reading.either:
        shown_byte = None if per_byte is None else previous.extra_byte_rate
    raised_char = per_char > previous.char_rate
    raised_byte = per_byte is not None and (shown_byte is None or per_byte > shown_byte)
    if not (raised_char or raised_byte):
        return None
    if per_byte is not None and shown_byte is not None:
        per_byte = max(per_byte, shown_byte)
    return max(per_char, previous.char_rate), per_byte


def _usable(reported: int, sent: Size, reused: Size) -> bool:
    if reported <= 0 or sent.chars <= 0:
        return False
    # Fewer tokens than this for what the cache cannot have held means it
    # held more than we think: nothing reliable to learn.
    return reported >= (sent - reused).chars * MIN_TOKENS_PER_CHAR


def _reading(reported: int, sent: Size, reused: Size, known: Calibration) -> Reading:
    """Whole when nothing could be cached, when nothing is left besides the
    cached part (Ollama then counts a token or two: below the plausible
    floor), or when the count exceeds what the rest could cost: more than
    its bytes (a byte-level tokenizer never makes more tokens than bytes)
    and more than twice its expected cost. Partial when too few for the
    whole prompt. Else, where the whole should cost several times the rest,
    the reading whose expected cost lies nearer (in ratio) the count; but
    one nearer the whole may only raise the rates (`either`): a new part
    denser than the session's text, counted alone, looks like a whole
    prompt of sparser text, and read so it would lower them.
    """
    fresh = sent - reused
    if reused.chars <= 0 or fresh.chars <= 0:
        return Reading.whole
    if reported < sent.chars * MIN_TOKENS_PER_CHAR:
        return Reading.partial
    as_fresh = _expected(fresh, known)
    if reported > max(fresh.bytes, PARTIAL_SLACK * as_fresh):
        return Reading.whole
    as_whole = _expected(sent, known)
    if not known.reports or as_whole < DISTINGUISHABLE * as_fresh:
        return Reading.either
    return Reading.either if reported * reported >= as_whole * as_fresh else Reading.partial


def _cautious_byte_rate(char_rate: float) -> float:
    return max(0.0, DENSE_TOKENS - char_rate) / 2


def _dense_end(basis: Sample) -> Rates:
    """The rates on the count's line whose dense bytes cost the cautious
    rate, or as near it as a plausible character rate allows."""
    chars, extra, tokens = basis.chars, basis.extra_bytes, basis.tokens
    # chars * r + extra * (DENSE_TOKENS - r) / 2 = tokens, solved for r.
    slope = chars - extra / 2
    per_char = (tokens - extra * DENSE_TOKENS / 2) / slope if slope > 0 else 0.0
    per_char = min(max(per_char, MIN_TOKENS_PER_CHAR), tokens / chars)
    return Rates(per_char, max(0.0, (tokens - chars * per_char) / extra))


def _text_chars(size: Size) -> int:
    return max(1, size.chars - MESSAGE_OVERHEAD_CHARS * size.messages)


def _expected(size: Size, cal: Calibration) -> float:
    text = max(0, size.chars - MESSAGE_OVERHEAD_CHARS * size.messages)
    cost = cal.rates.cost(text, size.extra_bytes)
    bound = cal.dense_bound
    if bound is not None:
        cost = max(cost, bound.cost(text, size.extra_bytes))
    return cost + FRAMING_TOKENS_PER_MESSAGE * size.messages


def _ratio(sample: Sample, known: Calibration) -> float | None:
    """The character ratio a count shows, dense text charged at the cautious
    rate, or None.

    Dense text weighing little is taken out at its cautious rate; where it
    weighs more, the count is charged to all characters alike: a ratio too
    high for the other text, never too low, whatever the dense text costs.
    """
    text_tokens = sample.tokens
    dense = sample.extra_bytes * known.extra_byte_rate
    if dense <= DENSE_MINOR_SHARE * (sample.chars * known.char_rate + dense):
        text_tokens -= dense
    ratio = text_tokens / sample.chars
    return ratio if MIN_TOKENS_PER_CHAR <= ratio <= MAX_TOKENS_PER_CHAR else None


def _dense_cost(sample: Sample, known: Calibration) -> Learnt | None:
    """A count over a token a character, charged to its dense text: a script
    the tokenizer has few tokens for (Hangul, CJK on a 32k vocabulary) costs
    up to three byte tokens a character. Thrown away, such a session never
    learnt its cost; charged to every character, it made English text cost
    several times its size. The character rate stays as known."""
    # A small count's rounding, charged to a few dense bytes, gives them a rate
    # far off (as `rates.solve` knows): a greeting priced a paste at twice its cost.
    if sample.extra_bytes <= 0 or sample.tokens < rates.MIN_SAMPLE_TOKENS:
        return None
    per_char = min(known.char_rate, rates.MAX_CHAR_RATE)
    per_byte = (sample.tokens - sample.chars * per_char) / sample.extra_bytes
    return (per_char, per_byte) if rates.plausible(per_char, per_byte) else None


def estimate_tokens(chars: int, calibration: Calibration, messages: int = 0,
                    extra_bytes: int = 0) -> int:
    """Tokens a prompt of `chars` characters (as `prompt.sent_chars` counts them)
    and `extra_bytes` (`text_size.extra_bytes`) in `messages` messages is
    expected to cost with this provider."""
    return math.ceil(_expected(Size(chars, extra_bytes, messages), calibration))


def estimate_size(size: Size, calibration: Calibration) -> int:
    return estimate_tokens(size.chars, calibration, size.messages, size.extra_bytes)


# The smallest window the product accepts: the summariser's instructions alone
# cost some 600 tokens, and a window of 256 left a prompt budget of 1.
MIN_NUM_CTX = 1024
# The least prompt budget a configured headroom may leave.
MIN_PROMPT_BUDGET = 512


def check_headroom(num_ctx: int, output_headroom: int | None) -> None:
    """ValueError when a configured headroom leaves the prompt too little."""
    if output_headroom is not None and num_ctx - output_headroom < MIN_PROMPT_BUDGET:
        raise ValueError(
            f"OUTPUT_HEADROOM {output_headroom} leaves {num_ctx - output_headroom} tokens of "
            f"NUM_CTX {num_ctx} for the prompt; at least {MIN_PROMPT_BUDGET} are needed")


def budget(num_ctx: int, output_headroom: int) -> int:
    """Prompt tokens a call may use: the window minus the room kept for the reply."""
    if num_ctx < 1 or output_headroom < 0:
        raise ValueError(f"need num_ctx >= 1 and headroom >= 0, got {num_ctx}, {output_headroom}")
    return max(1, num_ctx - output_headroom)


def default_headroom(num_ctx: int) -> int:
    """Tokens reserved for the reply: an eighth of the window, at least 256.

    Ollama's num_ctx holds the prompt and the generated tokens together, so a
    prompt filling the window leaves the model no room to answer. A fraction
    scales from small local windows to 256k ones (a fixed reserve would be
    wasteful on one and too small on the other); the floor keeps a useful
    answer possible in a 2k window.
    """
    return max(256, num_ctx // 8)


def prompt_budget(num_ctx: int, output_headroom: int | None = None) -> int:
    """The budget for a configured headroom, or for the default one when unset.

    The configured headroom is checked against NUM_CTX only; a model trained
    for a smaller window may be left too little prompt by it (none at all, at
    times), and then takes the default headroom for its own window."""
    if output_headroom is None or num_ctx - output_headroom < MIN_PROMPT_BUDGET:
        return budget(num_ctx, default_headroom(num_ctx))
    return budget(num_ctx, output_headroom)


def estimate_prompt(messages: Sequence[Mapping[str, Any]], calibration: Calibration,
                    tools: Sequence[Mapping[str, Any]] = ()) -> int:
    """Tokens these rendered messages (and tools) are expected to cost."""
    return estimate_size(prompt_size(messages, tools), calibration)
