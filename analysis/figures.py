"""What every analysis plot shares: the headless matplotlib backend, the resolution, a grid of subplots, saving."""

import math

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display: plots are files
import matplotlib.pyplot as plt  # noqa: E402

DPI = 110


def grid(n, ncols, w, h, layout=None):
    """A figure with n subplots of w x h inches, ncols per row; returns (fig, list of the n axes).
    layout="constrained" makes room for one colourbar shared by several panels (fig.colorbar(ax=axes))."""
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout=layout)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def save(fig, path, rect=None):
    """Lay out (inside `rect`, leaving room for a figure legend), write the PNG, free the figure; returns path.
    A figure made with a layout engine (constrained) keeps it: tight_layout would replace it, with a warning."""
    if fig.get_layout_engine() is None:
        fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def smooth(values_N, span=None):
    """A noisy series (training loss, batch MaxVio) smoothed with a symmetric exponential kernel w^|i-j|,
    normalized, so the curve has no lag behind the data (a one-sided EMA trails a falling loss); at the ends
    the kernel is one-sided. span (points, w = 1 - 1/span) defaults to 1/15 of the series, between 2 and 50:
    enough to see the trend of a long run without flattening a short one."""
    x_N = np.asarray(values_N, np.float64)
    span = min(max(len(x_N) / 15, 2.0), 50.0) if span is None else max(span, 1.0)
    w = 1 - 1 / span

    def one_sided(x):  # sum_{j<=i} w^(i-j) x_j and its weight sum
        acc, norm, sums, norms = 0.0, 0.0, np.empty_like(x), np.empty_like(x)
        for i, v in enumerate(x):
            acc, norm = w * acc + v, w * norm + 1.0
            sums[i], norms[i] = acc, norm
        return sums, norms

    fwd, fwd_n = one_sided(x_N)
    bwd, bwd_n = (a[::-1] for a in one_sided(x_N[::-1]))
    return (fwd + bwd - x_N) / (fwd_n + bwd_n - 1.0)  # x_i sits in both sums once
