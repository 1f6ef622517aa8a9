"""The GPU kernels' tests (tests_gpu/test_kernels.py: every Triton kernel against a float64 reference, many shapes)
on this machine's CPU, under Triton's interpreter, so that a kernel change is checked without a GPU. They run in a
child pytest because TRITON_INTERPRET must be set before Triton is first imported."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_kernels_match_float64_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_gpu/test_kernels.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    print(summary)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary
