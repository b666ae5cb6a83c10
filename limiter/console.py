"""The console the commands print their tables on (``qos status``, ``qos up --demo-load``,
``qos bench``)."""

from __future__ import annotations

import sys

from rich.console import Console


def stdout_console() -> Console:
    """A terminal's own width; piped or captured output gets room for every column (rich would
    cut cells at 80 characters: a worker's "(upstream down)", a benchmark's "class" as "cl…")."""
    return Console() if sys.stdout.isatty() else Console(width=200)
