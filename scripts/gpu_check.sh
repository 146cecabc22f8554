#!/usr/bin/env bash
# GPU check, for a machine with CUDA (never needed by CI): CUDA + NCCL on 1 GPU at world size 1, then the CPU
# suite on the same machine with CUDA hidden (the CPU patches apply only where CUDA is absent).
# Uses the machine's CUDA build of torch (system site packages) and installs the rest at the tested versions.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'"
python3 -m venv --system-site-packages .venv-gpu
.venv-gpu/bin/python -m pip install --quiet "pytorch-lightning==2.6.6" "fairscale==0.4.13" pytest pytest-timeout
.venv-gpu/bin/python -m pip install --quiet --no-deps -e .
.venv-gpu/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
.venv-gpu/bin/python -m pytest tests/gpu -q -p no:cacheprovider
CUDA_VISIBLE_DEVICES="" .venv-gpu/bin/python -m pytest tests -q -x -p no:cacheprovider --ignore=tests/gpu
