"""The GPU kernels' tests (tests_gpu/test_kernels.py: every Triton kernel against a float64 reference, many shapes)
and the GPU decode forward against the CPU's logits (tests_gpu/test_decode_forward.py) on this machine's CPU, under
Triton's interpreter, so that a kernel or GPU-forward change is checked without a GPU. They run in a child pytest
because TRITON_INTERPRET must be set before Triton is first imported."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_kernels_and_the_gpu_decode_forward_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_gpu/test_kernels.py",
                          "tests_gpu/test_decode_forward.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    print(summary)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary
