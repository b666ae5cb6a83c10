"""Optional dependencies are checked before any work starts, with the install command."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _qos_without(module: str, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """`qos ARGV` in a Python where importing ``module`` fails (as if never installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from limiter.cli import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("argv", [
    ("bench", "run", "--modes", "fifo", "--duration", "1", "--drain", "1", "--workers", "1",
     "--capacity-rps", "5", "--no-gap-probe", "--quiet", "--out", "{out}"),
    ("bench", "tenants", "--duration", "1", "--drain", "1", "--workers", "1", "--out", "{out}"),
    ("bench", "plot", "{out}"),
])
def test_bench_plots_without_matplotlib_stop_before_any_work(tmp_path, argv):
    out_dir = tmp_path / "out"
    out, took = _qos_without("matplotlib", *(a.replace("{out}", str(out_dir)) for a in argv))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "needs matplotlib" in out.stderr and "pip install 'inference-qos[bench]'" in out.stderr, out.stderr
    assert not out_dir.exists() or not any(out_dir.iterdir())  # nothing was run, nothing written
    assert took < 60


def test_qos_up_torch_without_torch_stops_before_anything_starts(tmp_path):
    out, _ = _qos_without("torch", "up", "--engine", "torch", "--port", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pip install 'inference-qos[worker]'" in out.stderr, out.stderr
    assert "ready" not in out.stdout and "stopping" not in out.stdout
