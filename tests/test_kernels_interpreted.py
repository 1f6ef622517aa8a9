"""The GPU kernels' tests (tests_gpu/test_kernels.py: every Triton kernel against a float64 reference, many shapes)
and the GPU decode forward against the CPU's logits (tests_gpu/test_decode_forward.py) on this machine's CPU, under
Triton's interpreter, so that a kernel or GPU-forward change is checked without a GPU. They run in a child pytest
because TRITON_INTERPRET must be set before Triton is first imported. The child takes minutes of one core: it
starts as soon as this test is selected (tests/conftest.py), beside the rest of the suite, and this test, moved
to the end, waits for it."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1500  # the child ends within CI's 10 minutes on the dev VM (21.5 before its programs were widened)
CHILD = pytest.StashKey[tuple]()  # the running child and its log (start()), set by tests/conftest.py


def start() -> tuple[subprocess.Popen, Path]:
    """The child pytest, running; its output goes to a file (a pipe nobody reads until the end could fill)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    fd, name = tempfile.mkstemp(prefix="ferry-interpreted-", suffix=".log")
    log = Path(name)
    with os.fdopen(fd, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "tests_gpu/test_kernels.py", "tests_gpu/test_decode_forward.py"],
                                 cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return child, log


def test_the_triton_kernels_and_the_gpu_decode_forward_pass_under_the_interpreter(request):
    child, log = request.config.stash[CHILD]  # started at collection; tests/conftest.py kills it and removes its log
    child.wait(timeout=TIMEOUT_S)
    text = log.read_text()
    summary = text.strip().splitlines()[-1] if text.strip() else ""
    print(summary)
    assert child.returncode == 0, text[-6000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary
