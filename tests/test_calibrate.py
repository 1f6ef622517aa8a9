"""ferry calibrate: the stored result is a contract the policy reads."""

import json

import pytest

from ferry.offload.calibrate import load
from ferry.cli import main
from ferry.errors import FerryError
from ferry.offload.cost import Calibration


def test_quick_calibration_measures_the_cpu_and_stores_json(tmp_path, capsys, monkeypatch):
    import contextlib

    import ferry.progress
    from ferry.offload.calibrate import steps

    shown = []  # what the progress bar would show on a terminal: (parts done, what) after each part

    @contextlib.contextmanager
    def bar(description, total, quiet=False):
        shown.append((description, total))
        yield lambda completed, note="", total=None: shown.append((completed, note))

    monkeypatch.setattr(ferry.progress, "progress", bar)
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "-t", "1", "--out", str(out), "-q"]) == 0
    assert shown[0] == ("calibrating", steps(True)) and [c for c, _ in shown[1:]] == list(range(1, steps(True) + 1))
    assert shown[2] == (2, "Q4_0 routed experts")
    printed = capsys.readouterr().out
    assert "CPU Q4_0 GEMV (1 threads)" in printed
    data = json.loads(out.read_text())
    assert data["cpu"]["threads"] == 1
    assert f"| ggml built for | {' '.join(data['cpu']['ggml_build'])} |" in printed
    # a GEMV reads weights at well over 100 MB/s on any machine, a 512-token matmul does over 1 GFLOP/s
    assert data["cpu"]["cpu_bytes_per_s"] > 1e8 and data["cpu"]["cpu_flops"] > 1e9
    # the experts' table (Q4_0 when quick): tokens per expert rising, and more tokens never cost less time per expert
    assert list(data["cpu"]["cpu_moe"]) == ["Q4_0"]
    table = data["cpu"]["cpu_moe"]["Q4_0"]
    assert [c for c, _ in table] == [1, 4, 16, 64]
    # ferry's own kernel at one token, measured where it runs on this machine
    from ferry.kernels.cpu import native

    assert set(data["cpu"]["cpu_moe_token"]) == ({"Q4_0"} if native.library() is not None else set())
    assert all(s > 0 for s in data["cpu"]["cpu_moe_token"].values())
    assert all(c1 * s1 >= 0.5 * c0 * s0 for (c0, s0), (c1, s1) in zip(table, table[1:]))
    assert all(s0 <= s1 * 1.5 for (_, s0), (_, s1) in zip(table, table[1:]))

def test_a_calibration_of_another_ggml_build_is_stale(tmp_path):
    """The CPU's rates belong to the ggml build that measured them: a stored calibration that names other CPU
    features, or none, is measured again by the next run (runtime.loader.calibration); the current build's is kept."""
    from ferry.kernels.cpu.native import kernel_id
    from ferry.offload.calibrate import ggml_build, stale

    now = ggml_build()
    path = tmp_path / "c.json"
    cpu = {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16, "cpu_kernels": kernel_id()}
    assert stale(path) is None  # none stored: nothing stale (the run calibrates anyway)
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": list(reversed(now))}, "gpu": None}))
    assert stale(path) is None
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": now + ["amx_int8_of_another_build"]}, "gpu": None}))
    assert "other CPU features" in stale(path) and "amx_int8_of_another_build" in stale(path)
    # ferry's own kernels changed (another source, or ggml's where they measured ferry's): measured again
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": now, "cpu_kernels": "ferry-0123456789ab"}, "gpu": None}))
    assert "ferry's CPU kernels changed" in stale(path) and "ferry-0123456789ab" in stale(path)
    path.write_text(json.dumps({"cpu": {**cpu, "ggml_build": now, "cpu_kernels": None}, "gpu": None}))
    assert "not recorded" in stale(path)
    path.write_text(json.dumps({"cpu": cpu, "gpu": None}))
    assert "does not record" in stale(path)


def test_a_run_calibrates_again_when_ggml_was_rebuilt(tmp_path, monkeypatch, capsys):
    from ferry.offload import calibrate
    from ferry.runtime.loader import calibration as _calibration

    path = tmp_path / "c.json"
    gpu = {"h2d_bytes_per_s": 55e9, "h2d_latency_s": 2.3e-5, "gpu_bytes_per_s": 3e12, "gpu_flops": 8e14, "gpu_name": "x"}
    fresh = {"cpu": {"cpu_bytes_per_s": 5e10, "cpu_flops": 1e12, "threads": 16, "ggml_build": calibrate.ggml_build(),
                     "cpu_kernels": calibrate.native.kernel_id()}, "gpu": gpu}
    measured = []
    monkeypatch.setattr(calibrate, "default_path", lambda: path)
    monkeypatch.setattr(calibrate, "calibrate", lambda backend, quick: measured.append(quick) or fresh)
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
    c = load(path)  # an older file: Q4_0's table alone, as a list
    assert c.cpu_moe == {"Q4_0": ((1.0, 2e-11), (64.0, 1e-9))} and c.launch_s == 1e-5 and c.cpu_moe_token == {}
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 16,
                                        "cpu_moe": {"Q4_0": [[1, 2e-11]], "Q4_K": [[1, 3e-11]]},
                                        "cpu_moe_token": {"Q4_0": 1.5e-11}}, "gpu": gpu}))
    c = load(path)
    assert c.cpu_moe == {"Q4_0": ((1.0, 2e-11),), "Q4_K": ((1.0, 3e-11),)} and c.cpu_moe_token == {"Q4_0": 1.5e-11}
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 4e10, "cpu_flops": 1e12, "threads": 2}, "gpu": None}))
    assert load(path) is None  # no GPU: nothing to offload to
    path.write_text("{}")
    with pytest.raises(FerryError, match="not a `ferry calibrate` result"):
        load(path)


def test_a_run_measures_the_expert_types_of_its_model_that_the_calibration_lacks_once(tmp_path, monkeypatch, capsys):
    """A quick calibration measures Q4_0's experts; a model whose experts in RAM are Q8_0 gets Q8_0's table measured
    (quickly, on a real layer) and stored beside it by its first run; the next run finds it and measures nothing."""
    from ferry.offload import calibrate
    from ferry.runtime.loader import calibration as _calibration

    path = tmp_path / "c.json"
    gpu = {"h2d_bytes_per_s": 55e9, "h2d_latency_s": 2.3e-5, "gpu_bytes_per_s": 3e12, "gpu_flops": 8e14, "gpu_name": "x"}
    q4_0 = {"Q4_0": [[1, 2e-11], [64, 1e-9]]}
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 5e10, "cpu_flops": 1e12, "threads": 1, "cpu_moe": q4_0,
                                        "cpu_moe_token": {"Q4_0": 1.5e-11}, "ggml_build": calibrate.ggml_build(),
                                        "cpu_kernels": calibrate.native.kernel_id()},
                                "gpu": gpu}))
    monkeypatch.setattr(calibrate, "default_path", lambda: path)
    assert calibrate.missing_experts(path, {"Q4_0"}) == []
    assert calibrate.missing_experts(path, {"Q4_0", "Q8_0"}) == ["Q8_0"]
    c = _calibration(1, quiet=False, expert_types={"Q8_0"})
    assert "calibrating the CPU's routed experts of Q8_0" in capsys.readouterr().err
    assert set(c.cpu_moe) == {"Q4_0", "Q8_0"} and c.cpu_moe["Q4_0"] == ((1.0, 2e-11), (64.0, 1e-9))
    assert [t for t, _ in c.cpu_moe["Q8_0"]] == [1, 4, 16, 64] and all(s > 0 for _, s in c.cpu_moe["Q8_0"])
    assert c.cpu_moe_token == {"Q4_0": 1.5e-11}  # ferry's kernel does not run Q8_0: no rate of it to measure
    _calibration(1, quiet=False, expert_types={"Q8_0"})
    assert "calibrating" not in capsys.readouterr().err


def test_a_calibration_without_the_kernels_rate_measures_it_where_the_kernel_runs(tmp_path):
    from ferry.offload import calibrate
    from ferry.kernels.cpu import native

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 5e10, "cpu_flops": 1e12, "threads": 1,
                                        "cpu_moe": [[1, 2e-11]]}, "gpu": None}))  # a file of before session 22
    assert calibrate.missing_experts(path, {"Q4_0"}) == (["Q4_0"] if native.library() is not None else [])
