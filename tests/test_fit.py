"""The fit (ferry/offload/fit.py): where no -ngl / -ot is given and a GPU is visible (or sized by --gpu-memory), the
GPU is filled in order with the other weights, the KV cache, the buffers, then routed experts; -c shrinks to fit down
to --fit-ctx. Planned without a GPU, from files of real shapes written with `ferry synth --shape-only`."""

import json
import subprocess
import sys

import pytest

from ferry.cli import main
from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.layers.cache import cache_layout
from ferry.models.base import ModelArgs
from ferry.offload.fit import FIT_TARGET_MIB, fit, placed, spread
from ferry.placement import GIB
from ferry.runtime.loader import RunConfig, load

MIB = 1 << 20


@pytest.fixture(scope="module")
def qwen12(tmp_path_factory):
    """Qwen3-30B-A3B's shapes in 12 layers (4.66 GiB, Q4_0 experts), written sparse in seconds."""
    path = tmp_path_factory.mktemp("fit") / "q12.gguf"
    assert main(["synth", "qwen3-30b-a3b", "--layers", "12", "--shape-only", "-o", str(path), "-q"]) == 0
    return path


def _fit(path, gib: float, n_ctx: int = 4096, **kw):
    f = GGUFFile(path)
    args = ModelArgs.from_gguf(f)
    return fit({t.name: t.nbytes for t in f.tensors.values()}, args, cache_layout(args, 0), (2, 2), "CUDA0",
               int(gib * GIB), n_ctx, 512, 2048, **kw)


def test_spread_takes_layers_evenly():
    assert spread(list(range(12)), 0) == [] and spread(list(range(12)), 1) == [6]
    assert spread(list(range(12)), 3) == [2, 6, 10] and spread(list(range(12)), 12) == list(range(12))
    assert spread([1, 3, 5, 7], 2) == [3, 7]


def test_plan_fills_a_4_gib_gpu_with_the_weights_the_cache_the_buffers_and_routed_experts(qwen12):
    """The issue's check, with no GPU: `ferry plan --gpu-memory CUDA0=4GiB --json` and no placement flags."""
    r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(qwen12), "--gpu-memory", "CUDA0=4GiB",
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    gpu = next(d for d in plan["devices"] if d["device"] == "CUDA0")
    assert gpu["total"] >= 0.6 * 4 * GIB and gpu["total"] <= 4 * GIB - FIT_TARGET_MIB * MIB
    assert plan["fit"]["expert_layers"] and plan["fit"]["n_ctx"] == 4096
    cpu = next(d for d in plan["devices"] if d["device"] == "CPU")
    assert 0 < cpu["weights"] < GGUFFile(qwen12).n_bytes  # the rest of the experts stay in RAM


def test_more_room_takes_more_layers_of_experts_spread_evenly_and_all_at_last(qwen12):
    sizes = [_fit(qwen12, gib) for gib in (4, 5, 6, 8)]
    counts = [len(s.expert_layers) for s in sizes]
    assert counts == sorted(counts) and counts[0] < counts[-1] == 12
    assert sizes[1].expert_layers == tuple(spread(list(range(12)), counts[1]))
    for s, gib in zip(sizes, (4, 5, 6, 8)):
        gpu = next(d for d in s.plan.devices if d.device == "CUDA0")
        assert gpu.total <= gib * GIB - FIT_TARGET_MIB * MIB
    assert sizes[0].gpu_share == counts[0] / 12
    assert "exps=CPU" in sizes[0].flags() and f"blk\\.({sizes[0].expert_layers[0]})" in sizes[0].flags()


def test_a_context_that_does_not_fit_shrinks_to_what_does_and_no_lower_than_fit_ctx(qwen12):
    big = _fit(qwen12, 4, n_ctx=400_000)
    assert 4096 <= big.n_ctx < 400_000 and "-c 400000 does not fit" in big.notes[0] and not big.expert_layers
    assert _fit(qwen12, 4, n_ctx=big.n_ctx + 1024).n_ctx == big.n_ctx  # the most that fits, found again
    with pytest.raises(FerryError, match="--fit: CUDA0.*hold no run with the routed experts in RAM"):
        _fit(qwen12, 1.8)
    with pytest.raises(FerryError, match="no more than the --fit-target margin"):
        _fit(qwen12, 0.5)


def test_the_fit_is_only_the_default(qwen12, tiny):
    f = GGUFFile(qwen12)
    args = ModelArgs.from_gguf(f)
    room = {"CUDA0": 8 * GIB}
    cfg, fitted = placed(RunConfig(qwen12), f, args, cache_layout(args, 0), room)
    assert fitted is not None and cfg.n_gpu_layers == 999 and cfg.override_tensor == fitted.override_tensor
    for given in (RunConfig(qwen12, n_gpu_layers=0), RunConfig(qwen12, override_tensor=["exps=CPU"]),
                  RunConfig(qwen12, fit=False)):
        cfg, fitted = placed(given, f, args, cache_layout(args, 0), room)
        assert fitted is None and cfg.n_gpu_layers == (given.n_gpu_layers or 0)
    assert placed(RunConfig(qwen12), f, args, cache_layout(args, 0), {})[1] is None  # no GPU: the CPU
    # a run on a machine without a GPU stays on the CPU whatever --gpu-memory says
    loaded = load(RunConfig(tiny, n_threads=1, quiet=True, gpu_memory=["CUDA0=4GiB"]))
    assert loaded.fit is None and loaded.backend.kv_devices(1) is None


@pytest.mark.parametrize("flags, says", [(["--fit-target", "-5"], "--fit-target"), (["--fit-target", "x"], "--fit-target"),
                                         (["--fit-ctx", "0"], "--fit-ctx"), (["--fit", "maybe"], "invalid choice")])
def test_bad_fit_flags_are_one_line(tiny, flags, says, capsys):
    assert main(["plan", "-m", str(tiny), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_plan_prints_the_fitted_placement_and_fit_off_keeps_the_cpu(qwen12, capsys):
    assert main(["plan", "-m", str(qwen12), "--gpu-memory", "CUDA0=6GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fit: every weight but the routed experts on the GPU, and the routed experts of")
    assert main(["plan", "-m", str(qwen12), "--gpu-memory", "CUDA0=6GiB", "--fit", "off", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fit"] is None and all(d["weights"] == 0 for d in plan["devices"] if d["device"] == "CUDA0")
