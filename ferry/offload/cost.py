"""The cost model of the offload policy, pure: what this machine does (Calibration, measured by `ferry calibrate`), and
the predicted seconds of an op or a MoE layer's routed experts on each side."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Calibration:
    """What this machine does, measured by `ferry calibrate`: bytes/s and FLOP/s per side, copy latency."""

    h2d_bytes_per_s: float
    h2d_latency_s: float
    cpu_bytes_per_s: float  # reading quantized weights (GEMV bound)
    cpu_flops: float  # dense matmul throughput (large batches)
    gpu_bytes_per_s: float
    gpu_flops: float
    # ggml's routed experts, measured per quant type: its name -> ((tokens per expert, seconds per byte of expert
    # weights), rising tokens); a batched mul_mat_id is neither GEMV- nor FLOP-bound on a CPU, so the policy
    # interpolates this table. A type not measured takes Q4_0's rate per byte
    cpu_moe: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # ferry's own kernel for one token's routed experts (kernels/cpu/native.py), measured: type -> seconds per byte of the
    # experts it reads (1.3x ggml's rate on the H100 machine, docs/decisions.md); none where it did not run
    cpu_moe_token: dict[str, float] = field(default_factory=dict)
    launch_s: float = 0.0  # one GPU kernel launch from Python: the GPU side of a split MoE costs a few dozen
    # the share of the shorter side's time that running both sides at once does not hide: PCIe copies and ggml's
    # experts slow each other (H100 machine: copy 4.3 ms, ggml 6.7 ms, both 9.9 ms; benchmarks/profile_hybrid.py;
    # 0.55 on another machine, docs/performance.md 2026-11-23). Not calibrated: a copy and ggml alone overlap almost
    # fully (docs/decisions.md)
    overlap: float = 0.73
    # what `ferry plan` forecasts a step from (calibrate.measure_steps; 0 where the calibration predates them)
    graph_kernel_s: float = 0.0  # a small GEMV inside a replayed CUDA graph
    gpu_gemv_bytes_per_s: float = 0.0  # a Q4_0 GEMV's weight reads beyond the L2
    handshake_s: float = 0.0  # a host step's handshake inside a replayed graph, beyond the graph's own work
    gpu_moe_flops: float = 0.0  # the grouped Q4_0 expert GEMM at 32 tokens per expert

    @property
    def forecasts(self) -> bool:
        """Whether this calibration holds what a step's forecast needs."""
        return self.graph_kernel_s > 0 and self.gpu_gemv_bytes_per_s > 0 and self.gpu_moe_flops > 0

    def cpu_expert_s(self, expert_bytes: float, tokens, flops_per_token: float, types: dict[str, float] | None = None,
                     token_kernel: bool = False):
        """One expert's weights times `tokens` tokens on the CPU, from the measured tables where there are some;
        tokens may be an array (each expert's count), and so is the result then. types: each quant type's share of
        the expert's bytes (Q4_0 alone by default); token_kernel: the u-batch is one token and ferry's own kernel
        runs it (CpuBackend.native_experts), at its measured rate where there is one."""
        t = np.asarray(tokens, dtype=np.float64)
        s = np.zeros_like(t)
        for qtype, share in (types or {"Q4_0": 1.0}).items():
            part = expert_bytes * share
            table = self.cpu_moe.get(qtype) or self.cpu_moe.get("Q4_0")
            if token_kernel and qtype in self.cpu_moe_token:
                s = s + part * self.cpu_moe_token[qtype] * t
            elif not table:
                s = s + np.maximum(part / self.cpu_bytes_per_s, t * flops_per_token * share / self.cpu_flops)
            else:
                c, per = np.array(table, dtype=np.float64).T
                # below the table its first point, inside it interpolated, beyond it compute-bound: linear in tokens
                s = s + part * np.where(t > c[-1], per[-1] * t / c[-1], np.interp(t, c, per))
        return s if np.ndim(tokens) else float(s)

    def gpu_expert_s(self, expert_bytes: float, tokens: np.ndarray, flops_per_token: float) -> np.ndarray:
        """Each expert's copy over PCIe and its compute on the GPU, for its count of tokens."""
        return (self.h2d_latency_s + expert_bytes / self.h2d_bytes_per_s
                + np.maximum(expert_bytes / self.gpu_bytes_per_s, tokens * flops_per_token / self.gpu_flops))


# launches' worth of host time a MoE layer's GPU side adds (staging, the expert kernels, the sum): 1.1 ms beyond its
# copies on the H100 machine at 9 us per launch (benchmarks/profile_hybrid.py, docs/performance.md 2026-11-23)
GPU_SIDE_LAUNCHES = 120


def type_shares(tensors) -> dict[str, float]:
    """Each quant type's share of a layer's expert bytes, from its expert tensors' (type name, bytes) pairs."""
    total = sum(n for _, n in tensors)
    shares: dict[str, float] = {}
    for qtype, n in tensors:
        shares[qtype] = shares.get(qtype, 0.0) + n / total
    return shares


def experts_hit(n_tokens: int, n_expert: int, n_expert_used: int) -> float:
    """Expected distinct experts a batch routes to, if each token picks k of E uniformly."""
    return n_expert * (1.0 - (1.0 - n_expert_used / n_expert) ** n_tokens)
