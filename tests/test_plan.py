"""Placement over several GPUs and the memory plan: what goes where, what does not fit, and what to change."""

import json
import re
import subprocess
import sys

import pytest

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.models.base import ModelArgs
from ferry.config import settings
from ferry.placement import layer_devices, memory_plan, parse_size, place

PROMPT_GRAPH_MAX = settings().prompt_graph_max  # FERRY_PROMPT_GRAPH_MAX


def test_layers_split_over_gpus_in_proportion():
    # 4 layers + output; -ngl 999: all five on GPUs, equal split 3/2 (rounded), 3:1 split 4/1
    assert layer_devices(4, 999, ["CUDA0", "CUDA1"]) == ["CUDA0", "CUDA0", "CUDA1", "CUDA1", "CUDA1"]
    assert layer_devices(4, 999, ["CUDA0", "CUDA1"], [3, 1]) == ["CUDA0"] * 4 + ["CUDA1"]
    # -ngl 2: the last two (layer 3 and the output) go to the GPU, the rest stays on the CPU
    assert layer_devices(4, 2, ["CUDA0"]) == ["CPU", "CPU", "CPU", "CUDA0", "CUDA0"]
    assert layer_devices(4, 0, ["CUDA0"]) == ["CPU"] * 5


def test_sizes_parse():
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("512 MiB") == 512 * 2**20 and parse_size("1.5G") == 3 * 2**29


def _plan(tiny, ngl, available, ot=(), n_ctx=4096, kv=(2, 2), kv_on_gpu=False):
    from ferry.placement import parse_overrides

    f = GGUFFile(tiny)
    sizes = {t.name: t.nbytes for t in f.tensors.values()}
    return memory_plan(sizes, ModelArgs.from_gguf(f), ngl, parse_overrides(list(ot)), ["CUDA0"], available, n_ctx, 512, kv,
                       kv_on_gpu=kv_on_gpu)


def test_the_hybrid_runtime_plans_every_kv_cache_and_a_layer_of_expert_staging_on_the_gpu(tiny):
    """With one GPU, ferry keeps activations and the whole KV cache there; experts left in RAM need staging
    buffers: one set of slots for a layer's experts, and the buffer copies land in, the largest expert tensor's."""
    f = GGUFFile(tiny)
    a = ModelArgs.from_gguf(f)
    dev = lambda p, d: next((x for x in p.devices if x.device == d), None)  # noqa: E731
    partial = _plan(tiny, 2, {}, kv_on_gpu=True)
    per_layer_kv = dev(_plan(tiny, 999, {}), "CUDA0").kv_cache / a.n_layer
    assert dev(partial, "CPU").kv_cache == 0 and dev(partial, "CUDA0").kv_cache == pytest.approx(per_layer_kv * a.n_layer)
    plain, hybrid = dev(_plan(tiny, 999, {}, ot=["exps=CPU"]), "CUDA0"), dev(_plan(tiny, 999, {}, ot=["exps=CPU"],
                                                                                   kv_on_gpu=True), "CUDA0")
    layer0 = sum(t.nbytes for t in f.tensors.values() if t.name.startswith("blk.0.") and "_exps" in t.name)
    largest = max(t.nbytes for t in f.tensors.values() if "_exps" in t.name)
    assert hybrid.compute - plain.compute == layer0 + largest and hybrid.weights == plain.weights


def test_the_gpu_compute_estimate_counts_the_prompt_graphs_pool_up_to_their_largest_u_batch(tiny):
    """u-batches up to PROMPT_GRAPH_MAX keep a recorded graph's pool beside the eager activations: at that size
    the GPU's compute estimate holds two sets, so doubling the u-batch past it adds only the logits."""
    f = GGUFFile(tiny)
    sizes, a = {t.name: t.nbytes for t in f.tensors.values()}, ModelArgs.from_gguf(f)

    def gpu_compute(ub: int) -> int:
        plan = memory_plan(sizes, a, 999, [], ["CUDA0"], {}, 256, ub)
        return next(d for d in plan.devices if d.device == "CUDA0").compute

    recorded, eager = gpu_compute(PROMPT_GRAPH_MAX), gpu_compute(2 * PROMPT_GRAPH_MAX)
    assert eager - recorded == 4 * PROMPT_GRAPH_MAX * a.n_vocab


def test_the_plan_counts_the_logits_a_u_batch_computes(tiny):
    """A prompt's u-batch computes the logits of each sequence's last position (run, bench, the server's slots), every
    position's only for perplexity: the plan counts those rows, so a big vocabulary's u-batch leaves the GPU room for
    weights (gpt-oss's 201088 entries at -ub 512: 393 MiB)."""
    from ferry.runtime.loader import RunConfig

    f = GGUFFile(tiny)
    sizes, a = {t.name: t.nbytes for t in f.tensors.values()}, ModelArgs.from_gguf(f)

    def gpu_compute(n_logits) -> int:
        plan = memory_plan(sizes, a, 999, [], ["CUDA0"], {}, 256, 512, n_logits=n_logits)
        return next(d for d in plan.devices if d.device == "CUDA0").compute

    assert gpu_compute(None) - gpu_compute(1) == 4 * 511 * a.n_vocab
    assert gpu_compute(512) == gpu_compute(None) and gpu_compute(4) - gpu_compute(1) == 4 * 3 * a.n_vocab
    assert RunConfig(tiny).logit_rows == 1 and RunConfig(tiny, all_logits=True).logit_rows == 512
    assert RunConfig(tiny, n_seq=4, n_ubatch=512).logit_rows == 4 and RunConfig(tiny, n_seq=8, n_ubatch=4,
                                                                                 n_batch=4).logit_rows == 4


def test_the_plan_counts_every_byte_and_advises_an_ngl_that_fits(tiny):
    f = GGUFFile(tiny)
    whole = _plan(tiny, 999, {})
    assert sum(d.weights for d in whole.devices) == sum(t.nbytes for t in f.tensors.values())
    gpu = next(d for d in whole.devices if d.device == "CUDA0")
    small = _plan(tiny, 999, {"CUDA0": gpu.total // 2})
    assert not small.fits and "CUDA0 needs" in small.error()
    ngl = int(re.search(r"-ngl (\d+) fits", small.advice).group(1))
    assert _plan(tiny, ngl, {"CUDA0": gpu.total // 2}).fits and not _plan(tiny, ngl + 1, {"CUDA0": gpu.total // 2}).fits


def test_experts_kept_in_ram_and_a_q8_cache_shrink_the_gpu_share(tiny):
    gpu = lambda p: next(d for d in p.devices if d.device == "CUDA0")  # noqa: E731
    all_gpu, exps_cpu = gpu(_plan(tiny, 999, {})), gpu(_plan(tiny, 999, {}, ot=["exps=CPU"]))
    assert exps_cpu.weights < all_gpu.weights / 2
    q8 = gpu(_plan(tiny, 999, {}, kv=(34 / 32, 34 / 32)))
    assert q8.kv_cache == pytest.approx(all_gpu.kv_cache * 34 / 64, rel=1e-6)


def test_plan_command_prints_the_table_and_fails_with_advice(tiny):
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(tiny), *args], capture_output=True, text=True)

    ok = plan("-ngl", "999", "--gpu-memory", "CUDA0=64GiB", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["fits"]
    bad = plan("-ngl", "999", "--gpu-memory", "CUDA0=1MiB")
    assert bad.returncode == 2 and "| CUDA0 |" in bad.stdout
    assert len(bad.stderr.strip().splitlines()) == 1 and "does not fit" in bad.stderr and "-ot exps=CPU" in bad.stderr
    wrong = plan("--gpu-memory", "GPU0=8GiB")
    assert wrong.returncode == 2 and "is not CUDAn=SIZE" in wrong.stderr


H100_LIKE = {"cpu": {"cpu_bytes_per_s": 5.4e10, "cpu_flops": 5e11, "threads": 16,
                     "cpu_moe": [[1, 2.95e-11], [4, 4.65e-11], [16, 1.93e-10], [64, 7.0e-10]]},
             "gpu": {"h2d_bytes_per_s": 5.5e10, "h2d_latency_s": 1.3e-5, "gpu_bytes_per_s": 2.8e12,
                     "gpu_flops": 7.4e14, "launch_s": 9e-6, "gpu_name": "H100"}}


def test_plan_shows_where_each_op_on_weights_in_ram_runs_per_u_batch_and_why(tiny, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(H100_LIKE))

    def plan(*args):
        return subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(tiny), "--gpu-memory", "CUDA0=80GiB",
                               *args], capture_output=True, text=True)

    r = plan("-ngl", "999", "-ot", "exps=CPU", "--calibration", str(cal), "--ubatches", "1,4096", "--json")
    assert r.returncode == 0
    ops = json.loads(r.stdout)["ops"]
    assert [(o["op"], o["n_ubatch"]) for o in ops] == [("mul_mat_id", 1), ("mul_mat_id", 4096)]
    one, big = ops
    assert one["where"].startswith("GPU 0 /") and one["cpu_ms"] > 0  # a token's few experts: read where they lie
    assert big["where"].endswith("/ CPU 0 of 16 hit") and "predicted GPU" in big["why"]
    forced = json.loads(plan("-ngl", "999", "-ot", "exps=CPU", "--calibration", str(cal), "--ubatches", "1",
                             "--offload-policy", "mul_mat_id=on", "--json").stdout)["ops"][0]
    assert forced["where"].startswith("GPU 4 /") and "override" in forced["why"]
    halves = json.loads(plan("-ngl", "999", "-ot", "exps=CPU", "--calibration", str(cal), "--ubatches", "64",
                             "--offload-policy", "mul_mat=off,mul_mat_id=on,moe_up_gate=off", "--json").stdout)["ops"][0]
    assert halves["where"] == "down on the GPU, up_gate on the CPU, of 16 hit"
    assert halves["cpu_ms"] > 0 and halves["gpu_ms"] > 0 and "moe_up_gate=off, moe_down=on" in halves["why"]
    text = plan("-ngl", "2", "--calibration", str(cal)).stdout  # whole layers in RAM: their dense ops too
    assert "| mul_mat | blk.0.attn_q.weight | 1 | CPU |" in text and "| mul_mat | blk.0.attn_q.weight | 512 | GPU |" in text
    missing = plan("-ngl", "999", "-ot", "exps=CPU", "--calibration", str(tmp_path / "none.json"))
    assert missing.returncode == 0 and "no calibration at" in missing.stdout


def _plan_ok(tiny, cal, *args) -> str:
    """`ferry plan` of the tiny model all on an 80 GiB GPU with the calibration `cal` (and args): its output."""
    r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(tiny), "--gpu-memory", "CUDA0=80GiB",
                        "-ngl", "999", "--calibration", str(cal), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_plan_states_what_the_weights_in_ram_cost_each_generated_token(tiny, tmp_path):
    """One token reads n_expert_used of each layer's experts where they lie: at the calibration's measured ggml rate
    for one token per expert, that time is a floor under generation, printed with its t/s bound."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(H100_LIKE))
    f = GGUFFile(tiny)
    a = ModelArgs.from_gguf(f)

    def plan(*args):
        return _plan_ok(tiny, cal, *args)

    experts = sum(t.nbytes for t in f.tensors.values() if "_exps" in t.name)
    per_token = experts * a.n_expert_used / a.n_expert  # every layer's experts are in RAM
    g = json.loads(plan("-ot", "exps=CPU", "--json"))["generation"]
    assert g["layers"] == a.n_layer and g["cpu_bytes_per_token"] == pytest.approx(per_token)
    seconds_per_byte = H100_LIKE["cpu"]["cpu_moe"][0][1]  # ggml's measured rate at one token per expert
    assert g["seconds_per_token"] == pytest.approx(per_token * seconds_per_byte)
    assert g["max_tokens_per_s"] == pytest.approx(1 / g["seconds_per_token"])
    text = plan("-ot", "exps=CPU")
    assert f"at most {g['max_tokens_per_s']:.1f} t/s" in text
    # the tiny model's experts are Q4_0: ferry's own kernel runs them where it could be built for this CPU
    from ferry.kernels.cpu import native

    own = native.library() is not None
    assert ("routed experts run on the CPU with ferry's own kernel" in text) == own
    assert ("routed experts run on the CPU with ggml's kernel" in text) == (not own)
    streamed = json.loads(plan("-ot", "exps=CPU", "--offload-policy", "all=on", "--json"))["generation"]
    assert streamed["cpu_bytes_per_token"] == 0 and streamed["seconds_per_token"] > 0  # copies over PCIe instead
    halves = json.loads(plan("-ot", "exps=CPU", "--offload-policy", "moe_up_gate=off,moe_down=on", "--json"))
    down = sum(t.nbytes for t in f.tensors.values() if "ffn_down_exps" in t.name)
    assert halves["generation"]["cpu_bytes_per_token"] == pytest.approx((experts - down) * a.n_expert_used / a.n_expert)
    assert json.loads(plan("--json"))["generation"] is None  # nothing in RAM
    assert "has not measured" not in text  # the tiny model's experts are Q4_0, which H100_LIKE measured
    only_q4_k = {**H100_LIKE, "cpu": {**H100_LIKE["cpu"], "cpu_moe": {"Q4_K": [[1, 3e-11]]}}}
    cal.write_text(json.dumps(only_q4_k))
    assert ("the calibration has not measured routed experts of Q4_0: their CPU times here are at its GEMV and "
            "matmul rates") in plan("-ot", "exps=CPU")
    # a calibration that timed ferry's kernel at one token: its rate, where the kernel runs these experts
    cal.write_text(json.dumps({**H100_LIKE, "cpu": {**H100_LIKE["cpu"], "cpu_moe_token": {"Q4_0": 1.6e-11}}}))
    g = json.loads(plan("-ot", "exps=CPU", "--json"))["generation"]
    assert g["seconds_per_token"] == pytest.approx(per_token * (1.6e-11 if own else seconds_per_byte))


def test_deepseek2s_kv_b_is_no_weight_a_gpu_loads(tmp_path):
    """kv_b (joined from the file's attn_k_b / attn_v_b, or the file's attn_kv_b) is read by ggml's graphs only:
    it is no model weight, so no GPU uploads it; the CPU graph joins it when it first expands a latent."""
    from ferry.cli import main
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model

    path = tmp_path / "ds.gguf"
    assert main(["synth", "deepseek2-tiny", "-o", str(path), "-q"]) == 0
    f = GGUFFile(path)
    model = load_model(f)
    assert {w.name for w in model.weights()} <= set(f.tensors)
    assert not any("attn_kv_b" in w.name for w in model.weights())
    attn = model.latent_layers()[0]
    kv_b = attn.kv_b()
    assert kv_b.name == "blk.0.attn_kv_b.weight" and attn.kv_b() is kv_b  # joined once


@pytest.mark.parametrize("legacy", [False, True])
def test_the_plan_counts_deepseek2s_copies_of_the_latent_projections(tmp_path, legacy):
    from ferry.gguf.synth import PRESETS, synth
    from ferry.quant import Q

    path = tmp_path / "ds.gguf"
    synth(PRESETS["deepseek2-tiny"], path, Q.Q4_0, Q.Q8_0, quiet=True, legacy_mla=legacy)
    f = GGUFFile(path)
    a = ModelArgs.from_gguf(f)
    file_bytes = sum(t.nbytes for t in f.tensors.values())
    split = sum(t.nbytes for t in f.tensors.values() if "attn_k_b" in t.name or "attn_v_b" in t.name)
    kv_b = sum(t.nbytes for t in f.tensors.values() if "attn_kv_b" in t.name)  # a legacy file's own
    per_layer = 4 * 4 * 64 * (32 + 32)  # float32, 4 heads x kv_lora_rank 64 x (nope 32 + v 32)
    tensors = {t.name: t.nbytes for t in f.tensors.values()}

    def by_device(plan):
        return {d.device: d.weights for d in plan.devices}

    # all on the GPU: the model's float32 k_b and v_b in RAM, a float16 copy on the GPU, no kv_b anywhere
    plan = by_device(memory_plan(tensors, a, 999, [], ["CUDA0"], {}, 64, 16))
    assert plan["CPU"] == a.n_layer * per_layer + sum(v for k, v in tensors.items() if k.startswith("token_embd"))
    assert plan["CUDA0"] + plan["CPU"] == file_bytes - split - kv_b + a.n_layer * (per_layer + per_layer // 2)
    # on the CPU, where ggml's graphs expand latents through kv_b: the file's, or one joined in float32
    plan = memory_plan(tensors, a, 0, [], [], {}, 64, 16)
    joined = 0 if legacy else a.n_layer * per_layer
    assert sum(d.weights for d in plan.devices) == file_bytes - split + a.n_layer * per_layer + joined
    assert (split == 0) == legacy and (kv_b == 0) != legacy
    # the hybrid runtime (-ngl 2 of 4, kv_on_gpu) attends on the GPU in every layer: all four layers' float16
    # copies are there
    plan = memory_plan(tensors, a, 2, [], ["CUDA0"], {}, 64, 16, kv_on_gpu=True)
    gpu = next(d for d in plan.devices if d.device == "CUDA0")
    on_gpu = sum(v for k, v in tensors.items() if place(k, a.n_layer, 2, [], layer_devices(a.n_layer, 2, ["CUDA0"]))
                 == "CUDA0" and "attn_k_b" not in k and "attn_v_b" not in k and "attn_kv_b" not in k)
    assert gpu.weights == on_gpu + a.n_layer * per_layer // 2


def test_plan_keeps_experts_the_gpu_cannot_read_or_expand_on_the_cpu(tmp_path):
    """IQ3_S experts: no GPU kernel of ferry's reads or expands them, so the run keeps them on the CPU whatever the
    policy, and the plan says so rather than predicting copies (Q4_K experts do stream, expanded on the GPU)."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(H100_LIKE))
    rows = {}
    for qtype in ("iq3_s", "q4_k"):
        path = tmp_path / f"{qtype}.gguf"
        assert main(["synth", "qwen3-moe-tiny", "--expert-type", qtype, "-o", str(path), "-q"]) == 0
        r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(path), "--gpu-memory", "CUDA0=80GiB",
                            "-ngl", "999", "-ot", "exps=CPU", "--calibration", str(cal), "--ubatches", "4096",
                            "--offload-policy", "all=on", "--json"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        rows[qtype] = json.loads(r.stdout)
    iq3 = rows["iq3_s"]["ops"][0]
    assert iq3["where"].startswith("GPU 0 /") and "IQ3_S, which no GPU kernel" in iq3["why"]
    assert rows["iq3_s"]["generation"]["cpu_bytes_per_token"] > 0
    assert rows["q4_k"]["ops"][0]["where"].endswith("/ CPU 0 of 16 hit")


def test_plan_forecasts_tg_and_pp_from_the_calibrations_measured_parts(tiny, tmp_path):
    """A token: DECODE_KERNELS_PER_LAYER small kernels a layer and the bytes the GPU reads, then the weights in RAM
    (the generation floor) and a handshake per host step, serialized; a u-batch: the GPU's quantized FLOPs at the
    grouped GEMM's rate and the RAM side as the policy places it. An older calibration gets no forecast, and says so."""
    from ferry.offload.plan import DECODE_KERNELS_PER_LAYER

    steps = {"graph_kernel_s": 4e-6, "gpu_gemv_bytes_per_s": 2.0e12, "handshake_s": 3e-5, "gpu_moe_flops": 1.0e14}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({**H100_LIKE, "gpu": {**H100_LIKE["gpu"], **steps}}))
    f = GGUFFile(tiny)
    a = ModelArgs.from_gguf(f)

    def plan(*args):
        return _plan_ok(tiny, cal, *args)

    k_over_e = a.n_expert_used / a.n_expert
    read = sum(t.nbytes * (k_over_e if "_exps" in t.name else 1.0) for t in f.tensors.values()
               if len(t.ne) >= 2 and not t.name.startswith("token_embd"))
    whole = json.loads(plan("--json"))
    fc = whole["forecast"]
    kernels_ms = 1e3 * a.n_layer * DECODE_KERNELS_PER_LAYER * steps["graph_kernel_s"]
    assert fc["tg_ms"]["gpu"] == pytest.approx(kernels_ms + 1e3 * read / steps["gpu_gemv_bytes_per_s"])
    assert fc["tg_ms"]["ram"] == 0 and fc["pp_ms"]["ram"] == 0
    assert fc["tg_per_s"] == pytest.approx(1e3 / sum(fc["tg_ms"].values()))
    assert fc["pp_ms"]["copies"] == 0 and fc["n_ubatch"] == 512
    assert fc["pp_per_s"] == pytest.approx(512e3 / (fc["pp_ms"]["gpu"] + fc["pp_ms"]["ram"]))
    ram = json.loads(plan("-ot", "exps=CPU", "--json"))
    g, fr = ram["generation"], ram["forecast"]
    assert fr["tg_ms"]["ram"] == pytest.approx(1e3 * g["seconds_per_token"])
    assert fr["host_steps"] >= a.n_layer and fr["tg_ms"]["handshakes"] == pytest.approx(
        1e3 * fr["host_steps"] * steps["handshake_s"])
    assert fr["tg_ms"]["gpu"] < fc["tg_ms"]["gpu"] and fr["pp_ms"]["ram"] > 0
    # a u-batch streams its experts while the GPU computes: the longer of the two
    assert fr["pp_per_s"] == pytest.approx(512e3 / max(fr["pp_ms"]["copies"], fr["pp_ms"]["gpu"] + fr["pp_ms"]["ram"]))
    streamed = json.loads(plan("-ot", "exps=CPU", "--offload-policy", "all=on", "--json"))["forecast"]["pp_ms"]
    cpu_only = json.loads(plan("-ot", "exps=CPU", "--offload-policy", "all=off", "--json"))["forecast"]["pp_ms"]
    assert streamed["copies"] > 0 and cpu_only["copies"] == 0
    assert fr["tg_per_s"] < fc["tg_per_s"]
    half = json.loads(plan("-ot", "exps=CPU", "--gpu-experts", f"0:0-{a.n_expert // 2 - 1}", "--json"))["forecast"]
    assert fr["tg_ms"]["ram"] > half["tg_ms"]["ram"] and fr["tg_ms"]["gpu"] < half["tg_ms"]["gpu"]
    assert "forecast: tg" in plan("-ot", "exps=CPU", "-ub", "128") and json.loads(
        plan("-ub", "128", "--json"))["forecast"]["n_ubatch"] == 128
    cal.write_text(json.dumps(H100_LIKE))  # measured before the forecast's parts
    old = plan("-ot", "exps=CPU")
    assert "no forecast of tg and pp" in old and "run `ferry calibrate` again" in old
    assert json.loads(plan("--json"))["forecast"] is None


@pytest.mark.parametrize("preset", ["qwen35moe-tiny", "deepseek4-tiny"])
def test_the_plan_counts_each_sequences_state_as_the_cache_holds_it(tmp_path, preset):
    """A server's slots (-np) of a model with a state per sequence (delta-nets' states, compressors' rings; the
    compressors' entries over each sequence's share of -c): the plan's cache bytes are the cache's own, for one
    sequence and for three."""
    from ferry.models import load_model
    from ferry.runtime.kv_cache import KVCache

    path = tmp_path / f"{preset}.gguf"
    assert main(["synth", preset, "-o", str(path), "-q"]) == 0
    f = GGUFFile(path)
    model = load_model(f)
    sizes = {t.name: t.nbytes for t in f.tensors.values()}
    got = []
    for n_seq in (1, 3):
        plan = memory_plan(sizes, model.args, 0, [], ["CUDA0"], {}, 96, 32, cache=model.cache_layout(), n_seq=n_seq)
        planned = sum(d.kv_cache for d in plan.devices)
        cache = KVCache.of(model.cache_layout(), model.args.n_layer, 96, "f16", "f16", None, model.state_layout(),
                           n_seq)
        assert planned == cache.n_bytes
        got.append(planned)
    assert got[1] > got[0]


def test_plan_counts_the_states_of_the_server_slots_it_is_given(tmp_path):
    """`ferry plan -np N` (as `ferry serve -np N`): a model with a state per sequence plans N of them, beside one
    sequence's; -np below 1 is one line and exit 2."""
    path = tmp_path / "q35.gguf"
    assert main(["synth", "qwen35moe-tiny", "-o", str(path), "-q"]) == 0

    def kv(*args):
        r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(path), "-ngl", "999", "--gpu-memory",
                            "CUDA0=8GiB", "-c", "256", "--json", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return next(d["kv_cache"] for d in json.loads(r.stdout)["devices"] if d["device"] == "CUDA0")

    one, three = kv(), kv("-np", "3")
    f = GGUFFile(path)
    from ferry.models import load_model

    state = load_model(f).state_layout()
    assert three - one == 2 * state.bytes_per_sequence
    bad = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(path), "-np", "0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["ferry: error: -np/--parallel must be at least 1, "
                                                                       "got 0"]
