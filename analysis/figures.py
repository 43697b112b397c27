"""What every analysis plot shares: the headless matplotlib backend, the resolution, a grid of subplots, saving."""

import math

import matplotlib

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
