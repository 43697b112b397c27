"""The LM head and next-token cross-entropy, optionally a sequence chunk at a time (never all [B, L, V] logits).

Key: B batch, L length, C positions per chunk, D model, V vocab.

The fp32 logits [B*L, V] and their gradient are the largest activations of a model whose vocabulary is much
wider than it (V 8192 at D 192 by default: 128 MiB each at 4,096 tokens; 1 GiB each for configs/gpu_1b.py at
32,768 tokens per device, 4 GiB at a 32k vocabulary). Two functions:

- `cross_entropy`: per-token values, differentiable for any cotangent; with chunks > 1 each chunk's logits are
  recomputed in the backward pass (jax.checkpoint). For evaluation and analysis.
- `weighted_cross_entropy`: the training objective sum(weights * ce), whose gradient is computed in the forward
  pass, chunk by chunk (the "fused linear cross-entropy" of Liger-Kernel / Cut Your Losses): softmax - one-hot
  times the weights, the input gradient and the head gradient, while the chunk's logits are still in cache. No
  logits survive the forward pass and none are recomputed: the same three head matmuls as autodiff of all logits
  at once. The train step uses it (train/step.py); execution.loss_chunks sets the chunks.

Chunks run along the sequence, so every chunk keeps the batch's sharding over data and fsdp. With the batch
sharded, the head gradient of each chunk is all-reduced inside the chunk loop (loss_chunks all-reduces of [D, V]
instead of one): keep loss_chunks small on a data-parallel mesh with a slow interconnect.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from moe.nn import chunk_count


def logits(x_NxD, head_DxV):
    """fp32 logits. One 2-D matmul over all rows: XLA:CPU runs a 3-D einsum's backward (the weight gradient
    contracted over two axes) ~3x slower; the same math on every backend."""
    return jnp.dot(x_NxD, head_DxV.astype(x_NxD.dtype), preferred_element_type=jnp.float32)


def cross_entropy(x_BxLxD, head_DxV, targets_BxL, chunks: int = 1, constrain=lambda x, names: x):
    """Per-token cross-entropy [B, L] (fp32) of the logits x @ head against integer targets.

    chunks: the sequence is cut into this many equal chunks (the largest divisor of L not above it); 1 computes
    all logits at once (the reference). constrain(x, logical_names): the caller's sharding constraint.
    """
    B, L, D = x_BxLxD.shape
    n = chunk_count(L, chunks)

    def chunk_ce(x_BxCxD, targets_BxC):
        C = x_BxCxD.shape[1]
        logits_BxCxV = logits(x_BxCxD.reshape(B * C, D), head_DxV).reshape(B, C, -1)
        logits_BxCxV = constrain(logits_BxCxV, ("batch", "length", "act_vocab"))
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxCxV, targets_BxC)

    if n == 1:
        return chunk_ce(x_BxLxD, targets_BxL)
    C = L // n
    x_NxBxCxD = jnp.moveaxis(x_BxLxD.reshape(B, n, C, D), 1, 0)
    targets_NxBxC = jnp.moveaxis(targets_BxL.reshape(B, n, C), 1, 0)
    ce_NxBxC = jax.lax.map(lambda xt: jax.checkpoint(chunk_ce)(*xt), (x_NxBxCxD, targets_NxBxC))
    return jnp.moveaxis(ce_NxBxC, 0, 1).reshape(B, L)


def weighted_cross_entropy(x_BxLxD, head_DxV, targets_BxL, weights_BxL, chunks: int = 1,
                           constrain=lambda x, names: x):
    """(sum(weights * ce), ce [B, L]): the weighted objective, differentiable in x, head and weights, its
    gradient computed chunk by chunk in the forward pass (module docstring); and the per-token cross-entropy as
    values only (no gradient flows through them). Equal to autodiff of `cross_entropy` (tests/test_lm_loss.py)."""
    objective, ce_BxL = _fused_objective(chunks, constrain, x_BxLxD, head_DxV, targets_BxL, weights_BxL)
    return objective, jax.lax.stop_gradient(ce_BxL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_objective(chunks, constrain, x_BxLxD, head_DxV, targets_BxL, weights_BxL):
    ce_BxL = cross_entropy(x_BxLxD, head_DxV, targets_BxL, chunks, constrain)  # not differentiated: no gradients
    return jnp.sum(weights_BxL * ce_BxL), ce_BxL


def _fused_fwd(chunks, constrain, x_BxLxD, head_DxV, targets_BxL, weights_BxL):
    B, L, D = x_BxLxD.shape
    V = head_DxV.shape[-1]
    n = chunk_count(L, chunks)
    C = L // n
    w_DxV = head_DxV.astype(x_BxLxD.dtype)
    by_chunk = lambda a: jnp.moveaxis(a.reshape(B, n, C, *a.shape[2:]), 1, 0)
    by_row = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, L, *a.shape[3:])

    def chunk(dhead_DxV, xs):
        x_BxCxD, targets_BxC, weights_BxC = xs
        x_MxD = x_BxCxD.reshape(B * C, D)  # 2-D matmuls: see `logits`
        logits_BxCxV = constrain(logits(x_MxD, head_DxV).reshape(B, C, -1), ("batch", "length", "act_vocab"))
        # exp once, for both the log-sum-exp and the softmax (one [B, C, V] exp fewer per chunk)
        max_BxC = logits_BxCxV.max(axis=-1)
        exp_BxCxV = jnp.exp(logits_BxCxV - max_BxC[..., None])
        sum_BxC = exp_BxCxV.sum(axis=-1)
        ce_BxC = max_BxC + jnp.log(sum_BxC) - jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
        # d(weights * ce) / d logits = weights * (softmax - one_hot(target)), fp32
        softmax_BxCxV = exp_BxCxV * (1 / sum_BxC)[..., None]
        dlogits_BxCxV = (softmax_BxCxV - jax.nn.one_hot(targets_BxC, V)) * weights_BxC[..., None]
        dlogits_MxV = dlogits_BxCxV.reshape(B * C, -1).astype(x_BxLxD.dtype)
        dx_MxD = jnp.dot(dlogits_MxV, w_DxV.T, preferred_element_type=jnp.float32).astype(x_BxLxD.dtype)
        dhead_DxV = dhead_DxV + jnp.dot(x_MxD.T, dlogits_MxV, preferred_element_type=jnp.float32)
        return dhead_DxV, (ce_BxC, dx_MxD.reshape(B, C, D))

    xs = (by_chunk(x_BxLxD), by_chunk(targets_BxL), by_chunk(weights_BxL.astype(jnp.float32)))
    dhead_DxV, (ce_NxBxC, dx_NxBxCxD) = jax.lax.scan(chunk, jnp.zeros(head_DxV.shape, jnp.float32), xs)
    ce_BxL = by_row(ce_NxBxC)
    out = (jnp.sum(weights_BxL * ce_BxL), ce_BxL)
    return out, (by_row(dx_NxBxCxD), dhead_DxV.astype(head_DxV.dtype), ce_BxL, weights_BxL)


def _fused_bwd(chunks, constrain, residuals, cotangents):
    dx_BxLxD, dhead_DxV, ce_BxL, weights_BxL = residuals
    g, _ = cotangents  # ce's cotangent is zero: weighted_cross_entropy stops its gradient
    return ((g * dx_BxLxD).astype(dx_BxLxD.dtype), (g * dhead_DxV).astype(dhead_DxV.dtype), None,
            (g * ce_BxL).astype(weights_BxL.dtype))


_fused_objective.defvjp(_fused_fwd, _fused_bwd)
