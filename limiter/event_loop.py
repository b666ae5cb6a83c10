"""Which asyncio event loop the ``qos`` processes run: uvloop where it is installed.

``QOS_EVENT_LOOP``: ``auto`` (default: uvloop when importable, else asyncio's own loop),
``uvloop`` (required: an error when it is not installed) or ``asyncio``. uvloop's gain is
measured by ``qos bench overhead`` (docs/benchmarks.md, "Frontend cost"); the standard loop
stays one variable away for a platform where uvloop misbehaves.
"""

from __future__ import annotations

import asyncio
import os

from limiter.errors import ConfigError

CHOICES = ("auto", "uvloop", "asyncio")


def install_event_loop(environ: dict[str, str] | None = None) -> str:
    """Set the event loop policy that ``QOS_EVENT_LOOP`` names; returns the loop chosen
    (``uvloop`` or ``asyncio``). Call before any loop is created."""
    env = os.environ if environ is None else environ
    choice = env.get("QOS_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError("QOS_EVENT_LOOP", f"must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("QOS_EVENT_LOOP", "uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"
