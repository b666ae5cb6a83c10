"""The latency sample: one per finished (or turned-away) request, the controller's evidence.

Every writer appends it to ``qos:{pool}:samples`` (field ``d``, a msgpack map); the controller
reads it back with :func:`unpack_sample` / :func:`decode_sample` into its SLO windows
(limiter/controller/slo_window.py) and capacity estimator. This module is the schema. Writers:

* workers, for requests they finished (``ok``, ``cancelled``, ``failed``, ``refused``): worker/samples.py
  fills it from the request's delivery;
* the frontend, for requests admission turned away (``rejected``): ``record_rejection``;
* the Redis Lua scripts, for outcomes decided inside Redis (``expired``, ``cancelled``,
  ``failed`` by lease loss, ``refused`` by claim: a prompt no worker of the pool can hold):
  ``add_sample`` in lua/include/. Lua cannot import this module,
  so it writes the same map by hand: a field added here must be added there too.

Fields, all times in ms. :func:`decode_sample` requires ``class``, ``outcome``, ``ts_ms``,
``input_tokens``, ``output_tokens``, ``queue_wait_ms`` and ``e2e_ms``, and ignores fields it
does not use:

==================  ===========================================================================
``v``               :data:`SAMPLE_VERSION` (schema version)
``pool``            pool name
``class``           priority class (P0, P1, ...)
``tenant``          tenant name
``outcome``         one of :data:`OUTCOMES`
``request_id``      request id
``worker``          worker id ('' when no worker ran it)
``engine``          workers only: ``torch`` | ``sim`` | ``openai``; ``simulated`` true for sim
``queue_wait_ms``   ``claimed_ms - enq_ms``: first claim minus admission, both Redis clock
                    (never claimed: time spent queued; rejected: 0)
``ttft_ms``         admission -> first token. If an earlier attempt already delivered one, it
                    is ``first_ms - enq_ms`` (Redis clock); otherwise ``(claim time of this
                    attempt - enq_ms)`` + local time from that claim to the engine emitting the
                    first token. Absent when no token was produced.
``tpot_mean_ms``    mean time per output token after the first, this attempt's tokens:
                    ``(last - first) / (n - 1)``; absent when fewer than 2 tokens
``tpot_max_ms``     the largest inter-token gap of this attempt (a decode stall shows here)
``e2e_ms``          admission -> completion (rejected: how long admission waited)
``input_tokens``    prompt tokens (pool tokenizer units: UTF-8 bytes + BOS; openai: the upstream's)
``prompt_tokens``   workers only: the prompt tokens admission counted (the frontend's count, pool
                    tokenizer units, whatever the engine); the frontend's and the scripts'
                    samples have that count as ``input_tokens``. A class's TTFT allowance per
                    prompt token is judged by it (:attr:`Sample.pool_prompt_tokens`): with
                    the openai engine ``input_tokens`` is in the model server's units, and one
                    class's target would otherwise move with the writer
``output_tokens``   tokens delivered in total, all attempts
``ttft_at_least_ms`` ``expired`` and ``rejected`` only: the request ended for a max wait its
                    client set below its class's (``X-QoS-Max-Wait-Ms``), not for the class's
                    own; its first token would have come no sooner than this (the time it
                    waited, or admission's estimate). The controller counts it a miss only
                    past the class's TTFT target: a client's own short wait is not a miss of
                    its class
``attempt``         workers only: this attempt's number (1 unless resumed after a worker died)
``ts_ms``           completion time (Redis clock; a worker estimates it from the claim reply)
``upstream_*``      openai engine only: the upstream's own ``prompt_tokens`` and
                    ``completion_tokens`` from its final usage chunk (its tokenizer's units)
==================  ===========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from limiter.errors import InvalidArgument
from limiter.keys import NAME_RE

SAMPLE_VERSION = 1
# ``rejected``: turned away at admission by the class budget (429) or a full queue (503);
# ``refused``: failed for what the request is (a prompt no worker can hold, a model server's
# 400), which no retry mends: not a miss of its class's latency targets
OUTCOMES = ("ok", "expired", "cancelled", "failed", "rejected", "refused")


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request, as the controller sees it. Times are ms; ``ts_ms`` is Redis time."""

    cls: str
    outcome: str
    ts_ms: float
    input_tokens: int
    output_tokens: int
    queue_wait_ms: float
    e2e_ms: float
    ttft_ms: float | None = None
    tpot_mean_ms: float | None = None
    tpot_max_ms: float | None = None
    worker: str = ""
    ttft_at_least_ms: float | None = None
    prompt_tokens: int | None = None  # workers: admission's count, when input_tokens is another's

    @property
    def pool_prompt_tokens(self) -> int:
        """The prompt's tokens as admission counted them (the pool tokenizer's units)."""
        return self.input_tokens if self.prompt_tokens is None else self.prompt_tokens


def build_sample(*, pool: str, cls: str, tenant: str, outcome: str, request_id: str, worker: str,
                 input_tokens: int, output_tokens: int, queue_wait_ms: float, e2e_ms: float, ts_ms: int,
                 **optional: Any) -> dict[str, Any]:
    """The map a writer appends: the required fields, then ``optional`` ones (``ttft_ms``,
    ``engine``, ...) whose value is not None -- an absent field, not a null, means "none"."""
    sample: dict[str, Any] = {
        "v": SAMPLE_VERSION, "pool": pool, "class": cls, "tenant": tenant, "outcome": outcome,
        "request_id": request_id, "worker": worker, "input_tokens": input_tokens,
        "output_tokens": output_tokens, "queue_wait_ms": queue_wait_ms, "e2e_ms": e2e_ms, "ts_ms": ts_ms,
    }
    return sample | {k: v for k, v in optional.items() if v is not None}


def pack_sample(sample: Mapping[str, Any]) -> bytes:
    """The stream entry's ``d`` field."""
    return msgpack.packb(sample, use_bin_type=True)


def unpack_sample(data: bytes, classes: Collection[str] | None = None) -> Sample:
    """A ``d`` field back to a :class:`Sample`; bad msgpack raises :class:`InvalidArgument` ``d``."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidArgument("d", f"undecodable msgpack ({type(exc).__name__}: {exc})") from exc
    return decode_sample(raw, classes)


def _text(value: object) -> object:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# Bounds a sample's figures must keep (a finite float can still be absurd: token counts of
# 1e308 made the controller's work sums inf, then NaN): token counts as admit takes them,
# times in ms up to ~300 years (ts_ms is a Unix time in ms).
MAX_TOKENS = 10_000_000
MAX_MS = 1e13


def _number(raw: Mapping[str, object], name: str, required: bool) -> float | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise InvalidArgument(f"sample.{name}", "missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"sample.{name}", f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or not 0 <= value <= MAX_MS:
        raise InvalidArgument(f"sample.{name}", f"must be a number in [0, {MAX_MS:g}], got {value!r}")
    return float(value)


def _required(raw: Mapping[str, object], name: str) -> float:
    value = _number(raw, name, required=True)
    assert value is not None  # _number raised for a missing required field
    return value


def _count(raw: Mapping[str, object], name: str) -> int:
    value = _required(raw, name)
    if value != int(value) or value > MAX_TOKENS:
        raise InvalidArgument(f"sample.{name}", f"must be a whole number <= {MAX_TOKENS}, got {value!r}")
    return int(value)


def decode_sample(raw: object, classes: Collection[str] | None = None) -> Sample:
    """Validate one raw sample (a msgpack-decoded map) and return it as a :class:`Sample`.

    Required: ``class``, ``outcome``, ``ts_ms``, ``input_tokens``, ``output_tokens``,
    ``queue_wait_ms``, ``e2e_ms``. Optional: ``ttft_ms``, ``tpot_mean_ms``, ``tpot_max_ms``
    (Redis-side samples of requests that never ran have none of them) -- except that an ``ok``
    sample that produced tokens must carry ``ttft_ms``, or its SLO could not be judged.
    Bytes keys and values (msgpack ``raw=True``) are accepted; unknown fields are ignored.
    Raises :class:`InvalidArgument` whose ``field`` names the offending field.
    """
    if not isinstance(raw, Mapping):
        raise InvalidArgument("sample", f"expected a map, got {type(raw).__name__}")
    fields: dict[str, object] = {str(_text(k)): v for k, v in raw.items()}
    cls = _text(fields.get("class"))
    if not isinstance(cls, str) or not NAME_RE.fullmatch(cls):
        raise InvalidArgument("sample.class", f"expected a class name, got {cls!r}")
    if classes is not None and cls not in classes:
        raise InvalidArgument("sample.class", f"unknown class {cls!r}")
    outcome = _text(fields.get("outcome"))
    if outcome not in OUTCOMES:
        raise InvalidArgument("sample.outcome", f"expected one of {OUTCOMES}, got {outcome!r}")
    output_tokens = _count(fields, "output_tokens")
    ttft = _number(fields, "ttft_ms", required=outcome == "ok" and output_tokens > 0)
    worker = _text(fields.get("worker", ""))
    return Sample(
        cls=cls,
        outcome=str(outcome),
        ts_ms=_required(fields, "ts_ms"),
        input_tokens=_count(fields, "input_tokens"),
        output_tokens=output_tokens,
        queue_wait_ms=_required(fields, "queue_wait_ms"),
        e2e_ms=_required(fields, "e2e_ms"),
        ttft_ms=ttft,
        tpot_mean_ms=_number(fields, "tpot_mean_ms", required=False),
        tpot_max_ms=_number(fields, "tpot_max_ms", required=False),
        worker=worker if isinstance(worker, str) else "",
        ttft_at_least_ms=_number(fields, "ttft_at_least_ms", required=False),
        prompt_tokens=None if fields.get("prompt_tokens") is None else _count(fields, "prompt_tokens"),
    )
