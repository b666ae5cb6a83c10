"""Byte-level tokenizer: ids 0..255 are UTF-8 bytes, a few special ids sit above them.

Why bytes: the project needs a tokenizer with no downloaded vocabulary (tests, CPU demo,
random-init models), and a byte vocabulary can spell any text. Token counts are then
UTF-8 byte counts, which is also what the frontends charge for.

Streaming is the subtle part. A model emits one byte per token, and a multi-byte UTF-8
character spans several tokens, so decoding each id on its own would stream broken text.
:class:`IncrementalDecoder` buffers an incomplete character until its last byte arrives,
so every piece it returns is valid text and the pieces concatenate to the full decode.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from limiter.errors import InvalidArgument

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
_BYTES = [bytes((b,)) for b in range(256)]  # id -> its byte, made once
_ASCII = [chr(b) for b in range(128)]  # an ASCII id -> its text


def encode(text: str, *, bos: bool = False) -> list[int]:
    """Return the UTF-8 bytes of ``text`` as ids, with :data:`BOS_ID` first when ``bos``."""
    if not isinstance(text, str):
        raise InvalidArgument("text", f"text must be a str, got {type(text).__name__}")
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if bos else ids


def decode(ids: Iterable[int]) -> str:
    """Decode a whole id sequence at once (special ids are dropped)."""
    dec = IncrementalDecoder()
    return dec.feed(ids) + dec.flush()


def _check_id(i: object) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < VOCAB_SIZE:
        raise InvalidArgument("token_id", f"token id {i!r} is outside 0..{VOCAB_SIZE - 1}")


class IncrementalDecoder:
    """Turn a stream of ids into text pieces that never split a UTF-8 character.

    Special ids produce no text. Bytes that are not valid UTF-8 (a random model emits
    plenty) become U+FFFD, so the output is always valid text.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the UTF-8 decoder holds the first bytes of a character

    def feed(self, ids: Iterable[int]) -> str:
        """Consume ``ids``; return the text completed by them (possibly ``""``)."""
        buf = bytearray()
        for i in ids:
            _check_id(i)
            if i < 256:
                buf.append(i)
        out = self._utf8.decode(bytes(buf), final=False)
        self._partial = bool(self._utf8.getstate()[0])
        return out

    def feed_one(self, token_id: int) -> str:
        """:meth:`feed` for one id: what a step produces for a sequence, once a step each.
        An ASCII byte with no character begun is its own text: most tokens of most text,
        one table lookup instead of the UTF-8 decoder (a tenth of a null-engine step)."""
        if type(token_id) is int and 0 <= token_id < 128 and not self._partial:
            return _ASCII[token_id]
        _check_id(token_id)
        if token_id >= 256:
            return ""
        out = self._utf8.decode(_BYTES[token_id], False)
        self._partial = bool(self._utf8.getstate()[0])
        return out

    def flush(self) -> str:
        """End of stream: return any dangling partial character as U+FFFD."""
        self._partial = False
        return self._utf8.decode(b"", final=True)
