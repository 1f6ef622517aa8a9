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
    assert plan["fit"]["experts_per_layer"] and plan["fit"]["n_ctx"] == 4096
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
    layers = "|".join(map(str, sizes[0].expert_layers))
    assert "exps=CPU" in sizes[0].flags() and f"blk\\.({layers})\\.ffn_" in sizes[0].flags()


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


def test_gpu_experts_text_round_trips_and_mistakes_are_one_line(tiny, capsys):
    from ferry.placement import format_gpu_experts, parse_gpu_experts

    spec = parse_gpu_experts("3:0-3,7;10:5; 3:9")
    assert spec == {3: (0, 1, 2, 3, 7, 9), 10: (5,)} and format_gpu_experts(spec) == "3:0-3,7,9;10:5"
    assert parse_gpu_experts(format_gpu_experts(spec)) == spec and parse_gpu_experts(None) == {}
    for bad in ("3", "3:", "x:1", "3:5-2", "3:-1"):
        with pytest.raises(FerryError, match="--gpu-experts"):
            parse_gpu_experts(bad)
    assert main(["plan", "-m", str(tiny), "--gpu-experts", "0:0-1"]) == 2  # no placement that leaves them in RAM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-ngl 999 -ot exps=CPU --gpu-experts" in err[0]


def test_resident_experts_count_on_the_gpu_in_the_memory_plan(qwen12):
    from ferry.placement import memory_plan, parse_overrides

    f = GGUFFile(qwen12)
    args = ModelArgs.from_gguf(f)
    tensors = {t.name: t.nbytes for t in f.tensors.values()}
    layer = sum(tensors[f"blk.3.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))

    def gpu(resident):
        plan = memory_plan(tensors, args, 999, parse_overrides(["exps=CPU"]), ["CUDA0"], {}, 4096, 512,
                           kv_on_gpu=True, resident=resident)
        return next(d for d in plan.devices if d.device == "CUDA0").weights
    assert gpu({3: tuple(range(32))}) - gpu({}) == layer * 32 // args.n_expert
    assert gpu({3: (0,), 5: (1, 2)}) - gpu({}) == 3 * (layer // args.n_expert)


def test_the_room_left_by_whole_layers_takes_experts_of_one_more(qwen12):
    whole, per_expert = _fit(qwen12, 5), _fit(qwen12, 5, per_expert=True)
    assert per_expert.expert_layers == whole.expert_layers and len(per_expert.resident) == 1
    (layer, ids), = per_expert.resident.items()
    assert layer not in whole.expert_layers and ids == tuple(range(len(ids))) and 0 < len(ids) < 128
    used = [next(d for d in s.plan.devices if d.device == "CUDA0").total for s in (whole, per_expert)]
    assert used[0] < used[1] <= 5 * GIB - FIT_TARGET_MIB * MIB
    assert per_expert.gpu_share == pytest.approx((len(whole.expert_layers) + len(ids) / 128) / 12)
    assert f"--gpu-experts '{layer}:0-{len(ids) - 1}'" in per_expert.flags()
    assert per_expert.experts_per_layer()[layer] == len(ids)


def test_counted_routing_puts_the_most_used_experts_first(qwen12):
    import numpy as np

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(12, 128))
    counts[:, :16] += 1000  # sixteen busy experts in every layer
    counts[4] += 10_000  # and a layer where every expert is busier than any other layer's
    held = counts // 2
    r = _fit(qwen12, 4, per_expert=True, routing={"counts": counts.tolist(), "held_counts": held.tolist()})
    assert 4 in r.expert_layers  # all of its experts chosen: placed whole
    for layer, ids in r.resident.items():
        assert set(range(16)) <= set(ids) or len(ids) < 16 and set(ids) < set(range(16))
    on = sum(len(ids) for ids in r.resident.values()) + 128 * len(r.expert_layers)
    uniform = on / (12 * 128)
    assert r.counted_share > 2 * uniform and r.held_out_share == pytest.approx(r.gpu_share)
    gpu = next(d for d in r.plan.devices if d.device == "CUDA0")
    assert gpu.total <= 4 * GIB - FIT_TARGET_MIB * MIB
    assert r.layer_share[next(iter(r.resident))] > 0.9  # the busy sixteen carry nearly every pair of their layer
    # routing nearly even: the most used experts catch little more than whole layers do, and whole layers stay
    even = np.full((12, 128), 100) + rng.integers(0, 3, size=(12, 128))
    flat = _fit(qwen12, 5, per_expert=True, routing={"counts": even.tolist()})
    assert flat.expert_layers == _fit(qwen12, 5).expert_layers and len(flat.resident) <= 1
    assert "layer by layer" in flat.notes[-1]
    # counts of another shape than this model's are not used
    other = _fit(qwen12, 5, per_expert=True, routing={"counts": [[1, 2]]})
    assert other.counted_share is None and other.expert_layers == _fit(qwen12, 5).expert_layers


def test_plan_uses_the_routing_counted_for_the_file(qwen12, tmp_path, monkeypatch, capsys, request):
    import numpy as np

    from ferry.config import settings
    from ferry.offload import routing

    monkeypatch.setenv("FERRY_CACHE", str(tmp_path))
    settings.cache_clear()  # read once per process: this test's cache, then the run's again
    request.addfinalizer(settings.cache_clear)
    counts = np.ones((12, 128), dtype=int)
    counts[:, 100:] = 50
    routing.save({"model": qwen12.name, "key": routing.model_key(qwen12), "counts": counts.tolist(),
                  "held_counts": counts.tolist()}, routing.default_path(qwen12))
    assert main(["plan", "-m", str(qwen12), "--gpu-memory", "CUDA0=5GiB", "--json"]) == 0
    fit_view = json.loads(capsys.readouterr().out)["fit"]
    assert fit_view["gpu_share_basis"].startswith("on the text held out")
    per_layer = fit_view["experts_per_layer"]
    assert sum(per_layer.values()) >= 12 * 20 and fit_view["gpu_experts"]
    assert all(set(map(int, part.split(":")[1].replace("-", ",").split(","))) >= {100}
               for part in fit_view["gpu_experts"].split(";"))
    assert main(["plan", "-m", str(qwen12), "--gpu-memory", "CUDA0=5GiB"]) == 0
    assert "routed experts on the GPU per MoE layer" in capsys.readouterr().out


def test_experts_the_split_kernels_do_not_read_stage_as_copied_and_count_one_scratch(qwen12, tmp_path):
    """A Q4_K_M file's experts (the split kernels read Q8_0, Q4_0 and MXFP4 alone) stream as copied: two staging sets
    of three buffers of the largest expert tensor, which the plan counts and the fit leaves room for (before, both sets
    held a layer's experts in bfloat16 too: 2.25 GiB at Qwen3-30B-A3B's shapes). kquant.py's grouped GEMM reads them
    in place; experts of a type no kernel reads (IQ4_XS: `expanded`) add one bfloat16 scratch of a projection that
    prompts expand into, shared with the GPU's own such experts and the ones it keeps."""
    from ferry.placement import expanded_layers, expanding_layers, memory_plan, parse_overrides

    km = tmp_path / "q12km.gguf"
    assert main(["synth", "qwen3-30b-a3b", "--layers", "12", "--shape-only", "--expert-type", "q4_k_m",
                 "-o", str(km), "-q"]) == 0
    f, q4 = GGUFFile(km), GGUFFile(qwen12)
    args = ModelArgs.from_gguf(f)
    assert expanding_layers(f.tensors.values()) == frozenset(range(12))
    assert expanded_layers(f.tensors.values()) == frozenset()
    assert expanding_layers(q4.tensors.values()) == frozenset() == expanded_layers(q4.tensors.values())
    tensors = {t.name: t.nbytes for t in f.tensors.values()}
    layer = {i: sum(t.nbytes for t in f.tensors.values() if t.name.startswith(f"blk.{i}.") and "_exps." in t.name)
             for i in range(12)}
    largest = max(t.nbytes for t in f.tensors.values() if "_exps." in t.name)
    assert largest > min(t.nbytes for t in f.tensors.values() if "_exps." in t.name)  # Q6_K downs beside Q4_K ones

    def compute(expands, rules=("exps=CPU",), resident=None, expanded=None):
        plan = memory_plan(tensors, args, 999, parse_overrides(list(rules)), ["CUDA0"], {}, 4096, 512,
                           kv_on_gpu=True, expands=expands, resident=resident, expanded=expanded)
        return next(d for d in plan.devices if d.device == "CUDA0").compute

    every, none = frozenset(range(12)), frozenset()
    assert compute(every, expanded=none) - compute(none) == 6 * largest - max(layer.values()) - largest
    assert compute(every, (), expanded=none) == compute(none, ())  # on the GPU: read in place, nothing expanded
    scratch = 2 * args.n_embd * args.n_ff_exp * args.n_expert
    assert scratch == 384 * MIB
    spread = max(layer.values()) + largest  # what the Q4_0-read layers stage: a layer of slots, a tensor's landing
    assert compute(every) - compute(none) == 6 * largest + scratch - spread
    # one such layer in RAM: its own sets and the scratch beside the other layers' slots and landing buffer
    assert compute(frozenset({0})) - compute(none) == (
        6 * largest + scratch + max(v for i, v in layer.items() if i) + largest - spread)
    assert compute(every) < compute(none) + 1.5 * 2 ** 30
    # every expert on the GPU: nothing streams; a prompt expands one projection of a layer at a time, in one scratch
    assert compute(every, ()) - compute(none, ()) == scratch
    # layers 0-5 on the GPU, some of 6's kept there: one scratch for all
    half = (r"blk\.[0-5]\.ffn_.*_exps=CUDA0", "exps=CPU")
    assert compute(every, half, {6: (1, 2)}) - compute(none, half, {6: (1, 2)}) == (
        6 * largest + scratch - max(v for i, v in layer.items() if i > 5) - largest)
    room = 6
    plain = _fit(km, room, per_expert=True)
    counted = _fit(km, room, per_expert=True, expands=expanding_layers(f.tensors.values()))
    placed = [(len(x.expert_layers), sum(map(len, x.resident.values()))) for x in (counted, plain)]
    assert placed[0] < placed[1] and placed[0][0] >= 5, placed  # a few experts fewer, not layers
    gpu = next(d for d in counted.plan.devices if d.device == "CUDA0")
    assert gpu.total <= room * GIB - FIT_TARGET_MIB * MIB and gpu.compute >= 6 * largest + scratch


def test_gpt_oss_experts_stream_in_place_and_biased_expanded_ones_stage_nothing(tmp_path):
    """gpt-oss's MXFP4 experts are read in place by the GPU's kernels, biases and all: no bfloat16 scratch on the GPU,
    and in RAM they stage a layer of their own bytes and one tensor's. Biased experts of a type the GPU would expand are never
    streamed (the CPU runs them): the plan keeps no staging buffers for them."""
    from ferry.placement import expanding_layers, memory_plan, parse_overrides

    path = tmp_path / "gpt-oss.gguf"
    assert main(["synth", "gpt-oss-20b", "--layers", "4", "--shape-only", "--expert-type", "mxfp4", "-o", str(path),
                 "-q"]) == 0
    f = GGUFFile(path)
    args = ModelArgs.from_gguf(f)
    tensors = {t.name: t.nbytes for t in f.tensors.values()}
    assert expanding_layers(f.tensors.values()) == frozenset()

    def compute(rules, expands=frozenset()):
        plan = memory_plan(tensors, args, 999, parse_overrides(list(rules)), ["CUDA0"], {}, 4096, 512,
                           kv_on_gpu=True, expands=expands)
        return next(d for d in plan.devices if d.device == "CUDA0").compute

    projection = 2 * args.n_embd * args.n_ff_exp * args.n_expert  # one of a layer's, in bfloat16
    layer = sum(tensors[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    on_gpu, in_ram = compute([]), compute(["exps=CPU"])
    largest = max(tensors[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    # read in place: a layer of their own bytes staged and the buffer copies land in, nothing expanded on either side
    assert in_ram - on_gpu == layer + largest
    # were they expanded (a type the GPU does not read), the biased ones would stay with the CPU: nothing staged
    expanded = frozenset(range(4))
    assert compute(["exps=CPU"], expanded) == in_ram - layer - largest
    assert compute([], expanded) == on_gpu + projection  # on the GPU, a prompt's scratch for one projection
