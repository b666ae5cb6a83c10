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


def _absolute(path: Path, module: str, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, a relative one resolved against ``module`` (the
    walls skipped relative imports: ``from ..controller import service`` in the frontend
    passed; found by a review)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports() -> list[tuple[str, str, tuple[str, ...]]]:
    """(importing module, imported module, names) for every import in limiter/ and worker/."""
    found = []
    for top in ("limiter", "worker"):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module(path)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found += [(module, alias.name, ()) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    target = _absolute(path, module, node)
                    if node.module is None:  # `from . import x`: each name is a module
                        found += [(module, f"{target}.{a.name}", ()) for a in node.names]
                    else:
                        found.append((module, target, tuple(a.name for a in node.names)))
    return found


def test_relative_imports_are_resolved() -> None:
    """The resolution the walls rely on, on the shapes a relative import takes."""
    node = ast.parse("from ..controller import service").body[0]
    assert isinstance(node, ast.ImportFrom)
    settings = ROOT / "limiter/frontend/settings.py"
    assert _absolute(settings, "limiter.frontend.settings", node) == "limiter.controller"
    node = ast.parse("from . import x").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _absolute(ROOT / "limiter/frontend/__init__.py", "limiter.frontend", node) == "limiter.frontend"


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
