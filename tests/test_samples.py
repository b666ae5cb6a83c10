"""The latency-sample schema: build, pack, unpack and validate (limiter/samples.py)."""

from __future__ import annotations

import pytest

from limiter.errors import InvalidArgument
from limiter.samples import SAMPLE_VERSION, Sample, build_sample, decode_sample, pack_sample, unpack_sample


def raw(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "v": 1,
        "pool": "llama",
        "class": "P0",
        "tenant": "acme",
        "outcome": "ok",
        "request_id": "r1",
        "worker": "w1",
        "input_tokens": 200,
        "output_tokens": 100,
        "queue_wait_ms": 12,
        "ttft_ms": 180.5,
        "tpot_mean_ms": 22.0,
        "tpot_max_ms": 61.0,
        "e2e_ms": 2400,
        "ts_ms": 1_700_000_000_000,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def test_a_built_sample_packs_and_reads_back() -> None:
    built = build_sample(pool="llama", cls="P1", tenant="acme", outcome="rejected", request_id="r1",
                         worker="", input_tokens=50, output_tokens=0, queue_wait_ms=0, e2e_ms=30, ts_ms=1000,
                         ttft_ms=None, engine="sim")
    assert built["v"] == SAMPLE_VERSION and "ttft_ms" not in built and built["engine"] == "sim"
    decoded = unpack_sample(pack_sample(built), ("P0", "P1"))
    assert decoded == Sample("P1", "rejected", 1000.0, 50, 0, 0.0, 30.0)
    with pytest.raises(InvalidArgument) as err:
        unpack_sample(b"\xc1")  # a byte msgpack never uses
    assert err.value.field == "d"


# --- decode_sample ----------------------------------------------------------------------
def test_decode_full_sample() -> None:
    s = decode_sample(raw(), classes=("P0", "P1", "P2"))
    assert s == Sample("P0", "ok", 1.7e12, 200, 100, 12.0, 2400.0, 180.5, 22.0, 61.0, "w1")


def test_decode_accepts_msgpack_bytes_and_redis_side_samples() -> None:
    # A sample written by a Lua script for a request that expired in the queue: no TTFT/TPOT.
    lua = raw(outcome="expired", ttft_ms=None, tpot_mean_ms=None, tpot_max_ms=None, output_tokens=0)
    as_bytes = {k.encode(): (v.encode() if isinstance(v, str) else v) for k, v in lua.items()}
    s = decode_sample(as_bytes)
    assert (s.cls, s.outcome, s.ttft_ms, s.tpot_mean_ms, s.worker) == ("P0", "expired", None, None, "w1")


@pytest.mark.parametrize(
    "field", ["class", "outcome", "ts_ms", "input_tokens", "output_tokens", "queue_wait_ms", "e2e_ms"]
)
def test_decode_missing_required_field_names_it(field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_sample(raw(**{field: None}))
    assert err.value.field == f"sample.{field}"
    assert f"sample.{field}" in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ttft_ms", "180"),
        ("ttft_ms", True),
        ("ttft_ms", -1),
        ("queue_wait_ms", float("nan")),
        ("e2e_ms", float("inf")),
        ("ts_ms", -5),
        ("input_tokens", 1.5),
        ("output_tokens", -2),
        ("tpot_mean_ms", [1]),
        ("outcome", "timeout"),
        ("class", "P0:x"),
        ("class", 7),
        ("prompt_tokens", -1),
        ("prompt_tokens", 2.5),
    ],
)
def test_decode_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_sample(raw(**{field: value}))
    assert err.value.field == f"sample.{field}"


def test_decode_rejects_unknown_class_and_non_maps() -> None:
    with pytest.raises(InvalidArgument, match="unknown class 'P9'"):
        decode_sample(raw(**{"class": "P9"}), classes=("P0", "P1", "P2"))
    with pytest.raises(InvalidArgument, match="expected a map"):
        decode_sample([1, 2])


def test_ok_sample_with_tokens_must_say_when_the_first_came() -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_sample(raw(ttft_ms=None))
    assert err.value.field == "sample.ttft_ms"
    assert decode_sample(raw(ttft_ms=None, output_tokens=0)).ttft_ms is None


def test_whole_floats_count_as_token_counts() -> None:
    assert decode_sample(raw(input_tokens=200.0)).input_tokens == 200


def test_the_prompt_as_admission_counted_it_is_the_worker_s_prompt_tokens_else_input_tokens() -> None:
    """The openai engine's ``input_tokens`` is the model server's count; its sample also
    carries admission's (``prompt_tokens``), which the frontend's and the scripts' samples
    have as ``input_tokens``: one unit for a class's TTFT allowance whoever wrote the sample."""
    assert decode_sample(raw()).pool_prompt_tokens == 200
    worker = decode_sample(raw(input_tokens=2_000, prompt_tokens=8_001))
    assert (worker.input_tokens, worker.pool_prompt_tokens) == (2_000, 8_001)
