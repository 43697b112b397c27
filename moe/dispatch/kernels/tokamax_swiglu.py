"""Kernel-backed grouped SwiGLU: `tokamax.ragged_dot` (`execution.grouped_matmul="tokamax"`).

tokamax (the kernel library MaxText's MoE uses) ships a grouped matmul with the `jax.lax.ragged_dot` API and
several implementations, tried in order until one accepts the call: Pallas Mosaic-GPU (Hopper/Blackwell),
Pallas Triton (other NVIDIA GPUs), Pallas Mosaic-TPU, and `xla` (`jax.lax.ragged_dot_general`, every backend).
Its custom VJP computes the input gradient as another ragged dot (transposed weights) and the weight gradient as
a ragged-*contracting* dot (one [D, F] block per group), both with the same kernels, so no [E, N, ...] dense
intermediate is ever built. On CPU only `xla` applies: the same numbers through tokamax's own VJP, which is what
the CPU tests check; the GPU kernels are checked by the GPU-only tests (tests/test_grouped_kernels.py).

tokamax is optional (`pip install 'moe-lm[kernels]'`); everything else imports and runs without it.
"""

import jax
import jax.numpy as jnp
from absl import flags

from moe.dispatch.kernels.common import saved, scale_rows

INSTALL_HINT = "pip install 'tokamax>=0.0.12,<0.2' (or pip install -e '.[kernels]')"


def _tokamax():
    try:
        import tokamax  # optional: INSTALL_HINT
    except ImportError as e:  # one line, naming the fix
        raise ImportError(f"grouped_matmul='tokamax' needs the tokamax package: {INSTALL_HINT}") from e
    # tokamax reads its options from absl flags and, if nobody parsed them, parses sys.argv itself, which fails
    # under any other command line (pytest, our CLIs): take the defaults instead.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def available() -> bool:
    try:
        _tokamax()
    except ImportError:
        return False
    return True


def tma_aligned(dtype, *widths: int) -> bool:
    """Whether rows of these widths can be copied by Hopper's TMA, as tokamax's Mosaic-GPU kernel does: every
    stride but the last a multiple of 16 bytes (bf16: widths multiple of 8). Else its compile fails with
    "async_copy requires all GMEM strides except the last one to be a multiple of 16 bytes"."""
    return all(w * jnp.dtype(dtype).itemsize % 16 == 0 for w in widths)


def grouped_swiglu_tokamax(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, implementation=None,
                           row_scale=None):
    """SwiGLU of expert e on the rows of group e (rows sorted by expert), rows past sum(group_sizes) give 0.

    implementation: tokamax's (None: its best available, falling back to `xla`, and `xla` outright for widths the
    GPU kernels cannot copy, see tma_aligned; e.g. "triton", "mosaic").
    Gate and up projections are one ragged dot against [E, D, 2F] (one kernel launch, twice the N width); the
    concatenation copies the weights once per call, small next to N x D x 2F at training sizes.
    row_scale: each row's scale of its SwiGLU product before the down projection (fp32 [N]; None: 1).
    """
    tk = _tokamax()
    N, D = x_NxD.shape
    F = w_gate_ExDxF.shape[-1]
    if implementation is None and not tma_aligned(x_NxD.dtype, D, F):
        implementation = "xla"  # the GPU kernels would refuse these widths at compile time, not fall back
    # Rows past the last group (expert_parallel's padding) are garbage in what the Mosaic-GPU kernel writes, in
    # both directions: with padding rows present every gradient comes out NaN.
    # So every kernel input and output is masked with `where` (a select: NaN does not leak through it, as it
    # would through a multiply), which also masks each backward cotangent the kernels produce.
    valid_Nx1 = (jnp.arange(N) < group_sizes_E.sum())[:, None]
    clean = lambda a: jnp.where(valid_Nx1, a, jnp.zeros((), a.dtype))
    # Accumulate in fp32 inside the kernel, return the activation dtype (as jnp.dot does for bf16 inputs).
    dot = lambda a, w: clean(tk.ragged_dot(clean(a), w, group_sizes_E, preferred_element_type=a.dtype,
                                           implementation=implementation))
    gu_Nx2F = saved(dot(x_NxD, jnp.concatenate([w_gate_ExDxF, w_up_ExDxF], axis=-1)))
    h_NxF = jax.nn.silu(gu_Nx2F[:, :F]) * gu_Nx2F[:, F:]
    return dot(scale_rows(h_NxF, row_scale), w_down_ExFxD)
