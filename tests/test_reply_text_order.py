"""limiter.reply_text.unpack_in_order against unpack: any packed pieces joined (NULs, mark
letters, empty pieces, both reasoning fields, tool calls) unpack alike, and the runs keep
the order the pieces came in."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from limiter.reply_text import ReplyText, pack, unpack, unpack_in_order

texts = st.text(st.sampled_from(["a", " ", "\x00", "r", "R", "c", "t", "[", "\n", "🙂"]), max_size=8)
json_text = st.text(st.sampled_from(["a", "\x00", "\"", "\\", "{", "}", "🙂", "\n"]), max_size=6)
delta = st.fixed_dictionaries({"index": st.integers(0, 3)},
                              optional={"id": json_text, "type": st.just("function"),
                                        "function": st.fixed_dictionaries(
                                            {}, optional={"name": json_text, "arguments": json_text})})
calls = st.one_of(st.none(), st.lists(delta, max_size=3))
pieces = st.lists(st.tuples(texts, texts, st.sampled_from(["reasoning", "reasoning_content"]), calls),
                  max_size=6)


@settings(max_examples=1500, deadline=None)
@given(pieces)
def test_packed_pieces_unpack_alike_in_order_and_merged(ps: list[tuple[str, str, str, Any]]) -> None:
    joined = "".join(pack(c, r, f, t) for c, r, f, t in ps)
    want = ReplyText("".join(c for c, *_ in ps), "".join(r for _, r, _, _ in ps),
                     next((f for _, r, f, _ in ps if r), ""), tuple(t for *_, t in ps if t))
    assert unpack(joined) == want
    runs = unpack_in_order(joined)
    assert "".join(r.content for r in runs) == want.content
    assert "".join(r.reasoning for r in runs) == want.reasoning
    assert tuple(c for r in runs for c in r.tool_calls) == want.tool_calls
    assert all(r.field in ("", want.field) for r in runs)
    assert all((r.field != "") == (r.reasoning != "") for r in runs)


def _events(seq: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for kind, v in seq:
        if not v:
            continue
        if out and kind != "t" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + v)
        else:
            out.append((kind, v))
    return out


@settings(max_examples=1500, deadline=None)
@given(pieces)
def test_runs_in_order_keep_the_servers_order(ps: list[tuple[str, str, str, Any]]) -> None:
    joined = "".join(pack(c, r, f, t) for c, r, f, t in ps)
    sent = _events([e for c, r, _, t in ps for e in (("r", r), *(("t", x) for x in [t] if t), ("c", c))])
    got = _events([e for run in unpack_in_order(joined)
                   for e in (("r", run.reasoning), *(("t", x) for x in run.tool_calls), ("c", run.content))])
    assert got == sent
