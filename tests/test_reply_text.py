"""limiter.reply_text: a push's text carries the answer's text and, marked inside it, the
reasoning a model server sent apart."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from limiter.reply_text import ReplyText, pack, unpack

# text with NULs and the mark letters beside them, the corner a marking must survive
texts = st.text(st.sampled_from(["a", "é", " ", "\x00", "r", "R", "c", "\n", "🙂"]), max_size=12)
pieces = st.lists(st.tuples(texts, texts, st.sampled_from(["reasoning", "reasoning_content"])), max_size=5)


@given(pieces)
def test_packed_pieces_joined_unpack_to_the_joined_texts(ps: list[tuple[str, str, str]]) -> None:
    """A push takes every pending piece and a non-streamed answer joins its pushes: whatever
    the pieces hold (NULs, mark letters), the joined text unpacks to the joined answer and
    the joined reasoning, under the first field the server used."""
    joined = "".join(pack(content, reasoning, field) for content, reasoning, field in ps)
    got = unpack(joined)
    assert got.content == "".join(c for c, _, _ in ps)
    assert got.reasoning == "".join(r for _, r, _ in ps)
    assert got.field == next((f for _, r, f in ps if r), "")


def test_text_without_reasoning_or_nul_is_carried_as_it_is() -> None:
    assert pack("hello world") == "hello world"
    assert unpack("hello world") == ReplyText("hello world", "", "")
    assert pack("a\x00b") != "a\x00b" and unpack(pack("a\x00b")).content == "a\x00b"


def test_a_nul_that_is_not_a_mark_is_text() -> None:
    """Text that did not come from pack (an older worker's answer holding a NUL) keeps it."""
    assert unpack("a\x00xb\x00") == ReplyText("a\x00xb\x00", "", "")
