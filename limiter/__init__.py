"""Request-level QoS for LLM inference: the shared core every role builds on.

The rooms (docs/architecture.md walks one request through them):

* ``limiter.frontend``   -- the OpenAI-compatible HTTP door: authenticates, admits, streams.
* ``worker``             -- one per GPU (or per upstream server): claims, batches, steps, completes.
* ``limiter.controller`` -- tunes each pool's rates from measured latency and capacity.
* ``limiter.localstack`` -- ``qos up``, a private Redis, the demo load and the load generator.
* ``limiter.bench``      -- the benchmarks (never imported by runtime code).
* ``lua/``               -- one atomic script per state transition, loaded by ``limiter.scripts``.

What is exported here is the API that embedding code and the roles share: the validated
configuration, the error hierarchy, the Redis key builder, the typed script registry and the
latency-sample schema.
"""

from limiter import errors  # the whole hierarchy: errors.Throttled, errors.QueueFull, ...
from limiter.config import ClassConfig, PoolConfig, QosConfig, RedisConfig, TenantConfig, load
from limiter.errors import (
    AdmissionRejected,
    ConfigError,
    InvalidArgument,
    LeaseLost,
    QosError,
    RedisUnavailable,
)
from limiter.keys import PoolKeys
from limiter.redis_conn import open_redis
from limiter.samples import Sample, build_sample, decode_sample, pack_sample
from limiter.scripts import Scripts

__all__ = [
    "AdmissionRejected", "ClassConfig", "ConfigError", "InvalidArgument", "LeaseLost", "PoolConfig",
    "PoolKeys", "QosConfig", "QosError", "RedisConfig", "RedisUnavailable", "Sample", "Scripts",
    "TenantConfig", "build_sample", "decode_sample", "errors", "load", "open_redis", "pack_sample",
]
