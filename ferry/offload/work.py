"""What an op on weights in RAM costs and may do, described once: a matmul's weight, or one MoE layer's routed experts
(bytes per expert, work per token, the quant types the CPU's rate depends on, whether ferry's CPU kernel runs one
token of them, whether the GPU can take them). The run (backends/hybrid.py) and `ferry plan` (offload/plan.py) both
decide through these, from a run's Weights or a file's tensor records alike (name, qtype, ne, nbytes)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferry.kernels.capabilities import can, cpu_native_experts, gpu_dense, gpu_reads
from ferry.offload.cost import Calibration, experts_hit, type_shares
from ferry.offload.policy import Decision, ExpertSplit, Policy, decide, split_experts
from ferry.quant import bytes_per_weight

ALL_ON, ALL_OFF = Policy(overrides={"all": "on"}), Policy(overrides={"all": "off"})
SIDES = {"gpu": ALL_ON, "cpu": ALL_OFF}  # a way that moves every expert hit to one side


def gpu_refuses(tensors, takes=lambda q: can(q).gpu_expand) -> str:
    """Why the GPU cannot take these weights from RAM ("" where it can): types no GPU kernel of theirs reads or
    expands (`takes`: the routed experts' kernels by default), or biases on experts it would expand (gpt-oss's
    experts are MXFP4, which it reads)."""
    kept = sorted({t.qtype.name for t in tensors if not takes(t.qtype)})
    if kept:
        return f"{', '.join(kept)}, which no GPU kernel of ferry's reads or expands"
    if any(getattr(t, "bias", None) is not None for t in tensors) and not gpu_reads(t.qtype for t in tensors):
        types = ", ".join(sorted({t.qtype.name for t in tensors}))
        return f"biases on {types} experts, which ferry's GPU kernels add only on the types they read in place"
    return ""


def dense_decision(tensor, n_tokens: int, calib: Calibration, policy: Policy) -> Decision:
    """Where a matmul on this weight in RAM runs for a u-batch of n_tokens: the policy's choice, or the CPU whatever
    the policy where the GPU cannot take its type."""
    d = decide("mul_mat", n_tokens, tensor.ne[1], tensor.ne[0], bytes_per_weight(tensor.qtype), calib, policy)
    why = gpu_refuses([tensor], gpu_dense)
    if why and d.device == "GPU":
        return replace(d, device="CPU", why=f"{why}: on the CPU under every policy")
    return d


@dataclass(frozen=True)
class ExpertsWork:
    """One MoE layer's routed experts (its stacked gate, up and down tensors) as the policy sees them."""

    n_expert: int
    n_expert_used: int
    expert_bytes: float  # one expert's gate, up and down
    flops_per_token: float
    up_gate_share: float  # gate and up's part of expert_bytes (2/3 when the three share a type)
    types: tuple[tuple[str, float], ...]  # each quant type's share of the bytes: the CPU's rate depends on them
    token_kernel: bool  # ferry's CPU kernel runs a token of them (at its own measured rate)
    gpu_refuses: str  # why the GPU cannot take them ("" where it can)

    @classmethod
    def of(cls, gate, up, down, n_expert_used: int, token_kernel: bool | None = None) -> ExpertsWork:
        """token_kernel: whether ferry's CPU kernel runs one token of them, as the run's CPU backend found; None asks
        the capability table and the kernel's build (what a run with the default flags would find)."""
        tensors = (gate, up, down)
        n_expert = gate.ne[2]
        total = sum(t.nbytes for t in tensors)
        shares = type_shares([(t.qtype.name, t.nbytes) for t in tensors])
        if token_kernel is None:
            from ferry.kernels.cpu import native

            token_kernel = not cpu_native_experts(up, gate, down, "silu") and native.library() is not None
        return cls(n_expert, n_expert_used, total / n_expert, 2.0 * sum(t.ne[0] * t.ne[1] for t in tensors),
                   (gate.nbytes + up.nbytes) / total, tuple(shares.items()), token_kernel, gpu_refuses(tensors))

    @property
    def gpu_takes(self) -> bool:
        return not self.gpu_refuses

    def split(self, counts: list[int], calib: Calibration, policy: Policy) -> ExpertSplit:
        """Where the experts a u-batch routes to run (counts[e]: its tokens routed to expert e): the policy's split
        (policy.split_experts), or all on the CPU whatever the policy where the GPU cannot take them."""
        if self.gpu_refuses:
            s = self._split(counts, calib, ALL_OFF)
            return replace(s, why=f"experts of {self.gpu_refuses}: on the CPU under every policy")
        return self._split(counts, calib, policy)

    def _split(self, counts: list[int], calib: Calibration, policy: Policy) -> ExpertSplit:
        return split_experts(counts, self.expert_bytes, self.flops_per_token, calib, policy, self.n_expert_used,
                             self.up_gate_share, dict(self.types), self.token_kernel)

    def even_counts(self, n_tokens: int) -> tuple[list[int], int]:
        """A u-batch of n_tokens routed evenly, as `ferry plan` assumes: (tokens per expert, the experts hit)."""
        hit = max(1, round(experts_hit(n_tokens, self.n_expert, self.n_expert_used)))
        per = n_tokens * self.n_expert_used // hit
        return [per] * hit + [0] * (self.n_expert - hit), hit
