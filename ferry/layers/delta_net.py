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

    def __call__(self, ops, x, norm: torch.Tensor | None = None, eps: float = 0.0):
        """The layer's output for x, or for RMSNorm(x) * norm when norm is given (Attention's signature)."""
        d, hk, hv = self.head_dim, self.n_k_heads, self.n_v_heads
        qkv, z, b, alpha = ops.linears(x, (self.wqkv, self.wz, self.wbeta, self.walpha), norm, eps)
        mixed = ops.short_conv(self.layer, qkv, self.conv)  # silu(conv): (n, channels)
        q, k, v = ops.split(mixed, [hk * d, hk * d, hv * d])
        o = ops.delta_net(self, ops.heads(q, hk, d), ops.heads(k, hk, d), ops.heads(v, hv, d), b, alpha)
        return ops.linear(ops.merge_heads(ops.gated_rms_norm(o, self.norm, ops.heads(z, hv, d), self.norm_eps)), self.wo)


def short_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the causal depthwise convolution of x (n, channels) after state (kernel - 1, channels), the inputs
    before it: (out (n, channels), the new state: the last kernel - 1 inputs)."""
    taps = weight.shape[1]
    xs = torch.cat([state.to(x.dtype), x], 0)  # (kernel - 1 + n, channels)
    out = F.conv1d(xs.t()[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0].t()
    return F.silu(out), xs[xs.shape[0] - (taps - 1):]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, chunk: int | None = None, scan=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens: q, k (n, heads, d_k) normalised (their heads already repeated to the value
    heads), v (n, heads, d_v), g, beta (n, heads), state (heads, d_k, d_v) -> (o (n, heads, d_v), the new state).
    One token is one step; more run by chunks of `chunk` (default CHUNK, read at the call; chunk_parts), every chunk's own work at once and only the state's
    passage from chunk to chunk in turn (`scan`: scan_chunks, or a GPU kernel of its signature)."""
    if q.shape[0] == 1:
        q, k, v = q[0] * q.shape[-1] ** -0.5, k[0], v[0]  # (heads, d)
        s = state * g[0].exp()[:, None, None]
        u = beta[0][:, None] * (v - torch.einsum("hkv,hk->hv", s, k))
        s = s + k[:, :, None] * u[:, None, :]
        return torch.einsum("hkv,hk->hv", s, q)[None], s
    n = q.shape[0]
    qd, p, w1, w2, kd, gl = chunk_parts(q, k, v, g, beta, chunk or CHUNK)
    u, states, last = (scan or scan_chunks)(w1, w2, kd, gl, state)
    out = qd @ states + p @ u  # (heads, chunks, chunk, d_v)
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1), last


def chunk_parts(q, k, v, g, beta, chunk: int):
    """What each chunk of `chunk` tokens needs apart from the state it starts from (the tokens padded with ones that
    neither decay nor write). With G the decay's running sum in the chunk and D[t, j] = e^(G_t - G_j) for j <= t,
    the writes of a chunk that starts from state S are U = W1 - W2 S, where (I + A) [W1 | W2] = beta [V | e^G K],
    A[t, j] = beta_t D[t, j] k_t.k_j (j < t); its outputs are O = (e^G Q) S + (D * Q K^T) U, and the state after it
    e^(G_last) S + (e^(G_last - G) K)^T U. Returns (e^G Q / sqrt(d_k), D * Q K^T / sqrt(d_k), W1, W2, e^(G_last - G)
    K, e^(G_last)), each per head and chunk: (heads, chunks, chunk, ...), the last (heads, chunks)."""
    n, heads = q.shape[:2]
    pad = -n % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (n, heads, ...) -> (heads, chunks, chunk, ...)
        t = torch.nn.functional.pad(t.transpose(0, 1), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(heads, -1, chunk, *t.shape[2:])

    q, k, v, g, beta = chunks(q * q.shape[-1] ** -0.5), chunks(k), chunks(v), chunks(g), chunks(beta)[..., None]
    g = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    a = (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(eye + a, beta * torch.cat([v, g.exp()[..., None] * k], -1), upper=False,
                                      unitriangular=True)
    w1, w2 = w.split([v.shape[-1], k.shape[-1]], -1)
    last = g[..., -1:]
    return (g.exp()[..., None] * q, decay * (q @ k.transpose(-1, -2)), w1.contiguous(), w2.contiguous(),
            ((last - g).exp()[..., None] * k).contiguous(), last[..., 0].exp().contiguous())


def scan_chunks(w1, w2, kd, gl, state):
    """The state's passage through the chunks in turn (chunk_parts): each chunk's writes U = W1 - W2 S and the state
    S it starts from; returns (U (heads, chunks, chunk, d_v), those states (heads, chunks, d_k, d_v), the last)."""
    us, states, s = [], [], state
    for c in range(w1.shape[1]):
        states.append(s)
        u = w1[:, c] - w2[:, c] @ s
        us.append(u)
        s = gl[:, c, None, None] * s + kd[:, c].transpose(-1, -2) @ u
    return torch.stack(us, 1), torch.stack(states, 1), s
