"""One pool's leader lease, as this process sees it.

``acquire_leader`` (lua/acquire_leader.lua) keeps ``qos:{pool}:leader = <owner>:<fence>`` with
a PX lease; every new leadership gets the next fencing token, and ``set_rates`` refuses any
other ``<owner>:<fence>`` -- so a leader that was paused past its lease cannot overwrite its
successor's rates: it gets :class:`~limiter.errors.StaleLeader` and steps down.

The owner is ``<controller id>.<8 hex digits>``, the digits drawn per process: two processes
given the same id (a ``controller_id`` in the shared ``[controller]`` table, a copied
``--id``) renewed each other's lease and both led with one fence, both writing rates. The
id alone still names the process everywhere else (its consumer in the samples group, so a
restart under the same id replays its pending samples; logs; decision records).

Locally the lease counts from when the renewal was *sent* (Redis starts the PX later), so
this process stops acting as leader no later than Redis lets the lease go, even when Redis
is unreachable and the renewal's outcome is unknown.
"""

from __future__ import annotations

import logging
import secrets
import time

from limiter.keys import PoolKeys
from limiter.scripts import Scripts

log = logging.getLogger("qos.controller")

# The lease's local clock counts the time the host spent suspended (Linux's CLOCK_BOOTTIME):
# Redis' PX runs on while a VM is suspended, and on time.monotonic (CLOCK_MONOTONIC), which
# stops, a resumed leader still read its lease as valid and went on reading -- and
# acknowledging -- samples its successor should have had, until its next renewal found the
# lease gone. Where there is no such clock, the monotonic one.
_LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def lease_clock() -> float:
    """Seconds on the clock the lease is timed with (only differences mean anything)."""
    return time.clock_gettime(_LEASE_CLOCK)


def holder_id(holder: str) -> str:
    """The controller id in a lease holder ``<id>.<hex>:<fence>`` (or an owner ``<id>.<hex>``)."""
    return holder.rpartition(":")[0].rpartition(".")[0] if ":" in holder else holder.rpartition(".")[0]


class LeaderLease:
    def __init__(self, scripts: Scripts, keys: PoolKeys, controller_id: str, lease_s: float) -> None:
        self.scripts = scripts
        self.keys = keys
        self.controller_id = controller_id
        self.owner = f"{controller_id[:55]}.{secrets.token_hex(4)}"  # this process's lease name
        self.lease_ms = max(100, int(lease_s * 1000))
        self.fence = 0  # > 0 while we hold the lease
        self.last_fence = 0  # the fence of our latest leadership (to release it after stepping down)
        self.holder = ""  # who holds it when we do not ("<owner>:<fence>")
        self.taken = False  # the last renew took the lease anew (a new leadership), not renewed it
        self._valid_until = 0.0  # lease_clock()

    @property
    def leading(self) -> bool:
        return self.fence > 0 and lease_clock() < self._valid_until

    async def renew(self) -> int:
        """Take or keep the lease; returns our fence, or 0 when another controller holds it.
        Raises RedisUnavailable (then the lease lapses locally on its own)."""
        sent = lease_clock()
        fence, holder, self.taken = await self.scripts.take_leader(self.keys, self.owner, self.lease_ms)
        if fence:
            if fence != self.fence:
                log.info("%s: leading with fence %d", self.keys.pool, fence)
            self.fence, self.last_fence, self.holder = fence, fence, ""
            self._valid_until = sent + self.lease_ms / 1000.0
        else:
            if self.fence:
                log.warning("%s: lease lost to %s; standing by", self.keys.pool, holder)
            self.fence, self.holder = 0, holder
        return self.fence

    def step_down(self, why: str) -> None:
        """Stop acting as leader now (e.g. a fenced write was refused)."""
        if self.fence:
            log.warning("%s: stepping down (fence %d): %s", self.keys.pool, self.fence, why)
        self.fence = 0

    async def release(self) -> bool:
        """Clean shutdown: delete the lease if it is still ours, so a standby takes over at once."""
        fence, self.fence = self.fence, 0
        if not fence:
            return False
        released = await self.scripts.release_leader(self.keys, self.owner, fence)
        if released:
            log.info("%s: released leadership (fence %d)", self.keys.pool, fence)
        return released
