"""`ferry compare A.json B.json`: is B faster than A? Per matching row of two bench results: the ratio of
means with a 95% confidence interval, and a verdict from Welch's t-test over the repetitions, with a
warning where the repetitions are too few or too noisy to decide."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ferry.errors import FerryError

ALPHA = 0.05
MIN_REPS = 3  # below this a t-test has one degree of freedom or none
NOISY_CV = 0.10  # a coefficient of variation above 10% swamps the differences people ask about
_MEASURED = {"samples_ts", "avg_ts", "stddev_ts", "experts_hit", "test"}


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q (q in (0.5, 1)), by bisection on the two-sided p."""
    target = 2.0 * (1.0 - q)
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


@dataclass
class Comparison:
    row: str
    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    ratio: float  # mean_b / mean_a
    ci_low: float
    ci_high: float
    p_value: float
    verdict: str  # "faster" | "slower" | "no significant difference" | "undecided"
    warning: str = ""


def welch(a: list[float], b: list[float], label: str = "") -> Comparison:
    """B against A: ratio of means with a 95% interval (delta method on log means, Welch's degrees of
    freedom) and Welch's two-sided t-test."""
    na, nb = len(a), len(b)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    warnings = []
    if na < MIN_REPS or nb < MIN_REPS:
        warnings.append(f"too few repetitions ({na} and {nb}; use -r {MIN_REPS} or more)")
        return Comparison(label, na, nb, ma, mb, mb / ma, math.nan, math.nan, math.nan, "undecided", "; ".join(warnings))
    va, vb = statistics.variance(a), statistics.variance(b)
    for name, m, v in (("A", ma, va), ("B", mb, vb)):
        if math.sqrt(v) / m > NOISY_CV:
            warnings.append(f"{name} is noisy (std {100 * math.sqrt(v) / m:.0f}% of the mean)")
    sa, sb = va / na, vb / nb
    if sa + sb == 0.0:
        p = 1.0 if ma == mb else 0.0
        df = float(na + nb - 2)
    else:
        t = (mb - ma) / math.sqrt(sa + sb)
        df = (sa + sb) ** 2 / (sa ** 2 / (na - 1) + sb ** 2 / (nb - 1)) if sa and sb else float(
            (na if sa else nb) - 1)
        p = t_two_sided_p(t, df)
    # log(mean_b / mean_a) has variance about sa / ma^2 + sb / mb^2
    se = math.sqrt(sa / ma ** 2 + sb / mb ** 2)
    half = t_quantile(1 - ALPHA / 2, df) * se
    ratio = mb / ma
    verdict = "no significant difference" if p >= ALPHA else "faster" if mb > ma else "slower"
    return Comparison(label, na, nb, ma, mb, ratio, ratio * math.exp(-half), ratio * math.exp(half), p, verdict,
                      "; ".join(warnings))


def paired(a: list[float], b: list[float], label: str = "") -> Comparison:
    """B against A from runs taken in pairs, a[i] beside b[i] in time: the geometric mean of the pairs' ratios
    b[i] / a[i] with a 95% t-interval over their logarithms, and the t-test of that mean against zero. What drifts
    between pairs (a machine slower for a minute) falls out of every ratio; Welch's test counts it as noise."""
    if len(a) != len(b):
        raise ValueError(f"paired runs need as many of A as of B ({len(a)} and {len(b)})")
    n = len(a)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if n < MIN_REPS:
        return Comparison(label, n, n, ma, mb, mb / ma, math.nan, math.nan, math.nan, "undecided",
                          f"too few pairs ({n}; use -r {MIN_REPS} or more)")
    logs = [math.log(y / x) for x, y in zip(a, b)]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    df = float(n - 1)
    se = sd / math.sqrt(n)
    p = (1.0 if mean == 0.0 else 0.0) if se == 0.0 else t_two_sided_p(mean / se, df)
    half = t_quantile(1 - ALPHA / 2, df) * se
    warning = f"the pairs' ratios are noisy (std {100 * sd:.0f}%)" if sd > NOISY_CV else ""
    verdict = "no significant difference" if p >= ALPHA else "faster" if mean > 0 else "slower"
    return Comparison(label, n, n, ma, mb, math.exp(mean), math.exp(mean - half), math.exp(mean + half), p, verdict,
                      warning)


def _load(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FerryError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FerryError(f"{path}: not JSON ({e}); give files written by `ferry bench -o json`") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) and isinstance(r.get("samples_ts"), list) for r in data):
        raise FerryError(f"{path}: not a `ferry bench -o json` result (a list of rows with samples_ts)")
    return data


def _key(row: dict) -> tuple:
    return tuple(sorted((k, json.dumps(v)) for k, v in row.items() if k not in _MEASURED))


def _label(row: dict) -> str:
    test = f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row.get('n_gen')}"
    parts = [row.get("model", "?"), test, f"t{row.get('n_threads')}", f"ub{row.get('n_ubatch')}"]
    if row.get("type_k", "f16") != "f16" or row.get("type_v", "f16") != "f16":
        parts.append(f"kv {row.get('type_k')}/{row.get('type_v')}")
    return " ".join(str(p) for p in parts)


def compare_files(a: Path, b: Path) -> list[Comparison]:
    rows_a, rows_b = _load(a), _load(b)
    by_key = {_key(r): r for r in rows_a}
    out = [welch(by_key[_key(r)]["samples_ts"], r["samples_ts"], _label(r)) for r in rows_b if _key(r) in by_key]
    if not out:
        raise FerryError(f"no row of {b} has the same settings as a row of {a} (model, test sizes, threads, ...)")
    return out


def render(rows: list[Comparison], fmt: str = "md") -> str:
    if fmt == "json":
        return json.dumps([asdict(r) for r in rows], indent=1)
    lines = ["| row | A t/s | B t/s | B/A | 95% CI | p | verdict |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in rows:
        ci = "" if math.isnan(r.ci_low) else f"{r.ci_low:.3f}-{r.ci_high:.3f}"
        p = "" if math.isnan(r.p_value) else f"{r.p_value:.3g}"
        verdict = r.verdict + (f" ({r.warning})" if r.warning else "")
        lines.append(f"| {r.row} | {r.mean_a:.2f} | {r.mean_b:.2f} | {r.ratio:.3f} | {ci} | {p} | {verdict} |")
    return "\n".join(lines)
