#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install what is missing from the carried .whl folder, run the
# GPU tests (tests_gpu/: kernels against the reference), and print a short summary.
#   carry .whl (gguf wheel); results in $OUT (default ./out)
set -euo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/gguf-*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q tests_gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.txt" | tail -15
