"""The capability table (ferry/kernels/capabilities.py) against the kernels themselves, and the descriptions of the
work (ferry/offload/work.py) that the run and `ferry plan` both decide through."""

from types import SimpleNamespace

import numpy as np
import pytest

from ferry.backends.cpu import CpuBackend
from ferry.gguf.synth import random_tensor
from ferry.kernels import capabilities as caps
from ferry.offload.cost import Calibration
from ferry.offload.policy import parse_policy
from ferry.offload.work import ExpertsWork, dense_decision
from ferry.quant import IkQuant, Q, bytes_per_weight
from ferry.weight import Weight

MACHINE = Calibration(h2d_bytes_per_s=50e9, h2d_latency_s=2e-5, cpu_bytes_per_s=50e9, cpu_flops=1e12,
                      gpu_bytes_per_s=3e12, gpu_flops=4e14)


def test_the_gpu_columns_are_what_the_gpu_kernels_read():
    from ferry.kernels.cuda.dequant import SUPPORTED
    from ferry.kernels.cuda.kquant import KINDS
    from ferry.kernels.cuda.layout import GEMV_KINDS

    assert caps.gpu_gemv_types() == set(GEMV_KINDS)
    assert caps.gpu_token_types() == set(KINDS)
    assert caps.gpu_expand_types() == set(SUPPORTED)
    assert {q for q in Q if caps.can(q).gpu_float} == {Q.F32, Q.F16, Q.BF16}
    assert caps.gpu_dense(Q.F16) and caps.gpu_dense(Q.Q4_K) and not caps.gpu_dense(Q.IQ2_XXS)
    assert not caps.can(Q.F16).gpu_expand and caps.can(Q.Q4_K).gpu_expand  # float experts stay on the CPU
    assert caps.gpu_reads([Q.Q4_0, Q.Q8_0]) and not caps.gpu_reads([Q.Q4_0, Q.Q4_K])
    # some of a layer's experts kept on the GPU: types the split kernels read, or kquant.py's, not a mix, not IQ4_XS
    assert caps.gpu_holds([Q.MXFP4]) and caps.gpu_holds([Q.Q4_K, Q.Q6_K]) and caps.gpu_holds([Q.Q5_K])
    assert not caps.gpu_holds([Q.Q4_0, Q.Q4_K]) and not caps.gpu_holds([Q.IQ4_XS]) and not caps.gpu_holds([Q.F16])
    assert caps.gpu_holds([Q.MXFP4], biased=True) and not caps.gpu_holds([Q.Q4_K], biased=True)  # kquant.py adds none


def _layer(rng, up_type, down_type=None, n_expert=4, n_embd=256, n_ff=256):
    def w(name, qtype, ne):
        return Weight(name, qtype, ne, random_tensor(qtype, ne, 0.5, rng))

    down_type = down_type or up_type
    return (w("blk.0.ffn_up_exps.weight", up_type, (n_embd, n_ff, n_expert)),
            w("blk.0.ffn_gate_exps.weight", up_type, (n_embd, n_ff, n_expert)),
            w("blk.0.ffn_down_exps.weight", down_type, (n_ff, n_embd, n_expert)))


def test_the_cpu_kernel_column_is_what_ferrys_kernel_reads():
    assert caps.cpu_native_types() == {Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4, *IkQuant}
    # ik_llama.cpp's IQ4_KS, IQ4_K, IQ3_KS, IQ2_KS: routed experts only, read plain; ggml never sees them (no repack probe, no
    # graph leaf)
    for ik in IkQuant:
        assert caps.can(ik).cpu_native == "plain" and not caps.can(ik).cpu_linear
        assert not caps.can_ggml(ik) and not caps.cpu_repack(ik, (2048, 768, 8))
        assert caps.cpu_native_experts(*_layer(np.random.default_rng(1), ik), "silu") == ""
    assert caps.can_ggml(Q.IQ4_XS)
    # ggml has no x86 repacked layout for Q5_K, Q6_K and IQ4_XS, and one for MXFP4 that the kernel need not read: the
    # kernel reads their plain rows, and a CPU backend leaves MXFP4 unrepacked where its kernels run
    assert {q for q in Q if caps.can(q).cpu_native == "plain"} == {Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4}
    assert caps.cpu_reads_plain(Q.MXFP4, (2880, 2880, 32)) and not caps.cpu_reads_plain(Q.MXFP4, (2880 + 32, 64, 4))
    assert not caps.cpu_reads_plain(Q.Q4_0, (2880, 2880, 32))
    rng = np.random.default_rng(0)
    q4 = _layer(rng, Q.Q4_0)
    assert caps.cpu_native_experts(*q4, "silu") == ""
    assert caps.cpu_native_experts(*q4, "swiglu_oai") == ""
    assert caps.cpu_native_experts(*q4, "silu_clamp") == ""
    assert "silu, swiglu_oai, silu_clamp" in caps.cpu_native_experts(*q4, "gelu")
    mx = _layer(rng, Q.MXFP4, n_embd=192, n_ff=320)
    assert caps.cpu_native_experts(*mx, "swiglu_oai") == ""
    assert "not whole blocks" in caps.cpu_native_experts(*_layer(rng, Q.MXFP4, n_embd=160, n_ff=320), "swiglu_oai")
    mx_backend = CpuBackend(1)
    from ferry.kernels.cpu import native as nat

    if nat.library() is not None:
        assert mx_backend.native_experts(1, True, *mx, "swiglu_oai") is not None
        assert not any(w.repacked for w in mx)  # no second copy of what the kernel reads plain
    assert "Q8_0" in caps.cpu_native_experts(*_layer(rng, Q.Q8_0), "silu")
    assert "repacked copy" in caps.cpu_native_experts(*q4, "silu", repacked=lambda w: False)  # --no-repack
    assert caps.cpu_native_experts(*_layer(rng, Q.Q6_K), "silu", repacked=lambda w: False) == ""
    # the run's CPU backend asks the same table: it runs ferry's kernel where the table says so and the CPU can
    backend = CpuBackend(1)
    from ferry.kernels.cpu import native

    up, gate, down = q4
    assert (backend.native_experts(1, True, up, gate, down, "silu") is not None) == (native.library() is not None)
    assert backend.native_experts(1, True, *_layer(rng, Q.Q8_0)[:3], "silu") is None


def _dense(qtype, rows=256, cols=512):
    return SimpleNamespace(name="blk.0.w", qtype=qtype, ne=(cols, rows), nbytes=int(rows * cols * bytes_per_weight(qtype)))


@pytest.mark.parametrize("qtype, where", [(Q.F32, "GPU"), (Q.F16, "GPU"), (Q.Q8_0, "GPU"), (Q.Q4_K, "GPU"),
                                          (Q.IQ2_XXS, "CPU")])
def test_a_dense_weight_goes_where_all_on_sends_it_unless_no_gpu_kernel_takes_its_type(qtype, where):
    d = dense_decision(_dense(qtype), 512, MACHINE, parse_policy("all=on"))
    assert d.device == where
    assert ("IQ2_XXS" in d.why and "under every policy" in d.why) == (where == "CPU")
    assert dense_decision(_dense(qtype), 512, MACHINE, parse_policy("all=off")).device == "CPU"


def test_a_layers_experts_are_described_once_for_the_run_and_the_plan():
    rng = np.random.default_rng(1)
    up, gate, down = _layer(rng, Q.Q4_K, Q.Q6_K)
    work = ExpertsWork.of(gate, up, down, 2, token_kernel=False)
    total = up.nbytes + gate.nbytes + down.nbytes
    assert work.n_expert == 4 and work.expert_bytes == total / 4 and work.gpu_takes
    assert abs(work.up_gate_share - (up.nbytes + gate.nbytes) / total) < 1e-12
    assert dict(work.types) == pytest.approx({"Q4_K": (up.nbytes + gate.nbytes) / total, "Q6_K": down.nbytes / total})
    counts, hit = work.even_counts(1)
    assert hit == 2 and sum(counts) == 2
    # a file's tensor records describe the same work as the run's weights
    records = [SimpleNamespace(name=w.name, qtype=w.qtype, ne=w.ne, nbytes=w.nbytes) for w in (gate, up, down)]
    assert ExpertsWork.of(*records, 2, token_kernel=False) == work
    iq = [SimpleNamespace(name=r.name, qtype=Q.IQ3_S, ne=r.ne, nbytes=r.nbytes) for r in records]
    refused = ExpertsWork.of(*iq, 2, token_kernel=False)
    assert not refused.gpu_takes and "IQ3_S" in refused.gpu_refuses
    s = refused.split([1, 1, 0, 0], MACHINE, parse_policy("all=on"))
    assert not s.gpu and s.cpu == (0, 1) and "under every policy" in s.why


def test_gpu_nbytes_counts_dense_k_quants_in_krows_rows():
    """A dense Q4_K / Q5_K / Q6_K matrix takes krows.py's rows on a GPU (scales a byte each, rows padded to 16):
    Q4_K 148 bytes a block of 256 for the file's 144, Q6_K its 210 (a row of 3 blocks padded from 630 to 640);
    stacked experts, other types and rows of part blocks as in the file."""
    W, gpu_nbytes = SimpleNamespace, caps.gpu_nbytes
    assert gpu_nbytes(W(qtype=Q.Q4_K, ne=(2048, 4096), nbytes=4096 * 8 * 144)) == 4096 * 8 * 148
    assert gpu_nbytes(W(qtype=Q.Q5_K, ne=(2048, 3), nbytes=3 * 8 * 176)) == 3 * 8 * 180
    assert gpu_nbytes(W(qtype=Q.Q6_K, ne=(768, 5), nbytes=5 * 630)) == 5 * 640
    for w in (W(qtype=Q.Q4_K, ne=(2048, 768, 8), nbytes=1), W(qtype=Q.Q4_0, ne=(2048, 8), nbytes=2),
              W(qtype=Q.Q4_K, ne=(640, 8), nbytes=3)):
        assert gpu_nbytes(w) == w.nbytes
