"""ferry calibrate: the stored result is a contract the policy reads."""

import json

import pytest

from ferry.calibrate import load
from ferry.cli import main
from ferry.errors import FerryError
from ferry.policy import Calibration


def test_quick_calibration_measures_the_cpu_and_stores_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "-t", "1", "--out", str(out), "-q"]) == 0
    assert "CPU Q4_0 GEMV (1 threads)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["cpu"]["threads"] == 1
    # a GEMV reads weights at well over 100 MB/s on any machine, a 512-token matmul does over 1 GFLOP/s
    assert data["cpu"]["cpu_bytes_per_s"] > 1e8 and data["cpu"]["cpu_flops"] > 1e9


def test_the_policy_reads_a_stored_calibration(tmp_path):
    path = tmp_path / "c.json"
    gpu = {"h2d_bytes_per_s": 55e9, "h2d_latency_s": 2.3e-5, "gpu_bytes_per_s": 3e12, "gpu_flops": 8e14, "gpu_name": "x"}
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16}, "gpu": gpu}))
    assert load(path) == Calibration(h2d_bytes_per_s=55e9, h2d_latency_s=2.3e-5, cpu_bytes_per_s=4e10,
                                     cpu_flops=1e12, gpu_bytes_per_s=3e12, gpu_flops=8e14)
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 2}, "gpu": None}))
    assert load(path) is None  # no GPU: nothing to offload to
    path.write_text("{}")
    with pytest.raises(FerryError, match="not a `ferry calibrate` result"):
        load(path)
