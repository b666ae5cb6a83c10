"""Tables as a benchmark prints them: rich tables on a terminal, or markdown for the docs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

Rows = Sequence[Sequence[Any]]


def render_tables(tables: Sequence[tuple[Sequence[str], Rows]], markdown: bool = False,
                  titles: Sequence[str] | None = None) -> list[Any]:
    """Each ``(header, rows)`` as a markdown table (a string) or a rich :class:`Table`."""
    names = list(titles or [""] * len(tables))
    if markdown:
        return [(f"**{name}**\n\n" if name else "") + "| " + " | ".join(h) + " |\n|" + "---|" * len(h) + "\n"
                + "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
                for name, (h, rows) in zip(names, tables, strict=True)]
    rendered = []
    for name, (h, rows) in zip(names, tables, strict=True):
        t = Table(title=name or None, title_justify="left")
        for col in h:
            t.add_column(col)
        for r in rows:
            t.add_row(*(str(c) for c in r))
        rendered.append(t)
    return rendered


def print_markdown(tables: Sequence[str]) -> None:
    """Markdown tables (``render_tables(..., markdown=True)``) as plain text: every row one line
    whatever the terminal (rich wraps at 80 columns in a pipe), and a blank line after each
    table, without which a markdown reader takes the next title or header for rows of the last."""
    print("\n\n".join(tables))
