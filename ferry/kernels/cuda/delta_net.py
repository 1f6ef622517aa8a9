"""The gated delta-net's GPU kernels: a generation step (the causal convolution's, and the delta rule's with its gates
and q/k norms, each one launch), the prompt form's passage of the state from chunk to chunk (the chunks' own work is
batched torch, layers/delta_net.chunk_parts), and the gated RMSNorm of its output. A delta-rule program keeps a block
of the state's value columns in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value columns of the state a program keeps


@triton.jit
def _step(q_ptr, k_ptr, v_ptr, b_ptr, alpha_ptr, dt_ptr, a_ptr, s_ptr, o_ptr, n_k_heads, ratio, d_v, scale, eps,
          TILED: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr):
    h, vb = tl.program_id(0), tl.program_id(1)
    kh = h % n_k_heads if TILED else h // ratio
    ks = tl.arange(0, DK)
    vs = vb * BV + tl.arange(0, BV)
    vm = vs < d_v
    k = tl.load(k_ptr + kh * DK + ks)
    q = tl.load(q_ptr + kh * DK + ks)
    k = k / tl.sqrt(tl.sum(k * k, 0) + eps)
    q = q / tl.sqrt(tl.sum(q * q, 0) + eps)
    v = tl.load(v_ptr + h * d_v + vs, mask=vm, other=0.0)
    x = tl.load(alpha_ptr + h) + tl.load(dt_ptr + h)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(softplus * tl.load(a_ptr + h))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + h)))
    rows = s_ptr + h * d_v * DK + vs[:, None] * DK + ks[None, :]  # the state transposed: (d_v, d_k) per head
    s = tl.load(rows, mask=vm[:, None], other=0.0) * decay
    u = beta * (v - tl.sum(s * k[None, :], 1))
    s = s + u[:, None] * k[None, :]
    tl.store(rows, s, mask=vm[:, None])
    tl.store(o_ptr + h * d_v + vs, tl.sum(s * q[None, :], 1) * scale, mask=vm)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
         dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor, tiled: bool, eps: float) -> torch.Tensor:
    """One token's gated delta rule with its gates: q, k (1, key heads, d_k), L2-normed here (eps inside the root),
    v (1, heads, d_v), b and alpha (1, heads): beta = sigmoid(b), the decay exp(softplus(alpha + dt_bias) * a);
    state (heads, d_v, d_k) float32, updated in place (ggml's layout: each head's state transposed). Value head h
    reads key head h % key heads (tiled) or h // ratio. Returns o (1, heads, d_v)."""
    heads, d_v, d_k = state.shape
    n_k_heads = q.shape[1]
    o = torch.empty(1, heads, d_v, device=v.device, dtype=torch.float32)
    _step[(heads, triton.cdiv(d_v, BLOCK_V))](q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                              b.float().contiguous(), alpha.float().contiguous(), dt_bias, a, state, o,
                                              n_k_heads, heads // n_k_heads, d_v, d_k ** -0.5, eps, TILED=tiled,
                                              DK=d_k, BV=BLOCK_V)
    return o


@triton.jit
def _scan(w1_ptr, w2_ptr, kd_ptr, gl_ptr, s_ptr, u_ptr, states_ptr, n_chunks, d_v,
          C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr):
    h, vb = tl.program_id(0), tl.program_id(1)
    ks, cs = tl.arange(0, DK), tl.arange(0, C)
    vs = vb * BV + tl.arange(0, BV)
    vm = vs < d_v
    state = s_ptr + h * DK * d_v + ks[:, None] * d_v + vs[None, :]  # (d_k, d_v) per head
    s = tl.load(state, mask=vm[None, :], other=0.0)
    for c in range(n_chunks):
        base = h * n_chunks + c
        tl.store(states_ptr + base * DK * d_v + ks[:, None] * d_v + vs[None, :], s, mask=vm[None, :])
        w2 = tl.load(w2_ptr + base * C * DK + cs[:, None] * DK + ks[None, :])
        w1 = tl.load(w1_ptr + base * C * d_v + cs[:, None] * d_v + vs[None, :], mask=vm[None, :], other=0.0)
        u = w1 - tl.dot(w2, s, input_precision="ieee")
        tl.store(u_ptr + base * C * d_v + cs[:, None] * d_v + vs[None, :], u, mask=vm[None, :])
        kd = tl.load(kd_ptr + base * C * DK + cs[:, None] * DK + ks[None, :])
        s = tl.load(gl_ptr + base) * s + tl.dot(tl.trans(kd), u, input_precision="ieee")
    tl.store(state, s, mask=vm[None, :])


def scans(d_k: int, chunk: int) -> bool:
    """Whether scan takes these sizes (the dot products' tiles: powers of two from 16)."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (d_k, chunk))


def scan(w1: torch.Tensor, w2: torch.Tensor, kd: torch.Tensor, gl: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layers/delta_net.scan_chunks in one launch: w1 (heads, chunks, chunk, d_v), w2 and kd (heads, chunks, chunk,
    d_k), gl (heads, chunks), state (heads, d_k, d_v) -> (U, the state each chunk starts from, the last state)."""
    heads, n_chunks, chunk, d_v = w1.shape
    d_k = w2.shape[-1]
    s = state.float().contiguous().clone()
    u = torch.empty_like(w1)
    states = torch.empty(heads, n_chunks, d_k, d_v, device=w1.device, dtype=torch.float32)
    _scan[(heads, triton.cdiv(d_v, BLOCK_V))](w1, w2, kd, gl, s, u, states, n_chunks, d_v, C=chunk, DK=d_k,
                                              BV=BLOCK_V)
    return u, states, s


@triton.jit
def _conv_step(x_ptr, state_ptr, w_ptr, y_ptr, channels, KEPT: tl.constexpr, BC: tl.constexpr):
    cs = tl.program_id(0) * BC + tl.arange(0, BC)
    m = cs < channels
    x = tl.load(x_ptr + cs, mask=m, other=0.0)
    acc = x * tl.load(w_ptr + cs * (KEPT + 1) + KEPT, mask=m, other=0.0)
    for i in tl.static_range(KEPT):  # the kept inputs, oldest first, each moved one place down
        kept = tl.load(state_ptr + cs * KEPT + i, mask=m, other=0.0)
        acc += kept * tl.load(w_ptr + cs * (KEPT + 1) + i, mask=m, other=0.0)
        if i > 0:
            tl.store(state_ptr + cs * KEPT + i - 1, kept, mask=m)
    tl.store(state_ptr + cs * KEPT + KEPT - 1, x, mask=m)
    tl.store(y_ptr + cs, acc / (1.0 + tl.exp(-acc)), mask=m)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token's causal convolution and SiLU: x (1, channels), state (channels, kernel - 1) of the inputs before
    it (updated in place), weight (channels, kernel) -> (1, channels)."""
    channels, kept = state.shape
    y = torch.empty(1, channels, device=x.device, dtype=torch.float32)
    block = 256
    _conv_step[(triton.cdiv(channels, block),)](x.float().contiguous(), state, weight.contiguous(), y, channels,
                                                KEPT=kept, BC=block)
    return y


@triton.jit
def _gated_norm(x_ptr, w_ptr, z_ptr, y_ptr, d, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=m, other=0.0)
    z = tl.load(z_ptr + row * d + cols, mask=m, other=0.0)
    y = x / tl.sqrt(tl.sum(x * x, 0) / d + eps) * tl.load(w_ptr + cols, mask=m, other=0.0) * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + row * d + cols, y, mask=m)


def gated_norm(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * silu(z) over the last dimension (each head's), float32, one launch."""
    x, z = x.float().contiguous(), z.float().contiguous()
    d = x.shape[-1]
    y = torch.empty_like(x)
    _gated_norm[(x.numel() // d,)](x, w, z, y, d, eps, BLOCK=triton.next_power_of_2(d))
    return y
