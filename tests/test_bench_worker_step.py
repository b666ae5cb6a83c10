"""tests/bench_worker_step.py (a benchmark script, not collected itself) still runs: a real
worker on a private redis-server holds the requests it was given throughout, flags checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import bench_worker_step as bench

SCRIPT = Path(bench.__file__)


def test_a_run_prints_the_cpu_of_a_step_for_each_round() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--running", "4", "--seconds", "0.3", "--rounds", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    number = r"([\d.]+)"
    m = re.fullmatch(rf"worker step, 4 requests decoding, (?:uvloop|asyncio) loop: best {number} us of CPU "
                     rf"\(rounds: {number}, {number}\)\n", r.stdout)
    assert m is not None, r.stdout
    best, *rounds = map(float, m.groups())
    assert best == min(rounds) > 0


@pytest.mark.parametrize(("flag", "value"), [("--running", "0"), ("--rounds", "0"), ("--seconds", "0"),
                                           ("--max-seqs", "2")])
def test_a_bad_flag_is_refused_by_name(flag: str, value: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"error: {flag} " in r.stderr, r.stderr  # not the usage line's list
