"""analysis/figures.py: the smoothing used by the loss curves and the MaxVio plot."""

import numpy as np

from analysis.figures import smooth


def test_smooth_has_no_lag_and_keeps_levels():
    x = np.arange(200.0)
    # A symmetric kernel follows a straight line exactly away from the ends (a one-sided EMA would trail it).
    np.testing.assert_allclose(smooth(x, span=5)[50:150], x[50:150], atol=1e-3)
    np.testing.assert_allclose(smooth(np.full(30, 3.0)), 3.0)
    np.testing.assert_array_equal(smooth(x[:7], span=1), x[:7])  # span 1: no smoothing
    assert smooth([]).shape == (0,) and smooth([4.0]).tolist() == [4.0]


def test_smooth_reduces_noise():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 1, 3000)
    assert np.std(smooth(noise)) < 0.2 * np.std(noise)  # default span: 50 points for a long series
