"""Grouped SwiGLU backends: expert e's SwiGLU on the rows of group e, rows sorted by expert (`dropless` and the
expert-parallel dispatch call them; they never import the dispatch).

Every backend has the signature (x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=None):
row_scale (fp32 [N]) scales each row's SwiGLU product before the down projection (`dropless` passes its gates
there), and rows past sum(group_sizes) come out 0.

  ragged_dot  jax.lax.ragged_dot (ragged.py)
  blocked     rows padded to whole blocks, batched matmuls (blocked.py)
  slab        per-expert slabs + spill blocks, hand-written VJP (slab.py)
  tokamax     tokamax's Pallas kernels, optional package (tokamax_swiglu.py)
"""

import functools

from moe.dispatch import platform
from moe.dispatch.kernels import slab, tokamax_swiglu
from moe.dispatch.kernels.blocked import grouped_swiglu_blocked
from moe.dispatch.kernels.common import SAVED, positions_per_end, saved, scale_rows, swiglu, swiglu_batched
from moe.dispatch.kernels.ragged import grouped_swiglu_ragged

GROUPED_SWIGLU = {"ragged_dot": grouped_swiglu_ragged, "blocked": grouped_swiglu_blocked,
                  "slab": slab.grouped_swiglu_slab, "tokamax": tokamax_swiglu.grouped_swiglu_tokamax}


def grouped_swiglu_for(grouped_matmul="auto", platform_name: str | None = None):
    """The grouped SwiGLU by name (`execution.grouped_matmul`; `auto`: moe.dispatch.platform's choice), with slab's layouts
    for `platform_name` (default: the current platform). A callable of the same signature is returned as is."""
    if callable(grouped_matmul):
        return grouped_matmul
    name = platform.choice("grouped_matmul", grouped_matmul, platform_name)
    if name == "slab":
        return functools.partial(slab.grouped_swiglu_slab, platform_name=platform_name or platform.current())
    return GROUPED_SWIGLU[name]


__all__ = ["GROUPED_SWIGLU", "SAVED", "grouped_swiglu_blocked", "grouped_swiglu_for", "grouped_swiglu_ragged",
           "positions_per_end", "saved", "scale_rows", "swiglu", "swiglu_batched"]
