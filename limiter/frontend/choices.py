"""Several answers to one request (``n`` > 1, or a completion's several prompts): each answer
is a request of its own in the queue (its tenant's quota and in-flight bound count each, and
each is scheduled, resumed and charged as any), answered together, whole or streamed, as vLLM
answers them: the choices in vLLM's order (``gens`` are each prompt's ``n`` in turn, the
choice ``index`` their place), the usage summed with a prompt counted once however many
answers it has. The first failure fails the whole, and the others are cancelled: their run's
end cancels them in Redis, refunding what they did not use. What could never be admitted
whole (more answers than the tenant's in-flight bound, more cost than its quota gives within
the admission wait, more bytes than a request may hold queued) is refused before any is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from limiter.config import ClassConfig, TenantConfig
from limiter.frontend import openai_api as oa
from limiter.frontend.errors import ApiError, to_api_error
from limiter.frontend.generation import ClientStalled, Generation
from limiter.frontend.quota_check import admission_cost
from limiter.frontend.replies import Reply
from limiter.scripts import MAX_PAYLOAD_BYTES

# --- what a request of several answers is refused before any is admitted -------------------

def refuse_more_than_in_flight(answers: int, tenant: TenantConfig) -> None:
    """A 429 (not to be resent) for more answers than the tenant may have in flight: it can
    never have them all. Refused later, some were admitted, charged, handed to a worker and
    cancelled when the rest found the bound taken (by its own answers), on each of the SDK's
    resends of the 429."""
    if 0 < tenant.max_inflight < answers:
        raise ApiError(429, f"This request asks for {answers} answers, each a request of its own, "
                       f"and tenant {tenant.name!r} may have at most {tenant.max_inflight} in flight "
                       "(its max_inflight): ask for fewer a request", code="too_many_inflight",
                       should_retry=False, outcome="throttled")


def refuse_over_the_quota(reqs: list[oa.GenerationRequest], tenant: TenantConfig, cls: ClassConfig) -> None:
    """A 429 (not to be resent) for answers that together cost more than their tenant's quota
    bucket can ever give them within the class's admission wait. Each answer is admitted on
    its own, charged its whole cost (admit.lua: the bucket must hold min(cost, burst), and
    goes into debt past it): the last one admitted needs what the others left, so even a full
    bucket, refilling for the whole admission wait, cannot admit them all. Refused later, some
    were admitted, charged and handed to a worker, then cancelled when the rest found the
    bucket empty -- on each of the SDK's resends of that (retryable) 429."""
    if len(reqs) < 2:
        return
    burst = tenant.rate_tokens_s * tenant.burst_s
    costs = [admission_cost(r.prompt_tokens, r.max_tokens, cls) for r in reqs]
    # the answer admitted last at best: the one whose cost is most over the burst (it needs
    # only a full bucket, and the debt it leaves is no other answer's)
    need = sum(costs) - max(max(c - burst, 0.0) for c in costs)
    most = burst + tenant.rate_tokens_s * cls.admission_wait_ms / 1000
    if need > most * (1 + 1e-9):
        raise ApiError(429, f"This request asks for {len(reqs)} answers, each a request of its own "
                       f"charged its cost: {need:g} weighted tokens in all, and tenant {tenant.name!r}'s "
                       f"quota gives at most {most:g} within class {cls.name}'s admission wait (its "
                       f"bucket's {burst:g} and the refill): ask for fewer answers (or fewer max_tokens) "
                       "a request",
                       code="rate_limit_exceeded", should_retry=False, outcome="throttled")


def refuse_more_than_they_may_hold(payloads: list[bytes], n: int) -> None:
    """A 400 for answers whose payloads together pass what one request may hold queued
    (``MAX_PAYLOAD_BYTES``): each answer is queued with its prompt, and n copies of a 1 MiB
    body held n MiB of Redis' memory while they waited (64 of a chat's, rendered and as
    messages, 128)."""
    if len(payloads) > 1 and (held := sum(map(len, payloads))) > MAX_PAYLOAD_BYTES:
        raise ApiError(400, f"The request is too large to queue: its {len(payloads)} answers, each queued "
                       f"with its prompt, take {held} bytes, over the {MAX_PAYLOAD_BYTES >> 20} MiB a "
                       "request may hold: ask for fewer answers a request", code="request_too_large",
                       param="n" if n > 1 else "prompt")


# --- answering them ------------------------------------------------------------------------

def _record_ids(gens: list[Generation]) -> str:
    return ",".join(g.request_id for g in gens)  # each answer's record, to trace it


async def run_choices(gens: list[Generation], n: int) -> web.Response:
    """The answers as one JSON body."""
    tasks = [asyncio.create_task(g.run_to_answer()) for g in gens]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:  # (in the choices' order: the same failure answers the same request)
            if t in done and (exc := t.exception()) is not None:
                raise exc
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    bodies = [t.result() for t in tasks]
    first = bodies[0]
    choices = []
    for i, b in enumerate(bodies):
        choice = b["choices"][0]
        choice["index"] = i
        choices.append(choice)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies[::n])
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    return await gens[0].send_json({**first, "choices": choices, "usage": oa.usage(prompt, completion)},
                                   _record_ids(gens))


@dataclass(frozen=True)
class _Event:
    """One reply entry of one answer, as the chunks the writer writes (``done``: its last
    entry). Its first also says that a worker took that answer: no queue timeout can end it
    any more, and a refusal of its prompt would have come instead."""

    index: int
    chunks: tuple[bytes, ...] = ()
    done: Reply | None = None


async def _read(g: Generation, index: int, events: asyncio.Queue[_Event | Exception]) -> None:
    """Admit one answer and hand each of its reply entries to the writer as the choice
    ``index``; a failure is handed over too (a cancellation, the writer's, is not)."""
    async def read() -> None:
        while True:
            r = await g.next_reply()
            if r.kind in ("err", "shutdown"):
                raise g.reply_error(r)
            done = r.kind == "done"
            events.put_nowait(_Event(index, tuple(g.sse_chunks(r, g.accept(r), index)),
                                     done=r if done else None))
            if done:
                return

    try:
        await g.run_admitted(read)
    except Exception as exc:
        events.put_nowait(exc)


async def stream_choices(gens: list[Generation], n: int) -> web.StreamResponse:
    """The answers as one SSE stream, their chunks interleaved as they come (each carries its
    choice's ``index``; a chat's role chunks, one a choice, open it). It opens only once every
    answer has its first reply entry (a worker took each) and one has text, as one answer's
    opens at its first token: until then a refusal (a 429 for the tenant's rate, say), a queue
    timeout of an answer no worker took yet, or the model server's refusal of one prompt is
    still an honest HTTP status (its Retry-After read by the SDK) rather than an error inside a
    200 stream opened on another answer's text. A failure after it opened is reported
    in-band, as one answer's is."""
    lead = gens[0]
    for g in gens[1:]:  # one answer: the chunks of every choice carry one id and one time
        g.public_id, g.created = lead.public_id, lead.created
    events: asyncio.Queue[_Event | Exception] = asyncio.Queue()
    tasks = [asyncio.create_task(_read(g, i, events)) for i, g in enumerate(gens)]
    resp: web.StreamResponse | None = None
    held: list[bytes] = []  # chunks not yet written

    async def write() -> ApiError | None:
        """Write the events until every answer is done (None), or one failed after the stream
        opened (its error, written once the others are cancelled)."""
        nonlocal resp
        left, usage_in, usage_out = len(gens), 0, 0
        started: set[int] = set()  # the answers a worker took (their first reply entry came)
        while True:
            batch = [await events.get()]
            while not events.empty():  # what came together goes in one write
                batch.append(events.get_nowait())
            for ev in batch:
                if isinstance(ev, Exception):
                    if resp is None:
                        raise ev
                    return to_api_error(ev)  # (after what came before it: ``held``)
                started.add(ev.index)
                held.extend(ev.chunks)
                if ev.done is not None:
                    left -= 1
                    usage_in += ev.done.usage_in if ev.index % n == 0 else 0  # a prompt once
                    usage_out += ev.done.usage_out
            if resp is None:
                if len(started) < len(gens) or not held:
                    continue
                resp = await lead.open_sse(_record_ids(gens))
                held[:0] = [c for i, g in enumerate(gens) for c in g.sse_opener(i)]
            if not left:
                await lead.bounded_write(resp.write_eof(b"".join(held + lead.sse_end(usage_in, usage_out))))
                return None
            if held:
                await lead.bounded_write(resp.write(b"".join(held)))
                held.clear()

    try:
        try:
            failure = await write()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if failure is not None and resp is not None:
            return await lead.end_with_error(resp, failure, b"".join(held))
        assert resp is not None  # (written to its end)
        return resp
    except (ConnectionError, ClientStalled) as exc:
        # the readers' cancellation (above) cancelled every answer in Redis
        return lead.ended_by_client(resp, exc)
