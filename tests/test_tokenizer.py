"""Byte tokenizer: round trips, and streaming pieces that never split a UTF-8 character."""

from __future__ import annotations

import pytest

from limiter.errors import InvalidArgument
from worker.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, IncrementalDecoder, decode, encode

TEXT = "héllo, 世界 🎉 ok"


def test_encode_is_utf8_bytes_and_bos_is_optional() -> None:
    assert encode("hi") == [104, 105]
    assert encode("hi", bos=True) == [BOS_ID, 104, 105]
    assert encode(TEXT) == list(TEXT.encode("utf-8"))
    assert max(BOS_ID, EOS_ID, PAD_ID) < VOCAB_SIZE and min(BOS_ID, EOS_ID, PAD_ID) > 255


def test_decode_round_trips_and_drops_specials() -> None:
    assert decode([BOS_ID, *encode(TEXT), EOS_ID, PAD_ID]) == TEXT


def test_incremental_decoder_never_emits_half_a_character() -> None:
    dec = IncrementalDecoder()
    pieces = [dec.feed([b]) for b in encode(TEXT)]
    pieces.append(dec.flush())
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    emoji = "🎉".encode()
    start = len("héllo, 世界 ".encode())
    # the first three bytes of the 4-byte emoji produce nothing; the fourth produces it whole
    assert pieces[start : start + 3] == ["", "", ""]
    assert pieces[start + 3] == "🎉" and len(emoji) == 4


def test_invalid_bytes_become_replacement_characters() -> None:
    dec = IncrementalDecoder()
    assert dec.feed([0xFF, 0x41]) == "\ufffdA"
    assert dec.feed([0xE4, 0xB8]) == ""  # a dangling partial character is held...
    assert dec.flush() == "\ufffd"  # ...and surfaces only at end of stream


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, 3.0, True])
def test_out_of_range_ids_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        IncrementalDecoder().feed([bad])  # type: ignore[list-item]


def test_encode_rejects_non_str() -> None:
    with pytest.raises(InvalidArgument):
        encode(b"bytes")  # type: ignore[arg-type]


def test_feeding_one_id_is_feeding_a_list_of_it() -> None:
    """feed_one (the scheduler's, a token a step) decodes as feed([id]) does, partial UTF-8
    characters and invalid bytes included, and refuses what feed refuses."""
    ids = [*encode("a€é\n"), 0xE2, 0x82, BOS_ID, 0xFF, 0x41, EOS_ID, PAD_ID, *range(256),
           # ASCII ids after begun characters
           0xE4, 0x41, 0xC3, BOS_ID, 0x42, 0xE2, 0x82, 0x43, 0xF0, 0x9F, 0x8E, 0x89, 0x44]
    one, listed = IncrementalDecoder(), IncrementalDecoder()
    assert [one.feed_one(i) for i in ids] == [listed.feed([i]) for i in ids]
    assert one.flush() == listed.flush()
    one.feed([0xE4, 0xB8])  # a character begun by feed, then an ASCII id
    assert one.feed_one(0x41) == "\ufffdA"
    one.feed([0xE4])  # a character begun, then the stream ended: the next ASCII id is its own
    assert one.flush() == "\ufffd" and one.feed_one(0x41) == "A"
    for bad in (-1, VOCAB_SIZE, True, 1.0, "a", None):
        with pytest.raises(InvalidArgument):
            IncrementalDecoder().feed_one(bad)  # type: ignore[arg-type]
