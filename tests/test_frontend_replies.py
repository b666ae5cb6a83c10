"""The reply-stream reader: each entry, of its own or grouped (a push's token batches for this
frontend's requests), reaches the queues of the requests it names, and only those."""

from __future__ import annotations

from limiter.frontend.metrics import FrontendMetrics
from limiter.frontend.replies import Reply, ReplyRouter, replies_of
from limiter.keys import PoolKeys
from limiter.slo import ClassSLO


def _counted(m: FrontendMetrics, kind: str) -> float:
    labels = {"pool": "tiny", "kind": kind}
    return m.registry.get_sample_value("qos_frontend_reply_entries_total", labels) or 0


def test_a_grouped_entry_reaches_each_request_named_in_it() -> None:
    m = FrontendMetrics()
    router = ReplyRouter(None, [PoolKeys("tiny")], "fe1", m)
    qa, qb = router.register("ra"), router.register("rb")
    router.dispatch("tiny", {b"k": b"toks", b"ra": b"3 0 2 two words ", b"gone": b"3 0 1 x",
                             b"rb": "7 5 1 Grüße".encode()})
    router.dispatch("tiny", {b"id": b"ra", b"k": b"done", b"a": b"3", b"o": b"2", b"n": b"0", b"t": b"",
                             b"fin": b"stop", b"in": b"4", b"out": b"2"})
    assert qa.get_nowait() == Reply("tok", offset=0, count=2, text="two words ", attempt=3)
    assert qa.get_nowait().kind == "done" and qa.empty()
    assert qb.get_nowait() == Reply("tok", offset=5, count=1, text="Grüße", attempt=7) and qb.empty()
    assert _counted(m, "tok") == 2 and _counted(m, "orphan") == 1 and _counted(m, "done") == 1


def test_an_entry_of_an_unknown_shape_is_skipped_and_counted() -> None:
    m = FrontendMetrics()
    router = ReplyRouter(None, [PoolKeys("tiny")], "fe1", m)
    q = router.register("ra")
    router.dispatch("tiny", {b"k": b"toks", b"ra": b"3 0 2"})  # no text field: not from push_tokens
    router.dispatch("tiny", {b"k": b"toks", b"ra": b"3 x 2 t"})
    router.dispatch("tiny", {b"k": b"stop"})  # a frontend's own wake-up entry: nobody's
    assert q.empty() and _counted(m, "malformed") == 2 and _counted(m, "orphan") == 0


def test_replies_of_reads_both_shapes_for_either_client_decoding() -> None:
    own = {"id": "ra", "k": "tok", "a": "1", "o": "0", "n": "1", "t": "x"}  # decode_responses=True
    assert replies_of(own) == [("ra", Reply("tok", offset=0, count=1, text="x", attempt=1))]
    assert replies_of({"k": "toks", "ra": "1 0 1 x"}) == replies_of(own)


def test_a_replay_is_counted_once_as_read_and_once_as_dropped_not_twice_as_read() -> None:
    """A resumed request's replayed tokens: read (kind `tok`), then dropped by the request
    (its own counter). Counted as a `dup` kind of the same counter, each replay was two of
    the replies read (found by a review of what operators see)."""
    import types

    from limiter.frontend.generation import Generation

    m = FrontendMetrics()
    router = ReplyRouter(None, [PoolKeys("tiny")], "fe1", m)
    q = router.register("rX")
    entry = {b"k": b"tok", b"id": b"rX", b"o": b"0", b"n": b"3", b"t": b"abc", b"a": b"1"}
    router.dispatch("tiny", entry)
    router.dispatch("tiny", entry)  # a worker resuming the request sends the same 3 tokens again
    request = types.SimpleNamespace(  # what Generation.accept reads of its request
        forwarded=0, deadline_active=True, first_token_at=None, request_id="rX", labels=("tiny", "P0"),
        cls="P0", req=types.SimpleNamespace(pool=types.SimpleNamespace(name="tiny"), prompt_tokens=3),
        admitted_at=0.0, received=0.0, fe=types.SimpleNamespace(metrics=m, slos={"P0": ClassSLO(500.0)}))
    assert [Generation.accept(request, q.get_nowait()) for _ in range(2)] == ["abc", ""]
    assert _counted(m, "tok") == 2 and _counted(m, "dup") == 0
    assert m.registry.get_sample_value("qos_frontend_replayed_replies_total", {"pool": "tiny"}) == 1
