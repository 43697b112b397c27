"""What every analysis plot shares: the headless matplotlib backend, the resolution, a grid of subplots, saving,
and the stamp that names what a figure shows (`source`: the run and checkpoint step, or the HF directory), so
figures of two runs can be told apart.

    with figures.source("runs/default, step 800"):
        plots.plot_domain_heatmaps(...)          # every figure saved inside carries the line, and PNG metadata
"""

import contextlib
import contextvars
import math
import textwrap

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


_SOURCE = contextvars.ContextVar("figure_source", default="")
STAMP_INCHES = 0.2  # the strip at the bottom that holds the stamp


@contextlib.contextmanager
def source(text: str):
    """Every figure saved inside names `text` in a line at its bottom right and in the PNG's "Source" metadata."""
    token = _SOURCE.set(text)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def source_of(workdir, step) -> str:
    """The stamp of a run's figure: its directory and checkpoint step."""
    return f"{workdir}, step {step}" if step is not None else str(workdir)


def title(fig, text: str, fontsize: float = 10):
    """A figure title wrapped to the figure's width (each line of `text` separately), so a one-panel figure's long
    title is not clipped at its edges."""
    width = max(20, int(fig.get_figwidth() * 118 / fontsize))  # characters of ~0.6 em per inch at 72 pt
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in text.split("\n")), fontsize=fontsize)


def count(n) -> str:
    """A count as every figure and summary prints it: 180,608."""
    return f"{int(n):,}"


def save(fig, path, rect=None):
    """Lay out (inside `rect`, leaving room for a figure legend and the stamp), write the PNG, free the figure;
    returns path. A figure made with a layout engine (constrained) keeps it: tight_layout would replace it, with a
    warning."""
    stamp = _SOURCE.get()
    if fig.get_layout_engine() is None:
        left, bottom, right, top = rect or (0, 0, 1, 1)
        strip = STAMP_INCHES / fig.get_figheight() if stamp else 0.0
        if stamp:
            fig.text(0.995, 0.004, stamp, ha="right", va="bottom", fontsize=7, color="0.35")
        fig.tight_layout(rect=(left, max(bottom, strip), right, top))
    elif stamp:  # the layout engine makes room for a figure-level x label: the stamp is one
        fig.supxlabel(stamp, x=0.995, ha="right", fontsize=7, color="0.35")
    fig.savefig(path, dpi=DPI, metadata={"Source": stamp} if stamp else None)
    plt.close(fig)
    return path
