"""The device the torch tests run on.

``QOS_TEST_DEVICE`` names it: ``cpu`` (the default, and what CI runs) or ``cuda`` /
``cuda:N`` on a GPU machine (``tests/gpu_check.sh`` runs the torch tests there). The tests
build their models in fp32 on this device whatever it is: they compare logits at fp32
tolerance, and CUDA's fp32 matmuls keep exact-enough arithmetic (TF32 is off by default).
"""

from __future__ import annotations

import os
import re

import torch

DEVICE = os.environ.get("QOS_TEST_DEVICE", "cpu")
if re.fullmatch(r"cpu|cuda(:\d+)?", DEVICE) is None:
    raise RuntimeError(f"QOS_TEST_DEVICE must be cpu, cuda or cuda:N, got {DEVICE!r}")
if DEVICE != "cpu" and not torch.cuda.is_available():
    raise RuntimeError(f"QOS_TEST_DEVICE={DEVICE} but torch sees no CUDA device")

ON_GPU = DEVICE != "cpu"
