#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and a CUDA build of torch with octavo installed: the cuda
# conformance suite and the cuda tests on the GPU (no interpreter), then the kernel benchmark
# (Triton vs octavo.ops.reference on the same GPU). Budget: under 8 minutes.
#   PY=python3 platforms/cuda/device-check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
unset TRITON_INTERPRET OCTAVO_TRITON_INTERPRET_DEVICE
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name())"
timeout 240 "$PY" -m pytest -x -q --pyargs octavo.testing.conformance --octavo-platform cuda
timeout 120 "$PY" -m pytest -x -q tests/platforms/cuda -m "not slow"
timeout 90 "$PY" -m octavo_cuda.bench
