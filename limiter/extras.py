"""Optional dependencies, checked before any work starts.

Each optional feature lives in a named extra of the package (pyproject.toml); a command that
needs one checks it first and, when it is missing, stops with the install command instead
of failing with ``ModuleNotFoundError`` after the work (a benchmark's minutes) is done.
"""

from __future__ import annotations

import importlib

from limiter.errors import QosError

# module -> the extra that installs it
EXTRAS = {"matplotlib": "bench", "fakeredis": "demo", "torch": "worker"}


class MissingDependency(QosError):
    pass


def require(module: str, needed_for: str) -> None:
    """Import ``module`` or raise MissingDependency naming ``needed_for`` and the install command."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS[module]
        raise MissingDependency(f"{needed_for} needs {module}, which is not installed: "
                                f"pip install 'inference-qos[{extra}]'") from exc
