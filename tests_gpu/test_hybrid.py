"""The hybrid runtime (weights in RAM, the rest on the GPU) against the all-CPU result: KL-divergence and top-1
agreement for every way an op on a RAM-resident weight can run (ggml on the CPU, streamed to the GPU, the MoE split
between both), at prompt u-batches and token by token, with experts in RAM (-ot exps=CPU) and with whole layers in
RAM (-ngl N)."""

import numpy as np
import pytest
import torch

from ferry.backends.hybrid import HybridBackend
from ferry.offload.cost import Calibration
from ferry.runtime.engine import Engine
from conftest import kl_top1, place

# a made-up machine on which a copy and a CPU read of an expert cost the same: auto splits every MoE layer
BALANCED = Calibration(h2d_bytes_per_s=40e9, h2d_latency_s=1e-6, cpu_bytes_per_s=40e9, cpu_flops=1e12,
                       gpu_bytes_per_s=3e12, gpu_flops=400e12)


EXPS = dict(n_gpu_layers=999, override_tensor=["exps=CPU"])  # the routed experts in RAM, the rest on the GPU


def _hybrid(path, flags: dict, calib: Calibration | None = None):
    backend, model = place(path, 8, **flags, n_ctx=512)
    assert isinstance(backend, HybridBackend)
    backend.stats.keep = True
    if calib is not None:
        backend.calib = calib
    return backend, model


def _check(want, got, label: str) -> None:
    kl, top1 = kl_top1(want, got)
    print(f"\n{label}: KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
    # the same rounding differences as the all-GPU path (tests_gpu/test_model_gpu.py): bf16/f16 prompt activations
    # on the GPU against ggml's 8-bit activations on the CPU
    assert kl.median() < 2e-3 and kl.max() < 3e-2 and top1 >= 0.95


@pytest.mark.parametrize("policy", ["all=off", "all=on", "threshold", "auto", "balanced"])
@pytest.mark.parametrize("ubatch", [512, 64, 5])
def test_experts_in_ram_match_the_cpu(mid, policy, ubatch):
    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy),
                             BALANCED if policy == "balanced" else None)
    assert backend.streamer.pinned, backend.streamer.why
    n = 300 if ubatch > 8 else 60
    got = Engine(model, backend, n_ctx=512, n_ubatch=ubatch).decode(tokens[:n], all_logits=True)
    _check(want[:n], got, f"-ot exps=CPU {policy} ub {ubatch}")
    where = {r.device for r in backend.stats.records if r.op == "mul_mat_id"}
    if policy == "all=off":
        assert all(d.startswith("GPU 0 /") for d in where)
    if policy == "all=on":
        assert all(d.endswith("/ CPU 0") for d in where)
    if policy == "balanced":  # both sides at once
        assert any(not d.startswith("GPU 0 /") and not d.endswith("/ CPU 0") for d in where), where


@pytest.mark.parametrize("policy", ["moe_up_gate=off,moe_down=on", "moe_up_gate=on,moe_down=off"])
@pytest.mark.parametrize("ubatch", [300, 64, 5])
def test_the_experts_halves_set_apart_match_the_cpu(mid, policy, ubatch):
    """Each expert's gate and up projections on one side, its down projection on the other (--offload-policy
    moe_up_gate / moe_down): prompts in one and in several u-batches, then generation through recorded steps."""
    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy=policy))
    n = 300 if ubatch > 8 else 60
    e = Engine(model, backend, n_ctx=512, n_batch=300, n_ubatch=ubatch)
    got = e.decode(tokens[:n], all_logits=True)
    _check(want[:n], got, f"-ot exps=CPU {policy} ub {ubatch}")
    on_gpu = "down" if policy.endswith("down=on") else "up_gate"
    on_cpu = "up_gate" if on_gpu == "down" else "down"
    where = {r.device for r in backend.stats.records if r.op == "mul_mat_id"}
    assert where == {f"GPU {on_gpu} / CPU {on_cpu}"}, where
    if ubatch == 5:
        backend.stats.keep = False  # generation's steps recorded as graphs cut at each MoE layer
        steps = torch.cat([e.decode([t]) for t in tokens[n:n + 20]])
        _check(want[n:n + 20], steps, f"decode -ot exps=CPU {policy}")


@pytest.mark.parametrize("policy", ["all=on", "all=off", "balanced"])
def test_a_batch_taken_layer_first_matches_the_cpu_and_reads_each_expert_once(mid, policy):
    """-b 300 -ub 64: five u-batches, whose MoE layers run once over all their rows (one decision per layer), give
    the CPU's logits; streamed, every layer's experts cross PCIe once instead of once per u-batch."""
    path, tokens, want = mid
    got, copied = {}, {}
    for order in ("layer-first", "ubatch-first"):
        backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy,
                                                   batch_order=order), BALANCED if policy == "balanced" else None)
        e = Engine(model, backend, n_ctx=512, n_batch=300, n_ubatch=64)
        assert e.layer_first == (order == "layer-first")
        got[order] = e.decode(tokens, all_logits=True)
        _check(want, got[order], f"-ot exps=CPU {policy} {order}")
        sizes = {r.n_tokens for r in backend.stats.records if r.op == "mul_mat_id"}
        assert sizes == ({300} if order == "layer-first" else {64, 300 - 4 * 64})
        copied[order] = backend.streamer.bytes_copied
        assert len(e.experts_hit) == 5
    if policy == "all=on":
        assert 0 < copied["layer-first"] < 0.5 * copied["ubatch-first"], copied
    _check(got["ubatch-first"].cpu().float(), got["layer-first"], f"{policy}: layer-first against ubatch-first")


@pytest.mark.parametrize("policy", ["all=on", "all=off"])
def test_a_batch_taken_layer_first_replays_as_graphs_with_the_eager_bits(mid, policy):
    """-b 300 -ub 64, three times over the same tokens: with graphs, the first run is eager, the second records CUDA
    graphs cut at each u-batch's attention over the cache and at each layer's joined experts (each u-batch's
    embedding from RAM is a handshake), the third replays them; every run gives the bits of eager runs."""
    from ferry.runtime.runners.cuda_graphs import CudaGraphRunner, _Recorder

    path, tokens, _ = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy=policy))
    backend.stats.keep = False
    runs = {}
    for graphs in (False, True):
        e = Engine(model, backend, n_ctx=512, n_batch=300, n_ubatch=64)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        runs[graphs] = []
        for _ in range(3):
            e.truncate(0)
            runs[graphs].append(e.decode(tokens, all_logits=True))
        assert len(e.experts_hit) == 3 * 5
    recorded = list(e.runner._captured.values())
    assert len(recorded) == 1 and isinstance(recorded[0].graph, _Recorder)
    n_ubatch = 5  # 4 x 64 + 44
    assert recorded[0].graph.n_handshakes == (0 if backend.on_gpu(model.token_embd) else n_ubatch)
    assert len(recorded[0].graph.graphs) == model.args.n_layer * (n_ubatch + 1) + 1
    for got in runs[False][1:] + runs[True]:
        assert torch.equal(runs[False][0], got)


@pytest.mark.parametrize("policy", ["all=off", "threshold", "balanced"])
def test_generation_with_experts_in_ram_matches_the_cpu_token_by_token(mid, policy):
    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy),
                             BALANCED if policy == "balanced" else None)
    backend.stats.keep = False  # all=off: generation's direct way to ggml, through pinned buffers
    e = Engine(model, backend, n_ctx=512)
    e.decode(tokens[:200])
    got = torch.cat([e.decode([t]) for t in tokens[200:240]])
    _check(want[200:240], got, f"decode -ot exps=CPU {policy}")


def test_auto_runs_a_decided_way_without_predicting_the_others(mid, monkeypatch):
    """Once auto has measured a size class's way and a layer has run that size, the layer's next u-batches cost what
    the manual policy's do: one split of the experts for that way, no prediction of auto's own; same logits."""
    import ferry.offload.work as work

    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto"))
    backend.stats.keep = False
    backend.explorer.chosen[128] = "gpu"  # as if measured: u-batches of 65-128 tokens stream every expert hit
    policies = []
    real = work.split_experts
    monkeypatch.setattr(work, "split_experts", lambda *a, **kw: policies.append(a[4]) or real(*a, **kw))
    e = Engine(model, backend, n_ctx=512, n_batch=100, n_ubatch=100)
    first = e.decode(tokens[:100], all_logits=True)
    n_moe = len(policies) // 2  # a layer's first u-batch of a size: the prediction, then the measured way
    assert n_moe == model.args.n_layer and policies[:2] == [backend.policy, work.ALL_ON]
    policies.clear()
    second = e.decode(tokens[100:200], all_logits=True)
    # (this second run of the shape records its CUDA graphs too: its host steps may run more than once per layer)
    assert len(policies) >= n_moe and all(p == work.ALL_ON for p in policies)
    _check(want[:200], torch.cat([first, second]), "-ot exps=CPU auto, decided gpu")


@pytest.mark.parametrize("policy", ["all=off", "all=on"])
def test_layers_left_in_ram_by_ngl_match_the_cpu(mid, policy):
    """-ngl 3: most layers' weights in RAM, computed by ggml or streamed whole to the GPU; the output on the GPU."""
    path, tokens, want = mid
    backend, model = _hybrid(path, dict(n_gpu_layers=3, override_tensor=[], offload_policy=policy))
    got = Engine(model, backend, n_ctx=512, n_ubatch=128).decode(tokens, all_logits=True)
    _check(want, got, f"-ngl 3 {policy}")
    dense = {r.device for r in backend.stats.records if r.op == "mul_mat"}
    assert dense == {"CPU" if policy == "all=off" else "GPU"}


@pytest.mark.parametrize("handshakes", [True, False])
@pytest.mark.parametrize("policy", ["all=off", "threshold", "balanced"])
def test_decode_recorded_as_graphs_between_host_steps_matches_eager_decoding(mid, policy, handshakes):
    """A decode step with experts in RAM replays CUDA graphs: the same bits as running it op by op. With handshakes,
    a host step that reads only host memory (the embedding from RAM, ggml on a MoE layer decided on the CPU) runs
    while one graph waits at it; without them (or where the step needs the GPU, as a split does), the graphs are
    cut at each host step."""
    from ferry.runtime.runners.cuda_graphs import CudaGraphRunner, _Recorder

    path, tokens, _ = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy),
                             BALANCED if policy == "balanced" else None)
    backend.stats.keep = False
    for size in (1, 64):  # the prompt (50 tokens) and each decode step: no trials, the same way in both runs
        backend.explorer.chosen[size] = "split" if policy == "balanced" else "cpu"
    direct, moe_experts = [], backend.cpu.moe_experts

    def spy(*args, out=None, **kw):  # the direct way writes ggml's result into pinned memory
        direct.append(out is not None and out.is_pinned())
        return moe_experts(*args, out=out, **kw)

    backend.cpu.moe_experts = spy
    out = []
    for graphs in (True, False):
        e = Engine(model, backend, n_ctx=512)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        if not handshakes:
            e.runner._handshakes = None
        e.decode(tokens[:50])
        out.append(torch.cat([e.decode([t]) for t in tokens[50:70]]))
        if graphs:
            recorded = list(e.runner._captured.values())
            assert recorded and isinstance(recorded[0].graph, _Recorder)
            embedding = 0 if backend.on_gpu(model.token_embd) else 1
            waits = (embedding + (model.args.n_layer if policy != "balanced" else 0)) if handshakes else 0
            assert recorded[0].graph.n_handshakes == waits
            assert len(recorded[0].graph.graphs) == model.args.n_layer + embedding - waits + 1
    assert torch.equal(out[0], out[1])
    assert any(direct) == (policy != "balanced")  # threshold's rule puts one token on the CPU: the direct way


def test_auto_records_its_decode_step_again_once_decided(mid):
    """auto's first decode steps run before it has decided their way, so the step is recorded cut at every MoE
    layer; once decided, the next step records it again, as handshakes where the way is the CPU's. Logits as the
    CPU's."""
    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto"))
    backend.stats.keep = False
    e = Engine(model, backend, n_ctx=512)
    got = [e.decode(tokens[:50], all_logits=True)]
    first = None
    for t in tokens[50:60]:
        got.append(e.decode([t]))
        step = next(c for k, c in e.runner._captured.items() if k[2] == 1)
        first = first or step
    way = backend.decided(1)
    assert first.decided is None and way is not None and step is not first
    embedding = 0 if backend.on_gpu(model.token_embd) else 1
    waits = embedding + (model.args.n_layer if way == "cpu" else 0)
    assert step.decided == way and step.graph.n_handshakes == waits
    assert len(step.graph.graphs) == model.args.n_layer + embedding - waits + 1
    _check(want[:60], torch.cat(got), f"-ot exps=CPU auto, decode decided {way}")

def test_auto_measures_a_provisional_decode_way_again_and_records_the_step_again(mid):
    """A generation way that the calibration disagrees with is measured again later (policy.Explorer.recheck_s): the
    decode step recorded for that way is recorded again, and every way is tried again, the step recorded for the way
    measured. Logits as the CPU's throughout."""
    path, tokens, want = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto"))
    backend.stats.keep = False
    e = Engine(model, backend, n_ctx=512)
    got = [e.decode(tokens[:40], all_logits=True)]
    for t in tokens[40:50]:
        got.append(e.decode([t]))
    decided_step = next(c for k, c in e.runner._captured.items() if k[2] == 1)
    assert backend.decided(1) is not None and decided_step.decided == backend.decided(1)
    backend.explorer._due[1] = 0.0  # due now, as a choice against the prediction is recheck_s after it was made
    steps = []
    for t in tokens[50:60]:
        got.append(e.decode([t]))
        steps.append(next(c for k, c in e.runner._captured.items() if k[2] == 1))
    assert steps[0] is not decided_step  # recorded again (its warm-up run may have tried the ways already)
    assert backend.explorer._rechecks[1] == 1 and backend.decided(1) is not None
    needed = backend.explorer._needed(1)
    assert all(len(v) >= needed for v in backend.explorer.trials[1].values())  # every way measured again
    assert steps[-1].decided == backend.decided(1)
    _check(want[:60], torch.cat(got), "-ot exps=CPU auto, decode measured again")


def test_auto_records_experts_the_gpu_cannot_stream_as_handshakes_from_the_first_step(tmp_path):
    """IQ3_S experts (no GPU kernel of ferry's reads or expands them) run on the CPU whatever the policy: auto records
    the decode step with a handshake at every MoE layer from its first step, as all=off does, and decodes the same
    bits. Before session 22 auto never decided such experts (then Q4_K) and cut its graphs at each: 29.7 against 47.8
    t/s on the 30B."""
    from ferry.cli import main

    path = tmp_path / "k.gguf"
    assert main(["synth", "qwen3-moe-mid", "--expert-type", "iq3_s", "--layers", "4", "-o", str(path), "-q"]) == 0
    tokens = list(range(1, 31))
    out = {}
    for policy in ("auto", "all=off"):
        backend, model = _hybrid(path, EXPS | dict(offload_policy=policy))
        backend.stats.keep = False
        e = Engine(model, backend, n_ctx=512)
        e.decode(tokens[:20])
        out[policy] = torch.cat([e.decode([t]) for t in tokens[20:]])
        step = next(c for k, c in e.runner._captured.items() if k[2] == 1)
        embedding = 0 if backend.on_gpu(model.token_embd) else 1
        assert step.graph.n_handshakes == embedding + model.args.n_layer and backend.decided(1) is None
    assert torch.equal(out["auto"], out["all=off"])


@pytest.fixture(scope="module")
def kmix(tmp_path_factory):
    """qwen3-moe-mid in 8 layers with llama.cpp's Q4_K_M mix of experts (Q4_K; down Q6_K in layers 0, 3, 6, 7): its CPU
    logits over a 300-token prompt."""
    from ferry.cli import main

    path = tmp_path_factory.mktemp("k") / "kmix.gguf"
    assert main(["synth", "qwen3-moe-mid", "--expert-type", "q4_k_m", "--layers", "8", "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = list(range(7, 307))
    return path, tokens, Engine(model, cpu, n_ctx=512).decode(tokens, all_logits=True)


@pytest.mark.parametrize("policy", ["all=on", "balanced", "moe_up_gate=on,moe_down=off", "moe_up_gate=off,moe_down=on"])
@pytest.mark.parametrize("ubatch", [300, 64, 5])
def test_k_quant_experts_streamed_to_the_gpu_match_the_cpu(kmix, policy, ubatch):
    """A Q4_K_M file's experts copied to the GPU as their blocks (streamer.Compact: read in place for few pairs,
    expanded a projection at a time to bfloat16 for torch's grouped GEMM for many), all of them, split with the CPU,
    or one half of each: prompts in one and several u-batches, then generation through recorded steps."""
    path, tokens, want = kmix
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy),
                             BALANCED if policy == "balanced" else None)
    n = 300 if ubatch > 8 else 60
    e = Engine(model, backend, n_ctx=512, n_batch=300, n_ubatch=ubatch)
    got = e.decode(tokens[:n], all_logits=True)
    _check(want[:n], got, f"Q4_K_M -ot exps=CPU {policy} ub {ubatch}")
    where = {r.device for r in backend.stats.records if r.op == "mul_mat_id"}
    assert backend.streamer.bytes_copied > 0
    if policy == "all=on":
        assert all(d.endswith("/ CPU 0") for d in where), where
    if policy == "balanced" and ubatch == 5:  # a layer-first batch's 300 tokens: this machine streams them whole
        assert any(not d.startswith("GPU 0 /") and not d.endswith("/ CPU 0") for d in where), where
    if policy.startswith("moe_up_gate=on"):
        assert where == {"GPU up_gate / CPU down"}, where
    if ubatch == 5:
        backend.stats.keep = False
        steps = torch.cat([e.decode([t]) for t in tokens[n:n + 20]])
        _check(want[n:n + 20], steps, f"Q4_K_M decode -ot exps=CPU {policy}")


@pytest.mark.parametrize("ubatch", [280, 40, 5])
def test_k_quant_experts_on_the_gpu_match_the_cpu(kmix, ubatch):
    """A Q4_K_M file all on the GPU: its experts read in their blocks by kquant.py's grouped GEMM (prompt u-batches of
    280 and 40) and expert GEMVs (5, and generation through recorded steps)."""
    from ferry.backends.cuda import CudaBackend

    path, tokens, want = kmix
    backend, model = place(path, 8, n_gpu_layers=999, n_ctx=512)
    assert isinstance(backend, CudaBackend)
    e = Engine(model, backend, n_ctx=512, n_ubatch=ubatch)
    _check(want[:280], e.decode(tokens[:280], all_logits=True), f"Q4_K_M on the GPU ub {ubatch}")
    steps = torch.cat([e.decode([t]) for t in tokens[280:292]])
    _check(want[280:292], steps, "Q4_K_M on the GPU, decode")


@pytest.mark.parametrize("placement", ["experts in RAM", "all on the GPU"])
def test_k_quant_attention_in_krows_matches_the_cpu(tmp_path, placement):
    """A Q4_K_M file as llama.cpp writes it, its attention and output K-quants too (`--type q4_k`): on the GPU those
    are held in krows.py's rows (KRows), read by its GEMV and, in decode, by the fused attention path (the norm, q, k
    and v into one output, rope and the cache stores in one kernel); prompts expand them for cuBLAS. With the experts
    in RAM and all on the GPU, a prompt, then steps through recorded CUDA graphs, against the CPU."""
    from ferry.cli import main
    from ferry.runtime.runners.cuda import held_krows

    path = tmp_path / "kattn.gguf"
    assert main(["synth", "qwen3-moe-mid", "--expert-type", "q4_k_m", "--type", "q4_k", "--layers", "4", "-o",
                 str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = list(range(11, 151))
    want = Engine(model, cpu, n_ctx=512).decode(tokens, all_logits=True)
    flags = EXPS if placement == "experts in RAM" else dict(n_gpu_layers=999)
    backend, model = place(path, 8, **flags, n_ctx=512)
    e = Engine(model, backend, n_ctx=512, n_ubatch=64)
    _check(want[:120], e.decode(tokens[:120], all_logits=True), f"Q4_K attention, {placement}, prompt")
    steps = torch.cat([e.decode([t]) for t in tokens[120:140]])
    _check(want[120:140], steps, f"Q4_K attention, {placement}, decode")
    assert held_krows(backend, model.fusable()[0]) is not None  # q, k and v in rows: the path under test


@pytest.mark.parametrize("policy", ["all=off", "all=on", "balanced"])
@pytest.mark.parametrize("ubatch", [300, 5])
def test_k_quant_experts_kept_on_the_gpu_beside_the_rest_match_the_cpu(kmix, policy, ubatch):
    """--gpu-experts on a Q4_K_M file: some of each layer's experts kept on the GPU as their blocks (layout.Blocks);
    the other pairs go as the policy says; prompts, then generation through recorded steps (the kept experts' GEMVs
    inside the graph)."""
    from ferry.kernels.cuda.layout import Blocks
    from ferry.placement import format_gpu_experts

    path, tokens, want = kmix
    _, probe = place(path, 1)
    spec = _resident_spec(probe.args.n_layer, probe.args.n_expert)
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy,
                                               gpu_experts=format_gpu_experts(spec)),
                             BALANCED if policy == "balanced" else None)
    assert len(backend._resident) == len(spec)
    assert all(isinstance(r.down, Blocks) for r in backend._resident.values())
    n = 280 if ubatch > 8 else 60
    e = Engine(model, backend, n_ctx=512, n_batch=300, n_ubatch=ubatch)
    _check(want[:n], e.decode(tokens[:n], all_logits=True), f"Q4_K_M --gpu-experts {policy} ub {ubatch}")
    if policy == "all=on":
        assert backend.streamer.bytes_copied > 0
    backend.stats.keep = False
    steps = torch.cat([e.decode([t]) for t in tokens[n:n + 12]])
    _check(want[n:n + 12], steps, f"Q4_K_M decode --gpu-experts {policy}")


def test_a_host_step_that_fails_lets_the_waiting_graph_go(mid):
    """A host step that raises while its graph waits at it (handshakes): the error reaches the caller, the graph is
    let past its remaining waits, and the next tokens decode to the same bits as where nothing failed."""
    path, tokens, _ = mid
    backend, model = _hybrid(path, EXPS | dict(offload_policy="all=off"))
    backend.stats.keep = False
    moe_experts = backend.cpu.moe_experts
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return moe_experts(*args, **kw)

    out = []
    for fail in (False, True):
        e = Engine(model, backend, n_ctx=512)
        e.decode(tokens[:50])
        e.decode([tokens[50]])  # records the step
        assert next(iter(e.runner._captured.values())).graph.n_handshakes > 0
        if fail:
            backend.cpu.moe_experts = failing
            with pytest.raises(RuntimeError, match="injected"):
                e.decode([tokens[51]])
            backend.cpu.moe_experts = moe_experts
        out.append(torch.cat([e.decode([t]) for t in tokens[51:60]]))
    assert torch.equal(out[0], out[1])


def _resident_spec(n_layer: int, n_expert: int) -> dict[int, tuple[int, ...]]:
    """Some experts of every layer but the last kept on the GPU: a different count and set in each (none in the
    last, as a layer the fit leaves wholly in RAM)."""
    import numpy as np

    rng = np.random.default_rng(7)
    return {layer: tuple(sorted(rng.choice(n_expert, size=1 + (layer * 11) % (n_expert - 1), replace=False).tolist()))
            for layer in range(n_layer - 1)}


@pytest.mark.parametrize("policy", ["all=off", "all=on", "balanced"])
@pytest.mark.parametrize("ubatch", [300, 64, 5])
def test_resident_experts_beside_the_rest_match_the_cpu(mid, policy, ubatch):
    """--gpu-experts: some of a layer's experts kept on the GPU; its other pairs go as the policy says (the CPU,
    streamed, or split), and the streamer never copies a resident expert."""
    from ferry.placement import format_gpu_experts

    path, tokens, want = mid
    _, probe = place(path, 1)
    spec = _resident_spec(probe.args.n_layer, probe.args.n_expert)
    backend, model = _hybrid(path, EXPS | dict(offload_policy="auto" if policy == "balanced" else policy,
                                               gpu_experts=format_gpu_experts(spec)),
                             BALANCED if policy == "balanced" else None)
    assert len(backend._resident) == len(spec) and "kept on the GPU too" in backend.describe()
    assert backend.streamer.pinned, backend.streamer.why
    by_gate = {id(g): layer for layer in spec for g in [next(w for w in model.weights()
                                                             if w.name == f"blk.{layer}.ffn_gate_exps.weight")]}
    staged, stage = [], backend.streamer.stage_experts

    def spy(weights, experts, *a, **kw):
        staged.append((by_gate.get(id(weights[0])), set(experts)))
        return stage(weights, experts, *a, **kw)

    backend.streamer.stage_experts = spy
    n = 300 if ubatch > 8 else 60
    try:
        got = Engine(model, backend, n_ctx=512, n_ubatch=ubatch).decode(tokens[:n], all_logits=True)
    finally:
        backend.streamer.stage_experts = stage
        backend.close()  # the spy's cycle would keep the file's pages registered into the next test
    _check(want[:n], got, f"--gpu-experts {policy} ub {ubatch}")
    assert all(not (experts & set(spec[layer])) for layer, experts in staged if layer is not None)
    if policy == "all=on":
        assert any(layer is not None for layer, _ in staged)


@pytest.mark.parametrize("policy", ["all=off", "threshold"])
def test_generation_with_resident_experts_replays_as_graphs_with_the_eager_bits(mid, policy):
    """A decode step with resident experts: the GPU's pairs inside the recorded graph, the CPU's at a handshake; the
    same bits as op by op, and the CPU's logits."""
    from ferry.placement import format_gpu_experts
    from ferry.runtime.runners.cuda_graphs import CudaGraphRunner

    path, tokens, want = mid
    _, probe = place(path, 1)
    spec = _resident_spec(probe.args.n_layer, probe.args.n_expert)
    backend, model = _hybrid(path, EXPS | dict(offload_policy=policy, gpu_experts=format_gpu_experts(spec)))
    backend.stats.keep = False
    backend.explorer.chosen[1] = backend.explorer.chosen[64] = "cpu"
    out = []
    for graphs in (True, False):
        e = Engine(model, backend, n_ctx=512)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        e.decode(tokens[:50])
        out.append(torch.cat([e.decode([t]) for t in tokens[50:80]]))
        if graphs:
            step = next(c for k, c in e.runner._captured.items() if k[2] == 1)
            assert step.graph.n_handshakes >= model.args.n_layer
    assert torch.equal(out[0], out[1])
    _check(want[50:80], out[0], f"decode --gpu-experts {policy}")


def test_resident_experts_flag_mistakes_are_one_line(mid):
    from ferry.errors import FerryError

    path, _, _ = mid
    for flags, says in ((dict(n_gpu_layers=999, override_tensor=["blk\\.[1-9]\\.ffn_.*_exps=CPU"],
                              gpu_experts="0:1"), "not in RAM"),
                        (EXPS | dict(gpu_experts="0:999"), "has experts 0-"),
                        (EXPS | dict(gpu_experts="500:1"), "no routed experts")):
        with pytest.raises(FerryError, match=says):
            place(path, 1, **flags)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """gpt-oss-tiny (MXFP4 experts with biases, the clamped SwiGLU, sinks, a window of 8): its CPU logits over a
    120-token prompt."""
    from ferry.cli import main

    path = tmp_path_factory.mktemp("g") / "gpt-oss.gguf"
    assert main(["synth", "gpt-oss-tiny", "--expert-type", "mxfp4", "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = list(range(11, 131))
    return path, tokens, Engine(model, cpu, n_ctx=512).decode(tokens, all_logits=True)


@pytest.mark.parametrize("preset,flags", [
    ("gpt-oss-tiny", dict(n_gpu_layers=999)), ("gpt-oss-tiny", EXPS), ("gpt-oss-tiny", EXPS | dict(n_batch=288)),
    ("gpt-oss-tiny", dict(n_gpu_layers=999, type_k="q8_0", type_v="q8_0")),
    ("deepseek4-tiny", dict(n_gpu_layers=999)), ("deepseek4-tiny", EXPS)],
    ids=["gpt-oss-all-gpu", "gpt-oss-experts-in-ram", "gpt-oss-experts-in-ram-layer-first", "gpt-oss-all-gpu-q8_0",
         "deepseek4-all-gpu", "deepseek4-experts-in-ram"])
def test_window_layers_rings_on_the_gpu_match_the_cpu(tmp_path_factory, preset, flags):
    """The window layers keep a ring of 512 rows (KVCache.ring; gpt-oss-tiny's even layers, MXFP4 experts;
    deepseek4-tiny's every layer, beside its compressors): a 700-token prompt in u-batches of 96 wraps it, then 30
    steps through CUDA graphs (the store at position mod the ring, the decode kernels' reads there); against the
    CPU over the same rings (tests/test_ring_cache.py holds the CPU's equal to --swa-full). n_batch 288: logical
    batches of three u-batches taken layer first (experts in RAM), each u-batch's attention before the next one's
    writes."""
    from ferry.cli import main

    path = tmp_path_factory.mktemp("r") / f"{preset}.gguf"
    extra = ["--expert-type", "mxfp4"] if preset.startswith("gpt-oss") else []
    assert main(["synth", preset, *extra, "-o", str(path), "-q"]) == 0
    tokens = np.random.default_rng(3).integers(0, 1000, 730).tolist()
    out = []
    flags = dict(flags)
    n_batch = flags.pop("n_batch", 96)
    for placed in (dict(n_gpu_layers=0), flags):
        backend, model = place(path, 8, n_ctx=2048, **placed)
        e = Engine(model, backend, n_ctx=2048, n_batch=n_batch, n_ubatch=96, type_k=placed.get("type_k", "f16"),
                   type_v=placed.get("type_v", "f16"))
        assert e.kv.ring == 512 and e.kv.k[0].shape[0] == 512
        assert e.layer_first or placed is not flags or n_batch == 96  # three u-batches a layer at a time
        out.append(torch.cat([e.decode(tokens[:700], all_logits=True)] + [e.decode([t]) for t in tokens[700:]]))
    _check(out[0], out[1], f"{preset} rings {'/'.join(f'{k}={v}' for k, v in flags.items())}")


def test_server_slots_rings_on_the_gpu_match_the_cpu(tmp_path_factory):
    """Two sequences in mixed batches (one's prompt chunk of 40 beside the other's 24, then both a token at a time)
    over gpt-oss-tiny's rings on the GPU: every row against the same batches on the CPU."""
    from ferry.cli import main

    path = tmp_path_factory.mktemp("r") / "gpt-oss.gguf"
    assert main(["synth", "gpt-oss-tiny", "-o", str(path), "-q"]) == 0
    gen = np.random.default_rng(4)
    a, b = (gen.integers(0, 2000, n).tolist() for n in (600, 560))
    out = []
    for placed in (dict(n_gpu_layers=0), dict(n_gpu_layers=999)):
        backend, model = place(path, 8, n_ctx=2048, **placed)
        e = Engine(model, backend, n_ctx=2048, n_batch=64, n_ubatch=64, n_seq=2)
        assert e.kv.ring == 512
        i, rows = [0, 0], []
        for step in range(40):
            toks, seqs, pos = [], [], []
            for s, prompt, n in ((0, a, 40), (1, b, 24)):
                take = prompt[i[s]:i[s] + (n if step < 15 else 1)]
                toks, seqs, pos = toks + take, seqs + [s] * len(take), pos + list(range(i[s], i[s] + len(take)))
                i[s] += len(take)
            rows.append(e.decode_sequences(toks, seqs, pos, 1024))
        out.append(torch.cat(rows))
    _check(out[0], out[1], "gpt-oss rings, two slots")


@pytest.mark.parametrize("policy,resident", [("all=on", False), ("balanced", False), ("all=off", True),
                                             ("all=on", True)])
@pytest.mark.parametrize("ubatch", [100, 5])
def test_gpt_oss_experts_streamed_and_resident_match_the_cpu(gptoss, policy, resident, ubatch):
    """gpt-oss's experts in RAM: streamed to the GPU and read there in place (MXFP4 split, each expert's biases
    added in the kernels), split with the CPU, or some kept on the GPU (--gpu-experts, their biases' rows with
    them); prompts, then generation through recorded steps."""
    from ferry.placement import format_gpu_experts

    path, tokens, want = gptoss
    _, probe = place(path, 1)
    flags = EXPS | dict(offload_policy="auto" if policy == "balanced" else policy)
    if resident:
        flags["gpu_experts"] = format_gpu_experts(_resident_spec(probe.args.n_layer, probe.args.n_expert))
    backend, model = _hybrid(path, flags, BALANCED if policy == "balanced" else None)
    assert bool(backend._resident) == resident
    n = 100 if ubatch > 8 else 40
    e = Engine(model, backend, n_ctx=512, n_batch=100, n_ubatch=ubatch)
    got = e.decode(tokens[:n], all_logits=True)
    _check(want[:n], got, f"gpt-oss -ot exps=CPU {policy}{' resident' if resident else ''} ub {ubatch}")
    where = {r.device for r in backend.stats.records if r.op == "mul_mat_id"}
    if policy == "all=on":
        assert backend.streamer.bytes_copied > 0 and all(d.endswith("/ CPU 0") for d in where), where
    backend.stats.keep = False
    steps = torch.cat([e.decode([t]) for t in tokens[n:n + 12]])
    _check(want[n:n + 12], steps, f"gpt-oss decode {policy}{' resident' if resident else ''}")
