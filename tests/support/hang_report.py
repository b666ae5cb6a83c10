"""What a hung test was waiting on: shortly before pytest-timeout ends a test, print every
thread's stack and every unfinished asyncio task's stack to stderr (pytest shows it with the
failure). pytest-timeout's own report is the main thread's frame only, which for an async
test is the event loop's ``select``: it says the loop was idle, not what it waited for."""

from __future__ import annotations

import asyncio
import faulthandler
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

MARGIN_S = 15.0  # the report comes this long before the timeout (at least half the timeout)


def report(nodeid: str) -> None:
    """Print the stacks; called from a timer thread while the test's loop is stuck, so it
    only reads (a task list that changes meanwhile is read again)."""
    err = sys.stderr
    print(f"\n=== {nodeid}: close to its timeout; threads and asyncio tasks follow ===", file=err)
    faulthandler.dump_traceback(file=err, all_threads=True)
    tasks: list[asyncio.Task] = []
    for _ in range(5):
        try:
            tasks = [t for t in list(asyncio.tasks._all_tasks) if not t.done()]  # type: ignore[attr-defined]
            break
        except RuntimeError:  # the set changed while it was copied
            continue
    for t in tasks:
        print(f"--- task {t.get_name()}: {t!r}"[:400], file=err)
        try:
            t.print_stack(limit=12, file=err)
        except Exception as exc:  # a frame that changed under us: say so, go on
            print(f"    (stack unreadable: {exc!r})", file=err)
    err.flush()


@contextmanager
def before_timeout(nodeid: str, timeout_s: float) -> Iterator[None]:
    """Arm the report for a test whose timeout is ``timeout_s`` (0 = none)."""
    if timeout_s <= 0:
        yield
        return
    timer = threading.Timer(max(timeout_s - MARGIN_S, timeout_s / 2), report, args=(nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
