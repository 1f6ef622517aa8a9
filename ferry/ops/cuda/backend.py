"""GPU backend, first form: weights live on the GPU in their GGUF encoding and are expanded by the Triton
dequantization kernels into one reused scratch buffer right before each matmul (cuBLAS through torch).
Float32 throughout: correctness first; bf16 scratch, quantized GEMV and grouped MoE kernels come next."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES

from ferry.ops import Weight
from ferry.quant import Q

_ACT = {"silu": F.silu, "gelu": lambda x: F.gelu(x, approximate="tanh")}
_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_GATHER_MAX = 64  # (token, expert) pairs up to which the MoE gathers experts instead of looping over them


class CudaBackend:
    name = "CUDA"

    def __init__(self, device: str = "cuda:0", dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype
        self._raw: dict[int, torch.Tensor] = {}
        self._scratch = torch.empty(0, dtype=dtype, device=self.device)

    def upload(self, w: Weight) -> torch.Tensor:
        """The weight's bytes on the GPU (once)."""
        raw = self._raw.get(id(w))
        if raw is None:
            with warnings.catch_warnings():  # the mmap is read-only and torch only reads it here
                warnings.simplefilter("ignore", UserWarning)
                raw = self._raw[id(w)] = torch.from_numpy(w.data).to(self.device)
        return raw

    def _expand(self, qtype, raw: torch.Tensor, ne: tuple[int, ...]) -> torch.Tensor:
        """Floats of `raw` (a whole tensor or a slice of whole rows) in the scratch buffer."""
        n = 1
        for v in ne:
            n *= v
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=self.dtype, device=self.device)
        out = self._scratch[:n].view(tuple(reversed(ne)))
        if qtype in _FLOAT:
            return out.copy_(raw.view(_FLOAT[qtype]).view(out.shape))
        from ferry.ops.cuda.dequant import SUPPORTED, dequantize  # Triton: only where a GPU is

        if qtype not in SUPPORTED:
            raise NotImplementedError(f"no GPU kernel for {qtype.name} yet")
        return dequantize(raw, qtype, ne, out=out)

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        """A small float model tensor (norm weight, bias) on the GPU (once)."""
        v = self._raw.get(id(t))
        if v is None:
            v = self._raw[id(t)] = t.to(self.device, self.dtype)
        return v

    def _matrix(self, w: Weight) -> torch.Tensor:
        return self._expand(w.qtype, self.upload(w), w.ne)

    def _expert(self, w: Weight, e: int) -> torch.Tensor:
        raw = self.upload(w).view(w.ne[2], -1)[e]
        return self._expand(w.qtype, raw, w.ne[:2])

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return x.to(self.dtype) @ self._matrix(w).T

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        h = _ACT[act](self.linear(x, gate)) * self.linear(x, up)
        return self.linear(h, down)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        block, size = GGML_QUANT_SIZES[w.qtype]
        rows = self.upload(w).view(w.ne[1], w.ne[0] // block * size)[ids.to(self.device).long()]
        return self._expand(w.qtype, rows.reshape(-1), (w.ne[0], len(ids))).clone()

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax router, top-k, each routed expert over its tokens, weighted sum: ((n, n_embd), ids (n, k))."""
        probs = torch.softmax(self.linear(x, router).float(), -1)
        weights, ids = probs.topk(n_used, -1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], down.ne[1], dtype=self.dtype, device=self.device)
        if x.shape[0] * n_used <= _GATHER_MAX:
            return self._moe_gathered(x, ids, weights, up, gate, down, act, out), ids.to(torch.int32)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xe = x[tok].to(self.dtype)
            h = _ACT[act](xe @ self._expert(gate, e).T) * (xe @ self._expert(up, e).T)
            out.index_add_(0, tok, (h @ self._expert(down, e).T) * weights[tok, slot, None].to(self.dtype))
        return out, ids.to(torch.int32)

    def _moe_gathered(self, x, ids, weights, up: Weight, gate: Weight, down: Weight, act: str, out: torch.Tensor):
        """Few (token, expert) pairs (generation): gather each pair's expert bytes on the GPU and run batched
        matmuls, with no host round trip to learn which experts were chosen."""
        flat = ids.flatten()
        tok = torch.arange(x.shape[0], device=self.device).repeat_interleave(ids.shape[1])
        xe = x[tok].to(self.dtype)[:, None, :]  # (pairs, 1, n_embd)

        def experts(w: Weight) -> torch.Tensor:  # (pairs, rows, cols) in the scratch: use before the next call
            raw = self.upload(w).view(w.ne[2], -1)[flat]
            return self._expand(w.qtype, raw.reshape(-1), (w.ne[0], w.ne[1], len(flat)))

        g = torch.bmm(xe, experts(gate).transpose(1, 2))
        h = _ACT[act](g) * torch.bmm(xe, experts(up).transpose(1, 2))
        y = torch.bmm(h, experts(down).transpose(1, 2))[:, 0, :]  # (pairs, n_embd)
        return out.index_add_(0, tok, y * weights.flatten()[:, None].to(self.dtype))
