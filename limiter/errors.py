"""The exception hierarchy every layer raises; the frontend maps it to HTTP in one place.

    QosError
    ├── ConfigError                 bad TOML / env / CLI value (names the field path)
    ├── InvalidArgument             a value the caller passed is unusable (names the field)
    │   └── InvalidName             a pool/class/tenant/... name that could inject keys
    ├── RedisUnavailable            Redis cannot be reached or is loading
    ├── PolicyMissing               the pool's policy hash is absent (not initialised)
    ├── AdmissionRejected           admit said no; nothing was charged or queued
    │   ├── Throttled               a bucket lacks tokens: ``retry_after_ms`` says when
    │   ├── QueueFull               the class queue is at its cap
    │   ├── TenantBusy              the tenant is at its concurrent-request cap
    │   └── RequestTooLarge         cost exceeds what the buckets could ever hold
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
    def __init__(self, bucket: str, retry_after_ms: int) -> None:
        super().__init__(f"{bucket} token bucket is empty; retry in {retry_after_ms} ms")
        self.bucket = bucket
        self.retry_after_ms = retry_after_ms


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


class RequestTooLarge(AdmissionRejected):
    def __init__(self, message: str) -> None:
        super().__init__(message)


class LeaseLost(QosError):
    pass


class StaleLeader(QosError):
    pass


class ScriptError(QosError):
    pass
