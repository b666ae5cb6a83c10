"""The exception hierarchy every layer raises; the frontend maps it to HTTP in one place.

    QosError
    ├── ConfigError                 bad TOML / env / CLI value (names the field path)
    ├── InvalidArgument             a value the caller passed is unusable (names the field)
    │   └── InvalidName             a pool/class/tenant/... name that could inject keys
    ├── RedisUnavailable            Redis cannot be reached or is loading
    ├── PolicyMissing               the pool's policy hash is absent (not initialised)
    ├── AdmissionRejected           admit said no; nothing was charged or queued
    │   ├── Throttled               a bucket lacks tokens: ``retry_after_ms`` says when
    │   ├── Overloaded              it could not start within its max wait
    │   ├── QueueFull               the class queue is at its cap
    │   └── TenantBusy              the tenant is at its concurrent-request cap
    ├── LeaseLost                   a worker wrote for a request it no longer owns
    ├── StaleLeader                 a controller wrote rates with an old fencing token
    └── ScriptError                 any other error reply from a script
"""

from __future__ import annotations


class QosError(Exception):
    """Base of everything this package raises on purpose."""


class ConfigError(QosError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class InvalidArgument(QosError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if field in message else f"{field}: {message}")
        self.field = field


class InvalidName(InvalidArgument):
    pass


class RedisUnavailable(QosError):
    pass


class PolicyMissing(QosError):
    def __init__(self, pool: str) -> None:
        super().__init__(f"pool {pool!r} has no policy in Redis (not initialised)")
        self.pool = pool


class AdmissionRejected(QosError):
    retry_after_ms: int = 0


class Throttled(AdmissionRejected):
    """``bucket``: which bucket is empty ('tenant', 'class'); ``retry_after_ms`` -1: the
    class ``cls`` is closed (its ceiling is 0), no wait will do."""

    def __init__(self, bucket: str, retry_after_ms: int, cls: str = "") -> None:
        super().__init__(f"{bucket} token bucket is empty; retry in {retry_after_ms} ms")
        self.bucket = bucket
        self.retry_after_ms = retry_after_ms
        self.cls = cls


def _duration(ms: int) -> str:
    return f"{ms} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


class QueueFull(AdmissionRejected):
    def __init__(self, cls: str, depth: int) -> None:
        super().__init__(f"queue for class {cls} is full ({depth} waiting)")
        self.cls = cls
        self.depth = depth


class TenantBusy(AdmissionRejected):
    def __init__(self, tenant: str, inflight: int) -> None:
        super().__init__(f"tenant {tenant!r} already has {inflight} requests in flight (its cap)")
        self.tenant = tenant
        self.inflight = inflight


class Overloaded(AdmissionRejected):
    """The work queued ahead would keep the request waiting longer than its max wait."""

    def __init__(self, cls: str, retry_after_ms: int, est_wait_ms: int, max_wait_ms: int) -> None:
        if est_wait_ms < 0:
            text = f"class {cls} gets no capacity now (its guarantee is 0 and higher classes use it all)"
        else:
            text = (f"class {cls} would wait about {_duration(est_wait_ms)} for a worker, "
                    f"past its max wait of {_duration(max_wait_ms)}")
        super().__init__(text)
        self.cls = cls
        self.retry_after_ms = retry_after_ms
        self.est_wait_ms = est_wait_ms
        self.max_wait_ms = max_wait_ms


class LeaseLost(QosError):
    pass


class StaleLeader(QosError):
    pass


class ScriptError(QosError):
    pass
