"""`ragged_dot` grouped SwiGLU (`execution.grouped_matmul="ragged_dot"`): `jax.lax.ragged_dot`, exact for any
group sizes; the TPU default. XLA:CPU lowers it densely over all experts."""

import jax

from moe.dispatch.kernels.common import saved, scale_rows


def grouped_swiglu_ragged(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=None):
    """SwiGLU of expert e on rows of group e (rows sorted by expert) with `jax.lax.ragged_dot`; row_scale (fp32
    [N], or None) scales each row's product before the down projection (`scale_rows`)."""
    a_NxF = saved(jax.lax.ragged_dot(x_NxD, w_gate_ExDxF, group_sizes_E))
    h_NxF = jax.nn.silu(a_NxF) * saved(jax.lax.ragged_dot(x_NxD, w_up_ExDxF, group_sizes_E))
    return jax.lax.ragged_dot(scale_rows(h_NxF, row_scale), w_down_ExFxD, group_sizes_E)
