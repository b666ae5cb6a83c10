"""Instructions a redis-server runs, counted by valgrind's callgrind.

Time on this project's shared 2-core machine moves by 2x from one hour to the next and by
tens of percent between two runs a minute apart, which hides a change of 5-10 % in a
script. The instructions a server runs for the same calls do not depend on the machine's
load: two runs agree within 0.5 %. So ``qos bench redis-budget --instructions`` runs its
private server under callgrind (about 50x slower) and reads, per phase, the instructions
the server ran between a zeroing of callgrind's counters and a dump of them, counted only
while it reads and runs commands and writes replies (``readQueryFromClient``,
``writeToClient``): the scripts, their inner commands, argument and reply conversion and
the protocol -- the server's work for the calls. Not its timers: ``serverCron`` runs 10
times a (callgrind-slowed) second, so how many of its runs fell in a phase depended on the
clock; counted, they made a short phase's figure differ by 2.5x from one run to the next.

Lua's garbage collector takes a step (about a million instructions) every 50 script calls,
counted in whichever call it falls: compare phases of hundreds of calls, not a few.

An instruction count is not a time (a cache miss or a slow string formatting counts as
its instructions); it is the figure to compare two versions of a script with.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

from limiter.localstack.redis_server import RedisServer

VALGRIND = "valgrind"
CONTROL = "callgrind_control"
# Where a redis-server reads a client's commands (parsing and running them) and writes
# their replies.
SERVING = ("readQueryFromClient", "writeToClient")
_TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def missing() -> str | None:
    """Why instructions cannot be counted here (a tool not on PATH), or None."""
    for tool in (VALGRIND, CONTROL):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH (install valgrind)"
    return None


def why_not(redis_url: str | None) -> str | None:
    """Why instructions cannot be counted for a run given ``redis_url`` (a server of the
    caller's, not one started under callgrind here), or None."""
    if redis_url:
        return "instructions are counted on a private server only (not with a Redis URL given)"
    return missing()


def start_server(out_dir: Path | None) -> tuple[RedisServer, InstructionCounter | None]:
    """A private redis-server (no AOF); with ``out_dir``, running under callgrind (its
    profiles written there), and the counter of its instructions."""
    server = RedisServer(extra=["--appendonly", "no"], wrapper=wrapper(out_dir) if out_dir else [])
    server.start(timeout_s=120.0 if out_dir else 10.0)  # valgrind starts a server slowly
    counter = InstructionCounter(server.proc.pid, out_dir) if out_dir and server.proc else None
    return server, counter


def wrapper(out_dir: Path) -> list[str]:
    """The command line that runs a server under callgrind, its profiles written to
    ``out_dir``, counting inside the functions that serve a client's calls (and what they
    call); :meth:`InstructionCounter.zero` discards what it counted before a phase."""
    return [VALGRIND, "--tool=callgrind", f"--callgrind-out-file={out_dir}/callgrind.%p", "--dump-line=no",
            *(f"--toggle-collect={f}" for f in SERVING)]


class InstructionCounter:
    """Zero, then dump and read, the counters of a server that runs under :func:`wrapper`."""

    def __init__(self, pid: int, out_dir: Path) -> None:
        self.pid = pid
        self.out_dir = out_dir

    async def _control(self, flag: str) -> None:
        proc = await asyncio.create_subprocess_exec(CONTROL, flag, str(self.pid),
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{CONTROL} {flag} {self.pid} failed ({proc.returncode}): "
                               f"{out.decode(errors='replace').strip()[-300:]}")

    async def zero(self) -> None:
        await self._control("--zero")

    async def read(self) -> int:
        """The instructions the server ran since the last zero (or dump): one dump, read back."""
        before = set(self.out_dir.glob(f"callgrind.{self.pid}.*"))
        await self._control("--dump")
        new = sorted(set(self.out_dir.glob(f"callgrind.{self.pid}.*")) - before,
                     key=lambda p: int(p.name.rsplit(".", 1)[1]))
        if not new:
            raise RuntimeError(f"{CONTROL} --dump {self.pid} wrote no profile in {self.out_dir}")
        text = new[-1].read_text(errors="replace")
        for path in new:  # a phase's profile is read once; the runs would fill the disk
            path.unlink()
        found = _TOTALS.findall(text)
        if not found:
            raise RuntimeError(f"{new[-1]}: no totals line (not a callgrind profile?)")
        return int(found[-1])
