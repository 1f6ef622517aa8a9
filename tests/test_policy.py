"""The offload policy as a pure function of a machine's calibration: made-up machines, known choices."""

import pytest

from ferry.errors import FerryError
from ferry.policy import Calibration, decide, experts_hit, parse_policy

# qwen3-30b-a3b's experts: 768 x 2048 Q4_0 (0.5625 bytes per weight), 128 experts, 8 used
EXPERT = dict(rows=768, cols=2048, bytes_per_weight=0.5625, n_expert=128, n_expert_used=8)
FAST_PCIE = Calibration(h2d_bytes_per_s=55e9, h2d_latency_s=23e-6, cpu_bytes_per_s=40e9, cpu_flops=1e12,
                        gpu_bytes_per_s=3e12, gpu_flops=400e12)
SLOW_PCIE = Calibration(**{**FAST_PCIE.__dict__, "h2d_bytes_per_s": 2e9})
SLOW_CPU = Calibration(**{**FAST_PCIE.__dict__, "cpu_bytes_per_s": 10e9, "cpu_flops": 1e11})


def test_policy_text_parses_modes_and_named_overrides():
    assert parse_policy("auto").mode == "auto" and parse_policy("threshold").mode == "threshold"
    p = parse_policy("mul_mat=off,mul_mat_id=on,moe_up_gate=off")
    assert p.setting("mul_mat") == "off" and p.setting("moe_down") == "on" and p.setting("moe_up_gate") == "off"
    assert parse_policy("all=off").setting("moe_down") == "off"
    assert parse_policy("threshold,moe_down=auto").setting("moe_down") == "auto"


@pytest.mark.parametrize("text,message", [
    ("mul_mat_idd=on", "unknown op 'mul_mat_idd'; valid names: all, mul_mat, mul_mat_id, moe_up_gate, moe_down"),
    ("mul_mat=maybe", "must set on, off or auto"),
    ("27,0", "is neither a mode"),
])
def test_bad_policies_are_user_errors_that_list_the_valid_names(text, message):
    with pytest.raises(FerryError, match=message):
        parse_policy(text)


def test_expected_experts_hit():
    assert experts_hit(1, 128, 8) == pytest.approx(8)
    assert experts_hit(4096, 128, 8) == pytest.approx(128)
    assert 8 < experts_hit(16, 128, 8) < 128


def test_threshold_mode_is_llama_cpps_rule():
    p = parse_policy("threshold")
    dense = dict(rows=2048, cols=2048, bytes_per_weight=1.0625)
    assert decide("mul_mat", 31, **dense, calib=FAST_PCIE, policy=p).device == "CPU"
    assert decide("mul_mat", 32, **dense, calib=FAST_PCIE, policy=p).device == "GPU"
    # experts: 32 * 128 / 8 = 512
    assert decide("mul_mat_id", 511, **EXPERT, calib=FAST_PCIE, policy=p).device == "CPU"
    assert decide("mul_mat_id", 512, **EXPERT, calib=FAST_PCIE, policy=p).device == "GPU"


def test_auto_keeps_generation_on_a_cpu_that_reads_faster_than_pcie_copies():
    p = parse_policy("auto")
    for machine in (FAST_PCIE, SLOW_PCIE):  # CPU reads 40 GB/s: one token's 7 MB of experts stay home
        assert decide("mul_mat_id", 1, **EXPERT, calib=machine, policy=p).device == "CPU"
    # a CPU reading 10 GB/s loses even a single token to a 55 GB/s copy plus the GPU's work
    assert decide("mul_mat_id", 1, **EXPERT, calib=SLOW_CPU, policy=p).device == "GPU"
    assert decide("mul_mat_id", 4096, **EXPERT, calib=FAST_PCIE, policy=p).device == "GPU"


def test_auto_keeps_experts_home_at_u_batch_512_only_where_pcie_is_slow():
    p = parse_policy("auto")
    fast = decide("mul_mat_id", 512, **EXPERT, calib=FAST_PCIE, policy=p)
    slow = decide("mul_mat_id", 512, **EXPERT, calib=SLOW_PCIE, policy=p)
    assert fast.device == "GPU" and slow.device == "CPU"
    assert slow.gpu_s > slow.cpu_s and "predicted CPU" in slow.why


def _crossover(machine):
    p = parse_policy("auto")
    return next(n for n in (2 ** i for i in range(14)) if decide("mul_mat_id", n, **EXPERT, calib=machine,
                                                                 policy=p).device == "GPU")


def test_a_slower_cpu_offloads_at_smaller_batches_and_once_offloaded_stays_offloaded():
    assert _crossover(SLOW_CPU) < _crossover(FAST_PCIE) < _crossover(SLOW_PCIE)
    p = parse_policy("auto")
    for machine in (FAST_PCIE, SLOW_PCIE, SLOW_CPU):
        devices = [decide("mul_mat_id", 2 ** i, **EXPERT, calib=machine, policy=p).device for i in range(14)]
        assert devices == sorted(devices)  # "CPU" < "GPU": a single switch from CPU to GPU


def test_overrides_win_over_the_prediction():
    on = decide("moe_down", 1, **EXPERT, calib=SLOW_PCIE, policy=parse_policy("mul_mat_id=on"))
    assert on.device == "GPU" and "override" in on.why
    assert decide("mul_mat_id", 4096, **EXPERT, calib=FAST_PCIE, policy=parse_policy("all=off")).device == "CPU"
