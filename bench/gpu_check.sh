#!/usr/bin/env bash
# GPU check of the Triton paged-decode kernel: correctness against the torch reference, then
# timings with the read check on and off (plain paged decode). Under 7 minutes on one GPU.
# Run on a CUDA machine from the repository root; writes $OUT/gpu_check.json (or bench/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 420 "$PY" bench/gpu_check.py  # GPU_CHECK_SWEEP=dot: the finer tl.dot sweep
