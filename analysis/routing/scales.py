"""Colour scales and line colours shared by the routing plots.

A routing share has a chance level, what a router that ignores its input gives: K/E for a top-k share, 1/E
for first choices, (K-1)/(E-1) for co-activation. `chance_norm` colours a value by its ratio to that level on a
log scale (white at chance, red above, blue below: 2x and 1/2x equally strong), and one norm is built for all
panels of a figure so layers compare; `shared_colorbar` draws one colourbar for them with the chance level
marked and ticks at chance x 2^k.
"""

import numpy as np
from matplotlib.colors import LogNorm, Normalize

from analysis.figures import plt

CHANCE_CMAP = plt.get_cmap("RdBu_r").with_extremes(bad="0.6")  # grey: no value (NaN, diagonal)


def line_colors(n):
    """Distinct strong colours for n per-layer lines: tab10 up to 10, else plasma cut before its pale end
    (deep layers stay readable and the order still shows)."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    return [plt.get_cmap("plasma")(0.85 * i / (n - 1)) for i in range(n)]


def chance_norm(vmax, chance):
    """A colour scale in ratios to the chance level, white at chance, red above, blue below, symmetric in log:
    2x chance and chance/2 are equally strong. It reaches the largest value shown (at least 2x, at most 16x);
    lower values, dead experts included, get the darkest blue. Without a positive chance level (top-1
    co-activation is all 0), a plain 0..vmax scale."""
    vmax = float(vmax) if np.isfinite(vmax) else 1.0
    if chance <= 0:
        return Normalize(0.0, max(vmax, 1e-9))
    ratio = min(max(vmax / chance, 2.0), 16.0)
    return LogNorm(chance / ratio, chance * ratio, clip=True)


def shared_colorbar(fig, im, axes, chance, label, chance_label):
    """One colourbar for every panel of `axes`; ticks at chance x 2^k, the chance level drawn and named."""
    cb = fig.colorbar(im, ax=axes, fraction=0.03 if len(axes) > 2 else 0.05, pad=0.02, aspect=30)
    cb.set_label(label + (" (log scale)" if chance > 0 else ""), fontsize=8)
    cb.ax.tick_params(labelsize=7)
    if chance > 0:
        n = int(np.floor(np.log2(im.norm.vmax / chance) + 1e-9))
        ticks = [chance * 2.0 ** k for k in range(-n, n + 1)]
        cb.set_ticks(ticks)
        cb.ax.minorticks_off()
        cb.set_ticklabels([f"{chance_label} {t:.3g}" if k == 0 else f"{t:.3g} ({2.0 ** k:g}x)"
                           for k, t in zip(range(-n, n + 1), ticks)])
        cb.ax.axhline(chance, color="black", linewidth=1.5)
    return cb
