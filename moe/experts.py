"""Routed-expert computation: sum_k g_{t,k} * SwiGLU_{e_{t,k}}(x_t).

`dropless` is the fast path (sort token copies by expert, grouped matmul with `jax.lax.ragged_dot`);
`reference` is the plain loop over experts it is tested against. Both take
  x_TxD, ids_TxK (chosen experts), gates_TxK (fp32), and expert weights w_gate/w_up [E,D,F], w_down [E,F,D].
"""

import jax
import jax.numpy as jnp


def swiglu(x, w_gate, w_up, w_down):
    return jnp.dot(jax.nn.silu(jnp.dot(x, w_gate)) * jnp.dot(x, w_up), w_down)


def reference(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Every expert on every token, weighted by its gate (0 where not chosen). O(E) compute: tests only."""
    E = w_gate_ExDxF.shape[0]
    y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
    for e in range(E):
        g_T = jnp.where(ids_TxK == e, gates_TxK, 0.0).sum(-1)
        out_TxD = swiglu(x_TxD, w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e])
        y_TxD = y_TxD + g_T[:, None] * out_TxD.astype(jnp.float32)
    return y_TxD.astype(x_TxD.dtype)


def dropless(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Sort the T*K token copies by expert and run each expert on exactly its tokens (no capacity, no drops)."""
    T, K = ids_TxK.shape
    E = w_gate_ExDxF.shape[0]
    flat_ids_N = ids_TxK.reshape(-1)  # N = T*K token copies
    order_N = jnp.argsort(flat_ids_N, stable=True)
    x_NxD = jnp.take(x_TxD, order_N // K, axis=0)
    group_sizes_E = jnp.bincount(flat_ids_N, length=E).astype(jnp.int32)
    h_NxF = jax.nn.silu(jax.lax.ragged_dot(x_NxD, w_gate_ExDxF, group_sizes_E)) * jax.lax.ragged_dot(
        x_NxD, w_up_ExDxF, group_sizes_E)
    y_sorted_NxD = jax.lax.ragged_dot(h_NxF, w_down_ExFxD, group_sizes_E)
    # Undo the sort with a gather by the inverse permutation (its transpose is a scatter-add, cheap in bwd).
    inverse_N = jnp.argsort(order_N)
    y_TxKxD = jnp.take(y_sorted_NxD, inverse_N, axis=0).reshape(T, K, -1)
    y_TxD = jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), gates_TxK)
    return y_TxD.astype(x_TxD.dtype)


DISPATCH = {"dropless": dropless, "reference": reference}
