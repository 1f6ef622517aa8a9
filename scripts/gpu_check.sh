#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install what is missing from the carried .whl folder (gguf;
# ggml-python built on the carried llama.cpp tree's ggml, for the CPU results the GPU is checked against),
# run the GPU tests (tests_gpu/: kernels against the reference dequantizer, the GPU forward against the CPU
# one), and print a short summary.
#   carry .whl (gguf wheel, ggml-python sdist, llama.cpp-src.tar.gz); results in $OUT (default ./out)
set -euo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/gguf-*.whl
export FERRY_CACHE=/tmp/ferry-cache
python3 -c "import ggml" 2>/dev/null || python3 benchmarks/llamacpp.py ggml-python .whl/ggml_python-*.tar.gz \
    .whl/llama.cpp-src.tar.gz > "$OUT/ggml_python_build.log" 2>&1 || { tail -20 "$OUT/ggml_python_build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -s tests_gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.txt" | tail -15
# this machine, as the offload policy sees it
python3 -m ferry calibrate -t 16 --out "$OUT/calibration.json" -q | tee "$OUT/calibration.md"
# benchmarks: the all-GPU path (eager, float32 scratch: the first form) on the synthetic mid model
python3 -m ferry synth qwen3-moe-mid -o /tmp/mid.gguf -q
python3 -m ferry bench -m /tmp/mid.gguf -ngl 999 -p 512 -n 64 -r 3 | tee "$OUT/bench_gpu_mid.md"
python3 -m ferry bench -m /tmp/mid.gguf -ngl 0 -t 16 -p 512 -n 64 -r 3 | tail -2 | tee -a "$OUT/bench_gpu_mid.md"
