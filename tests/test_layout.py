"""The rooms' walls (docs/architecture.md): which package may import which.

Runtime code never imports the benchmarks; a worker never imports the controller or the
frontend (and the other way round); nothing imports a test helper; and no module imports
another module's private name. Checked on the source, so a new arrow fails here first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import limiter

ROOT = Path(__file__).resolve().parent.parent

# (package of the importing module, packages it must not import)
WALLS = (
    ("limiter", ("limiter.bench", "tests")),  # runtime and tools; limiter.bench is exempted below
    ("worker", ("limiter.bench", "limiter.controller", "limiter.frontend", "limiter.localstack", "tests")),
    ("limiter.frontend", ("limiter.controller", "limiter.localstack", "worker")),
    ("limiter.controller", ("limiter.frontend", "limiter.localstack", "worker")),
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> list[tuple[str, str, tuple[str, ...]]]:
    """(importing module, imported module, names) for every import in limiter/ and worker/."""
    found = []
    for top in ("limiter", "worker"):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module(path)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found += [(module, alias.name, ()) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.append((module, node.module, tuple(a.name for a in node.names)))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_crosses_a_wall() -> None:
    crossings = []
    for importer, imported, _names in _imports():
        for room, forbidden in WALLS:
            if not _inside(importer, room) or (room == "limiter" and _inside(importer, "limiter.bench")):
                continue
            crossings += [f"{importer} imports {imported}" for f in forbidden if _inside(imported, f)]
    assert crossings == []


def test_no_module_imports_another_modules_private_name() -> None:
    private = [f"{importer} imports {imported}.{name}" for importer, imported, names in _imports()
               for name in names if name.startswith("_") and not name.startswith("__")
               and imported.split(".")[0] in ("limiter", "worker")]
    assert private == []


def test_the_package_exports_its_public_api() -> None:
    missing = [name for name in limiter.__all__ if not hasattr(limiter, name)]
    assert missing == [] and len(limiter.__all__) == len(set(limiter.__all__))
