"""One pool's leader lease, as this process sees it.

``acquire_leader`` (lua/acquire_leader.lua) keeps ``qos:{pool}:leader = <id>:<fence>`` with a
PX lease; every new leadership gets the next fencing token, and ``set_rates`` refuses any
other ``<id>:<fence>`` -- so a leader that was paused past its lease cannot overwrite its
successor's rates: it gets :class:`~limiter.errors.StaleLeader` and steps down.

Locally the lease counts from when the renewal was *sent* (Redis starts the PX later), so
this process stops acting as leader no later than Redis lets the lease go, even when Redis
is unreachable and the renewal's outcome is unknown.
"""

from __future__ import annotations

import logging
import time

from limiter.keys import PoolKeys
from limiter.scripts import Scripts

log = logging.getLogger("qos.controller")


class LeaderLease:
    def __init__(self, scripts: Scripts, keys: PoolKeys, controller_id: str, lease_s: float) -> None:
        self.scripts = scripts
        self.keys = keys
        self.controller_id = controller_id
        self.lease_ms = max(100, int(lease_s * 1000))
        self.fence = 0  # > 0 while we hold the lease
        self.last_fence = 0  # the fence of our latest leadership (to release it after stepping down)
        self.holder = ""  # who holds it when we do not ("<id>:<fence>")
        self._valid_until = 0.0  # monotonic

    @property
    def leading(self) -> bool:
        return self.fence > 0 and time.monotonic() < self._valid_until

    async def renew(self) -> int:
        """Take or keep the lease; returns our fence, or 0 when another controller holds it.
        Raises RedisUnavailable (then the lease lapses locally on its own)."""
        sent = time.monotonic()
        fence, holder = await self.scripts.acquire_leader(self.keys, self.controller_id, self.lease_ms)
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
        released = await self.scripts.release_leader(self.keys, self.controller_id, fence)
        if released:
            log.info("%s: released leadership (fence %d)", self.keys.pool, fence)
        return released
