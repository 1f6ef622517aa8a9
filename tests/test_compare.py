"""ferry compare: Welch's t-test and the ratio's confidence interval on samples with known differences and noise."""

import json
import math
import random

import pytest

from ferry.cli import main
from ferry.tools.compare import paired, t_quantile, t_two_sided_p, welch


def test_t_distribution_matches_tables():
    # two-sided p of t=2.0 with 10 df is 0.0734; the 97.5% quantiles are 12.706 (1 df), 2.228 (10), 1.960 (inf)
    assert t_two_sided_p(2.0, 10) == pytest.approx(0.07339, abs=1e-4)
    assert t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-4)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)


def _samples(rng, mean, std, n):
    return [rng.gauss(mean, std) for _ in range(n)]


def test_a_real_ten_percent_speedup_is_called_faster_with_an_interval_around_it():
    rng = random.Random(1)
    r = welch(_samples(rng, 100, 1, 10), _samples(rng, 110, 1, 10))
    assert r.verdict == "faster" and r.p_value < 1e-6 and not r.warning
    assert r.ci_low < 1.1 < r.ci_high and r.ci_low > 1.0


def test_a_slowdown_is_called_slower():
    rng = random.Random(2)
    assert welch(_samples(rng, 100, 2, 8), _samples(rng, 95, 2, 8)).verdict == "slower"


def test_without_a_true_difference_five_percent_are_called_different_and_intervals_cover_one():
    # the test's error rate is its alpha: over 1000 simulated comparisons of equal engines, about 5% differ
    rng = random.Random(3)
    results = [welch(_samples(rng, 50, 3, 5), _samples(rng, 50, 3, 7)) for _ in range(1000)]
    false_positive = sum(r.verdict != "no significant difference" for r in results) / len(results)
    covered = sum(r.ci_low <= 1.0 <= r.ci_high for r in results) / len(results)
    assert 0.03 < false_positive < 0.075
    assert covered > 0.92


def test_too_few_repetitions_are_undecided_and_noise_is_flagged():
    r = welch([100.0, 101.0], [120.0, 121.0])
    assert r.verdict == "undecided" and "too few repetitions" in r.warning and math.isnan(r.p_value)
    rng = random.Random(4)
    noisy = welch(_samples(rng, 100, 25, 5), _samples(rng, 100, 1, 5))
    assert "A is noisy" in noisy.warning


def _bench_json(path, samples_by_test):
    rows = [{"model": "m.gguf", "size_bytes": 1, "n_params": 1, "backend": "CPU", "n_threads": 2, "n_batch": 512,
             "n_ubatch": 512, "repack": True, "type_k": "f16", "type_v": "f16", "n_prompt": p, "n_gen": n,
             "samples_ts": s, "experts_hit": [], "test": f"pp{p}" if p else f"tg{n}",
             "avg_ts": sum(s) / len(s), "stddev_ts": 0.0} for (p, n), s in samples_by_test.items()]
    path.write_text(json.dumps(rows))
    return str(path)


def test_compare_command_matches_rows_by_settings(tmp_path, capsys):
    rng = random.Random(5)
    a = _bench_json(tmp_path / "a.json", {(512, 0): _samples(rng, 100, 1, 5), (0, 64): _samples(rng, 30, 0.3, 5)})
    b = _bench_json(tmp_path / "b.json", {(512, 0): _samples(rng, 120, 1, 5), (0, 64): _samples(rng, 30, 0.3, 5),
                                          (0, 128): _samples(rng, 29, 0.3, 5)})
    assert main(["compare", a, b, "-o", "json"]) == 0
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"m.gguf pp512 t2 ub512", "m.gguf tg64 t2 ub512"}  # tg128 has no partner in A
    assert rows["m.gguf pp512 t2 ub512"]["verdict"] == "faster"
    assert rows["m.gguf pp512 t2 ub512"]["ratio"] == pytest.approx(1.2, abs=0.03)
    assert main(["compare", a, b]) == 0
    assert "| m.gguf pp512 t2 ub512 |" in capsys.readouterr().out


@pytest.mark.parametrize("content,message", [("not json", "not JSON"), ("{}", "not a `ferry bench -o json` result")])
def test_compare_rejects_files_that_are_not_bench_results(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["compare", str(bad), str(bad)]) == 2
    assert message in capsys.readouterr().err


def test_paired_runs_see_through_a_drift_that_hides_the_difference_from_welch():
    # the machine's speed wanders by +-15% from pair to pair; B is 2% faster than A within each pair
    rng = random.Random(6)
    drift = [100 * (1 + rng.uniform(-0.15, 0.15)) for _ in range(20)]
    a = [d * (1 + rng.gauss(0, 0.005)) for d in drift]
    b = [d * 1.02 * (1 + rng.gauss(0, 0.005)) for d in drift]
    assert welch(a, b).verdict == "no significant difference"
    r = paired(a, b)
    assert r.verdict == "faster" and not r.warning
    assert 1.0 < r.ci_low < 1.02 < r.ci_high < 1.04


def test_paired_runs_of_equal_engines_are_called_different_five_percent_of_the_time():
    rng = random.Random(7)
    results = []
    for _ in range(1000):
        drift = [rng.uniform(80, 120) for _ in range(8)]
        results.append(paired([d * rng.gauss(1, 0.03) for d in drift], [d * rng.gauss(1, 0.03) for d in drift]))
    false_positive = sum(r.verdict != "no significant difference" for r in results) / len(results)
    covered = sum(r.ci_low <= 1.0 <= r.ci_high for r in results) / len(results)
    assert 0.03 < false_positive < 0.075 and covered > 0.92


def test_paired_runs_need_pairs_and_enough_of_them():
    with pytest.raises(ValueError, match="as many of A as of B"):
        paired([1.0, 2.0, 3.0], [1.0, 2.0])
    r = paired([100.0, 101.0], [110.0, 111.0])
    assert r.verdict == "undecided" and "too few pairs" in r.warning and math.isnan(r.ci_low)
    r = paired([100.0, 50.0, 80.0], [100.0, 50.0, 80.0])
    assert r.ratio == 1.0 and r.p_value == 1.0 and r.verdict == "no significant difference"
    assert "noisy" in paired([100.0, 100.0, 100.0], [70.0, 130.0, 100.0]).warning
