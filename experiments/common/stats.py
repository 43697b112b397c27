"""Statistics for paired-seed studies (the decoder-only mask study): what a careful reviewer asks for.

    d = loss_a - loss_b                          # one difference per seed (same data order and init)
    paired_t_interval(d)                         # mean and 95% t-interval of the paired difference
    sign_test(d)                                 # exact two-sided p of "a wins as often as b"
    holm(p_values)                               # family-wise adjusted p-values for several contrasts
    equivalent(d, margin=0.02)                   # "no gain" only if the 95% interval lies inside +-margin
    gate(causal, bigram, replaced)               # is the study interpretable at all?

Pure NumPy + math: the Student-t quantile comes from the regularized incomplete beta function (no SciPy).
"""

import math

import numpy as np

GATE_BIGRAM_MARGIN = 0.3  # nats the causal model must beat the interpolated bigram reference by
GATE_INPUT_GAP = 0.1  # nats replacing the input with another document's must cost


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on the CDF; plenty fast for a report)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_t_interval(diffs, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the mean paired difference; needs >= 2 pairs."""
    d = np.asarray(diffs, np.float64)
    if d.size < 2:
        raise ValueError("a paired interval needs at least 2 pairs")
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    half = t_quantile(0.5 + level / 2.0, d.size - 1) * se
    return mean, mean - half, mean + half


def sign_test(diffs) -> float:
    """Exact two-sided p-value that positive and negative differences are equally likely (ties dropped).
    With n pairs all of one sign, p = 2 / 2^n: 3 seeds can never reach p < 0.05 (p = 0.25)."""
    d = np.asarray(diffs, np.float64)
    pos, n = int(np.sum(d > 0)), int(np.sum(d != 0))
    if n == 0:
        return 1.0
    k = min(pos, n - pos)
    return min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n)


def holm(p_values) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error over all contrasts), in the input order."""
    p = np.asarray(p_values, np.float64)
    order = np.argsort(p)
    adjusted, running = np.empty_like(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def paired_t_p(diffs) -> float:
    """Two-sided p-value of the paired t-test that the mean difference is 0."""
    d = np.asarray(diffs, np.float64)
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    if se == 0.0:
        return 1.0 if d.mean() == 0 else 0.0
    return float(2.0 * (1.0 - t_cdf(abs(float(d.mean())) / se, d.size - 1)))


def equivalent(diffs, margin: float = 0.02, level: float = 0.95) -> bool:
    """True when the paired `level` interval lies inside (-margin, +margin): only then may a report say
    "no difference" (absence of evidence is not evidence of absence)."""
    _, lo, hi = paired_t_interval(diffs, level)
    return -margin < lo and hi < margin


def gate(causal_loss: float, bigram_loss: float, replaced_input_loss: float) -> dict:
    """The pre-registered gate: a mask can only matter through context, so the study is interpretable only if
    the causal model beats the bigram reference by GATE_BIGRAM_MARGIN nats and replacing the input with another
    document's costs at least GATE_INPUT_GAP nats."""
    beats = bigram_loss - causal_loss
    gap = replaced_input_loss - causal_loss
    passed = beats >= GATE_BIGRAM_MARGIN and gap >= GATE_INPUT_GAP
    return {"beats_bigram_by": beats, "input_replacement_gap": gap, "passed": bool(passed),
            "verdict": "interpretable" if passed else "not interpretable"}
