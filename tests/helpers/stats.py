"""Goodness-of-fit helpers for the sampling tests (seeded, so each test is deterministic)."""

import numpy as np
from scipy import stats

P_VALUE_FLOOR = 1e-4


def assert_matches(counts, probs, min_expected: float = 5.0, floor: float = P_VALUE_FLOOR) -> float:
    """Chi-square goodness of fit of observed ``counts`` to ``probs``; cells expected < min_expected are pooled.

    Also fails when a zero-probability cell was observed. Returns the p-value.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    total = counts.sum()
    assert total > 0
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"observed outcomes of probability 0: {np.nonzero(impossible & (counts > 0))}"
    expected = probs * total / probs.sum()
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > floor, f"distribution mismatch: p={p_value:.3g}\nobserved={np.round(obs)}\nexpected={np.round(exp, 1)}"
    return p_value
