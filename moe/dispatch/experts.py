"""Routed-expert computation: sum_k g_{t,k} * SwiGLU_{e_{t,k}}(x_t), or with gate_input (Llama 4) the gate on the
expert's input, sum_k SwiGLU_{e_{t,k}}(g_{t,k} x_t) (SwiGLU is not homogeneous: not the same function).

`dropless` is the fast path (sort token copies by expert, then a grouped SwiGLU backend from moe/dispatch/kernels/);
`capacity` is GShard-style (one-hot dispatch/combine einsums around batched matmuls, at most C tokens per
expert and group, the rest dropped); `reference` is the plain loop over experts both are tested against: it
defines both gate placements. All take
  x_TxD, ids_TxK (chosen experts), gates_TxK (fp32), and expert weights w_gate/w_up [E,D,F], w_down [E,F,D].
An id >= E is a zero expert (LongCat-Flash): every path leaves it out of the expert computation (dropless sorts it
past the grouped matmul's rows, which the kernels leave zero; capacity's one-hot has no column for it), and
`zero_experts` adds its term g x. The expert-parallel (shard_map + all_to_all) path is in
moe/dispatch/expert_parallel.py.
"""

import functools
import math

import jax
import jax.numpy as jnp

from moe.dispatch import platform
from moe.dispatch.kernels import grouped_swiglu_for, saved, swiglu


def reference(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, gate_input: bool = False,
              biases=None, clamp=None):
    """Every expert on every token, weighted by its gate (0 where not chosen): g SwiGLU_e(x), or with gate_input
    SwiGLU_e(g x) (= 0 where not chosen: no biases). Zero experts (ids >= E) are not here: `zero_experts`. O(E)
    compute: tests, and the only path of gpt-oss's experts: `biases` (b_gate [E,F], b_up [E,F], b_down [E,D], the
    down bias inside g (...)) and `clamp` (limit, alpha) for `clamped_swiglu`."""
    E = w_gate_ExDxF.shape[0]
    y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
    for e in range(E):
        g_T = jnp.where(ids_TxK == e, gates_TxK, 0.0).sum(-1)
        if biases is not None or clamp is not None:
            out_TxD = _general_expert(x_TxD, w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e],
                                      None if biases is None else [b[e] for b in biases], clamp)
            y_TxD = y_TxD + g_T[:, None] * out_TxD.astype(jnp.float32)
        elif gate_input:
            out_TxD = swiglu(scale_input(x_TxD, g_T), w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e])
            y_TxD = y_TxD + out_TxD.astype(jnp.float32)
        else:
            out_TxD = swiglu(x_TxD, w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e])
            y_TxD = y_TxD + g_T[:, None] * out_TxD.astype(jnp.float32)
    return y_TxD.astype(x_TxD.dtype)


def clamped_swiglu(a_xF, b_xF, limit: float, alpha: float):
    """gpt-oss's activation: (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)."""
    g_xF = jnp.minimum(a_xF, limit)
    return (jnp.clip(b_xF, -limit, limit) + 1) * (g_xF * jax.nn.sigmoid(alpha * g_xF))


def _general_expert(x_TxD, w_gate_DxF, w_up_DxF, w_down_FxD, biases, clamp):
    """One expert with optional biases and the clamped activation (gpt-oss)."""
    a_TxF, b_TxF = x_TxD @ w_gate_DxF, x_TxD @ w_up_DxF
    if biases is not None:
        a_TxF, b_TxF = a_TxF + biases[0].astype(a_TxF.dtype), b_TxF + biases[1].astype(b_TxF.dtype)
    h_TxF = jax.nn.silu(a_TxF) * b_TxF if clamp is None else clamped_swiglu(a_TxF, b_TxF, *clamp)
    out_TxD = h_TxF @ w_down_FxD
    return out_TxD if biases is None else out_TxD + biases[2].astype(out_TxD.dtype)


def scale_input(x_NxD, g_N):
    """g x per row, multiplied in fp32 and rounded once to x's dtype: the gated input of gate_input."""
    return (x_NxD.astype(jnp.float32) * g_N.astype(jnp.float32)[:, None]).astype(x_NxD.dtype)


def zero_experts(x_TxD, ids_TxK, gates_TxK, n_experts: int):
    """The zero experts' term (LongCat-Flash): x times the summed gates of the chosen ids >= n_experts (an identity
    expert of gated input gives the same). fp32, rounded once to x's dtype."""
    g_T = jnp.where(ids_TxK >= n_experts, gates_TxK, 0.0).sum(-1)
    return scale_input(x_TxD, g_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_copies(x_TxD, order_N, inverse_N, K: int):
    """x's rows in sorted-copy order (row n is token order_N[n] // K), with a VJP that gathers: token t's gradient
    is the sum of its K copies' rows, which sit at inverse_N[t*K : t*K+K]. Autodiff of the plain take would
    scatter-add N rows into T (atomics on GPU)."""
    return jnp.take(x_TxD, order_N // K, axis=0)


def _permute_fwd(x_TxD, order_N, inverse_N, K):
    return permute_copies(x_TxD, order_N, inverse_N, K), inverse_N


def _permute_bwd(K, inverse_N, dx_NxD):
    T = inverse_N.shape[0] // K
    d_TxKxD = jnp.take(dx_NxD, inverse_N, axis=0).reshape(T, K, -1)
    return d_TxKxD.astype(jnp.float32).sum(1).astype(dx_NxD.dtype), None, None


permute_copies.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def permute_rows(a_NxD, perm_N, inverse_N):
    """a's rows in the order perm_N (row n is a[perm_N[n]]), with a VJP that gathers by the inverse permutation
    (the transpose of a permutation is its inverse) instead of scatter-adding."""
    return jnp.take(a_NxD, perm_N, axis=0)


def _permute_rows_fwd(a_NxD, perm_N, inverse_N):
    return permute_rows(a_NxD, perm_N, inverse_N), inverse_N


def _permute_rows_bwd(inverse_N, d_NxD):
    return jnp.take(d_NxD, inverse_N, axis=0), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def take_copies(x_TxD, order_N, inverse_N, K: int, permute: str):
    """x's rows for the sorted token copies (row n: token order_N[n] // K); its backward by `permute`'s rule
    (scatter: autodiff's scatter-add; gather: `permute_copies`)."""
    if permute == "gather":
        return permute_copies(x_TxD, order_N, inverse_N, K)
    return jnp.take(x_TxD, order_N // K, axis=0)


def take_rows(a_NxD, perm_N, inverse_N, permute: str):
    """a's rows in the order perm_N (a permutation; inverse_N its inverse); its backward by `permute`'s rule."""
    if permute == "gather":
        return permute_rows(a_NxD, perm_N, inverse_N)
    return jnp.take(a_NxD, perm_N, axis=0)


PERMUTES = ("scatter", "gather")


def permute_for(permute: str = "auto") -> str:
    """`execution.permute_grad` by name (`auto`: moe.dispatch.platform's choice)."""
    permute = platform.choice("permute_grad", permute)
    if permute not in PERMUTES:
        raise ValueError(f"permute {permute!r}: one of auto, {', '.join(PERMUTES)}")
    return permute


def dropless(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, grouped="auto",
             constrain=lambda a, names: a, permute="auto", gate_input: bool = False):
    """Sort the T*K token copies by expert and run each expert on exactly its tokens (no capacity, no drops).
    grouped: a `grouped_swiglu_for` name, or the grouped SwiGLU function itself. constrain: `Execution.constrain`
    when XLA partitions this over a mesh. permute: how the backward pass moves rows: "scatter" (autodiff of the
    gathers: scatter-adds), "gather" (permute_copies / permute_rows: gathers only; the same numbers up to the
    order of the K-copy sum) or "auto" (`permute_for`). The A/B is `benchmarks.moe_layer --dispatch
    dropless:scatter,dropless:gather`. Zero-expert copies (ids >= E) sort after every group: outside the grouped
    matmul's rows, they come out 0."""
    permute = permute_for(permute)
    T, K = ids_TxK.shape
    E = w_gate_ExDxF.shape[0]
    flat_ids_N = ids_TxK.reshape(-1)  # N = T*K token copies
    order_N = saved(jnp.argsort(flat_ids_N, stable=True))
    # Undo the sort with a gather by the inverse permutation; the inverse is a scatter of N integers, not a
    # second sort.
    inverse_N = saved(jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0], dtype=order_N.dtype),
                                                               unique_indices=True))
    x_NxD = take_copies(x_TxD, order_N, inverse_N, K, permute)
    # Every device needs every group size. Left to XLA's sharding propagation they may come out split along
    # `expert` (like the weights they index), and XLA:CPU then partitions the padded-block fallback inside
    # slab's lax.switch wrongly (the last expert's rows come out 0; tests/test_sharding.py): pinned
    # replicated.
    group_sizes_E = constrain(jnp.bincount(flat_ids_N, length=E).astype(jnp.int32), (None,))
    grouped_fn = grouped if callable(grouped) else grouped_swiglu_for(grouped)
    # Each copy's gate scales its SwiGLU product before the down projection (`scale_rows`), so the combine is a
    # plain sum and the gates' gradient, <h, dy W_down^T>, comes from what the backward pass has anyway. Scaling the
    # outputs instead needs the experts' output rows in the backward pass: under remat_policy="save_moe" the largest
    # residual of configs/gpu_1b.py's step (over a quarter of the memory XLA plans for it at 8 experts).
    scale_N = take_rows(gates_TxK.astype(jnp.float32).reshape(-1, 1), order_N, inverse_N, permute)[:, 0]
    if gate_input:  # the gate scales the copy's input instead, and the combine is a plain sum all the same
        x_NxD, scale_N = scale_input(x_NxD, scale_N), None
    # Under remat_policy="save_moe" the backward pass reruns the gather into x_NxD (cheap), not the experts.
    y_sorted_NxD = grouped_fn(x_NxD, group_sizes_E, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, row_scale=scale_N)
    y_TxKxD = take_rows(y_sorted_NxD, inverse_N, order_N, permute).reshape(T, K, -1)
    return y_TxKxD.astype(jnp.float32).sum(1).astype(x_TxD.dtype)


def expert_capacity(S: int, K: int, E: int, capacity_factor: float) -> int:
    """Slots per expert and group of S tokens: ceil(cf * S * K / E), at most S (top-k experts are distinct, so
    one expert never gets more than S copies: cf >= E / K can drop nothing)."""
    return max(1, min(S, math.ceil(capacity_factor * S * K / E)))


def capacity_slots(ids_GxSxK, E: int, C: int):
    """Slot of each token copy in its expert's buffer, GShard priority: all first choices of the group before
    any second choice, then by position. Returns (slot_GxSxK, keep_GxSxK); kept iff slot < C."""
    G, S, K = ids_GxSxK.shape
    onehot_GxKSxE = jax.nn.one_hot(jnp.swapaxes(ids_GxSxK, 1, 2).reshape(G, K * S), E, dtype=jnp.int32)
    slot_GxKS = ((jnp.cumsum(onehot_GxKSxE, axis=1) - 1) * onehot_GxKSxE).sum(-1)
    slot_GxSxK = jnp.swapaxes(slot_GxKS.reshape(G, K, S), 1, 2)
    return slot_GxSxK, slot_GxSxK < C


def capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                        capacity_factor: float = 1.25, group_size: int | None = None, gate_input: bool = False):
    """GShard dispatch: (y_TxD, keep_TxK). Tokens form groups of `group_size` (default: all T) with
    C = expert_capacity(group_size, ...) slots per expert each; copies past C are dropped (keep False).
    The dispatch tensor is [G, S, E, C]: memory and einsum FLOPs grow with S * E * C, so keep groups short.
    A zero-expert copy (id >= E) has no column in the one-hot: never dispatched, never dropped (keep True).
    gate_input: the gates weight the dispatch (each slot receives g x, in fp32) and the combine is a plain sum."""
    T, K = ids_TxK.shape
    E = w_gate_ExDxF.shape[0]
    S = group_size or T
    G = T // S
    C = expert_capacity(S, K, E, capacity_factor)
    ids_GxSxK = ids_TxK.reshape(G, S, K)
    slot_GxSxK, keep_GxSxK = capacity_slots(ids_GxSxK, E, C)
    # [G,S,K,E] x [G,S,K,C] summed over K: each (token, expert) pair has at most one slot.
    where_GxSxKxE = jax.nn.one_hot(ids_GxSxK, E, dtype=jnp.float32) * keep_GxSxK[..., None]
    slot_GxSxKxC = jax.nn.one_hot(slot_GxSxK, C, dtype=jnp.float32)
    dispatch_GxSxExC = jnp.einsum("gske,gskc->gsec", where_GxSxKxE, slot_GxSxKxC)
    combine_GxSxExC = jnp.einsum("gske,gskc,gsk->gsec", where_GxSxKxE, slot_GxSxKxC,
                                 gates_TxK.reshape(G, S, K))
    dt = x_TxD.dtype
    x_GxSxD = x_TxD.reshape(G, S, -1)
    if gate_input:  # each slot holds one copy: the fp32 einsum is g x exactly, rounded once (as `scale_input`)
        x_ExGxCxD = jnp.einsum("gsec,gsd->egcd", combine_GxSxExC, x_GxSxD.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST).astype(dt)
        combine_GxSxExC = dispatch_GxSxExC  # outputs come back unweighted
    else:
        x_ExGxCxD = jnp.einsum("gsec,gsd->egcd", dispatch_GxSxExC.astype(dt), x_GxSxD)
    # The dispatched rows, pre-activations and expert outputs are kept under remat_policy="save_moe".
    x_ExGCxD = saved(x_ExGxCxD.reshape(E, G * C, -1))
    h_ExGCxF = jax.nn.silu(saved(jnp.einsum("end,edf->enf", x_ExGCxD, w_gate_ExDxF))) * saved(jnp.einsum(
        "end,edf->enf", x_ExGCxD, w_up_ExDxF))
    y_ExGxCxD = saved(jnp.einsum("enf,efd->end", h_ExGCxF, w_down_ExFxD).reshape(E, G, C, -1))
    y_GxSxD = jnp.einsum("gsec,egcd->gsd", combine_GxSxExC, y_ExGxCxD.astype(jnp.float32))
    return y_GxSxD.reshape(T, -1).astype(dt), keep_GxSxK.reshape(T, K)


def capacity(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, capacity_factor=1.25,
             group_size=None, gate_input=False):
    return capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                               capacity_factor=capacity_factor, group_size=group_size, gate_input=gate_input)[0]
