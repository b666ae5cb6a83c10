"""tests/bench_torch_gpu.py in its quick form on CPU (its real run needs a GPU: tests/gpu/check.sh),
so the script a GPU session runs cannot rot between such sessions."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from tests.bench_torch_gpu import StepPoint, fit_cost_model, main
from worker.engines.sim import CostModel


def test_the_quick_form_prints_its_three_parts(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["--device", "cpu", "--model", "tiny", "--quick", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"fit: +c0 [\d.]+ ms, c_prefill [\d.]+ us/token", out), out
    assert len(re.findall(r"^  (prefill|decode) .* [+-]\d+%", out, re.M)) == 7, out
    assert re.search(r"whole prompt +[\d.]+ms", out) and re.search(r"chunks of 128 +[\d.]+ms", out), out
    # fp32 on CPU: the resumed tokens are the straight run's (tests/test_engines.py's claim)
    assert re.search(r"float32 +same run twice: 1/1; resumed tokens equal to the straight run's: 8/8",
                     out), out


def test_the_fit_recovers_a_cost_model_its_points_were_made_from() -> None:
    truth = CostModel(c0=0.004, c_prefill=30e-6, c_decode=0.5e-3, c_kv=0.05e-6)
    shapes = [(p, 0, p + s) for p in (256, 2048, 8192) for s in (0, 8192)] + \
             [(0, b, b * (c + 1)) for b in (1, 8, 32) for c in (1024, 4096)]
    points = [StepPoint("x", p, d, k, truth.cost(p, d, k)) for p, d, k in shapes]
    fitted = fit_cost_model(points)
    for name in ("c0", "c_prefill", "c_decode", "c_kv"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_the_gpu_scripts_parse() -> None:
    for script in ("tests/gpu/bundle.sh", "tests/gpu/check.sh"):
        done = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
