"""The one TOML configuration, as frozen dataclasses validated once at start.

Every role loads the same file (``--config`` / ``QOS_CONFIG``); deploy-time values come
from environment overrides (``QOS_REDIS_URL``). A mistake raises :class:`ConfigError`
naming the field by its path, e.g. ``classes[1].share: must be between 0 and 1``.
With no file, :func:`demo_config` gives the documented demo deployment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import os
import re
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio.cluster
import redis.asyncio.connection
import redis.connection

from limiter import token_count
from limiter.errors import ConfigError
from limiter.keys import CLASS_NAME_RE, NAME_RE

DEMO_KEYS = {"demo-p0": "P0", "demo-p1": "P1", "demo-p2": "P2"}
DEMO_ADMIN_KEY = "demo-admin"


def hash_key(key: str) -> str:
    """Keys are stored in config as sha256 hex digests, never in clear. The digest is of the
    key's bytes as sent: a key that is not UTF-8 comes in (argv, stdin, an HTTP header) with
    its bytes as surrogates, and goes back to them here, as the frontend's lookup does (a
    strict encode was a traceback out of `qos config hash-key`)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


# The most weighted tokens/s a pool may be said to serve: a bound on the config, and on what
# the controller takes from a worker's heartbeat or its own estimate (set_rates refuses
# rates above 1e15, so a figure past this could only wedge it).
MAX_CAPACITY_TOKENS_S = 1e12

@dataclass(frozen=True)
class ClassConfig:
    """One priority class. Rates are shares of the pool's capacity (weighted tokens/s)."""

    name: str
    share: float  # guaranteed share of capacity: the class bucket's rate, enforced at claim
    ceil_share: float = 1.0  # most share of capacity the class may be served (1.0 = every idle slot)
    floor: float = 0.0  # starvation floor: minimum share of claimed work when backlogged
    weight: float = 1.0  # cost per input token
    out_weight: float = 1.0  # cost per reserved/generated output token
    burst_s: float = 0.5  # burst = burst_s seconds of rate
    max_wait_ms: int = 30_000  # max queue wait: refused at admission (429) if it cannot be met
    admission_wait_ms: int = 0  # how long a frontend may wait for the tenant's quota before a 429
    queue_cap: int = 10_000
    slo_ttft_ms: float | None = None
    # The TTFT target grows by this many ms per 1,000 prompt tokens (pool tokenizer units):
    # a long prompt's own prefill is no interference the controller could remove by cutting
    # the classes below, so a fixed target would read it as their fault (0: a fixed target).
    slo_ttft_ms_per_1k_prompt_tokens: float = 0.0
    # The prompt tokens slo_ttft_ms already covers: the allowance counts only those past it,
    # so a short prompt keeps the fixed target (0: every token counts).
    slo_ttft_base_prompt_tokens: int = 0
    slo_tpot_ms: float | None = None
    # A worker pushes this class's tokens to Redis at least this often (default: the worker's
    # flush_ms, 50). Longer for classes whose clients read in bulk (batch jobs): each push is
    # one request's share of a push_tokens call, the largest per-token Redis cost.
    stream_flush_ms: float | None = None
    # Tenants of the class share it by virtual token counters (true), or are served in
    # arrival order whoever sent the request (false: plain FIFO inside the class).
    fair: bool = True


@dataclass(frozen=True)
class PoolConfig:
    """One model deployment; its keys share the hash tag ``{name}``."""

    name: str
    model: str = ""  # the OpenAI `model` name clients send; defaults to the pool name
    context_tokens: int = 4096  # prompt + max_tokens may not exceed this
    default_max_tokens: int = 256
    capacity_tokens_s: float = 20_000.0  # initial capacity until the controller measures it
    lease_ms: int = 10_000
    max_attempts: int = 3
    frontend_ttl_ms: int = 15_000
    floor_half_life_ms: int = 10_000
    record_ttl_s: int = 300
    floor_quantum_tokens: float = 2048.0  # how far below its floor a class must fall to go first
    # Output tokens a request is charged ahead at a binding ceiling (lua/include/ceiling.lua):
    # what it may deliver before a lease renewal charges it. Bounds how many requests the
    # class starts at once; a longer reservation holds no more than this of the ceiling.
    ceiling_ahead_tokens: int = 256
    # What prompt tokens are counted in (limiter/token_count.py): "bytes" (UTF-8 bytes + BOS,
    # the tiny model's and the sim engine's), the path of a tokenizer.json (or a directory
    # holding one; relative to the config file), or "upstream" (the model server's /tokenize).
    tokenizer: str = "bytes"
    tokenizer_url: str = ""  # tokenizer = "upstream": the server (default: [worker] upstream_url)
    # Request fields the frontend passes to the model server as the client sent them, for a
    # pool behind the openai engine: vLLM's top_k, min_p, chat_template_kwargs, ... (a step
    # engine refuses a request that carries any). Not one this service implements itself.
    upstream_fields: tuple[str, ...] = ()
    # Whether the pool's workers front a model server that calls tools (vLLM with
    # --enable-auto-tool-choice and a --tool-call-parser): the frontend then takes a request's
    # `tools`, `tool_choice` and earlier tool calls, and answers the server's tool calls as
    # OpenAI does. Off, only their empty values are accepted (a step engine calls no tools).
    tool_calls: bool = False
    # Whether the pool's workers front a model server that returns token log probabilities
    # (vLLM does: --max-logprobs, 20 by default): the frontend then takes a chat's `logprobs`
    # and `top_logprobs` and a completion's `logprobs`, each up to max_logprobs alternatives a
    # token, and answers the server's logprobs as OpenAI does. Off, only their neutral values.
    logprobs: bool = False
    max_logprobs: int = 20  # OpenAI's bound (a token's alternatives ride in Redis until read)
    # Whether the pool's workers front a model server that holds an answer to a JSON schema
    # (vLLM's structured outputs, on by default): the frontend then takes a chat's
    # `response_format` (json_object, json_schema) and sends it on. Off, only {"type": "text"}.
    structured_outputs: bool = False

    @property
    def model_name(self) -> str:
        return self.model or self.name


@dataclass(frozen=True)
class TenantConfig:
    name: str
    key_sha256: tuple[str, ...] = ()
    default_class: str = "P1"
    max_class: str = "P1"  # the highest class this tenant's keys may use
    rate_tokens_s: float = 1e9  # quota per pool, weighted tokens/s (checked at admission)
    burst_s: float = 1.0
    max_inflight: int = 0  # 0 = no cap
    weight: float = 1.0  # share of its class next to the other backlogged tenants (VTC weight)
    admin: bool = False


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False


@dataclass(frozen=True)
class QosConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    classes: tuple[ClassConfig, ...] = ()
    pools: tuple[PoolConfig, ...] = ()
    tenants: tuple[TenantConfig, ...] = ()
    frontend: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    controller: dict[str, Any] = field(default_factory=dict)
    demo: bool = False

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]

    def class_config(self, name: str) -> ClassConfig | None:
        """Class ``name``'s settings, or None for a class this config does not have."""
        for c in self.classes:
            if c.name == name:
                return c
        return None

    def class_rank(self, name: str) -> int:
        return self.class_names().index(name)


# --- generic loading -----------------------------------------------------------------

def _convert(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(path, args[0], value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {type(value).__name__}")
        (inner, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(f"{path}[{i}]", inner, v) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a table, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build_section(path, tp, value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer past any float (TOML's are unbounded)
            raise ConfigError(path, "must be a number, got an integer too large for one") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp}")


def build_section(path: str, cls: type, data: Any) -> Any:
    """Build dataclass ``cls`` from a TOML table, naming ``path.field`` in any error.

    Roles use it for their own sections (``[frontend]``, ``[worker]``, ``[controller]``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{path}.{key}" if path else key, "unknown field")
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in data:
            kwargs[f.name] = _convert(sub, hints[f.name], data[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, "is required")
    return cls(**kwargs)


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(path, message)


def _check_new_name(kind: str, path: str, name: str, seen: set[str]) -> None:
    """``name`` (of a class, pool or tenant at ``path``) goes into Redis keys, so it must be a
    valid key component, and it must not repeat one already in ``seen``; it is added there."""
    if kind == "class":
        _check(bool(CLASS_NAME_RE.fullmatch(name)), f"{path}.name",
               f"{name!r} is not a valid class name (letters, digits, '_' and '-', up to 64)")
    else:
        _check(bool(NAME_RE.fullmatch(name)), f"{path}.name", f"{name!r} is not a valid name")
    _check(name not in seen, f"{path}.name", f"duplicate {kind} {name!r}")
    seen.add(name)


def _init_params(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes, its base classes' included."""
    names: set[str] = set()
    for k in cls.__mro__:
        if "__init__" in vars(k):
            names |= {p.name for p in inspect.signature(vars(k)["__init__"]).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names


def _secret_option(name: str) -> bool:
    return urllib.parse.unquote_plus(name).lower().endswith("password")


def redacted_url(url: str) -> str:
    """``url`` fit to print: the password of its user part and of a ``password=`` query option
    replaced by ``***``. The user part is taken to the *last* '@': a password with an
    unencoded '/' or '?' would otherwise be read as a path."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<the Redis URL>"
    userinfo, at, host = rest.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        rest = f"{user}:***@{host}" if colon else f"{userinfo}@{host}"
    head, q, query = rest.partition("?")
    if q:
        # any option whose name (as redis-py decodes it) is a password: `password`, and the TLS
        # client key's `ssl_password`, which was printed whole
        query = "&".join(f"{part.partition('=')[0]}=***" if _secret_option(part.partition("=")[0]) else part
                         for part in query.split("&"))
    return f"{scheme}://{head}{q}{query}"


# The numbers a Redis URL's query may set, and their bounds: redis-py takes any, and then
# ?socket_timeout=0 (or nan, or 1e-9) timed every command out, for ever, as an outage;
# ?max_connections=-1 was a traceback; ?health_check_interval=-5 failed every command.
_URL_NUMBERS: dict[str, tuple[float, float, str]] = {
    "socket_timeout": (0.001, 3600, " s"),
    "socket_connect_timeout": (0.001, 3600, " s"),
    "timeout": (0, 3600, " s"),  # a blocking pool's wait for a free connection
    "health_check_interval": (0, 86400, " s"),
    "max_connections": (1, 100_000, ""),
    "socket_read_size": (1, 1 << 26, " bytes"),
    "db": (0, 1 << 31, ""),
}


def check_redis_url(url: str, path: str, cluster: bool = False) -> None:
    """A URL redis-py can open: its scheme, and a port that is a number (redis-py's own
    ValueError came out of `qos status` as a traceback); with ``cluster``, one the cluster
    client takes. Never names the URL itself (it may hold a password)."""
    _check(url.startswith(("redis://", "rediss://", "unix://")), path,
           "must start with redis://, rediss:// or unix://")
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port
    except ValueError:
        # urllib's message quotes the host part, which a password with '/', '?' or '#' cut
        # short: "Port could not be cast to integer value as '<the password>'".
        raise ConfigError(path, "not a valid URL: no host[:port] can be read from it (percent-encode "
                          "a password's '/', '?', '#', '%' and '@', e.g. '/' as %2F)") from None
    if parts.scheme != "unix":
        # urllib ends the host part at the first '/', '?' or '#': a password holding one, not
        # percent-encoded, put the rest of the password and the real host in the path, and
        # the host was read from the password ("Error connecting to ssw0rd:6379"; a password
        # of digits then '/' named localhost and a port). An '@' in the path shows it (in the
        # query it may be a value: ?password=p@ss).
        _check("@" not in parts.path, path,
               "not a valid URL: an '@' in its path (percent-encode a password's '/', '?', "
               "'#', '%' and '@', e.g. '/' as %2F, or the host is read from the password)")
        # redis-py reads the path as the database and ignores one that is not a number (db 0)
        db = urllib.parse.unquote(parts.path).strip("/")
        _check(not db or db.isdigit(), path, "its path (the database) must be a number, e.g. /0")
    try:
        options = redis.connection.parse_url(url)  # its query too (?db=x was a traceback)
    except ValueError as exc:
        raise ConfigError(path, f"not a valid URL: {exc}") from exc
    # TLS options on a plain URL: a cluster client dropped them and connected in plain text.
    tls = sorted({k for k, _ in urllib.parse.parse_qsl(parts.query) if k == "ssl" or k.startswith("ssl_")})
    _check(not tls or parts.scheme == "rediss", path,
           f"has TLS options ({', '.join(tls)}) on a {parts.scheme}:// URL: use rediss:// for TLS")
    # What redis-py refuses only when it builds the client or its first connection: a traceback
    # (TypeError, RedisClusterException) at every role's start, or (a bad protocol or
    # ssl_cert_reqs) an error each role took for an outage and retried for ever.
    if cluster:
        _check(parts.scheme != "unix", path, "a unix:// socket cannot reach a Redis Cluster "
               "(redis.cluster / QOS_REDIS_CLUSTER): use redis:// or rediss://")
        _check(not options.get("db"), path, f"names database {options.get('db')}: a Redis Cluster "
               "has only database 0")
        accepted = _init_params(redis.asyncio.cluster.RedisCluster)
    else:
        conn = {"unix": redis.asyncio.connection.UnixDomainSocketConnection,
                "rediss": redis.asyncio.connection.SSLConnection}.get(parts.scheme,
                                                                     redis.asyncio.connection.Connection)
        accepted = _init_params(conn) | {"max_connections"}  # the one pool option every client takes
    unknown = sorted(set(urllib.parse.parse_qs(parts.query)) - accepted)
    _check(not unknown, path, f"has query options redis-py does not take here: {', '.join(unknown)}")
    _check(options.get("protocol") in (None, 2, 3), path, "protocol must be 2 or 3")
    for name, (low, high, unit) in _URL_NUMBERS.items():
        value = options.get(name)
        _check(value is None or (math.isfinite(value) and low <= value <= high), path,
               f"query option {name} must be in [{low:g}, {high:g}]{unit}, got {value}")
    _check(options.get("ssl_cert_reqs") in (None, "none", "optional", "required"), path,
           "ssl_cert_reqs must be none, optional or required")


# The policy script's bounds (lua/init_pool.lua, lua/admit.lua): what `qos config check` calls ok
# must be what every role's start can write (it was refused there, naming policy.classes[1]).
MAX_CLASSES = 16
MAX_WEIGHT = 1e6
MAX_BURST_TOKENS = 1e15
# A TTFT allowance of a minute per 1,000 prompt tokens is past any model server's prefill:
# a larger figure is a unit mistake (seconds or tokens), not a target.
MAX_TTFT_MS_PER_1K = 60_000.0
MAX_LOGPROBS = 20  # a pool's max_logprobs: OpenAI's top_logprobs bound, and vLLM's default
MAX_CONTEXT_TOKENS = 10_000_000  # a pool's context_tokens, and so any prompt's length
# Fields a pool's upstream_fields may not name: those this service implements or sets itself
# (the frontend checks and counts them, the worker writes them upstream), those that change
# the answer's shape, which the frontend builds (more choices, logprobs, tool calls, echo),
# and vLLM's that carry a prompt, a template or text nobody counts (prompt_embeds,
# chat_template, documents), reach past the request (kv_transfer_params: where a decode node
# pulls its KV from; logits_processors, vllm_xargs: server-side code and arguments), or
# generate several sequences for one answer (use_beam_search).
RESERVED_REQUEST_FIELDS = frozenset({
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "stop", "seed", "stream", "stream_options", "ignore_eos", "min_tokens", "user", "metadata",
    "safety_identifier", "prompt_cache_key", "store", "service_tier", "modalities",
    "n", "best_of", "logprobs", "top_logprobs", "echo", "suffix", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "prediction", "audio",
    "priority", "continue_final_message", "add_generation_prompt", "request_id",
    "chat_template", "documents", "prompt_embeds", "kv_transfer_params", "logits_processors", "vllm_xargs",
    "use_beam_search"})
FIELD_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MIN_TENANT_QUOTA = 1e-9  # admit.lua's least tenant_rate (tokens/s) and tenant_burst (tokens)


def _check_upstream_fields(names: tuple[str, ...], path: str) -> None:
    _check(len(names) <= 64, path, f"at most 64 fields, got {len(names)}")
    seen: set[str] = set()
    for j, name in enumerate(names):
        fp = f"{path}[{j}]"
        _check(bool(FIELD_NAME_RE.fullmatch(name)), fp, f"{name[:80]!r} is not a request field's name "
               "(letters, digits, _; at most 64)")
        _check(name not in RESERVED_REQUEST_FIELDS, fp, f"{name!r} is implemented or set by this service "
               "itself (or shapes the answer it builds): it cannot be passed through")
        _check(name not in seen, fp, f"{name!r} is listed twice")
        seen.add(name)


def validate(cfg: QosConfig, *, tokenizer_files: bool = True) -> QosConfig:
    """Cross-field checks; returns ``cfg`` unchanged when it is valid. ``tokenizer_files``
    False: a pool's tokenizer.json is not read (a role that counts no tokens -- workers, the
    controller, `qos status` -- runs on a host without the model's files; its mode and URL
    are still checked)."""
    check_redis_url(cfg.redis.url, "redis.url", cfg.redis.cluster)
    _check(0 < len(cfg.classes) <= MAX_CLASSES, "classes", f"1 to {MAX_CLASSES} classes are allowed")
    seen: set[str] = set()
    shares = 0.0
    floors = 0.0
    for i, c in enumerate(cfg.classes):
        p = f"classes[{i}]"
        _check_new_name("class", p, c.name, seen)
        _check(0 <= c.share <= 1, f"{p}.share", "must be between 0 and 1")
        _check(c.share <= c.ceil_share <= 1, f"{p}.ceil_share", "must be between share and 1")
        _check(0 <= c.floor <= 1, f"{p}.floor", "must be between 0 and 1")
        _check(0 <= c.weight <= MAX_WEIGHT, f"{p}.weight", f"must be in [0, {MAX_WEIGHT:g}]")
        _check(0 <= c.out_weight <= MAX_WEIGHT, f"{p}.out_weight", f"must be in [0, {MAX_WEIGHT:g}]")
        _check(0 < c.burst_s <= 3600, f"{p}.burst_s", "must be in (0, 3600]")
        _check(1 <= c.max_wait_ms <= 86_400_000, f"{p}.max_wait_ms", "must be in [1, 86400000]")
        _check(0 <= c.admission_wait_ms <= 60_000, f"{p}.admission_wait_ms", "must be in [0, 60000]")
        _check(0 <= c.queue_cap <= 100_000_000, f"{p}.queue_cap", "must be in [0, 100000000]")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(c, name)
            _check(v is None or (math.isfinite(v) and v > 0), f"{p}.{name}",
                   "must be a finite number > 0 (no target: leave it out)")
        per_1k = c.slo_ttft_ms_per_1k_prompt_tokens
        per_1k_path = f"{p}.slo_ttft_ms_per_1k_prompt_tokens"
        _check(math.isfinite(per_1k) and 0 <= per_1k <= MAX_TTFT_MS_PER_1K, per_1k_path,
               f"must be in [0, {MAX_TTFT_MS_PER_1K:g}]")
        _check(per_1k == 0 or c.slo_ttft_ms is not None, per_1k_path,
               "needs slo_ttft_ms (the target for an empty prompt) in the same class")
        base_path = f"{p}.slo_ttft_base_prompt_tokens"
        _check(0 <= c.slo_ttft_base_prompt_tokens <= MAX_CONTEXT_TOKENS, base_path,
               f"must be in [0, {MAX_CONTEXT_TOKENS}]")
        _check(c.slo_ttft_base_prompt_tokens == 0 or per_1k > 0, base_path,
               "has no effect without slo_ttft_ms_per_1k_prompt_tokens in the same class")
        _check(c.stream_flush_ms is None or 0 < c.stream_flush_ms <= 10_000, f"{p}.stream_flush_ms",
               "must be in (0, 10000]")
        shares += c.share
        floors += c.floor
    _check(shares <= 1.0 + 1e-9, "classes", f"shares add up to {shares:.3f}, more than 1")
    _check(floors <= 1.0 + 1e-9, "classes", f"floors add up to {floors:.3f}, more than 1")
    _check(len(cfg.pools) > 0, "pools", "at least one pool is required")
    pool_names: set[str] = set()
    models: dict[str, int] = {}  # model name -> the pool that serves it
    for i, pool in enumerate(cfg.pools):
        p = f"pools[{i}]"
        _check_new_name("pool", p, pool.name, pool_names)
        # A request's `model` picks the first pool that serves it: a second pool with the same
        # model name would never be reached (a split pool needs a model name per half).
        _check(pool.model_name not in models, f"{p}.model",
               f"model {pool.model_name!r} is already served by pools[{models.get(pool.model_name)}]; "
               "each pool needs its own model name")
        models[pool.model_name] = i
        _check(16 <= pool.context_tokens <= MAX_CONTEXT_TOKENS, f"{p}.context_tokens",
               f"must be in [16, {MAX_CONTEXT_TOKENS}]")
        _check(1 <= pool.default_max_tokens <= pool.context_tokens, f"{p}.default_max_tokens",
               "must be in [1, context_tokens]")
        _check(0 < pool.capacity_tokens_s <= MAX_CAPACITY_TOKENS_S, f"{p}.capacity_tokens_s",
               "must be in (0, 1e12]")
        # the controller's burst_s, when set, replaces the classes' in every rate it writes
        ctl_burst = cfg.controller.get("burst_s", 0)
        longest = max(c.burst_s for c in cfg.classes)
        if not isinstance(ctl_burst, bool) and isinstance(ctl_burst, int | float) and ctl_burst > longest:
            longest = ctl_burst
        _check(pool.capacity_tokens_s * longest <= MAX_BURST_TOKENS, f"{p}.capacity_tokens_s",
               f"times the longest burst_s ({longest:g} s, of a class or [controller]) must be "
               f"<= {MAX_BURST_TOKENS:g} tokens")
        _check(100 <= pool.lease_ms <= 3_600_000, f"{p}.lease_ms", "must be in [100, 3600000]")
        _check(1 <= pool.max_attempts <= 100, f"{p}.max_attempts", "must be in [1, 100]")
        _check(100 <= pool.frontend_ttl_ms <= 3_600_000, f"{p}.frontend_ttl_ms", "must be in [100, 3600000]")
        _check(1 <= pool.floor_half_life_ms <= 86_400_000, f"{p}.floor_half_life_ms", "out of range")
        _check(1 <= pool.record_ttl_s <= 604_800, f"{p}.record_ttl_s", "must be in [1, 604800]")
        _check(0 <= pool.floor_quantum_tokens <= 1e12, f"{p}.floor_quantum_tokens", "must be in [0, 1e12]")
        _check(0 <= pool.ceiling_ahead_tokens <= 10_000_000, f"{p}.ceiling_ahead_tokens",
               "must be in [0, 10000000]")
        token_count.check(pool.tokenizer, pool.tokenizer_url, f"{p}.tokenizer", cfg.worker,
                          read_file=tokenizer_files)
        _check_upstream_fields(pool.upstream_fields, f"{p}.upstream_fields")
        _check(0 <= pool.max_logprobs <= MAX_LOGPROBS, f"{p}.max_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    tenant_names: set[str] = set()
    all_keys: set[str] = set()
    for i, t in enumerate(cfg.tenants):
        p = f"tenants[{i}]"
        _check_new_name("tenant", p, t.name, tenant_names)
        _check(t.default_class in seen, f"{p}.default_class", f"unknown class {t.default_class!r}")
        _check(t.max_class in seen, f"{p}.max_class", f"unknown class {t.max_class!r}")
        _check(cfg.class_rank(t.default_class) >= cfg.class_rank(t.max_class), f"{p}.default_class",
               f"{t.default_class} is above the tenant's max_class {t.max_class}")
        # admit.lua's bounds on tenant_rate and tenant_burst (= rate_tokens_s x burst_s)
        _check(MIN_TENANT_QUOTA <= t.rate_tokens_s <= 1e12, f"{p}.rate_tokens_s", "must be in [1e-09, 1e12]")
        _check(0 < t.burst_s <= 3600, f"{p}.burst_s", "must be in (0, 3600]")
        _check(MIN_TENANT_QUOTA <= t.rate_tokens_s * t.burst_s <= MAX_BURST_TOKENS, f"{p}.burst_s",
               f"times rate_tokens_s must be in [1e-09, {MAX_BURST_TOKENS:g}] tokens (its bucket's size)")
        _check(0 <= t.max_inflight <= 1_000_000, f"{p}.max_inflight", "must be in [0, 1000000]")
        _check(1e-3 <= t.weight <= 1e3, f"{p}.weight", "must be in [0.001, 1000]")
        for j, k in enumerate(t.key_sha256):
            kp = f"{p}.key_sha256[{j}]"
            _check(len(k) == 64 and all(ch in "0123456789abcdef" for ch in k), kp,
                   "must be a lowercase sha256 hex digest (64 chars); run `qos config hash-key KEY`")
            _check(k not in all_keys, kp, "the same key is configured twice")
            all_keys.add(k)
    return cfg


def parse(data: Mapping[str, Any], base_dir: str | Path | None = None, *,
          tokenizer_files: bool = True) -> QosConfig:
    """Build and validate a config from a parsed TOML document; relative tokenizer paths are
    taken from ``base_dir`` (the config file's directory)."""
    if "demo" in data:
        # QosConfig.demo marks the built-in demo config (no file); a file saying demo = true
        # had every role announce demo keys it does not hold.
        raise ConfigError("demo", "unknown field (the demo config is what runs when no file is given)")
    cfg = build_section("", QosConfig, data)
    if base_dir is not None:
        def anchored(p: PoolConfig) -> PoolConfig:
            spec = p.tokenizer
            if spec in token_count.MODES or not spec.strip() or token_count.expanded(spec).is_absolute():
                return p
            return dataclasses.replace(p, tokenizer=str(Path(base_dir) / spec))

        pools = tuple(anchored(p) for p in cfg.pools)
        cfg = dataclasses.replace(cfg, pools=pools)
    return validate(cfg, tokenizer_files=tokenizer_files)


def apply_env(cfg: QosConfig, env: Mapping[str, str], *, tokenizer_files: bool = True) -> QosConfig:
    """Deploy-time overrides: QOS_REDIS_URL, QOS_REDIS_CLUSTER (1/0)."""
    redis_cfg = cfg.redis
    if (cl := env.get("QOS_REDIS_CLUSTER")) is not None:
        if cl not in ("0", "1"):
            raise ConfigError("QOS_REDIS_CLUSTER", f"must be 0 or 1, got {cl!r}")
        redis_cfg = dataclasses.replace(redis_cfg, cluster=cl == "1")
    if url := env.get("QOS_REDIS_URL"):
        # not the file's redis.url
        check_redis_url(url, "QOS_REDIS_URL (or --redis-url)", redis_cfg.cluster)
        redis_cfg = dataclasses.replace(redis_cfg, url=url)
    return validate(dataclasses.replace(cfg, redis=redis_cfg), tokenizer_files=tokenizer_files)


def load(path: str | Path | None = None, env: Mapping[str, str] | None = None, *,
         tokenizer_files: bool = True) -> QosConfig:
    """Load the config file (or the demo config when no path is given), then env overrides
    (``tokenizer_files``: :func:`validate`)."""
    env = os.environ if env is None else env
    path = path or env.get("QOS_CONFIG") or None
    if path is None:
        cfg = demo_config()
    else:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(str(path), "file not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(str(path), f"invalid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:  # tomllib's answer to bytes that are not UTF-8
            raise ConfigError(str(path), f"not UTF-8 text: {exc}") from exc
        except OSError as exc:  # a directory, no permission, ...
            raise ConfigError(str(path), f"cannot read it: {exc.strerror or exc}") from exc
        cfg = parse(data, Path(path).resolve().parent, tokenizer_files=tokenizer_files)
    return apply_env(cfg, env, tokenizer_files=tokenizer_files)


DEFAULT_CLASSES = (
    ClassConfig(name="P0", share=0.60, ceil_share=1.0, floor=0.0, max_wait_ms=2_000,
                admission_wait_ms=200, slo_ttft_ms=500, slo_tpot_ms=50),
    ClassConfig(name="P1", share=0.35, ceil_share=1.0, floor=0.30, max_wait_ms=10_000,
                admission_wait_ms=500, slo_ttft_ms=2_000, slo_tpot_ms=150),
    ClassConfig(name="P2", share=0.05, ceil_share=1.0, floor=0.05, max_wait_ms=60_000,
                admission_wait_ms=1_000),
)


def demo_config() -> QosConfig:
    """The documented demo deployment: one pool 'tiny', keys demo-p0/p1/p2 and demo-admin."""
    tenants = [
        TenantConfig(name=f"demo-{cls.lower()}", key_sha256=(hash_key(key),), default_class=cls,
                     max_class=cls, rate_tokens_s=1e9)
        for key, cls in DEMO_KEYS.items()
    ]
    tenants.append(TenantConfig(name="demo-admin", key_sha256=(hash_key(DEMO_ADMIN_KEY),),
                                default_class="P0", max_class="P0", admin=True))
    # context 16384 = the tiny torch model's max_seq_len; the sim engine takes it too.
    return validate(QosConfig(classes=DEFAULT_CLASSES, pools=(PoolConfig(name="tiny", context_tokens=16384),),
                              tenants=tuple(tenants), demo=True))
