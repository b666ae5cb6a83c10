"""Writing a qos config as TOML: the one writer the benchmarks and the tests share.

The standard library reads TOML but does not write it; a qos config needs only scalars,
lists of scalars, tables, arrays of tables and tables nested in those, which is all this
writes. ``None`` values are left out (the loader's default applies).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from limiter.config import QosConfig


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _table(header: str, name: str, body: Mapping[str, Any]) -> list[str]:
    lines = ["", header]
    subtables = []
    for k, v in body.items():
        if v is None:
            continue
        if isinstance(v, Mapping):
            subtables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value(v)}")
    for k, v in subtables:
        lines += _table(f"[{name}.{k}]", f"{name}.{k}", v)
    return lines


def toml_dumps(data: Mapping[str, Any], comment: str = "") -> str:
    """``data``'s top-level tables (a mapping) and arrays of tables (a list of mappings)."""
    lines = [f"# {comment}"] if comment else []
    for name, value in data.items():
        if isinstance(value, list | tuple) and value and isinstance(value[0], Mapping):
            for item in value:
                lines += _table(f"[[{name}]]", name, item)
        elif isinstance(value, Mapping):
            lines += _table(f"[{name}]", name, value)
    return "\n".join(lines) + "\n"


def config_toml(cfg: QosConfig, comment: str = "") -> str:
    """``cfg`` as a TOML file every role can load (``--config``); round-trips through
    :func:`limiter.config.load`."""
    data: dict[str, Any] = {"redis": dataclasses.asdict(cfg.redis)}
    for section in ("classes", "pools", "tenants"):
        data[section] = [dataclasses.asdict(item) for item in getattr(cfg, section)]
    for section in ("frontend", "worker", "controller"):
        data[section] = getattr(cfg, section)
    return toml_dumps(data, comment)


def write_toml(data: Mapping[str, Any] | QosConfig, path: Path, comment: str = "") -> Path:
    """Write a config (a :class:`QosConfig` or its TOML-shaped mapping) to ``path``."""
    text = config_toml(data, comment) if isinstance(data, QosConfig) else toml_dumps(data, comment)
    path.write_text(text)
    return path
