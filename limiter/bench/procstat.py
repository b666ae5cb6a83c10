"""CPU time from Linux ``/proc``: what one process used, and how busy the whole machine was.

Benchmarks on a shared machine need both: a throughput figure means little unless one can
tell whether the machine's cores were the limit, and which process spent them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_process_cpu_s(stat: str, ticks_s: float = TICKS_S) -> float:
    """``/proc/<pid>/stat`` -> user + system CPU seconds. The command name (field 2) may hold
    spaces and parentheses, so fields are counted from its closing parenthesis."""
    rest = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(rest[11]), int(rest[12])  # fields 14 and 15 of the whole line
    return (utime + stime) / ticks_s


def process_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` used so far (0.0 once it is gone: a dead process spends nothing more)."""
    try:
        return parse_process_cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_by_role(pids: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds each role's processes used so far (``pids``: role -> its processes)."""
    return {role: sum(process_cpu_s(p) for p in ps) for role, ps in pids.items()}


@dataclass(frozen=True)
class MachineTicks:
    """The ``cpu`` line of ``/proc/stat``: busy and total ticks over all cores since boot."""

    busy: int
    total: int

    @staticmethod
    def parse(stat: str) -> MachineTicks:
        fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already counted in user
        return MachineTicks(total - idle, total)

    @staticmethod
    def read() -> MachineTicks:
        try:
            return MachineTicks.parse(Path("/proc/stat").read_text())
        except OSError:
            return MachineTicks(0, 0)


def busy_share(before: MachineTicks, after: MachineTicks) -> float | None:
    """The share of the machine's cores that were busy between two readings (None: no /proc)."""
    total = after.total - before.total
    return (after.busy - before.busy) / total if total > 0 else None
