"""Two token rates from two counts: one for characters, one for the extra
bytes of dense scripts.

A prompt's text costs `chars * r + extra_bytes * e` tokens (framing aside).
One count gives one equation, so one count alone cannot tell a costly CJK
character from a costly ASCII one. Two counts of prompts of different make-up
pin both rates; consecutive prompts of one session usually share most of
their text, so the pair is solved only when their shares of dense bytes
differ enough for the counts' rounding not to swamp the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

# A byte-level tokenizer never makes more tokens than bytes, nor (in any
# tokenizer seen) fewer than one per 12 characters of text. A three-byte
# character it lacks costs three tokens, its first byte charged at the
# character rate: its two extra bytes carry the rest.
MIN_CHAR_RATE = 1 / 12
MAX_CHAR_RATE = 1.0
MOST_TOKENS_A_DENSE_CHAR = 3.0
# Two counts are solved together only when their shares of extra bytes (of all
# bytes) differ by at least this much, and each is of at least this many
# tokens: a tokenizer rounds at every message's edges, and in a small count
# that rounding, charged to the few dense bytes, gives them a rate far off.
MIN_SHARE_GAP = 0.05
MIN_SAMPLE_TOKENS = 128.0


@dataclass(frozen=True)
class Sample:
    """One count: the text's characters (framing taken out), its UTF-8 bytes
    beyond one per character, and the tokens the provider charged for them."""

    chars: float
    extra_bytes: float
    tokens: float

    @property
    def dense_share(self) -> float:
        total = self.chars + self.extra_bytes
        return self.extra_bytes / total if total > 0 else 0.0


@dataclass(frozen=True)
class Rates:
    per_char: float
    per_extra_byte: float

    def cost(self, chars: float, extra_bytes: float) -> float:
        return chars * self.per_char + extra_bytes * self.per_extra_byte


def solve(basis: Sample, latest: Sample) -> Rates | None:
    """Both rates from two counts, or None when they are too alike in make-up
    (or too small) to tell the rates apart, or the answer is implausible."""
    if min(basis.tokens, latest.tokens) < MIN_SAMPLE_TOKENS:
        return None
    if abs(basis.dense_share - latest.dense_share) < MIN_SHARE_GAP:
        return None
    det = basis.chars * latest.extra_bytes - latest.chars * basis.extra_bytes
    if det == 0:
        return None
    per_char = (basis.tokens * latest.extra_bytes - latest.tokens * basis.extra_bytes) / det
    per_byte = (basis.chars * latest.tokens - latest.chars * basis.tokens) / det
    return Rates(per_char, per_byte) if plausible(per_char, per_byte) else None


def fit_dominant(latest: Sample, known: Rates) -> Rates | None:
    """Rates that make the latest count exact, moving only the rate of the kind
    of text that carries most of its expected tokens: that rate is the one
    this count measures best."""
    chars_cost = latest.chars * known.per_char
    bytes_cost = latest.extra_bytes * known.per_extra_byte
    if chars_cost >= bytes_cost:
        if latest.chars <= 0:
            return None
        rates = Rates((latest.tokens - bytes_cost) / latest.chars, known.per_extra_byte)
    else:
        rates = Rates(known.per_char, (latest.tokens - chars_cost) / latest.extra_bytes)
    return rates if plausible(rates.per_char, rates.per_extra_byte) else None


def plausible(per_char: float, per_extra_byte: float) -> bool:
    return (MIN_CHAR_RATE <= per_char <= MAX_CHAR_RATE and per_extra_byte >= 0.0
            and per_char + 2 * per_extra_byte <= MOST_TOKENS_A_DENSE_CHAR)
