"""Gated delta-net linear attention (Qwen3.5 / Qwen3-Next): a causal depthwise convolution over q, k, v whose last
inputs carry over between u-batches, then the gated delta rule, a recurrence on one head_dim x head_dim state per
value head; and its torch forms (one token at a time, and by chunks for prompts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.weight import Weight

CHUNK = 64  # tokens per chunk of the prompt form: its triangular solve is CHUNK x CHUNK per head


@dataclass
class GatedDeltaNet:
    """One recurrent layer. Per token: q, k, v from one projection (then the convolution and SiLU), z (the output
    gate), beta = sigmoid(b) (the write strength) and the log decay g = softplus(alpha + dt_bias) * a (a = -exp(A_log),
    as llama.cpp's converter stores it); q and k L2-normalised per head; value head h reads key head h % n_k_heads
    (qwen35moe: the converter orders the value heads so; qwen3next's read h // ratio); per head the state S (k x v) decays by exp(g), takes
    k (beta (v - S^T k))^T, and gives o = S^T q / sqrt(head_dim); o is RMS-normed per head, times silu(z)."""

    layer: int
    wqkv: Weight
    wz: Weight
    wbeta: Weight
    walpha: Weight
    conv: torch.Tensor  # (channels, kernel) float32: each channel's taps, oldest first
    dt_bias: torch.Tensor  # (n_v_heads,)
    a: torch.Tensor  # (n_v_heads,) = -exp(A_log)
    norm: torch.Tensor  # (head_dim,)
    wo: Weight
    n_k_heads: int
    n_v_heads: int
    head_dim: int
    norm_eps: float
    tiled: bool = True  # value head h reads key head h % n_k_heads; else h // (n_v_heads / n_k_heads) (qwen3next)

    @property
    def channels(self) -> int:
        return (2 * self.n_k_heads + self.n_v_heads) * self.head_dim

    def __call__(self, ops, x, norm: torch.Tensor | None = None, eps: float = 0.0):
        """The layer's output for x, or for RMSNorm(x) * norm when norm is given (Attention's signature)."""
        if norm is not None:
            x = ops.rms_norm(x, norm, eps)
        d, hk, hv = self.head_dim, self.n_k_heads, self.n_v_heads
        mixed = ops.short_conv(self.layer, ops.linear(x, self.wqkv), self.conv)  # silu(conv): (n, channels)
        q, k, v = ops.split(mixed, [hk * d, hk * d, hv * d])
        q = ops.l2_norm(ops.heads(q, hk, d), self.norm_eps)
        k = ops.l2_norm(ops.heads(k, hk, d), self.norm_eps)
        beta = ops.sigmoid(ops.linear(x, self.wbeta))
        g = ops.decay(ops.linear(x, self.walpha), self.dt_bias, self.a)
        o = ops.delta_net(self.layer, q, k, ops.heads(v, hv, d), g, beta, self.tiled)  # (n, hv, d)
        z = ops.heads(ops.linear(x, self.wz), hv, d)
        return ops.linear(ops.merge_heads(ops.gated_rms_norm(o, self.norm, z, self.norm_eps)), self.wo)


def short_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the causal depthwise convolution of x (n, channels) after state (kernel - 1, channels), the inputs
    before it: (out (n, channels), the new state: the last kernel - 1 inputs)."""
    taps = weight.shape[1]
    xs = torch.cat([state.to(x.dtype), x], 0)  # (kernel - 1 + n, channels)
    out = F.conv1d(xs.t()[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0].t()
    return F.silu(out), xs[xs.shape[0] - (taps - 1):]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens: q, k (n, heads, d) normalised (their heads already repeated to the value
    heads), v (n, heads, d), g, beta (n, heads), state (heads, d_k, d_v) -> (o (n, heads, d_v), the new state). One
    token is one step; more run by chunks: within a chunk the writes u solve a unit lower-triangular system
    (I + A) U = beta (V - e^G K S0), A[t, j] = beta_t e^(G_t - G_j) k_t.k_j for j < t (G the decay's running sum),
    and o = e^G Q S0 + (causal e^(G_t - G_j) q_t.k_j) U."""
    scale = q.shape[-1] ** -0.5
    q, k, v = q.transpose(0, 1) * scale, k.transpose(0, 1), v.transpose(0, 1)  # (heads, n, d)
    g, beta = g.t(), beta.t()  # (heads, n)
    if q.shape[1] == 1:
        s = state * g.exp()[:, :, None]
        u = beta[:, :, None] * (v - k @ s)  # (heads, 1, d_v)
        s = s + k.transpose(1, 2) @ u
        return (q @ s).transpose(0, 1), s
    outs = []
    s = state
    for c0 in range(0, q.shape[1], chunk):
        qc, kc, vc = q[:, c0:c0 + chunk], k[:, c0:c0 + chunk], v[:, c0:c0 + chunk]
        gc, bc = g[:, c0:c0 + chunk].cumsum(-1), beta[:, c0:c0 + chunk, None]
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, -torch.inf).exp()  # e^(G_t - G_j), j <= t
        a = (bc * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + a, bc * (vc - gc.exp()[:, :, None] * (kc @ s)), upper=False,
                                          unitriangular=True)
        outs.append(gc.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u)
        last = gc[:, -1:]
        s = last.exp()[:, :, None] * s + (kc * (last - gc).exp()[:, :, None]).transpose(1, 2) @ u
    return torch.cat(outs, 1).transpose(0, 1), s
