"""Releasing generated text to the client: stop strings without losing tokens on resume.

A stop string may be split across tokens (``"\\n\\n"`` as two newline tokens, a word over
several byte tokens), so text cannot be streamed the moment it is decoded: the tail that
could still be the start of a stop must wait. :class:`StopScanner` keeps back at least
``len(longest stop) - 1`` characters and scans everything not yet released, so a stop is
always seen whole before any of it reaches the client; on a match the text is truncated
just before the stop.

It holds back *tokens*, not just text: a token is released only together with all of its
text. The tokens delivered to Redis are what a resuming worker re-prefills and primes its
decoder with (discarding that text), so delivering a token whose text the client never
got would lose that text on a takeover. The one exception is an incomplete UTF-8
character (a byte token with an empty text piece): it is released, and a resuming decoder
primed with the same ids holds the same partial bytes, so the character still completes.

Why the scan is complete: when the release point moves from ``R`` to ``R' <= T - hold``
(``T`` = text known so far), any stop of length ``m <= hold + 1`` starting before ``R'``
ends at or before ``R' + hold <= T``; it lay whole inside the scanned, unreleased text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Release:
    """Tokens and text that may go to the client now; ``stopped`` when a stop matched."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False


class StopScanner:
    """Per-sequence holdback buffer for stop strings (see the module docstring)."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._tokens: list[int] = []
        self._pieces: list[str] = []

    @property
    def pending_tokens(self) -> int:
        return len(self._tokens)

    def feed(self, token_id: int, piece: str) -> Release:
        """Add one generated token and its decoded text piece; return what may be released."""
        if not self.stops:  # nothing is ever held back: the token goes with its text
            return Release([token_id], piece)
        self._tokens.append(token_id)
        self._pieces.append(piece)
        text = "".join(self._pieces)
        cut = self._find_stop(text)
        if cut is not None:
            return self._take_all(text[:cut], stopped=True)
        if not self.hold:
            return self._take_all(text)
        keep = len(text)  # characters not yet released
        n = 0
        for piece_len in map(len, self._pieces):
            if keep - piece_len < self.hold:
                break
            keep -= piece_len
            n += 1
        out = Release(self._tokens[:n], "".join(self._pieces[:n]))
        del self._tokens[:n], self._pieces[:n]
        return out

    def finish(self, tail: str = "") -> Release:
        """End of generation (EOS, length): release everything, plus the decoder's ``tail``."""
        text = "".join(self._pieces) + tail
        cut = self._find_stop(text)
        if cut is not None:
            return self._take_all(text[:cut], stopped=True)
        return self._take_all(text)

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _take_all(self, text: str, stopped: bool = False) -> Release:
        out = Release(self._tokens, text, stopped)
        self._tokens, self._pieces = [], []
        return out
