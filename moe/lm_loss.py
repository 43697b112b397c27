"""The LM head and next-token cross-entropy, optionally a sequence chunk at a time (never all [B, L, V] logits).

Key: B batch, L length, C positions per chunk, D model, V vocab.

The fp32 logits [B*L, V] and their gradient are the largest activations of a model whose vocabulary is much
wider than it (V 8192 at D 192 by default: 128 MiB each at 4,096 tokens; 1 GiB each for configs/gpu_1b.py at
32,768 tokens per device, 4 GiB at a 32k vocabulary). execution.loss_chunks > 1 computes the loss chunk by chunk,
each chunk's logits recomputed in the backward pass (jax.checkpoint): one [B, C, V] block alive at a time for one
more head matmul. It is a memory knob, not a speed one: on the 2-core CPU the default train step ran 7-9%
slower with 8 or 16 chunks (docs/performance.md), so the default is 1. Chunks run along the sequence, so every
chunk keeps the batch's sharding over data and fsdp.
"""

import jax
import jax.numpy as jnp
import optax

from moe.layers import chunk_count


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

