"""glm4moe (q/k/v biases, rope on half of each head, sigmoid routing with a correction bias, a shared expert),
deepseek2 (latent attention, group-free sigmoid routing), minimax-m2 (q/k norms across all heads, rope on half of
each head, sigmoid routing with a correction bias), qwen35moe (gated delta-net layers with their recurrent state,
gated attention, a gated shared expert), deepseek32 / glm-dsa (sparse attention, top-k 16 of the 220 positions) and
deepseek4 (compressed attention: a window of 8, entries pooled by 4 and 16, the indexer's top 4; hyper-connection
streams; hash routing) on the GPU and in the hybrid runtime, against the all-CPU
result, on the tiny synthetic presets: prompts at two u-batch sizes, then token by token through CUDA graphs. Also
files as ik_llama.cpp quantized them (IQ4_KS, IQ4_K, IQ5_KS, IQ3_KS, IQ2_KS, IQ4_KSS, IQ2_KL, IQ2_K or IQ3_K experts
(some interleaved as _R4, de-interleaved at load) read in place
by the CPU kernel and, kept on the GPU in part, by the GPU's kquant.py kernels, all on the GPU rewritten as Q8_0;
tensors of Q6_0, IQ5_K, IQ6_K, and the others' non-expert tensors, rewritten at load as Q8_0:
tests/fixtures/ik)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.backends.cuda import CudaBackend
from ferry.runtime.engine import Engine
from conftest import kl_top1, place

N_PROMPT, N_GEN = 200, 20


IK_FILES = {"ik-types": "qwen3moe-ik.gguf", "ik-k-types": "qwen3moe-ik-k.gguf", "ik-low-types": "qwen3moe-ik-low.gguf",
            "ik-r4-types": "qwen3moe-ik-r4.gguf", "ik-kl-types": "qwen3moe-ik-kl.gguf",
            "ik-k2-types": "qwen3moe-ik-k2-r4.gguf"}


def _family(name, tmp_path_factory):
    if name in IK_FILES:
        path = Path(__file__).parents[1] / "tests" / "fixtures" / "ik" / IK_FILES[name]
    else:
        path = tmp_path_factory.mktemp("f") / f"{name}.gguf"
        assert main(["synth", name, "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = np.random.default_rng(1).integers(0, model.args.n_vocab, N_PROMPT + N_GEN).tolist()
    e = Engine(model, cpu, n_ctx=256)
    want = torch.cat([e.decode(tokens[:N_PROMPT], all_logits=True)] + [e.decode([t]) for t in tokens[N_PROMPT:]])
    return name, path, tokens, want


@pytest.fixture(scope="module", params=["glm4moe-tiny", "deepseek2-tiny", "minimax-m2-tiny", "qwen35moe-tiny",
                                        "qwen3next-tiny", "deepseek32-tiny", "glm-dsa-tiny", "deepseek4-tiny",
                                        *IK_FILES])
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=list(IK_FILES))
def ik_family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


def _run(engine, tokens):
    return torch.cat([engine.decode(tokens[:N_PROMPT], all_logits=True)] +
                     [engine.decode([t]) for t in tokens[N_PROMPT:]])


def _check(want, got, label: str) -> None:
    kl, top1 = kl_top1(want, got)
    print(f"\n{label}: KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
    assert kl.median() < 2e-3 and kl.max() < 3e-2 and top1 >= 0.95


@pytest.mark.parametrize("ubatch", [64, 5])
def test_all_gpu_matches_the_cpu(family, ubatch):
    name, path, tokens, want = family
    engine = Engine(load_model(GGUFFile(path)), CudaBackend(), n_ctx=256, n_ubatch=ubatch)
    _check(want, _run(engine, tokens), f"{name} GPU ub {ubatch}")


@pytest.mark.parametrize("policy", ["all=off", "all=on"])
def test_experts_in_ram_match_the_cpu(family, policy):
    name, path, tokens, want = family
    backend, model = place(path, 8, n_gpu_layers=999, override_tensor=["exps=CPU"], offload_policy=policy, n_ctx=256)
    _check(want, _run(Engine(model, backend, n_ctx=256, n_ubatch=64), tokens), f"{name} -ot exps=CPU {policy}")


def test_ik_experts_on_the_gpu_are_rewritten_whole_and_read_in_place_in_part(ik_family):
    """A run with every routed expert on the GPU (-ngl 999) rewrites the experts kept in ik_llama.cpp's types as Q8_0
    (faster there: the loader's _ik_experts_on_gpu); some of each layer's experts kept on the GPU (--gpu-experts, as
    the fit keeps them on a small GPU) stay in their types, read in place by kquant.py's kernels, the rest on the CPU
    kernel or streamed. All against the CPU."""
    from ferry.placement import format_gpu_experts
    from ferry.quant import IkQuant

    name, path, tokens, want = ik_family
    backend, model = place(path, 8, n_gpu_layers=999, n_ctx=256)
    experts = [w for w in model.weights() if "_exps" in w.name]
    assert experts and all(w.qtype == GGMLQuantizationType.Q8_0 for w in experts)
    _check(want, _run(Engine(model, backend, n_ctx=256, n_ubatch=64), tokens), f"{name} GPU, experts rewritten")
    n_layer, n_expert = model.args.n_layer, model.args.n_expert
    spec = {layer: tuple(range(layer % 2, n_expert, 2 + layer % 3)) for layer in range(n_layer - 1)}
    for policy in ("all=off", "all=on"):
        backend, model = place(path, 8, n_gpu_layers=999, override_tensor=["exps=CPU"], offload_policy=policy,
                               gpu_experts=format_gpu_experts(spec), n_ctx=256)
        assert len(backend._resident) == len(spec)
        assert any(isinstance(w.qtype, IkQuant) for w in model.weights() if "_exps" in w.name)
        try:
            for ubatch in (64, 5):
                _check(want, _run(Engine(model, backend, n_ctx=256, n_ubatch=ubatch), tokens),
                       f"{name} --gpu-experts {policy} ub {ubatch}")
        finally:
            backend.close()


@pytest.mark.parametrize("name", ["deepseek4-tiny", "qwen35moe-tiny"])
def test_sequences_in_turn_decode_through_graphs_of_their_own(name, tmp_path):
    """A server's slots on the GPU: two sequences of a model with a state per sequence (compressors' rows and
    entries, delta-nets') take decode steps in turn, each through the CUDA graph recorded for its sequence (a graph
    recorded for one and replayed for the other would read and write the first one's state); each gives the logits
    it gives alone on the CPU."""
    path = tmp_path / f"{name}.gguf"
    assert main(["synth", name, "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, model.args.n_vocab, 60).tolist() for _ in range(2)]
    want = [_run_from(Engine(model, cpu, n_ctx=128), s, 20) for s in seqs]
    engine = Engine(load_model(GGUFFile(path)), CudaBackend(), n_ctx=256, n_seq=2)
    for i, s in enumerate(seqs):
        engine.decode_sequences(s[:20], [i] * 20, list(range(20)), 128)
    got = [engine.decode_sequences([seqs[0][p], seqs[1][p]], [0, 1], [p, p], 128, all_logits=True)
           for p in range(20, 60)]
    for i in range(2):
        _check(want[i], torch.stack([g[i] for g in got]), f"{name} sequence {i} of 2, GPU graphs")


def _run_from(engine, tokens, n_prompt):
    """The logits of each token after the first n_prompt, fed one by one."""
    engine.decode(tokens[:n_prompt])
    return torch.cat([engine.decode([t]) for t in tokens[n_prompt:]])
