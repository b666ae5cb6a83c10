"""tests/support/helpers.py dump_all: a snapshot of every key, which the model test and the
"a refused call changes nothing" checks compare."""

from __future__ import annotations

from typing import Any

from tests.support.helpers import dump_all


class _Expiring:
    """A client whose keys expire while a snapshot is taken: one gone by its DUMP, one gone
    by its PTTL, one with 0 ms left, one without a TTL."""

    def keys(self, _pattern: str) -> list[bytes]:
        return [b"gone-at-dump", b"gone-at-pttl", b"last-ms", b"forever"]

    def dump(self, key: bytes) -> Any:
        return None if key == b"gone-at-dump" else b"v:" + key

    def pttl(self, key: bytes) -> int:
        return {b"gone-at-dump": -2, b"gone-at-pttl": -2, b"last-ms": 0, b"forever": -1}[key]


def test_a_key_that_expires_while_the_snapshot_is_taken_is_left_out() -> None:
    assert dump_all(_Expiring()) == {b"last-ms": (b"v:last-ms", True), b"forever": (b"v:forever", False)}


def test_a_real_snapshot_names_ttls(sync_redis) -> None:
    sync_redis.set("a", 1)
    sync_redis.set("b", 2, ex=60)
    snap = dump_all(sync_redis)
    assert set(snap) == {b"a", b"b"} and snap[b"a"][1] is False and snap[b"b"][1] is True
