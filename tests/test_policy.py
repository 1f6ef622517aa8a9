"""The offload policy as a pure function of a machine's calibration: made-up machines, known choices."""

import numpy as np
import pytest

from ferry.errors import FerryError
from ferry.offload.cost import Calibration, experts_hit
from ferry.offload.policy import decide, experts_fixed_side, parse_policy, split_experts

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


# one qwen3-30b-a3b expert: gate + up + down, 3 x 768 x 2048 Q4_0
EXPERT_BYTES = 3 * 768 * 2048 * 0.5625
EXPERT_FLOPS = 2 * 3 * 768 * 2048


def _split(counts, machine, text="auto", **rate):
    return split_experts(counts, EXPERT_BYTES, EXPERT_FLOPS, machine, parse_policy(text), 8, **rate)


def test_a_generated_token_splits_its_experts_between_pcie_and_cpu_when_both_are_fast():
    """Eight experts of one token: a 55 GB/s copy and a 40 GB/s CPU read cost about the same, so running both
    sides at once beats either alone; hot experts go first and the predicted time is the slower side's."""
    counts = [0] * 128
    for e in (3, 9, 17, 30, 64, 65, 100, 127):
        counts[e] = 1
    s = _split(counts, FAST_PCIE)
    assert 0 < len(s.gpu) < 8 and sorted(s.gpu + s.cpu) == [3, 9, 17, 30, 64, 65, 100, 127]
    all_cpu, all_gpu = _split(counts, FAST_PCIE, "all=off"), _split(counts, FAST_PCIE, "all=on")
    assert max(s.gpu_s, s.cpu_s) < min(all_cpu.cpu_s, all_gpu.gpu_s)
    assert not all_cpu.gpu and not all_gpu.cpu and "override" in all_gpu.why


def test_slow_pcie_keeps_few_token_experts_home_and_a_slow_cpu_sends_them_away():
    counts = [1] * 8 + [0] * 120
    assert not _split(counts, SLOW_PCIE).gpu
    assert len(_split(counts, SLOW_CPU).gpu) > len(_split(counts, FAST_PCIE).gpu)


def test_the_hottest_experts_are_the_ones_copied():
    counts = [0] * 128
    counts[:40] = [200] * 8 + [1] * 32  # a skewed u-batch: eight experts carry most tokens
    s = _split(counts, FAST_PCIE)
    assert set(range(8)) <= set(s.gpu)
    assert all(counts[e] <= min(counts[g] for g in s.gpu) for e in s.cpu)


def test_a_large_u_batch_sends_every_expert_to_the_gpu_and_threshold_follows_llama_cpp():
    big = [4096 * 8 // 128] * 128  # 256 tokens per expert: the CPU's FLOPs, not its reads, bound its share
    s = _split(big, FAST_PCIE)
    assert len(s.gpu) >= 0.9 * 128 and max(s.gpu_s, s.cpu_s) <= _split(big, FAST_PCIE, "all=on").gpu_s
    small = [1] * 8 + [0] * 120  # one token: 1 < 32 * 128 / 8
    assert not _split(small, FAST_PCIE, "threshold").gpu and len(_split(big, FAST_PCIE, "threshold").gpu) == 128


def test_the_halves_set_apart_run_every_expert_hit_half_on_each_side_one_after_the_other():
    counts = [2] * 16 + [0] * 112
    s = _split(counts, FAST_PCIE, "mul_mat=off,mul_mat_id=on,moe_up_gate=off")  # the example
    assert s.halves == "down" and s.gpu == s.cpu == tuple(range(16))
    assert s.predicted_s == pytest.approx(s.gpu_s + s.cpu_s) and "moe_up_gate=off, moe_down=on" in s.why
    other = _split(counts, FAST_PCIE, "moe_up_gate=on,moe_down=off")
    assert other.halves == "up_gate"
    # each side does its half: gate + up are 2/3 of an expert, down 1/3 (all Q4_0)
    whole_cpu, whole_gpu = _split(counts, FAST_PCIE, "all=off").cpu_s, _split(counts, FAST_PCIE, "all=on").gpu_s
    assert s.cpu_s < whole_cpu and other.cpu_s < whole_cpu and s.cpu_s > other.cpu_s
    assert s.gpu_s < whole_gpu and other.gpu_s > s.gpu_s
    # up_gate_share: a file whose down projections are larger moves more with them
    heavy_down = split_experts(counts, EXPERT_BYTES, EXPERT_FLOPS, FAST_PCIE, parse_policy("moe_up_gate=off,moe_down=on"),
                               8, up_gate_share=0.5)
    assert heavy_down.gpu_s > s.gpu_s and heavy_down.cpu_s < s.cpu_s


def test_a_half_left_at_auto_goes_where_predicted_faster_beside_its_other_half_or_apart():
    small, big = [1] * 8 + [0] * 120, [256] * 128
    # slow PCIe: one token's down projections are not worth their copy, so the experts stay whole on the CPU
    s = _split(small, SLOW_PCIE, "moe_up_gate=off")
    assert not s.halves and not s.gpu and "down: auto" in s.why
    # 256 tokens per expert on a fast link: the CPU's FLOPs bound it, so the down half goes to the GPU
    s = _split(big, FAST_PCIE, "moe_up_gate=off")
    assert s.halves == "down" and "moe_up_gate=off, moe_down=auto" in s.why
    # the GPU half fixed: a big batch takes the rest along (whole on the GPU)
    s = _split(big, FAST_PCIE, "moe_down=on")
    assert not s.halves and len(s.gpu) == 128 and not s.cpu


def test_a_half_left_at_auto_follows_the_threshold_rule_in_threshold_mode():
    small, big = [1] * 8 + [0] * 120, [256] * 128  # 1 and 4096 tokens against 32 * 128 / 8 = 512
    assert _split(small, FAST_PCIE, "threshold,moe_up_gate=on").halves == "up_gate"
    s = _split(big, FAST_PCIE, "threshold,moe_up_gate=on")
    assert not s.halves and len(s.gpu) == 128 and "threshold: batch 4096 >= 512" in s.why
    assert _split(big, FAST_PCIE, "threshold,moe_up_gate=off").halves == "down"


@pytest.mark.parametrize("text, tokens, side", [
    ("all=off", 4096, "cpu"), ("mul_mat_id=on", 1, "gpu"), ("moe_up_gate=on,moe_down=on", 1, "gpu"),
    ("threshold", 1, "cpu"), ("threshold", 511, "cpu"), ("threshold", 512, "gpu"),
    ("threshold,mul_mat_id=on", 1, "gpu"), ("threshold,moe_down=off", 4096, None),  # the halves apart
    ("auto", 1, None), ("auto", 4096, None), ("moe_up_gate=off", 1, None)])
def test_the_side_a_policy_fixes_without_a_prediction(text, tokens, side):
    # generation's host step goes straight to ggml where this says "cpu": threshold at one token too (its rule
    # puts it on the CPU), which used to run the whole split machinery for every layer
    assert experts_fixed_side(parse_policy(text), tokens, 128, 8) == side


def test_the_threshold_side_follows_offload_min_batch():
    p = parse_policy("threshold", min_batch=1)  # 1 * 128 / 8 = 16 tokens
    assert [experts_fixed_side(p, n, 128, 8) for n in (1, 15, 16, 17)] == ["cpu", "cpu", "gpu", "gpu"]


# the H100 machine's measured experts (ggml, 16 threads, session 5): 54 GB/s at one token per expert, then
# compute-bound; and its 15 us launches from Python
MEASURED = Calibration(h2d_bytes_per_s=52e9, h2d_latency_s=15e-6, cpu_bytes_per_s=54e9, cpu_flops=0.4e12,
                       gpu_bytes_per_s=1.4e12, gpu_flops=700e12,
                       cpu_moe={"Q4_0": ((1, 1 / 54e9), (4, 1 / 25e9), (16, 1 / 8e9), (64, 1 / 2.2e9))}, launch_s=15e-6)


def test_the_measured_expert_table_replaces_the_two_number_cpu_model():
    assert MEASURED.cpu_expert_s(1e6, 1, EXPERT_FLOPS) == pytest.approx(1e6 / 54e9)
    assert MEASURED.cpu_expert_s(1e6, 10, EXPERT_FLOPS) == pytest.approx(1e6 * (1 / 25e9 + (1 / 8e9 - 1 / 25e9) * 0.5))
    assert MEASURED.cpu_expert_s(1e6, 128, EXPERT_FLOPS) == pytest.approx(2 * 1e6 / 2.2e9)  # linear beyond
    # a layer's experts at once (split_experts): each one as the single-expert answer above
    counts = [0, 1, 3, 10, 64, 100, 128]
    table = MEASURED.cpu_expert_s(1e6, np.array(counts), EXPERT_FLOPS)
    assert table == pytest.approx([MEASURED.cpu_expert_s(1e6, c, EXPERT_FLOPS) for c in counts], rel=1e-12)
    model = Calibration(**{**MEASURED.__dict__, "cpu_moe": {}})  # no table: the larger of reading and computing
    assert model.cpu_expert_s(1e6, np.array([1, 500]), EXPERT_FLOPS) == pytest.approx(
        [max(1e6 / 54e9, EXPERT_FLOPS / 0.4e12), 500 * EXPERT_FLOPS / 0.4e12])


def test_each_quant_type_takes_its_own_measured_table_and_an_unmeasured_one_q4_0s_rate_per_byte():
    q4_k = {"Q4_K": ((1, 1 / 40e9), (64, 1 / 1.5e9))}
    c = Calibration(**{**MEASURED.__dict__, "cpu_moe": {**MEASURED.cpu_moe, **q4_k}})
    assert c.cpu_expert_s(1e6, 1, EXPERT_FLOPS, {"Q4_K": 1.0}) == pytest.approx(1e6 / 40e9)
    assert c.cpu_expert_s(1e6, 1, EXPERT_FLOPS, {"Q8_0": 1.0}) == pytest.approx(1e6 / 54e9)  # not measured: Q4_0's
    # Q4_K_M's experts: gate and up Q4_K, down Q6_K (not measured here): each type's bytes at its rate
    mixed = c.cpu_expert_s(1e6, 1, EXPERT_FLOPS, {"Q4_K": 0.6, "Q6_K": 0.4})
    assert mixed == pytest.approx(0.6e6 / 40e9 + 0.4e6 / 54e9)


def test_one_tokens_experts_take_ferrys_kernel_rate_where_it_runs_and_ggmls_otherwise():
    c = Calibration(**{**MEASURED.__dict__, "cpu_moe_token": {"Q4_0": 1 / 70e9}})
    assert c.cpu_expert_s(1e6, 1, EXPERT_FLOPS, token_kernel=True) == pytest.approx(1e6 / 70e9)
    assert c.cpu_expert_s(1e6, 1, EXPERT_FLOPS) == pytest.approx(1e6 / 54e9)  # ggml's table
    assert c.cpu_expert_s(1e6, 1, EXPERT_FLOPS, {"Q4_K": 1.0}, token_kernel=True) == pytest.approx(1e6 / 54e9)
    counts = [1] * 8 + [0] * 120  # one token, 8 experts, all on the CPU
    assert _split(counts, c, "all=off", token_kernel=True).cpu_s == pytest.approx(8 * EXPERT_BYTES / 70e9)
    assert _split(counts, c, "all=off").cpu_s == pytest.approx(8 * EXPERT_BYTES / 54e9)
    # two tokens are never ferry's kernel's (it runs one token): ggml's rate, whatever the caller says
    two = _split([2] * 8 + [0] * 120, c, "all=off", token_kernel=True).cpu_s
    assert two == pytest.approx(8 * EXPERT_BYTES * c.cpu_expert_s(1.0, 2, EXPERT_FLOPS))
    assert two > 8 * EXPERT_BYTES / 54e9


def test_a_cpu_slow_at_batched_experts_keeps_fewer_of_them_at_u_batch_128():
    counts = [8] * 128  # u-batch 128, 8 of 128 experts per token: 8 tokens per expert
    fast_table = Calibration(**{**MEASURED.__dict__, "cpu_moe": {"Q4_0": ((1, 1 / 54e9), (64, 1 / 50e9))}})
    assert len(_split(counts, MEASURED).cpu) < len(_split(counts, fast_table).cpu)


def test_the_gpu_side_costs_its_launches_so_a_single_token_stays_on_the_cpu_when_launches_are_slow():
    counts = [1] * 8 + [0] * 120
    slow_launch = Calibration(**{**MEASURED.__dict__, "launch_s": 50e-6})
    assert not _split(counts, slow_launch).gpu
    free = Calibration(**{**MEASURED.__dict__, "launch_s": 0.0, "overlap": 0.0})  # free launches, perfect overlap
    assert _split(counts, free).gpu


def test_copies_and_ggml_that_slow_each_other_keep_a_u_batch_on_one_side():
    """On the H100 machine a copy and ggml's experts at once hide only a quarter of the shorter one: at u-batch 64
    (4 tokens per expert) the measured table says stream everything; with perfect overlap the CPU would take some."""
    counts = [4] * 128
    assert not _split(counts, MEASURED).cpu
    assert _split(counts, Calibration(**{**MEASURED.__dict__, "overlap": 0.0})).cpu


def test_auto_measures_each_plausible_way_in_a_row_and_keeps_the_fastest_per_size_class():
    from ferry.offload.policy import Explorer, size_class

    assert [size_class(n) for n in (1, 2, 3, 64, 65, 4096)] == [1, 2, 4, 64, 128, 4096]
    e = Explorer(samples=2, warmup=0)
    predicted = {"gpu": 1.0, "cpu": 2.0, "split": 0.8}
    seen = []
    for measured in ({"gpu": 5.0, "cpu": 2.0, "split": 3.0}, {"gpu": 4.0, "cpu": 2.5, "split": 3.0}):
        for _ in range(3):
            mode, trial = e.mode(100, predicted)
            assert trial
            seen.append(mode)
            e.record(100, mode, measured[mode])
        if measured["gpu"] == 5.0:
            assert size_class(100) not in e.chosen
    assert seen == ["gpu", "gpu", "cpu", "cpu", "split", "split"]  # each way twice in a row
    assert e.mode(128, predicted) == ("cpu", False)  # the same size class: measured fastest, though predicted slower
    assert "cpu 2.000 ms" not in e.why(100) and "cpu 2000.000 ms" in e.why(100)
    assert e.mode(129, predicted)[1]  # another size class starts its own trials


def test_auto_does_not_count_a_ways_first_layers_and_samples_generation_longer():
    from ferry.offload.policy import Explorer

    e = Explorer(samples=2, warmup=1)
    predicted = {"gpu": 1.0, "cpu": 1.0}
    # generation (1 token): 1 warm-up + 4 counted layers per way; the CPU's first layer is slow, as measured on the
    # H100 machine after a prompt that ran on the GPU: counted, it would make auto stream
    measured = {"gpu": [1.5, 1.5, 1.5, 1.5, 1.5], "cpu": [9.8, 1.0, 1.1, 0.9, 1.0]}
    for way in ("gpu", "cpu"):
        for t in measured[way]:
            assert e.mode(1, predicted) == (way, True)
            e.record(1, way, t)
    assert e.chosen[1] == "cpu" and e.mode(1, predicted) == ("cpu", False)
    assert "cpu 900.000 ms" in e.why(1) and "9800" not in e.why(1)  # seconds in, milliseconds out
    big = Explorer(samples=2, warmup=1)  # a prompt u-batch: 1 + 2 per way
    for way in ("gpu", "gpu", "gpu", "cpu", "cpu", "cpu"):
        assert big.mode(512, predicted) == (way, True)
        big.record(512, way, 1.0 if way == "gpu" else 2.0)
    assert big.chosen[512] == "gpu"


def test_auto_does_not_try_a_prompt_way_predicted_far_slower_than_the_best_but_tries_every_generation_way():
    from ferry.offload.policy import Explorer

    e = Explorer()
    assert e.mode(4096, {"gpu": 1.0, "cpu": 40.0}) == ("gpu", False)
    mode, trial = e.mode(64, {"gpu": 1.0, "cpu": 2.9, "split": 10.0})
    assert trial and set(e.trials[64]) == {"gpu", "cpu"}
    mode, trial = e.mode(1, {"gpu": 1.0, "cpu": 40.0, "split": 10.0})
    assert trial and set(e.trials[1]) == {"gpu", "cpu", "split"}
    assert not e.notes


def test_a_calibration_far_off_what_generation_measures_is_reported_and_overruled():
    """A calibration taken beside `ferry synth` read the CPU's experts 10x too slow (session 22): generation measures
    the CPU too, keeps it where it is faster, and says that the calibration was this far off."""
    from ferry.offload.policy import Explorer

    e = Explorer(samples=1, warmup=0)
    guess = {"gpu": 1.0, "cpu": 10.0}
    for way in ("gpu", "gpu", "cpu", "cpu"):  # generation: samples x 2 per way, in a row
        assert e.mode(1, guess) == (way, True)
        e.record(1, way, 1.0e-3 if way == "gpu" else 0.3e-3)
    assert e.chosen[1] == "cpu"
    assert len(e.notes) == 1 and "cpu 0.300 ms" in e.notes[0] and "10x slower than gpu" in e.notes[0]
    assert "ferry calibrate" in e.notes[0]
    agreed = Explorer(samples=1, warmup=0)  # the prediction's best measured best: nothing to say
    for way in ("gpu", "gpu", "cpu", "cpu"):
        agreed.mode(1, guess)
        agreed.record(1, way, 1.0e-3 if way == "gpu" else 2e-3)
    assert agreed.chosen[1] == "gpu" and not agreed.notes


def test_a_generation_way_the_calibration_disagrees_with_is_measured_again_later():
    """On the H100 machine the first process after writing an 18 GB file measured the CPU's generation layers at
    4.9 ms against 0.9 a minute later, and streamed its whole run: a choice against the prediction is provisional,
    measured again recheck_s later, each in turn, and then stands."""
    from ferry.offload.policy import Explorer

    guess = {"gpu": 4.0, "cpu": 1.0}  # the calibration: the CPU 4x faster

    def measure(e, ms):
        for way in ("gpu", "gpu", "cpu", "cpu"):
            assert e.mode(1, guess) == (way, True)
            e.record(1, way, ms[way] * 1e-3)

    e = Explorer(samples=1, warmup=0, recheck_s=(3600.0,))
    measure(e, {"gpu": 1.4, "cpu": 4.9})  # a busy moment
    assert e.way(1) == "gpu" and e.mode(1, guess) == ("gpu", False)  # not due yet
    assert len(e.notes) == 1 and "4x slower than cpu" in e.notes[0]
    e._due[1] = 0.0  # an hour on
    assert e.way(1) is None and 1 not in e.trials
    e.record(1, "cpu", 1e-3)  # a trial of the earlier round, ending late: ignored, not an error
    measure(e, {"gpu": 1.5, "cpu": 0.9})  # tried again, every way from the start
    assert e.way(1) == "cpu" and not e.notes and not e._due  # as predicted: nothing to say, nothing more to measure
    assert e.choices() == ["cpu for u-batches up to 1: gpu 1.500 ms, cpu 0.900 ms"]

    stubborn = Explorer(samples=1, warmup=0, recheck_s=(0.0, 0.0))  # measured against the prediction every time
    for _ in range(3):
        assert stubborn.way(1) is None
        measure(stubborn, {"gpu": 1.0, "cpu": 4.0})
    assert stubborn.way(1) == "gpu" and stubborn.way(1) == "gpu" and stubborn._rechecks[1] == 2
    assert "(measured 3 times)" in stubborn.notes[0]


def test_generation_is_measured_again_even_where_the_prediction_agreed_and_prompts_are_not():
    """gpt-oss-120b's first run after writing its 63 GB file measured the CPU's generation layers at 8.9 ms against
    streaming's 1.8 (a prediction as slow for the CPU agreed) and streamed every token: generation's choice is
    measured again at each recheck_s, and then stands; a prompt class's choice, which agreed, is not."""
    from ferry.offload.policy import Explorer

    guess = {"gpu": 1.0, "cpu": 4.0}  # no calibration here: the CPU predicted slow too
    e = Explorer(samples=1, warmup=0, recheck_s=(0.0, 0.0))

    def measure(ms, n=1, predicted=guess):
        for way in ("gpu", "gpu", "cpu", "cpu") if n == 1 else ("gpu", "cpu"):
            assert e.mode(n, predicted) == (way, True)
            e.record(n, way, ms[way] * 1e-3)

    measure({"gpu": 1.8, "cpu": 8.9})  # the busy moment: streaming, as predicted
    assert e.chosen[1] == "gpu" and not e.notes and 1 in e._due
    assert e.way(1) is None  # due: tried again
    measure({"gpu": 1.8, "cpu": 0.7})
    assert e.way(1) is None  # measured against the prediction now: provisional again, a recheck left
    measure({"gpu": 1.8, "cpu": 0.7})
    assert e.way(1) == "cpu" and e.way(1) == "cpu" and 1 not in e._due  # the schedule is spent: it stands
    measure({"gpu": 1.0, "cpu": 2.0}, n=64, predicted={"gpu": 1.0, "cpu": 2.0})  # a prompt as predicted: it stands
    assert e.way(64) == "gpu" and 64 not in e._due


def test_work_that_grows_with_the_cache_is_measured_per_u_batch_and_cache_size_class():
    """-mla 3's forms on a GPU (runners/cuda.LatentForms): a class is a pair of powers of two, so a longer
    cache starts its own trials and a cache within the same class keeps the choice."""
    from ferry.offload.policy import Explorer

    e = Explorer(samples=1, warmup=0, alternate=True)
    forms = {"absorbed": 1.0, "expanded": 1.0}  # no prediction: both are tried
    for n_kv, times in ((700, {"absorbed": 1.0, "expanded": 2.0}), (5000, {"absorbed": 3.0, "expanded": 2.0})):
        for form in ("absorbed", "expanded"):
            assert e.mode(512, forms, cells=n_kv) == (form, True)
            e.record(512, form, times[form], cells=n_kv)
    assert e.chosen == {(512, 1024): "absorbed", (512, 8192): "expanded"}
    assert e.mode(300, forms, cells=1000) == ("absorbed", False) and e.mode(512, forms, cells=8000)[0] == "expanded"
    assert e.mode(512, forms, cells=2000)[1] and e.mode(64, forms, cells=700)[1]  # other classes: trials
    assert "u-batches up to 512 over up to 8192 cells: absorbed 3000.000 ms, expanded 2000.000 ms" in e.why(512, 5000)


def test_ways_taken_in_turn_spread_a_slow_start_over_each_of_them():
    from ferry.offload.policy import Explorer

    e = Explorer(samples=2, warmup=1, alternate=True)
    ways = []
    for t in (9.0, 8.0, 2.0, 1.0, 2.0, 1.0):  # a slow start, then absorbed 2 and expanded 1 per layer
        way, trial = e.mode(512, {"absorbed": 1.0, "expanded": 1.0}, cells=4096)
        assert trial
        ways.append(way)
        e.record(512, way, t, cells=4096)
    assert ways == ["absorbed", "expanded"] * 3 and e.chosen[512, 4096] == "expanded"



def test_generation_trials_every_way_also_where_every_prediction_is_zero():
    """A layer whose every pair met a resident expert predicts 0 s for each way: generation still trials them all
    (its margin is unbounded, and inf * 0 must not leave none)."""
    from ferry.offload.policy import Explorer

    e = Explorer(samples=1, warmup=0)
    ways = set()
    for _ in range(6):
        mode, trial = e.mode(1, {"gpu": 0.0, "cpu": 0.0})
        if not trial:
            break
        ways.add(mode)
        e.record(1, mode, 1e-3 if mode == "cpu" else 2e-3)
    assert ways == {"gpu", "cpu"} and e.mode(1, {"gpu": 0.0, "cpu": 0.0}) == ("cpu", False)
