"""Expert parallelism: routed experts computed where their weights live, tokens moved with all_to_all.

Inside the jitted, auto-sharded model, `dispatch` wraps the expert computation in `jax.shard_map` over the
active mesh. With P = mesh.expert shards of E_l = E / P experts each:
  1. the T tokens, already split over (data, fsdp), are split further over `expert`: each device holds
     T_l = T / (data * fsdp * expert) tokens and their routing (ids, gates);
  2. it sorts its N = T_l * K token copies by destination shard e // E_l (then by top-k rank, then by token) into
     a padded send buffer [P, C, D]: C rows per (source, destination) pair, C = ceil(cf * N / P), at most N;
  3. `jax.lax.all_to_all` over `expert` swaps buffers: row block p of the receive buffer came from shard p;
  4. the grouped matmul (`execution.grouped_matmul`) runs the E_l local experts on the received rows (padding rows are
     sorted last and left out of every group, so they cost nothing and produce zeros);
  5. a second all_to_all sends the outputs back; each copy is gathered from its slot and combined with its gate.
Copies past C are dropped (output 0, counted in the returned keep mask), later top-k choices first. A zero-expert
copy (id >= E, LongCat-Flash) has no destination: it sorts after every shard's block, is never sent, comes back 0
and counts as kept (moe.dispatch.routed_experts adds its g x). With gate_input (Llama 4) each copy is sent as g x
and the outputs are summed unweighted. C = N
(capacity_factor=None) can never drop: that is `dispatch="expert_parallel_dropless"`, at the price of send/receive
buffers of P * N rows instead of cf * N (P times the local dropless path's N rows). `dispatch="expert_parallel"`
uses cf = capacity_factor; its capacity is shared by all rows on a device, so one sequence's output can depend
on the other rows of the batch (evaluate with a dropless or per-sequence `capacity` dispatch to avoid that).

Weights enter split over `expert` and, with mesh.tensor > 1, their expert width F over `tensor` (Megatron style:
each tensor rank computes its slice of every expert's hidden units on the same rows, and the partial outputs are
summed with one psum over `tensor` before the return all_to_all). XLA all-gathers their fsdp (embed) shards
before the shard_map (ZeRO-3), and shard_map's transpose sums their gradients over (data, fsdp). The routing statistics
(load, balance loss) are computed outside, from the auto-sharded router output, so they are global.
`jax.lax.ragged_all_to_all` (GPU/TPU only, not on XLA:CPU) would avoid the padding; not used yet.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe.dispatch import experts, kernels

TOKEN_AXES = ("data", "fsdp", "expert")  # the token axis of x/ids/gates inside the shard_map


def send_capacity(n_copies: int, n_shards: int, capacity_factor: float | None) -> int:
    """Rows per (source, destination) pair: ceil(cf * N / P), at most N; None: N (never drops)."""
    if capacity_factor is None:
        return n_copies
    return max(1, min(n_copies, math.ceil(capacity_factor * n_copies / n_shards)))


def token_shards(mesh) -> int:
    return math.prod(mesh.shape[a] for a in TOKEN_AXES)


def local_dispatch(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, n_shards: int,
                   capacity: int, axis_name: str | None = "expert", grouped_matmul: str = "auto",
                   tensor_axis: str | None = None, permute: str = "auto", gate_input: bool = False):
    """One device's part (inside shard_map; ids are global expert ids, weights the E_l local experts).
    Returns (y_TxD, keep_TxK). With axis_name None (one shard) there is no exchange. grouped_matmul: see
    kernels.grouped_swiglu_for; rows past sum(group sizes) are padding and come out zero in both.
    tensor_axis: the weights hold this device's slice of the expert width F (Megatron style), so the expert
    outputs are partial sums, added up over that axis. permute: how the backward pass moves the permuted rows
    (experts.permute_for: scatter-adds or gathers)."""
    permute = experts.permute_for(permute)
    T, K = ids_TxK.shape
    El = w_gate_ExDxF.shape[0]
    D = x_TxD.shape[-1]
    Pn, C = n_shards, capacity
    N = T * K
    flat_ids_N = ids_TxK.reshape(N)
    # By destination shard, then by top-k rank, then by token: when a destination's C rows overflow, the copies
    # dropped are the latest choices (as in capacity dispatch), not whichever experts sort last.
    rank_N = jnp.arange(N) % K
    order_N = kernels.saved(jnp.argsort((flat_ids_N // El) * K + rank_N, stable=True))
    inverse_N = kernels.saved(jnp.argsort(order_N))
    ids_N = flat_ids_N[order_N]
    dest_N = ids_N // El  # >= Pn for a zero expert: out of range, so the scatters below drop it
    routed_N = dest_N < Pn
    counts_P = (dest_N[:, None] == jnp.arange(Pn)).sum(0)
    slot_N = jnp.arange(N) - (jnp.cumsum(counts_P) - counts_P)[jnp.minimum(dest_N, Pn - 1)]  # row in its block
    fits_N = slot_N < C
    keep_N = fits_N & routed_N  # the copies whose expert output comes back
    x_NxD = experts.take_copies(x_TxD, order_N, inverse_N, K, permute)
    if gate_input:
        g_N = experts.take_rows(gates_TxK.astype(jnp.float32).reshape(N, 1), order_N, inverse_N, permute)[:, 0]
        x_NxD = experts.scale_input(x_NxD, g_N)
    send_PxCxD = jnp.zeros((Pn, C, D), x_TxD.dtype).at[dest_N, slot_N].set(x_NxD, mode="drop")
    send_ids_PxC = jnp.full((Pn, C), El, jnp.int32).at[dest_N, slot_N].set(ids_N % El, mode="drop")

    def exchange(a):
        return a if axis_name is None else jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)

    # Kept under remat_policy="save_moe" (with the sorts and the returned rows): its backward pass exchanges no rows
    # that the forward pass already sent.
    recv_PxCxD, recv_ids_PxC = kernels.saved(exchange(send_PxCxD)), kernels.saved(exchange(send_ids_PxC))
    M = Pn * C
    rids_M = recv_ids_PxC.reshape(M)
    order_M = kernels.saved(jnp.argsort(rids_M, stable=True))  # padding rows (id El) last, outside every group
    inverse_M = kernels.saved(jnp.argsort(order_M))
    gs_E = (rids_M[:, None] == jnp.arange(El)).sum(0).astype(jnp.int32)
    grouped_fn = kernels.grouped_swiglu_for(grouped_matmul)
    y_sorted_MxD = grouped_fn(experts.take_rows(recv_PxCxD.reshape(M, D), order_M, inverse_M, permute), gs_E,
                              w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    if tensor_axis is not None:
        y_sorted_MxD = jax.lax.psum(y_sorted_MxD, tensor_axis)
    y_PxCxD = experts.take_rows(y_sorted_MxD, inverse_M, order_M, permute).reshape(Pn, C, D)
    back_PxCxD = kernels.saved(exchange(y_PxCxD))

    y_NxD = back_PxCxD[jnp.minimum(dest_N, Pn - 1), jnp.minimum(slot_N, C - 1)] * keep_N[:, None].astype(x_TxD.dtype)
    y_TxKxD = experts.take_rows(y_NxD, inverse_N, order_N, permute).reshape(T, K, D)
    keep_TxK = (fits_N | ~routed_N)[inverse_N].reshape(T, K)  # a zero expert's copy is never dropped
    if gate_input:
        y_TxD = y_TxKxD.astype(jnp.float32).sum(1)
    else:
        y_TxD = jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), gates_TxK)
    return y_TxD.astype(x_TxD.dtype), keep_TxK


def dispatch(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, mesh=None,
             capacity_factor: float | None = None, grouped_matmul: str = "auto", permute: str = "auto",
             gate_input: bool = False):
    """(y_TxD, keep_TxK) with experts sharded over mesh axis `expert`. T must be divisible by
    data * fsdp * expert. mesh None: the same math on one shard (no exchange)."""
    T, K = ids_TxK.shape
    if mesh is None:
        C = send_capacity(T * K, 1, capacity_factor)
        return local_dispatch(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, n_shards=1,
                              capacity=C, axis_name=None, grouped_matmul=grouped_matmul, permute=permute,
                              gate_input=gate_input)
    n_ep, n_tok = mesh.shape["expert"], token_shards(mesh)
    if T % n_tok:
        raise ValueError(f"expert parallelism needs the {T} tokens divisible by data*fsdp*expert ({n_tok})")
    C = send_capacity(T // n_tok * K, n_ep, capacity_factor)
    tok = P(TOKEN_AXES)
    tp = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    w_in, w_out = P("expert", None, tp), P("expert", tp, None)  # [E, D, F] and [E, F, D]: F split over tensor
    f = jax.shard_map(functools.partial(local_dispatch, n_shards=n_ep, capacity=C, grouped_matmul=grouped_matmul,
                                        tensor_axis=tp, permute=permute, gate_input=gate_input),
                      mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=(tok, tok))
    return f(x_TxD, ids_TxK, gates_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)

