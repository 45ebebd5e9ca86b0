#!/usr/bin/env bash
# The real-GPU check of the cuda platform (issue 9), for a machine with an NVIDIA GPU, a CUDA
# build of torch and octavo installed (make install, then a CUDA torch in the same venv):
#   1. the conformance suite on the GPU, no interpreter (every kernel against octavo.ops.reference);
#   2. the cuda kernel tests on the GPU (not the slow end-to-end ones);
#   3. a short throughput benchmark: each Triton kernel against the torch reference on the same GPU.
# Budget: 8 minutes in all; each stage has its own timeout and the total is checked at the end.
# Without a usable GPU it stops at once, saying why (exit 2); use `python ci/run_leg.py
# cuda-interpret` there instead. Usage:
#   ci/device-check.sh              # PY defaults to .venv/bin/python, else python3
#   PY=/path/to/python ci/device-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
unset TRITON_INTERPRET OCTAVO_TRITON_INTERPRET_DEVICE OCTAVO_PLATFORM
BUDGET_S=480
started=$SECONDS

if ! command -v nvidia-smi >/dev/null 2>&1 && ! compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
  echo "device-check: needs an NVIDIA GPU: no nvidia-smi on PATH and no /dev/nvidia* device here." >&2
  echo "Without a GPU run the interpreter leg instead: python ci/run_leg.py cuda-interpret" >&2
  exit 2
fi

if ! "$PY" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("device-check: torch is not installed for this python; run make install (and a CUDA build of torch)")
why = None
if torch.version.cuda is None:
    why = f"torch {torch.__version__} is not a CUDA build (torch.version.cuda is None)"
elif not torch.cuda.is_available():
    why = "torch.cuda.is_available() is False: no NVIDIA GPU visible (check the driver, nvidia-smi, CUDA_VISIBLE_DEVICES)"
if why:
    sys.exit(f"device-check: needs an NVIDIA GPU: {why}.\n"
             "Without a GPU run the interpreter leg instead: python ci/run_leg.py cuda-interpret")
major, minor = torch.cuda.get_device_capability()
print(f"device-check: {torch.cuda.get_device_name()} (sm_{major}{minor}), torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
then
  exit 2
fi

stage() {  # stage NAME SECONDS COMMAND...: run with a timeout, report the wall time
  local name=$1 limit=$2 t0=$SECONDS rc=0
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" || rc=$?
  if [[ $rc -eq 124 ]]; then echo "device-check: $name ran past its ${limit}s limit" >&2; fi
  echo "== $name: rc=$rc in $((SECONDS - t0))s"
  return $rc
}

stage "conformance (cuda, no interpreter)" 240 "$PY" -m pytest -x -q -p no:cacheprovider \
  --pyargs octavo.testing.conformance --octavo-platform cuda
stage "cuda kernel tests" 110 "$PY" -m pytest -x -q -p no:cacheprovider tests/platforms/cuda -m "not slow"
stage "throughput: triton vs reference" 110 "$PY" -m octavo_cuda.bench

total=$((SECONDS - started))
echo "device-check: passed in ${total}s (budget ${BUDGET_S}s)"
if (( total > BUDGET_S )); then
  echo "device-check: over the ${BUDGET_S}s budget" >&2
  exit 1
fi
