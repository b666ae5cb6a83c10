"""What the README and docs/*.md name must exist: every test they cite (``file.py::name``,
and the shorthand ``…::name`` for the file named before it in the same table cell or, in a
table, the same column of the rows above), every repository path, every settings field with
its flag and plain default, every metric with its labels. Prose drifts as the code moves (a
renamed test, a row inserted above a ``…::`` one, a new field or metric never written up);
this reads the files only and takes about a second."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PY_FILE = re.compile(r"([\w./-]+\.py)\b")
CITATION = re.compile(r"((?:[\w./-]+\.py)|…|\.\.\.)::\s*([\w\[\]*-]+(?:\.\.\.|…)?)")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@cache
def _names(path: Path) -> frozenset[str]:
    """Functions, classes and module-level names defined in a Python file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names.add(t.id)
    return frozenset(names)


def _resolve(name: str) -> Path | None:
    """A cited file: a repository path, or a bare name under tests/, limiter/ or worker/."""
    for base in ("", "tests/", "limiter/", "worker/"):
        if (ROOT / base / name).is_file():
            return ROOT / base / name
    return None


def previous_files(text: str, pos: int) -> list[str]:
    """The .py files named before ``pos``, for a ``…::name`` there: in the same table cell,
    else the same column of the table's rows above; in prose, the same paragraph."""
    start = text.rfind("\n", 0, pos) + 1
    if not text.startswith("|", start):
        return PY_FILE.findall(text[text.rfind("\n\n", 0, pos) + 1:pos])
    found = PY_FILE.findall(text[text.rfind("|", start, pos) + 1:pos])
    if found:
        return found
    column = text.count("|", start, pos)
    for row in reversed(text[:start].split("\n")[:-1]):
        if not row.startswith("|") or set(row) <= set("|-: "):
            break
        cells = row.split("|")
        if column < len(cells) and (found := PY_FILE.findall(cells[column])):
            return found
    return []


def stale_citations(text: str, doc: str = "doc") -> list[str]:
    problems = []
    for m in CITATION.finditer(text):
        file, name = m.group(1), m.group(2)
        where = f"{doc}:{_line(text, m.start())}: {m.group(0)}"
        if file in ("…", "..."):
            before = previous_files(text, m.start())
            if not before:
                problems.append(f"{where}: no file named before it in its cell or column")
                continue
            file = before[-1]
        path = _resolve(file)
        if path is None:
            problems.append(f"{where}: no file {file}")
            continue
        pattern = re.sub(r"(\.\.\.|…)$", "*", re.sub(r"\[.*$", "", name))
        if not any(fnmatch.fnmatchcase(n, pattern) for n in _names(path)):
            problems.append(f"{where}: no {pattern} in {path.relative_to(ROOT)}")
    return problems


def test_every_cited_test_exists() -> None:
    problems = [p for doc in DOCS for p in stale_citations(doc.read_text(), doc.name)]
    assert not problems, "\n".join(problems)


def test_the_shorthand_reads_its_own_cell_then_the_column_above() -> None:
    """The rule the docs use, and the drift it catches: a row inserted between a ``…::``
    row and the row that named its file turns the shorthand to the inserted row's file."""
    table = ("| fault | test |\n|---|---|\n"
             "| a | `test_worker_faults.py::test_a_late_renew_reply_*` |\n"
             "| b | `…::test_openai_a_stale_attempts_*` |\n")
    assert stale_citations(table) == []
    inserted = table.replace("| b |", "| c | `test_leases.py::test_renew_extends_*` |\n| b |")
    assert len(stale_citations(inserted)) == 1
    prose = "`test_claim.py` (seeded ...), `…::test_a_class_named_ts_*`\n\nthen `…::test_x`"
    assert len(stale_citations(prose)) == 1  # a paragraph does not reach past a blank line
    assert len(stale_citations("`test_leases.py::test_no_such_test_at_all`")) == 1


PATH = re.compile(r"(?<![\w./<{-])((?:tests|limiter|worker|lua|deploy|docs)/[\w./-]*[\w/])")


def test_every_cited_path_exists() -> None:
    problems = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not m.group(1).startswith(("http://", "https://")) and not (doc.parent / m.group(1)).exists():
                problems.append(f"{doc.name}:{_line(text, m.start())}: link {m.group(1)}")
        for m in PATH.finditer(text):
            path = m.group(1).rstrip("/.")
            # `worker/local_run.run_local`: a module's function
            module = re.sub(r"\.\w+$", ".py", path)
            if "*" not in path and not (ROOT / path).exists() and not (ROOT / module).is_file():
                problems.append(f"{doc.name}:{_line(text, m.start())}: {path}")
        for m in re.finditer(r"(?<![\w/.-])((?:test|bench)_\w+\.py)", text):
            if not (ROOT / "tests" / m.group(1)).is_file():
                problems.append(f"{doc.name}:{_line(text, m.start())}: tests/{m.group(1)}")
    assert not problems, "\n".join(problems)


# --- settings tables ---------------------------------------------------------------------


def _table_rows(doc: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, split into cells."""
    rows, inside = [], False
    for line in (ROOT / doc).read_text().splitlines():
        if line.startswith(header):
            inside = True
        elif inside and not line.startswith("|"):
            break
        elif inside and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.split("|")[1:-1]])
    assert rows, f"{doc}: no table under {header!r}"
    return rows


def _plain_defaults(cell: str) -> list[str] | None:
    """``1, 30`` / ``0.9`` / ``true`` / ``1048576``; None for prose (``torch's``, ``pool's``)."""
    values = [v.strip().strip("`") for v in re.sub(r"\s*\(.*?\)", "", cell).split(",")]
    if all(re.fullmatch(r"-?\d+(\.\d+)?|true|false|on|off", v) for v in values):
        return values
    return None


def _same(value: object, doc: str) -> bool:
    if isinstance(value, bool):
        return doc in (("true", "on") if value else ("false", "off"))
    return isinstance(value, int | float) and float(doc) == float(value)


def _role_flags(role: str) -> set[str]:
    from limiter.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {o for a in sub.choices[role]._actions for o in a.option_strings}


def _settings_problems(doc: str, header: str, cls: type, flag_col: int | None, role: str,
                       default_col: int) -> list[str]:
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    flags = _role_flags(role)
    documented: set[str] = set()
    problems = []
    for cells in _table_rows(doc, header):
        if cells[0].startswith("`[controller.capacity]`"):
            continue  # the estimator's own fields: test_controller_capacity_fields below
        names = re.findall(r"`(\w+)`", cells[0])
        documented |= set(names)
        for name in names:
            if name not in fields:
                problems.append(f"{doc}: {name} is no field of {cls.__name__}")
        if flag_col is not None:
            for flag in re.findall(r"`(--[\w\[\]-]+)`", cells[flag_col]):
                forms = {flag.replace("[no-]", ""), flag.replace("[no-]", "no-")}
                if not forms <= flags:
                    problems.append(f"{doc}: `qos {role}` has no {flag}")
        defaults = _plain_defaults(cells[default_col])
        if defaults and len(defaults) == len(names):
            for name, value in zip(names, defaults, strict=True):
                if name in fields and not _same(fields[name], value):
                    problems.append(f"{doc}: {name} defaults to {fields[name]!r}, the table says {value}")
    problems += [f"{doc}: field {n} not in the table" for n in fields if n not in documented]
    return problems


def test_frontend_settings_table() -> None:
    from limiter.frontend.settings import FrontendSettings

    assert not _settings_problems("docs/frontend.md", "| `[frontend]` field", FrontendSettings, 1,
                                  "frontend", 2)


def test_worker_settings_table() -> None:
    from worker.settings import WorkerSettings

    assert not _settings_problems("docs/worker.md", "| `[worker]` field", WorkerSettings, 1, "worker", 2)


def test_controller_settings_table() -> None:
    from limiter.controller.settings import ControllerSettings

    problems = _settings_problems("docs/controller.md", "| field | default", ControllerSettings, None,
                                  "controller", 1)
    assert problems == ["docs/controller.md: field capacity not in the table"]


def test_controller_capacity_fields() -> None:
    from limiter.controller.capacity import CapacityConfig

    rows = [c for c in _table_rows("docs/controller.md", "| field | default")
            if c[0].startswith("`[controller.capacity]`")]
    named = {n for c in rows for n in re.findall(r"`(\w+)`", c[0].removeprefix("`[controller.capacity]`"))}
    assert named == {f.name for f in dataclasses.fields(CapacityConfig)}


# --- metrics -----------------------------------------------------------------------------


def _registries() -> dict[str, object]:
    from limiter.controller.metrics import ControllerMetrics
    from limiter.frontend.metrics import FrontendMetrics
    from worker.metrics import WorkerMetrics

    return {
        "frontend": FrontendMetrics().registry,
        "worker": WorkerMetrics(pool="p", worker="w", engine="sim", simulated=True, device="cpu").registry,
        "controller": ControllerMetrics("c").registry,
    }


@pytest.mark.parametrize("role", ["frontend", "worker", "controller"])
def test_every_metric_is_documented_with_its_labels(role: str) -> None:
    """Each metric the role registers is in docs/<role>.md with labels it has (``{a,b}`` or,
    in the controller's table, a labels column); each ``qos_<role>_...`` named exists."""
    text = (ROOT / "docs" / f"{role}.md").read_text()
    code = {}
    for collector in _registries()[role]._collector_to_names:  # type: ignore[attr-defined]
        name = collector._name + ("_total" if collector._type == "counter" else "")
        code[name] = set(collector._labelnames)
    problems = [f"{name} is not in docs/{role}.md" for name in code if f"`{name}" not in text]
    for m in re.finditer(rf"(qos_{role}_\w+)(\{{([^}}]*)\}})?", text):
        name, labels = m.group(1), m.group(3)
        if name not in code:
            problems.append(f"docs/{role}.md:{_line(text, m.start())}: no metric {name}")
        elif labels is not None:
            named = {re.split(r"[=!~]", x)[0].strip() for x in labels.split(",") if x.strip()}
            if not named <= code[name]:
                problems.append(f"docs/{role}.md: {name}{{{labels}}}: labels are {sorted(code[name])}")
    if role == "controller":
        for cells in _table_rows("docs/controller.md", "| metric | labels"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                if name in code and {x.strip() for x in cells[1].split(",")} != code[name]:
                    problems.append(f"{name}: labels {cells[1]}, code {sorted(code[name])}")
    assert not problems, "\n".join(problems)
