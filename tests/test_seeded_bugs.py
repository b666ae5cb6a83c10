"""The catalogue of seeded bugs (tests/seeded_bugs.py) stays plantable. Not in that
module's own test list: while a bug is planted its text is gone, and this test would
"catch" every bug."""

from __future__ import annotations

from tests.seeded_bugs import BUGS, LUA, UNIT_TESTS


def test_every_seeded_bug_still_finds_the_text_it_replaces():
    """Each bug is a text replacement; a rewrite of the Lua that moves that text leaves the
    bug unplantable, found only when somebody runs the catalogue (complete.lua's fence check
    had been so since its record fields were named)."""
    for bug in BUGS:
        for path, old, _ in ((bug.path, bug.old, bug.new), *bug.also):
            found = (LUA / path).read_text().count(old)
            assert found == 1, f"{bug.name}: its text is in lua/{path} {found} times, not once"


def test_this_check_is_not_among_the_tests_a_planted_bug_must_fail():
    assert not any("seeded_bugs" in t for t in UNIT_TESTS)


def test_an_unknown_name_or_a_flag_runs_nothing_and_says_so(capsys) -> None:
    """`--help` was taken as a bug name and an unknown name skipped without a word: "0/0
    seeded bugs caught", exit 0 (a newcomer's walk of the README)."""
    from tests.seeded_bugs import main

    assert main(["no_such_bug"]) == 2
    assert "no such seeded bug: no_such_bug" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m tests.seeded_bugs" in out and BUGS[0].name in out
    assert main(["--frobnicate"]) == 2
