"""tests/bench_scheduler_step.py (a benchmark script, not collected itself) still runs: the
scheduler built as the worker builds it, sequences replaced as they end, flags checked."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests import bench_scheduler_step as bench

SCRIPT = Path(bench.__file__)


@pytest.mark.parametrize("fixed_budget", [False, True])
@pytest.mark.parametrize("output_tokens", [0, 4])
def test_a_round_times_steps_with_as_many_sequences_throughout(fixed_budget: bool,
                                                               output_tokens: int) -> None:
    us = asyncio.run(bench.one_round(3, 40, fixed_budget, output_tokens))  # exits if the batch size moved
    assert us > 0
    sched = bench.scheduler(3, fixed_budget)
    assert (sched.budget is None) == fixed_budget and (sched.top_prefill_tokens == 0) == fixed_budget


@pytest.mark.parametrize("flag", ["--running", "--steps", "--rounds", "--output-tokens"])
def test_a_bad_flag_is_refused_by_name(flag: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), flag, "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"error: {flag} " in r.stderr, r.stderr  # not the usage line's list
