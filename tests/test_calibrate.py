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
    printed = capsys.readouterr().out
    assert "CPU Q4_0 GEMV (1 threads)" in printed
    data = json.loads(out.read_text())
    assert data["cpu"]["threads"] == 1
    assert f"| ggml built for | {' '.join(data['cpu']['ggml_build'])} |" in printed
    # a GEMV reads weights at well over 100 MB/s on any machine, a 512-token matmul does over 1 GFLOP/s
    assert data["cpu"]["cpu_bytes_per_s"] > 1e8 and data["cpu"]["cpu_flops"] > 1e9
    # the experts' table: tokens per expert rising, and more tokens never cost less time per expert
    table = data["cpu"]["cpu_moe"]
    assert [c for c, _ in table] == [1, 4, 16, 64]
    assert all(c1 * s1 >= 0.5 * c0 * s0 for (c0, s0), (c1, s1) in zip(table, table[1:]))
    assert all(s0 <= s1 * 1.5 for (_, s0), (_, s1) in zip(table, table[1:]))

def test_a_calibration_of_another_ggml_build_is_stale(tmp_path):
    """The CPU's rates belong to the ggml build that measured them: a stored calibration that names other CPU
    features, or none, is measured again by the next run (cli._calibration); the current build's is kept."""
    from ferry.calibrate import ggml_build, stale

    now = ggml_build()
    path = tmp_path / "c.json"
    cpu = {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16}
    assert stale(path) is None  # none stored: nothing stale (the run calibrates anyway)
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": list(reversed(now))}, "gpu": None}))
    assert stale(path) is None
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": now + ["amx_int8_of_another_build"]}, "gpu": None}))
    assert "other CPU features" in stale(path) and "amx_int8_of_another_build" in stale(path)
    path.write_text(json.dumps({"cpu": cpu, "gpu": None}))
    assert "does not record" in stale(path)


def test_a_run_calibrates_again_when_ggml_was_rebuilt(tmp_path, monkeypatch, capsys):
    from ferry import calibrate
    from ferry.cli import _calibration

    path = tmp_path / "c.json"
    gpu = {"h2d_bytes_per_s": 55e9, "h2d_latency_s": 2.3e-5, "gpu_bytes_per_s": 3e12, "gpu_flops": 8e14, "gpu_name": "x"}
    fresh = {"cpu": {"cpu_bytes_per_s": 5e10, "cpu_flops": 1e12, "threads": 16, "ggml_build": calibrate.ggml_build()},
             "gpu": gpu}
    measured = []
    monkeypatch.setattr(calibrate, "default_path", lambda: path)
    monkeypatch.setattr(calibrate, "calibrate", lambda threads, quick: measured.append(quick) or fresh)
    path.write_text(json.dumps({"cpu": {**fresh["cpu"], "cpu_bytes_per_s": 1e9, "ggml_build": ["sse3"]}, "gpu": gpu}))
    assert _calibration(16, quiet=False).cpu_bytes_per_s == 5e10 and measured == [True]
    assert "calibrating this machine for the offload policy (again, as ggml was built" in capsys.readouterr().err
    assert _calibration(16, quiet=False).cpu_bytes_per_s == 5e10 and measured == [True]  # now current: kept


def test_the_policy_reads_a_stored_calibration(tmp_path):
    path = tmp_path / "c.json"
    gpu = {"h2d_bytes_per_s": 55e9, "h2d_latency_s": 2.3e-5, "gpu_bytes_per_s": 3e12, "gpu_flops": 8e14, "gpu_name": "x"}
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16}, "gpu": gpu}))
    assert load(path) == Calibration(h2d_bytes_per_s=55e9, h2d_latency_s=2.3e-5, cpu_bytes_per_s=4e10,
                                     cpu_flops=1e12, gpu_bytes_per_s=3e12, gpu_flops=8e14)  # an older file: no table
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16,
                                        "cpu_moe": [[1, 2e-11], [64, 1e-9]]}, "gpu": {**gpu, "launch_s": 1e-5}}))
    c = load(path)
    assert c.cpu_moe == ((1.0, 2e-11), (64.0, 1e-9)) and c.launch_s == 1e-5
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 2}, "gpu": None}))
    assert load(path) is None  # no GPU: nothing to offload to
    path.write_text("{}")
    with pytest.raises(FerryError, match="not a `ferry calibrate` result"):
        load(path)
