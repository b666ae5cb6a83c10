"""A whole stack of real processes for the fault, soak and security suites, and the ledger.

:class:`LiveStack` starts ``qos frontend``, ``qos worker --engine sim`` and ``qos controller``
as OS processes (``python -m limiter.cli ...``, each dying with the test process) against a
private ``redis-server``, each frontend on its own port so a test knows which clients a
killed frontend had. :func:`call` is one client request that always ends in exactly one
:class:`Outcome` (an answer, an error that says why, a transport error, or ``hang`` when it
outlived its timeout). The ledger checks then hold the stack to "nothing admitted is lost":

* client side (:func:`check_outcomes`): every request ended once, answers are complete and
  coherent (the sim engine's text is a pure function of position, so a resumed stream must
  equal an uninterrupted one), every error names its code, 429/503 carry ``Retry-After``;
* Redis side (:class:`Recorder`, :func:`server_ledger`): every admitted request id reached
  exactly one terminal state (one latency sample each, stats counters balanced), and what
  each one was charged in the end (``cost - refund + overrun``) is exactly what it used;
* afterwards (:func:`wait_clean`): no per-request key (``req:``, ``gen:``) left once the
  record TTL passed, every index empty, every bucket back to full, and every key that is not
  one of the pool's fixed keys carries a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack

from limiter import lifecycle
from limiter.config import hash_key
from limiter.keys import PoolKeys, policy_text
from limiter.localstack.launcher import Child, module_argv
from limiter.localstack.sse import sse_chunks
from limiter.localstack.toml_writer import toml_dumps
from tests.support.helpers import charge_of
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = b"simulated output "  # worker/engines/sim.py: token = PLACEHOLDER[position % 17]
TERMINAL = ("done", "failed", "expired", "cancelled")
KEY_P0, KEY_P1, KEY_P2 = "rel-key-p0", "rel-key-p1", "rel-key-p2"


# --- config -----------------------------------------------------------------------------------


def base_config(
    redis_url: str,
    *,
    pools: Iterable[str] = ("tiny",),
    cluster: bool = False,
    lease_ms: int = 1000,
    record_ttl_s: int = 3,
    frontend_ttl_ms: int = 1500,
    max_attempts: int = 10,
    capacity: float = 1e6,
    queue_cap: int = 10_000,
    max_wait_ms: int = 60_000,
    tenant_rate: float = 1e9,
    max_inflight: int = 0,
    classes: dict[str, dict[str, Any]] | None = None,
    frontend: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    controller: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config with short leases and TTLs (faults resolve in seconds), three tenants (one per
    class key) and fast heartbeats. Capacity defaults to "no rate limit"; the soak sets it."""
    cls = []
    for name, share, slo in (
        ("P0", 0.6, {"slo_ttft_ms": 2000, "slo_tpot_ms": 200}),
        ("P1", 0.35, {"slo_ttft_ms": 5000}),
        ("P2", 0.05, {}),
    ):
        c = {
            "name": name,
            "share": share,
            "max_wait_ms": max_wait_ms,
            "admission_wait_ms": 0,
            "queue_cap": queue_cap,
            **slo,
        }
        c.update((classes or {}).get(name, {}))
        cls.append(c)
    tenants = [
        {
            "name": f"t-{c.lower()}",
            "key_sha256": [hash_key(k)],
            "default_class": c,
            "max_class": c,
            "rate_tokens_s": tenant_rate,
            "burst_s": 1.0,
            "max_inflight": max_inflight,
        }
        for c, k in (("P0", KEY_P0), ("P1", KEY_P1), ("P2", KEY_P2))
    ]
    return {
        "redis": {"url": redis_url, "cluster": cluster},
        "classes": cls,
        "pools": [
            {
                "name": p,
                "context_tokens": 4096,
                "default_max_tokens": 64,
                "capacity_tokens_s": capacity,
                "lease_ms": lease_ms,
                "max_attempts": max_attempts,
                "frontend_ttl_ms": frontend_ttl_ms,
                "record_ttl_s": record_ttl_s,
            }
            for p in pools
        ],
        "tenants": tenants,
        "frontend": {"heartbeat_s": 0.25, "request_timeout_s": 60, "shutdown_grace_s": 2, **(frontend or {})},
        "worker": {
            "heartbeat_s": 0.25,
            "idle_block_s": 0.25,
            "reap_interval_s": 0.5,
            "drain_timeout_s": 5,
            **(worker or {}),
        },
        "controller": {"lease_s": 1.0, "renew_s": 0.2, "tick_s": 0.2, "block_s": 0.2, **(controller or {})},
    }


# --- processes --------------------------------------------------------------------------------


class LiveStack:
    """Frontends, sim workers and controllers as real processes sharing one config file."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.tmp = tmp
        self.config = config
        self.path = tmp / "qos.toml"
        self.path.write_text(toml_dumps(config))
        self.procs: dict[str, Child] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        self.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def _cmd(self, role: str, *args: str) -> list[str]:
        level = os.environ.get("QOS_REL_LOG_LEVEL", "WARNING")  # INFO to debug a failing run
        return module_argv(role, self.path, "--log-level", level, *args)

    def _role(self, name: str, role: str, *args: str, port: int = 0, pass_fds: tuple[int, ...] = ()) -> Child:
        """Start one role process, its output to ``<name>.log`` (kept for a failing test's
        report); SIGKILLed when the test process dies, even if pytest itself is killed."""
        assert name not in self.procs, name
        child = Child(name, role, self._cmd(role, *args), log=self.tmp / f"{name}.log", port=port)
        self.procs[name] = child.launch(self.env, death_signal=signal.SIGKILL, cwd=ROOT, pass_fds=pass_fds)
        return child

    def frontend(self, name: str) -> Child:
        """A frontend serving a socket bound here on a port the kernel picks, which it
        inherits: no other process can take that port between its choice and the bind (with
        free_port() and --port, an outgoing connection of any process could, and the
        frontend died at start)."""
        sock = lifecycle.listen_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        try:
            return self._role(name, "frontend", "--port", str(port), "--listen-fd", str(sock.fileno()),
                              port=port, pass_fds=(sock.fileno(),))
        finally:
            sock.close()  # the child holds its own copy: the socket closes when the child exits

    def worker(
        self,
        name: str,
        *,
        pool: str | None = None,
        time_scale: float = 1.0,
        max_seqs: int | None = None,  # None: the worker's default
        extra: Iterable[str] = (),
    ) -> Child:
        pool = pool or self.config["pools"][0]["name"]
        batch = ["--max-seqs", str(max_seqs)] if max_seqs is not None else []
        return self._role(name, "worker", "--engine", "sim", "--worker-id", name, "--pool", pool,
                          "--time-scale", str(time_scale), *batch, *extra)

    def controller(self, name: str) -> Child:
        port = free_port()
        return self._role(name, "controller", "--id", name, "--metrics-port", str(port),
                          "--metrics-host", "127.0.0.1", port=port)

    def of(self, role: str) -> list[Child]:
        return [p for p in self.procs.values() if p.role == role]

    def base(self, name: str) -> str:
        return self.procs[name].url()

    async def wait_ready(self, client: Any, timeout: float = 60.0) -> None:
        """Every frontend's /readyz is 200 and every live worker has sent a heartbeat."""
        deadline = time.monotonic() + timeout
        pools = [PoolKeys(p["name"]) for p in self.config["pools"]]
        async with aiohttp.ClientSession() as s:
            while True:
                dead = [
                    p
                    for p in self.procs.values()
                    if p.proc is not None
                    and p.proc.poll() is not None
                    and p.proc.returncode not in (-signal.SIGKILL,)
                ]
                assert not dead, "\n".join(
                    f"{p.name} exited {p.proc.returncode}:\n{p.tail()}" for p in dead if p.proc is not None
                )
                assert time.monotonic() < deadline, "stack not ready: " + ", ".join(
                    f"{p.name}: {p.tail(5)}" for p in self.procs.values()
                )
                ok = True
                for fe in self.of("frontend"):
                    if not fe.running:
                        continue
                    ok = ok and await self._every_pool_set_up(s, fe)
                if ok:
                    seen: set[str] = set()
                    for k in pools:
                        seen |= {m.decode() for m in await client.zrange(k.workers, 0, -1)}
                    ok = all(w.name in seen for w in self.of("worker") if w.running)
                if ok:
                    return
                await asyncio.sleep(0.1)

    @staticmethod
    async def _every_pool_set_up(s: aiohttp.ClientSession, fe: Child) -> bool:
        """/readyz is 200 with no pool waiting for its set-up: a frontend serves once one pool
        is set up, and leaves a pool whose set-up ends more than START_OTHERS_S after the
        first (a loaded machine) to its heartbeat loop."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with s.get(fe.url("/readyz"), timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                degraded = (await r.json()).get("degraded", {})
                return r.status == 200 and not any("not set up yet" in why for why in degraded.values())
        return False

    async def frontend_ids(self) -> dict[str, str]:
        """Frontend process name -> its frontend id (the ``frontend`` field of request records)."""
        out = {}
        async with aiohttp.ClientSession() as s:
            for fe in self.of("frontend"):
                if fe.running:
                    async with s.get(fe.url("/healthz")) as r:
                        out[fe.name] = (await r.json())["frontend"]
        return out

    def stop(self) -> None:
        """SIGTERM everything (workers first: they drain), then make sure nothing is left."""
        order = self.of("worker") + self.of("controller") + self.of("frontend")
        for p in order:
            p.send_signal(signal.SIGTERM)
        for p in order:
            p.stop(timeout_s=10)


# --- one client request -----------------------------------------------------------------------


@dataclass
class Outcome:
    """How one client request ended, as the client saw it."""

    cid: str
    via: str  # frontend name
    kind: str = "hang"  # ok | http_error | stream_error | transport | hang
    status: int = 0
    code: str = ""
    message: str = ""
    retry_after: str | None = None
    request_id: str = ""
    text: str = ""
    usage_in: int = 0
    usage_out: int = 0
    finish: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    seconds: float = 0.0


def expected_sim_text(prompt_tokens: int, n: int) -> str:
    """The sim engine's output for a prompt of ``prompt_tokens`` tokens: position-keyed bytes."""
    return bytes(PLACEHOLDER[(prompt_tokens + i) % len(PLACEHOLDER)] for i in range(n)).decode()


async def call(
    session: aiohttp.ClientSession,
    base: str,
    via: str,
    key: str,
    cid: str,
    *,
    prompt_tokens: int = 40,
    max_tokens: int = 32,
    stream: bool = True,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
    model: str = "tiny",
) -> Outcome:
    """POST /v1/completions with the client id in the prompt; never raises, never hangs."""
    prompt = f"[{cid}] " + "x" * max(0, prompt_tokens - 4 - len(cid))
    prompt_tokens = len(prompt.encode()) + 1
    out = Outcome(cid, via, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                f"{base}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}", **(headers or {})},
            ) as r:
                out.status = r.status
                out.request_id = r.headers.get("X-QoS-Request-Id", "")
                out.retry_after = r.headers.get("Retry-After")
                if r.status != 200:
                    try:
                        err = (await r.json())["error"]
                        out.code, out.message = err.get("code") or "", err.get("message") or ""
                    except (aiohttp.ContentTypeError, json.JSONDecodeError, KeyError, TypeError):
                        out.code = f"http_{r.status}"
                    out.kind = "http_error"
                elif not stream:
                    data = await r.json()
                    out.text = data["choices"][0]["text"]
                    out.finish = data["choices"][0]["finish_reason"] or ""
                    out.usage_in = data["usage"]["prompt_tokens"]
                    out.usage_out = data["usage"]["completion_tokens"]
                    out.kind = "ok"
                else:
                    await _read_stream(r, out)
    except TimeoutError:
        out.kind = "hang"
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind = "transport"
        out.code = type(exc).__name__
    out.seconds = time.monotonic() - t0
    return out


async def _read_stream(r: aiohttp.ClientResponse, out: Outcome) -> None:
    done = False
    async for chunk in sse_chunks(r.content):
        if chunk is None:
            done = True
            break
        if chunk.get("error"):
            out.kind = "stream_error"
            out.code = chunk["error"].get("code") or "stream_error"
            out.message = chunk["error"].get("message") or ""
            return
        for choice in chunk.get("choices") or ():
            out.text += choice.get("text") or ""
            out.finish = choice.get("finish_reason") or out.finish
        if usage := chunk.get("usage"):
            out.usage_in, out.usage_out = usage["prompt_tokens"], usage["completion_tokens"]
    # A stream that ends without [DONE] and without an error event is a silent drop.
    out.kind = "ok" if done else "transport"
    if not done:
        out.code = "stream_ended_without_done"


# --- the ledger -------------------------------------------------------------------------------


@dataclass
class Report:
    """What a fault run measured (printed by the tests, quoted in docs/reliability.md)."""

    sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    admitted: int = 0
    samples: int = 0
    duplicates: int = 0

    @property
    def lost(self) -> int:
        """Admitted requests that never reached a terminal state, plus clients left hanging."""
        return self.admitted - self.samples + self.kinds["hang"]

    def client_line(self) -> str:
        k = ", ".join(f"{n} {c}" for c, n in sorted(self.kinds.items()))
        codes = ", ".join(f"{c}={n}" for c, n in sorted(self.codes.items()))
        return f"sent {self.sent} ({k}); errors by code: {codes or 'none'}"

    def line(self) -> str:
        return (
            f"{self.client_line()}; admitted {self.admitted}, terminal samples {self.samples}, "
            f"lost {self.lost}, ended twice {self.duplicates}"
        )


def check_outcomes(
    outcomes: list[Outcome],
    *,
    transport_ok_via: Iterable[str] = (),
    allowed_codes: Iterable[str] | None = None,
    rec: Recorder | None = None,
) -> Report:
    """Client side of the ledger: each request ended exactly once, coherently, or said why.

    ``transport_ok_via``: frontends that were killed (their clients lose the connection).
    ``allowed_codes``: error codes acceptable in this run (None = any code, but one is needed)."""
    rep = Report(sent=len(outcomes))
    assert len({o.cid for o in outcomes}) == len(outcomes), "client ids must be unique"
    killed = set(transport_ok_via)
    allowed = None if allowed_codes is None else set(allowed_codes)
    for o in outcomes:
        rep.kinds[o.kind] += 1
        why = rec.history(o.cid) if rec else ""
        assert o.kind != "hang", f"{o.cid} via {o.via}: no answer within {o.seconds:.1f} s {why}"
        if o.kind == "transport":
            assert o.via in killed, f"{o.cid} via {o.via}: connection lost ({o.code}), frontend alive {why}"
            continue
        if o.kind == "ok":
            assert o.usage_in == o.prompt_tokens, (o.cid, o.usage_in, o.prompt_tokens)
            assert o.usage_out == len(o.text.encode()), (o.cid, o.usage_out, len(o.text))
            assert o.text == expected_sim_text(o.prompt_tokens, o.usage_out), f"{o.cid}: incoherent text"
            assert o.finish in ("stop", "length") and (o.finish != "length" or o.usage_out == o.max_tokens), o
            continue
        rep.codes[o.code] += 1
        assert o.code, f"{o.cid}: an error without a code: {o}"
        assert o.message, f"{o.cid}: an error without a message: {o}"
        if allowed is not None:
            assert o.code in allowed, f"{o.cid} via {o.via}: unexpected error {o.code}: {o.message}"
        if o.kind == "http_error" and o.status in (429, 503):
            assert o.retry_after and int(o.retry_after) >= 1, f"{o.cid}: {o.status} without Retry-After"
    return rep


class Recorder:
    """Snapshots every request record of a pool while a run goes on (records expire after
    ``record_ttl_s``; the scan period is well below it), so the charge ledger can be checked
    after the keys are gone."""

    FIELDS = (
        "state",
        "ended",
        "class",
        "tenant",
        "cost",
        "refund",
        "input_tokens",
        "max_tokens",
        "out_tokens",
        "usage_in",
        "usage_out",
        "attempts",
        "claimed_ms",
        "reason",
        "w_in",
        "w_out",
        "worker",
        "frontend",
        "enq_ms",
        "finished_ms",
        "lease_ms",
        "cancel",
    )

    def __init__(self, client: Any, pools: Iterable[str], period_s: float = 0.5) -> None:
        self.client = client
        self.pools = [PoolKeys(p) for p in pools]
        self.period_s = period_s
        self.records: dict[str, dict[str, str]] = {}  # request id -> last snapshot
        self.latest: dict[str, dict[str, str]] = {}  # request id -> last snapshot, any state
        self.max_gap_s = 0.0  # longest time between two completed scans: must stay below the TTL
        self._last_scan = 0.0
        self.failed_scans: list[str] = []  # what each scan that raised raised (for a failing test's message)
        self.cid_of: dict[str, str] = {}  # request id -> client id (from the prompt in the payload)
        self._task: asyncio.Task[None] | None = None
        self._stop = False

    async def __aenter__(self) -> Recorder:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task:
            await self._task

    async def _run(self) -> None:
        while not self._stop:
            try:
                await self.scan()
            except Exception as e:  # Redis restarts are part of some runs
                self.failed_scans.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(self.period_s)

    async def scan(self) -> None:
        for keys in self.pools:
            ids = [k async for k in self.client.scan_iter(match=keys.request_prefix + "*", count=1000)]
            if not ids:
                continue
            pipe = self.client.pipeline(transaction=False)
            for k in ids:
                pipe.hmget(k, self.FIELDS)
            new: list[tuple[str, Any]] = []
            for k, vals in zip(ids, await pipe.execute(), strict=True):
                rid = (k.decode() if isinstance(k, bytes) else k)[len(keys.request_prefix) :]
                rec = {
                    f: (v.decode() if isinstance(v, bytes) else v)
                    for f, v in zip(self.FIELDS, vals, strict=True)
                }
                if rec["state"] is None:
                    continue
                if rid not in self.cid_of:
                    new.append((rid, k))
                self.latest[rid] = rec
                if rec["state"] in TERMINAL:
                    self.records[rid] = rec
            if new:
                pipe = self.client.pipeline(transaction=False)
                for _, k in new:
                    pipe.hget(k, "payload")
                for (rid, _), raw in zip(new, await pipe.execute(), strict=True):
                    self.cid_of[rid] = _cid(raw)
        now = time.monotonic()
        if self._last_scan:
            self.max_gap_s = max(self.max_gap_s, now - self._last_scan)
        self._last_scan = now

    def history(self, cid: str) -> list[tuple[str, dict[str, str]]]:
        """What Redis recorded for a client id (for a failing test's message)."""
        return [(rid, self.latest[rid]) for rid, c in self.cid_of.items() if c == cid]


def _cid(payload: bytes | None) -> str:
    """The client id a request's prompt starts with (``[<cid>] ...``), from its payload."""
    with contextlib.suppress(Exception):
        prompt = msgpack.unpackb(payload, raw=False)["prompt"]
        return prompt[1 : prompt.index("]")]
    return ""


def check_charges(records: dict[str, dict[str, str]]) -> dict[str, int]:
    """Every finished request was charged exactly what it used (helpers.charge_of)."""
    states: Counter[str] = Counter()
    for rid, r in records.items():
        states[r["state"]] += 1
        charged = float(r["cost"]) - float(r["refund"] or 0) + float(r.get("overrun") or 0)
        assert math.isclose(charged, charge_of(r), abs_tol=1e-6), (rid, r, charge_of(r))
    return dict(states)


async def samples_by_id(client: Any, pool: str, rejected: bool = False) -> dict[str, list[str]]:
    """Request id -> the outcomes of its latency samples (one per terminal state reached).

    A frontend's ``rejected`` samples (requests turned away at admission, never admitted)
    are left out unless ``rejected``."""
    keys = PoolKeys(pool)
    seen: dict[str, list[str]] = {}
    last = "-"
    while True:
        batch = await client.xrange(keys.samples, min=last, max="+", count=5000)
        if last != "-":
            batch = batch[1:]
        if not batch:
            return seen
        for _eid, f in batch:
            s = msgpack.unpackb(f[b"d"], raw=False)
            if s["outcome"] != "rejected" or rejected:
                seen.setdefault(s["request_id"], []).append(s["outcome"])
        last = batch[-1][0].decode()


async def sample_ids(client: Any, pool: str) -> Counter[str]:
    """Request id -> number of latency samples (terminal outcomes) in the pool's stream."""
    return Counter({rid: len(v) for rid, v in (await samples_by_id(client, pool)).items()})


async def server_ledger(client: Any, pools: Iterable[str]) -> tuple[int, int, dict[str, Counter[str]]]:
    """Exactly one terminal sample per admitted request id, and balanced counters.

    Returns (admitted, samples, outcome counts per pool); asserts nothing is in flight."""
    admitted = 0
    n_samples = 0
    outcomes: dict[str, Counter[str]] = {}
    for pool in pools:
        keys = PoolKeys(pool)
        everything = await samples_by_id(client, pool, rejected=True)
        by_id = {rid: [o for o in v if o != "rejected"] for rid, v in everything.items()}
        turned_away = [rid for rid, v in everything.items() if "rejected" in v]
        both = [rid for rid in turned_away if by_id[rid] or len(everything[rid]) > 1]
        assert not both, f"{pool}: requests both turned away and admitted (or turned away twice): {both[:5]}"
        by_id = {rid: v for rid, v in by_id.items() if v}
        seen = Counter({rid: len(v) for rid, v in by_id.items()})
        per_outcome = Counter(o for v in everything.values() for o in v)
        twice = [rid for rid, n in seen.items() if n > 1]
        assert not twice, f"{pool}: requests ended more than once: {twice[:5]}"
        stats = {k.decode(): int(v) for k, v in (await client.hgetall(keys.stats)).items() if k != b"seq"}
        adm = sum(v for k, v in stats.items() if k.endswith(".admitted"))
        ended = sum(v for k, v in stats.items() if k.rsplit(".", 1)[-1] in TERMINAL)
        assert adm == ended == len(seen), f"{pool}: {adm} admitted, {ended} ended, {len(seen)} samples"
        admitted += adm
        n_samples += len(seen)
        outcomes[pool] = per_outcome
    return admitted, n_samples, outcomes


FIXED = (
    "policy",
    "deadlines",
    "leases",
    "cancels",
    "served",
    "wake",
    "inflight",
    "tenant_inflight",
    "stats",
    "samples",
    "decisions",
    "leader",
    "fence",
    "frontends",
    "workers",
    "worker_kv",
    "queued",
)
EMPTY_AFTER = ("deadlines", "leases", "cancels", "inflight", "tenant_inflight")


async def pool_keys_in_redis(client: Any, pool: str) -> AsyncIterator[tuple[str, str]]:
    """Every key of ``pool`` in Redis, as (key, the part after the pool's ``qos:{pool}:``)."""
    keys = PoolKeys(pool)
    async for raw in client.scan_iter(match=keys.pattern(), count=1000):
        k = raw.decode() if isinstance(raw, bytes) else raw
        yield k, k[len(keys.base) :]


async def leftovers(client: Any, pool: str) -> list[str]:
    """Keys of ``pool`` that should not exist once every request ended and its TTL passed."""
    out = []
    async for k, rest in pool_keys_in_redis(client, pool):
        per_request = rest.startswith(("req:", "gen:", "backlog:"))
        if per_request or (rest.startswith("queue:") and await client.zcard(k)):
            out.append(k)
        elif rest == "queued" and any(float(v) for v in (await client.hgetall(k)).values()):
            out.append(k)
        elif rest in EMPTY_AFTER and await client.exists(k):
            out.append(k)
    return out


async def untimed_keys(client: Any, pool: str) -> list[str]:
    """Keys that are neither one of the pool's fixed keys nor set to expire (a leak)."""
    out = []
    async for k, rest in pool_keys_in_redis(client, pool):
        # per tenant or class, so bounded by the config: buckets and idle tenants' counters
        if rest in FIXED or rest.startswith(("bucket:", "queue:", "vtime:")) or rest == "compliance":
            continue
        if await client.pttl(k) < 0:
            out.append(k)
    return out


async def wait_clean(client: Any, pools: Iterable[str], timeout: float = 30.0) -> float:
    """Wait until no per-request key and no in-flight index entry is left; returns the wait."""
    t0 = time.monotonic()
    pools = list(pools)
    while True:
        left = [k for p in pools for k in await leftovers(client, p)]
        if not left:
            untimed = [k for p in pools for k in await untimed_keys(client, p)]
            assert not untimed, f"keys that never expire: {untimed}"
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"still there after {timeout} s: {left[:10]} ({len(left)})"
        await asyncio.sleep(0.25)


async def buckets_full(client: Any, pool: str) -> dict[str, float]:
    """Each class and ceiling bucket's level now (refilled as the scripts compute it), as a
    share of its burst; debt left by a missing refund would keep a bucket below 1."""
    keys = PoolKeys(pool)
    pol = policy_text(await client.hgetall(keys.policy))
    sec, usec = await client.time()
    now = int(sec) * 1000 + int(usec) // 1000
    levels = {}
    specs = []
    for c in pol["classes"].split(","):
        specs.append((keys.class_bucket(c), float(pol[f"{c}.rate"]), float(pol[f"{c}.burst"])))
        ceil = keys.ceil_bucket(c)
        specs.append((ceil, float(pol[f"{c}.ceil"]), float(pol[f"{c}.ceil_burst"])))
    for key, rate, burst in specs:
        raw = await client.hmget(key, ["tokens", "ts"])
        if raw[0] is None or burst <= 0:
            continue
        level = min(burst, float(raw[0]) + rate * max(0, now - int(raw[1])) / 1000)
        levels[key] = (level / burst, (burst - level) / rate if rate > 0 else math.inf)
    return levels


async def wait_buckets_full(client: Any, pool: str, cap_s: float = 30.0) -> float:
    """Wait until every bucket of ``pool`` is full again; returns the wait.

    A bucket in debt refills at its *current* rate, so after a controller cut a rate the
    debt charged under the old (larger) burst takes a while; the wait allowed is what the
    rates say it takes, plus slack. A refund gone missing would not keep a bucket down for
    ever (buckets always refill), which is why :func:`check_charges` checks each request."""
    t0 = time.monotonic()
    eta = None
    while True:
        levels = await buckets_full(client, pool)
        low = {k: v for k, v in levels.items() if v[0] < 0.999}
        if not low:
            return time.monotonic() - t0
        if eta is None:
            eta = max(v[1] for v in low.values())
        assert time.monotonic() - t0 < min(cap_s, eta + 2.0), f"buckets not refilling: {low}"
        await asyncio.sleep(0.2)


# --- load -------------------------------------------------------------------------------------


@dataclass
class Load:
    """A closed-loop load: ``n`` requests, at most ``concurrency`` at once, spread round-robin
    over ``via`` (frontend names); every request gets a unique client id."""

    n: int
    concurrency: int
    max_tokens: tuple[int, int] = (16, 64)
    prompt_tokens: tuple[int, int] = (20, 200)
    stream_share: float = 0.7
    timeout_s: float = 60.0
    keys: tuple[str, ...] = (KEY_P0, KEY_P1, KEY_P2)
    models: tuple[str, ...] = ("tiny",)
    tag: str = "c"
    backoff_cap_s: float = 1.0  # after a 429/503 a slot waits Retry-After (capped) as SDKs do


async def drive(
    stack: LiveStack, via: list[str], load: Load, seed: int = 1, on_progress: Any = None
) -> list[Outcome]:
    """Run ``load`` against the named frontends; returns one Outcome per request.

    ``via`` is read at each request, so a test may append a replacement frontend to it."""
    import random

    rng = random.Random(seed)
    sem = asyncio.Semaphore(load.concurrency)
    outcomes: list[Outcome] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(i: int) -> None:
            kw = {
                "prompt_tokens": rng.randint(*load.prompt_tokens),
                "max_tokens": rng.randint(*load.max_tokens),
                "stream": rng.random() < load.stream_share,
                "timeout_s": load.timeout_s,
                "model": load.models[i % len(load.models)],
            }
            key = load.keys[i % len(load.keys)]
            async with sem:
                # As a load balancer would: skip a frontend whose process is gone.
                names = [via[(i + k) % len(via)] for k in range(len(via))]
                name = next((n for n in names if stack.procs[n].running), names[0])
                o = await call(session, stack.base(name), name, key, f"{load.tag}{i}", **kw)
                if o.retry_after and o.status in (429, 503):
                    await asyncio.sleep(min(load.backoff_cap_s, float(o.retry_after)))
            outcomes.append(o)
            if on_progress is not None:
                on_progress(len(outcomes))

        await asyncio.gather(*(one(i) for i in range(load.n)))
    return outcomes
