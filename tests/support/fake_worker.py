"""A minimal in-test worker that drives the real Redis scripts: claim -> push_tokens -> complete.

It "generates" the rendered prompt reversed (or a fixed text), one token per character,
in batches, optionally with a delay per batch, honouring max_tokens, stop sequences and
cancellation (the cancels set, asked after each push). Usage in is counted with the same
function the frontend charges with (limiter.prompt.count_tokens), as the real worker does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from limiter.errors import LeaseLost, PolicyMissing
from limiter.keys import PoolKeys
from limiter.prompt import Payload, count_tokens
from limiter.scripts import Claimed, Scripts


@dataclass
class Served:
    request_id: str
    outcome: str  # ok | cancelled | failed
    usage_in: int
    usage_out: int
    text: str
    cls: str


@dataclass
class FakeWorker:
    client: Any
    keys: PoolKeys
    worker_id: str = "fake-w1"
    fixed_text: str | None = None  # None: the prompt reversed
    batch: int = 4
    delay_s: float = 0.0  # sleep before each batch
    fail: bool = False  # complete every request as failed
    fail_outcome: str = "failed"  # or "refused" (failed for what the request is)
    served: list[Served] = field(default_factory=list)
    claimed: list[str] = field(default_factory=list)
    payloads: dict[str, Payload] = field(default_factory=dict)  # request id -> what the frontend stored
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _loop_task: asyncio.Task[None] | None = None
    _stopping: bool = False

    def __post_init__(self) -> None:
        self.scripts = Scripts(self.client)

    async def __aenter__(self) -> FakeWorker:
        await self.client.zadd(self.keys.workers, {self.worker_id: await self._now_ms()})
        self._loop_task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A flag, not cancel(): redis-py can swallow a cancellation inside BLPOP.
        self._stopping = True
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=2.0)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)

    async def _now_ms(self) -> int:
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    def output(self, payload: Payload) -> str:
        return self.fixed_text if self.fixed_text is not None else payload.prompt[::-1]

    async def _run(self) -> None:
        while not self._stopping:
            try:
                res = await self.scripts.claim(self.keys, self.worker_id, 16)
            except PolicyMissing:  # Redis lost the policy; a frontend writes it again
                await asyncio.sleep(0.05)
                continue
            for c in res.requests:
                self.claimed.append(c.request_id)
                t = asyncio.create_task(self._serve(c))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            if not res.requests:
                await self.client.zadd(self.keys.workers, {self.worker_id: res.now_ms})
                # Block on the wake list like a real worker: no polling while idle.
                await self.client.blpop([self.keys.wake], timeout=0.2)

    async def _serve(self, c: Claimed) -> None:
        p = Payload.unpack(c.payload)
        self.payloads[c.request_id] = p
        text = self.output(p)
        finish = "stop"
        for s in p.stop:
            if s in text:
                text = text[: text.index(s)]
        if len(text) > c.max_tokens:
            text, finish = text[: c.max_tokens], "length"
        usage_in = count_tokens(p.prompt)
        pos = c.delivered
        try:
            if self.fail:
                await self.scripts.complete(self.keys, request_id=c.request_id, worker_id=self.worker_id,
                                            fence=c.fence, outcome=self.fail_outcome, usage_in=usage_in,
                                            finish_reason="error", message="fake worker told to fail")
                self.served.append(Served(c.request_id, self.fail_outcome, usage_in, pos, "", c.cls))
                return
            while len(text) - pos > self.batch:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                chunk = text[pos: pos + self.batch]
                await self.scripts.push_tokens(
                    self.keys, request_id=c.request_id, worker_id=self.worker_id, fence=c.fence,
                    offset=pos, token_ids=[ord(ch) for ch in chunk], text=chunk)
                pos += len(chunk)
                # as a real worker learns it: the cancels set (a push does not say it)
                if await self.scripts.client.sismember(self.keys.cancels, c.request_id):
                    await self.scripts.complete(self.keys, request_id=c.request_id, worker_id=self.worker_id,
                                                fence=c.fence, outcome="cancelled", usage_in=usage_in,
                                                finish_reason="cancelled")
                    self.served.append(Served(c.request_id, "cancelled", usage_in, pos, text[:pos], c.cls))
                    return
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = text[pos:]
            await self.scripts.complete(self.keys, request_id=c.request_id, worker_id=self.worker_id,
                                        fence=c.fence, outcome="ok", usage_in=usage_in,
                                        token_ids=[ord(ch) for ch in last], text=last, finish_reason=finish)
            self.served.append(Served(c.request_id, "ok", usage_in, len(text), text, c.cls))
        except LeaseLost:
            self.served.append(Served(c.request_id, "lost", usage_in, pos, text[:pos], c.cls))

    async def by_id(self, request_id: str, timeout: float = 10.0) -> Served:
        """What this worker did with ``request_id``. Waits for it: the worker records a request
        after its ``complete`` returned, and the frontend can answer the client before that."""
        deadline = time.monotonic() + timeout
        while True:
            for s in self.served:
                if s.request_id == request_id:
                    return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the fake worker did not record {request_id} within {timeout} s")
            await asyncio.sleep(0.01)
