"""analysis/figures.py: the smoothing used by the loss curves and the MaxVio plot."""

import numpy as np

from train.loss_plot import smooth


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


def test_contrast_plot_scales_its_axis_to_the_seeds_when_intervals_are_huge(monkeypatch, tmp_path):
    """A 2-seed t-interval (+-2.3 nats here) must not flatten the seeds (0.03-0.4 apart) into a line."""
    from experiments.common import plots as study_plots

    figs = []
    monkeypatch.setattr(study_plots, "save", lambda fig, path: figs.append(fig))
    rows = [{"contrast": "a - b", "diffs": [0.03, 0.40], "mean": 0.215, "lo": -2.09, "hi": 2.53},
            {"contrast": "c - b", "diffs": [0.09, 0.13], "mean": 0.11, "lo": -0.12, "hi": 0.34}]
    study_plots.plot_contrasts(rows, tmp_path / "x.png", "nats", "title")
    ax = figs[0].axes[0]
    lo, hi = ax.get_ylim()
    assert -0.3 < lo <= -0.12 and 0.4 < hi < 0.7  # the seeds, the means, 0 and the narrow interval fit
    assert "run past the axis" in ax.get_title()
    figs.clear()
    rows[0].update(lo=0.0, hi=0.43)  # every interval inside: no note
    study_plots.plot_contrasts(rows, tmp_path / "x.png", "nats", "title")
    assert "run past" not in figs[0].axes[0].get_title()
