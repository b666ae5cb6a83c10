"""Shared pieces of the worker tests: a tiny client (admit + read the reply stream), config
files, in-process workers and worker subprocesses. Everything runs on the tests' private
redis-server; nothing touches a shared instance."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from limiter.config import QosConfig
from limiter.config import load as load_config
from limiter.frontend.replies import replies_of
from limiter.keys import PoolKeys
from limiter.localstack import launcher
from limiter.localstack.launcher import module_argv, spawn
from limiter.localstack.toml_writer import write_toml
from limiter.prompt import Payload, count_tokens
from limiter.reply_text import unpack
from limiter.scripts import Scripts, policy_document, unpack_token_ids
from tests.support.frontend_helpers import frontend
from tests.support.helpers import three_classes
from worker.engines.base import Engine
from worker.engines.sim import PLACEHOLDER
from worker.main import build_worker, run_worker
from worker.runtime import WorkerRuntime
from worker.settings import load_settings

if TYPE_CHECKING:
    from tests.support.fake_upstream import FakeUpstream

ROOT = Path(__file__).resolve().parents[2]
FE = "fe1"
_ids = itertools.count(1)


def write_config(path: Path, redis_url: str, *, lease_ms: int = 10000, worker: dict[str, Any] | None = None,
                 classes: dict[str, dict[str, Any]] | None = None) -> Path:
    """Pool "tiny" (no rate limit) and classes that wait up to a minute; ``worker``: [worker]
    settings; ``classes``: more fields of some classes (``{"P2": {"floor": 0.05}}``)."""
    return write_toml({
        "redis": {"url": redis_url},
        "classes": three_classes(**{c: {"max_wait_ms": 60000, **(classes or {}).get(c, {})}
                                    for c in ("P0", "P1", "P2")}),
        "pools": [{"name": "tiny", "lease_ms": lease_ms, "max_attempts": 5, "capacity_tokens_s": 1e9}],
        "worker": dict(worker or {}),
    }, path)


@dataclass
class Answer:
    """One request as the client saw it on the reply stream."""

    wire: str = ""  # the entries' texts as pushed (limiter/reply_text.py: marks and all)
    tokens: int = 0  # sum of counts delivered
    offsets: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    times_ms: list[int] = field(default_factory=list)  # stream entry ids' ms (Redis clock)
    done: dict[str, str] | None = None
    error: dict[str, str] | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    @property
    def text(self) -> str:
        """The answer's text, as the frontend unpacks it (a NUL the model wrote is one NUL)."""
        return unpack(self.wire).content

    @property
    def reasoning(self) -> str:
        return unpack(self.wire).reasoning


class Client:
    """Admits with Scripts.admit (frontend 'fe1', alive) and reassembles the reply stream."""

    def __init__(self, client: Any, cfg: QosConfig, pool: str = "tiny") -> None:
        self.client = client
        self.cfg = cfg
        self.keys = PoolKeys(pool)
        self.scripts = Scripts(client)
        self.answers: dict[str, Answer] = {}
        self.entries = 0
        self._last = "0-0"

    async def setup(self) -> None:
        await self.scripts.init_pool(self.keys, policy_document(self.cfg, self.cfg.pool(self.keys.pool)))
        await self.client.zadd(self.keys.frontends, {FE: 4102444800000})

    async def admit(self, prompt: str, *, cls: str = "P1", max_tokens: int = 32, temperature: float = 0.0,
                    seed: int | None = 1, stop: tuple[str, ...] = (), rid: str | None = None,
                    kind: str = "completion", **extra: Any) -> str:
        """``extra``: more Payload fields (ignore_eos, min_tokens, messages; grouped_tokens=False
        for a frontend of an older release, which reads one entry per token batch)."""
        rid = rid or f"r{next(_ids)}"
        extra.setdefault("grouped_tokens", True)  # as this release's frontend
        payload = Payload(kind, prompt, max_tokens, temperature=temperature, stop=stop, seed=seed, **extra)
        await self.scripts.admit(self.keys, request_id=rid, tenant="t1", cls=cls,
                                 input_tokens=count_tokens(prompt), max_tokens=max_tokens, tenant_rate=1e9,
                                 tenant_burst=1e9, tenant_max_inflight=0, max_wait_ms=0, frontend_id=FE,
                                 payload=payload.pack())
        self.answers[rid] = Answer()
        return rid

    async def read(self, block_ms: int = 100) -> None:
        resp = await self.client.xread({self.keys.reply(FE): self._last}, block=block_ms)
        for _stream, entries in resp or []:
            for eid, f in entries:
                self._last = eid.decode()
                self.entries += 1
                for rid, r in replies_of(f):  # one per request of a grouped entry
                    a = self.answers.setdefault(rid, Answer())
                    if r.kind in ("tok", "done"):
                        if r.count:
                            a.offsets.append(r.offset)
                            a.attempts.append(r.attempt)
                            a.times_ms.append(int(self._last.split("-")[0]))
                        assert not r.count or r.offset == a.tokens, f"{rid}: {r.offset} after {a.tokens}"
                        a.tokens += r.count
                        a.wire += r.text
                        if r.kind == "done":
                            a.done = {k.decode(): v.decode() for k, v in f.items()}
                    else:
                        a.error = {k.decode(): v.decode() for k, v in f.items()}

    async def wait(self, ids: list[str] | None = None, timeout: float = 30.0) -> None:
        ids = list(self.answers) if ids is None else ids
        deadline = time.monotonic() + timeout
        while not all(self.answers[r].finished for r in ids):
            left = {r: self.answers[r] for r in ids if not self.answers[r].finished}
            assert time.monotonic() < deadline, left
            await self.read()

    async def wait_tokens(self, rid: str, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.answers[rid].tokens < n and not self.answers[rid].finished:
            assert time.monotonic() < deadline, f"{rid}: only {self.answers[rid].tokens} tokens"
            await self.read()

    async def record(self, rid: str) -> dict[str, str]:
        raw = await self.client.hgetall(self.keys.request(rid))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}

    async def generated(self, rid: str) -> list[int]:
        return unpack_token_ids(await self.client.get(self.keys.tokens(rid)) or b"")

    async def samples(self) -> list[dict[str, Any]]:
        out = []
        for _id, f in await self.client.xrange(self.keys.samples):
            out.append(msgpack.unpackb(f[b"d"], raw=False))
        return out


async def start_worker(cfg: QosConfig, engine_obj: Engine | None = None, **settings: Any
                       ) -> tuple[WorkerRuntime, Any, asyncio.Task[int]]:
    """An in-process worker (the real runtime and loop) running as a task: its runtime, its
    loop and the task. The task has not run yet: the runtime may be patched before the
    caller's next await."""
    s = load_settings(cfg, {"pool": "tiny", "heartbeat_s": 0.2, "idle_block_s": 0.2, **settings})
    rt, loop = build_worker(s, cfg, engine_obj)
    return rt, loop, asyncio.create_task(run_worker(rt, loop))


async def drained_now(rt: WorkerRuntime, task: asyncio.Task[int]) -> None:
    """A SIGTERM with its deadline at once (what remains is handed back); the worker must
    exit 0 within 30 s."""
    rt.begin_drain("test")
    rt.drain_deadline = time.monotonic()
    assert await asyncio.wait_for(task, 30) == 0


async def stop_worker(rt: WorkerRuntime, task: asyncio.Task[int]) -> BaseException | None:
    """Drain now; returns what the worker task raised (None if it ended cleanly)."""
    rt.begin_drain("test over")
    rt.drain_deadline = time.monotonic()
    try:
        await asyncio.wait_for(task, 30)
    except BaseException as exc:
        return exc
    return None


@contextlib.asynccontextmanager
async def worker(cfg: QosConfig, engine_obj: Engine | None = None, **settings: Any
                 ) -> AsyncIterator[WorkerRuntime]:
    """An in-process worker (the real runtime and loop) for the duration of the block;
    drained on exit (what the worker raised is raised there)."""
    rt, _loop, task = await start_worker(cfg, engine_obj, **settings)
    try:
        yield rt
    finally:
        if (exc := await stop_worker(rt, task)) is not None:
            raise exc


async def blocked_on_the_wake_list(c: Client, timeout: float = 30.0, name: str | None = None) -> None:
    """Until a client of this Redis is blocked in BLPOP: an idle worker waiting for work
    (``name``: the connection of that CLIENT SETNAME, not another test's left blocked on the
    same server)."""
    deadline = time.monotonic() + timeout
    while not any(x.get("cmd") == "blpop" and "b" in x.get("flags", "")
                  and (name is None or x.get("name") == name)
                  for x in await c.client.client_list()):
        assert time.monotonic() < deadline, f"no worker blocked on the wake list after {timeout} s"
        await asyncio.sleep(0.01)


async def admit_one_at_a_time(c: Client, n: int) -> list[str]:
    """``n`` short requests, each admitted once a worker waits on the wake list (idle) and
    read to its end before the next."""
    ids: list[str] = []
    for i in range(n):
        await blocked_on_the_wake_list(c)
        ids.append(await c.admit(f"one at a time {i}", max_tokens=4))
        await c.wait(ids[-1:], timeout=30)
    return ids


def record_calls(owner: Any, name: str, what: Callable[..., Any]) -> list[Any]:
    """Wraps the coroutine method ``name`` of ``owner``: from now on each call appends
    ``what(*its arguments)`` to the list returned, then runs as before."""
    calls: list[Any] = []
    real = getattr(owner, name)

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(what(*args, **kwargs))
        return await real(*args, **kwargs)

    setattr(owner, name, recorded)
    return calls


def count_claims(rt: WorkerRuntime) -> list[None]:
    """The worker's claim calls from now on, one entry each."""
    return record_calls(rt, "claim", lambda *_, **__: None)


def count_pushes(rt: WorkerRuntime) -> list[list[tuple[int, int]]]:
    """The worker's push_tokens calls from now on: per call, each request's (offset, count)."""
    return record_calls(rt.scripts, "push_tokens_many",
                        lambda keys, worker_id, batches, *_, **__: [(b.offset, b.count) for b in batches])


def config(path: Path, redis_url: str, **kw: Any) -> QosConfig:
    return load_config(write_config(path, redis_url, **kw), env={})


def spawn_worker(config_path: Path, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m limiter.cli worker --config ...`` as a real OS process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("QOS_REDIS_URL", None)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT} if log is None else {}
    return spawn(module_argv("worker", config_path, *args), env, log=log, append=False, cwd=ROOT, **quiet)


def stop_process(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Its exit status; raises (after killing it) when it did not exit within ``timeout``."""
    rc = launcher.stop_process(p, sig, timeout)
    if rc is None:
        raise subprocess.TimeoutExpired(p.args, timeout)
    return rc


def sim_text(prompt: str, start: int, n: int) -> str:
    """What the sim engine emits for a prompt: placeholder bytes keyed on position."""
    pos = count_tokens(prompt)
    return "".join(chr(PLACEHOLDER[(pos + i) % len(PLACEHOLDER)]) for i in range(start, start + n))


async def release_each_chunk_once_pushed(c: Client, up: FakeUpstream, rid: str, chunks: int,
                                         timeout: float = 20.0) -> None:
    """Let a gated upstream send ``rid``'s chunks one at a time, each once the one before
    reached the reply stream in an entry of its own; ``chunks``: its text chunks (the
    finish chunk is released after the last)."""
    for k in range(1, chunks + 1):
        deadline = time.monotonic() + timeout
        while len(c.answers[rid].offsets) < k:
            assert time.monotonic() < deadline, f"{rid}: chunk {k - 1} was not pushed ({c.answers[rid]})"
            await c.read()
        up.gate.release()


def mark_hand_backs(monkeypatch: Any) -> contextvars.ContextVar[bool]:
    """Patch :meth:`WorkerRuntime.hand_back` so that the calls it makes can tell they are its
    own: the variable returned is True in its context (and in the tasks it starts) only, for a
    test that fails a script's call in the hand-back and nowhere else."""
    handing_back: contextvars.ContextVar[bool] = contextvars.ContextVar("handing_back", default=False)
    real = WorkerRuntime.hand_back

    async def hand_back(self: WorkerRuntime, ds: Any, spent: bool = False) -> None:
        token = handing_back.set(True)
        try:
            await real(self, ds, spent)
        finally:
            handing_back.reset(token)  # the caller's own calls after it are not the hand-back's

    monkeypatch.setattr(WorkerRuntime, "hand_back", hand_back)
    return handing_back


async def answered_through_openai_worker(cfg: QosConfig, upstream_url: str, path: str, raw: bytes,
                                         headers: dict[str, str]) -> dict[str, Any]:
    """``raw`` sent to ``path`` of a frontend with an openai worker in front of ``upstream_url``
    (a captured client's request, replayed): its unstreamed answer, a 200 asserted."""
    async with frontend(cfg) as client, worker(cfg, engine="openai", upstream_url=upstream_url):
        r = await client.post(path, data=raw, headers=headers)
        assert r.status == 200, await r.text()
        return await r.json()
