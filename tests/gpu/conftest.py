"""What the CUDA tests share: the device they run on, and a rehearsal of them on CPU where no GPU is lent.

On a machine with CUDA these tests train at world size 1 on ``cuda:0`` with NCCL (two ranks would need two GPUs:
NCCL runs one rank per GPU). ``LIGHTNING_STRATEGIES_GPU_REHEARSAL=1`` runs the same tests on one CPU process with
gloo instead, so their own logic is checked before a GPU machine is lent (fp16 autocast cases are skipped there:
Lightning refuses ``16-mixed`` on CPU). A rehearsal proves nothing about CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

REHEARSAL = os.environ.get("LIGHTNING_STRATEGIES_GPU_REHEARSAL") == "1"
ACCELERATOR = "cpu" if REHEARSAL else "gpu"
BACKEND = "gloo" if REHEARSAL else "nccl"

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() and not REHEARSAL,
    reason="needs a CUDA GPU: see docs/gpu.md (scripts/gpu_prepare.py prints the device call);"
    " LIGHTNING_STRATEGIES_GPU_REHEARSAL=1 rehearses these tests on CPU",
)
needs_fp16_autocast = pytest.mark.skipif(REHEARSAL, reason="Lightning runs 16-mixed on CUDA only")
#: Trainer arguments for one rank on the device under test (``cuda:0``, or the CPU in a rehearsal).
ONE_DEVICE: dict[str, Any] = {"accelerator": ACCELERATOR, "devices": 1}
